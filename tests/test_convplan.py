"""``model.winograd``: which 3x3 convolutions multiply by Winograd, timed per shape on the machine,
cached, recorded in the run and kept by a resume (``hpcdl.nn.convplan``, ``hpcdl.driver.convplan``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from hpcdl.config import load_config, stored_values
from hpcdl.driver import convplan
from hpcdl.driver.settle import continue_legacy
from hpcdl.errors import ConfigError
from hpcdl.models import build_model
from hpcdl.nn import Conv2d, Sequential, observe
from hpcdl.nn.convplan import ConvShape, apply, layers, shapes, time_products
from hpcdl.rng import generator
from hpcdl.train import run

# a CNN of two eligible 3x3 layers (1 -> 3 and 3 -> 6 channels at 8x8), a few steps
CNN = ["model.channels=3", "train.steps=6", "checkpoint.every=0"]


def _resnet() -> Sequential:
    return build_model("resnet18", (3, 16, 16), 10, rng=generator(0, "init"), width_mult=0.125)


class _Seen:
    """Records the input shape of every eligible convolution a step runs."""

    nested = True

    def __init__(self) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}

    def before(self, phase: str, layer: Any, x: Any) -> None:
        if phase == "forward" and isinstance(layer, Conv2d) and layer.winograd_eligible:
            self.shapes[layer.name] = tuple(x.shape)

    def after(self, phase: str, layer: Any, y: Any) -> None:
        pass


def test_shapes_are_those_a_step_of_the_batch_gives_each_eligible_layer() -> None:
    model = _resnet()
    found = shapes(model, (3, 16, 16), 5)
    seen = _Seen()
    with observe(seen):
        model.forward(np.zeros((5, 3, 16, 16), np.float32))
    assert found and set(found) == set(seen.shapes) == {layer.name for layer in layers(model)}
    for name, s in found.items():
        assert (s.batch, s.in_channels, s.height, s.width) == seen.shapes[name]
        assert s.dtype == "float32" and s.padding == 1
    # the stride-2 3x3 convolutions are not eligible; the stem's is (3 -> 8 channels at 16x16)
    assert all(c.stride == (1, 1) for c in layers(model))
    assert found["0"] == ConvShape(5, 3, 8, 16, 16, 1, "float32", input_grad=False)  # the first layer


def test_shapes_leaves_the_model_as_it_was() -> None:
    model = _resnet()
    before = {k: v.copy() for k, v in model.state_dict().items()}  # BatchNorm statistics included
    shapes(model, (3, 16, 16), 4)
    assert model.training
    assert all(np.array_equal(before[k], v) for k, v in model.state_dict().items())
    model.eval()
    shapes(model, (3, 16, 16), 4)
    assert not model.training


def test_shapes_draws_nothing_from_the_dropout_stream() -> None:
    stream = generator(0, 0, "dropout")
    model = build_model("cnn", (1, 8, 8), 10, rng=generator(0, "init"), dropout_rng=stream, dropout=0.5)
    before = stream.bit_generator.state
    assert shapes(model, (1, 8, 8), 4)
    assert stream.bit_generator.state == before
    model.forward(np.zeros((2, 1, 8, 8), np.float32))  # a training forward does draw: the test can fail
    assert stream.bit_generator.state != before


def test_time_products_times_each_product_as_a_layer_of_that_shape_runs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both products are timed on layers of the shape, and a product's time is per call: on a
    clock that a forward by im2row moves by 1 s and one by Winograd by 3 s, with 5 s to fill per
    repetition, im2row is called 5 times a repetition and Winograd once, and each is 1 s and 3 s."""
    import types

    from hpcdl.nn import convplan as nn_convplan

    now = [0.0]
    calls: dict[bool, list[tuple[int, ...]]] = {False: [], True: []}
    forward = Conv2d.forward

    def ticking(self: Conv2d, x: Any) -> Any:
        calls[bool(self.winograd)].append(tuple(x.shape))
        now[0] += 3.0 if self.winograd else 1.0
        return forward(self, x)

    monkeypatch.setattr(Conv2d, "forward", ticking)
    monkeypatch.setattr(nn_convplan, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    t = time_products(ConvShape(2, 3, 4, 6, 6, 1, "float32"), repeat=2, min_time=5.0)
    assert set(calls[False]) == set(calls[True]) == {(2, 3, 6, 6)}
    assert (len(calls[False]), len(calls[True])) == (1 + 2 * 5, 1 + 2 * 1)  # a warm-up, then 2 repetitions
    assert t == {"im2row": 1.0, "winograd": 3.0}


def test_apply_fixes_every_eligible_layer() -> None:
    model = _resnet()
    names = [layer.name for layer in layers(model)]
    apply(model, names[:2])
    assert [layer.winograd for layer in layers(model)] == [True, True] + [False] * (len(names) - 2)
    assert all(layer.uses_winograd() == (layer.name in names[:2]) for layer in layers(model))


def _fake_times(winograd_from: int) -> Any:
    """Times that make Winograd faster from ``winograd_from`` input channels up; counts its calls."""

    def fake(shape: ConvShape, **_: Any) -> dict[str, float]:
        fake.timed.append(shape.key)
        faster = shape.in_channels >= winograd_from
        return {"im2row": 2e-3, "winograd": 1e-3 if faster else 3e-3}

    fake.timed = []
    return fake


def test_measure_chooses_by_the_times_caches_them_and_times_nothing_the_second_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "conv.json"
    model = _resnet()
    fake = _fake_times(16)
    monkeypatch.setattr(convplan, "time_products", fake)
    chosen, eligible, lines = convplan.measure(model, (3, 16, 16), 4, "float32", cache)
    found = shapes(model, (3, 16, 16), 4)
    assert eligible == len(found) and len(fake.timed) == len({s.key for s in found.values()})
    assert chosen == [name for name, s in found.items() if s.in_channels >= 16] and chosen
    assert any("timed" in line and "cached in" in line for line in lines)
    entry = next(iter(json.loads(cache.read_text())["entries"].values()))
    assert entry["machine"] == convplan.machine() and set(entry["times"]) == set(fake.timed)
    fake.timed.clear()
    again, _, lines = convplan.measure(_resnet(), (3, 16, 16), 4, "float32", cache)
    assert again == chosen and fake.timed == [] and not any("timed" in line for line in lines)
    # another batch is another shape: timed, and added beside the first
    convplan.measure(_resnet(), (3, 16, 16), 8, "float32", cache)
    assert fake.timed and all(k.startswith("n8 ") for k in fake.timed)
    entry = next(iter(json.loads(cache.read_text())["entries"].values()))
    assert {k.split()[0] for k in entry["times"]} == {"n4", "n8"}


@pytest.mark.parametrize("damage", ["not json", '{"format": 99, "entries": {}}', "other machine"])
def test_a_cache_that_does_not_fit_is_timed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    cache = tmp_path / "conv.json"
    fake = _fake_times(16)
    monkeypatch.setattr(convplan, "time_products", fake)
    convplan.measure(_resnet(), (3, 16, 16), 4, "float32", cache)
    if damage == "other machine":
        data = json.loads(cache.read_text())
        for entry in data["entries"].values():
            entry["machine"]["cpu"] = "elsewhere"
        cache.write_text(json.dumps(data))
    else:
        cache.write_text(damage)
    fake.timed.clear()
    chosen, _, lines = convplan.measure(_resnet(), (3, 16, 16), 4, "float32", cache)
    assert fake.timed and chosen
    assert (damage == "other machine") != any("timing again" in line for line in lines)


def test_a_cache_that_cannot_be_written_costs_a_line_not_the_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(convplan, "time_products", _fake_times(16))
    chosen, _, lines = convplan.measure(_resnet(), (3, 16, 16), 4, "float32", blocker / "conv.json")
    assert chosen and any("not cached" in line for line in lines)


def test_a_model_without_eligible_layers_times_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _fake_times(0)
    monkeypatch.setattr(convplan, "time_products", fake)
    mlp = build_model("mlp", (1, 8, 8), 10, rng=generator(0, "init"))
    assert convplan.measure(mlp, (1, 8, 8), 4, "float32", tmp_path / "c.json") == ([], 0, [])
    assert fake.timed == [] and not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("mode", ["rule", "always", "never"])
def test_the_other_modes_fix_the_layers_without_timing(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_times(0)
    monkeypatch.setattr(convplan, "time_products", fake)
    model = _resnet()
    assert convplan.plan_model(model, mode, (3, 16, 16), 4, "float32") == [] and fake.timed == []
    used = [layer.uses_winograd() for layer in layers(model)]
    rule = [min(c.in_channels, c.out_channels) >= 64 for c in layers(model)]
    with pytest.raises(ValueError, match="'layers' is not"):  # bench step: layers need their names
        convplan.plan_model(model, "layers", (3, 16, 16), 4, "float32")
    assert used == {"rule": rule, "always": [True] * len(used), "never": [False] * len(used)}[mode]


def test_a_run_records_the_measured_layers_and_every_model_it_builds_follows_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """digits-cnn at 3 channels: the first layer (1 channel in) is made slower by Winograd, the
    second faster; the run file's config names the second, and the trained model uses it alone."""
    monkeypatch.setattr(convplan, "time_products", _fake_times(3))
    result = run(load_config("digits-cnn", CNN), out=tmp_path / "r.h5")
    with h5py.File(tmp_path / "r.h5", "r") as f:
        stored = stored_values(f.attrs["config"])
    eligible = [layer.name for layer in layers(result.model)]
    assert len(eligible) == 2
    assert stored["model.winograd"] == "layers" and stored["model.winograd_layers"] == eligible[1:]
    assert [layer.uses_winograd() for layer in layers(result.model)] == [False, True]


def test_a_measure_that_chooses_no_layer_leaves_them_all_to_im2row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 64 channels Conv2d's rule gives the second layer Winograd; timed slower, it runs im2row."""
    monkeypatch.setattr(convplan, "time_products", _fake_times(999))
    result = run(load_config("digits-cnn", [*CNN, "model.channels=64"]), out=tmp_path / "r.h5")
    with h5py.File(tmp_path / "r.h5", "r") as f:
        stored = stored_values(f.attrs["config"])
    assert (stored["model.winograd"], stored["model.winograd_layers"]) == ("layers", [])
    assert [c.winograd_by_rule for c in layers(result.model)] == [False, True]
    assert [c.uses_winograd() for c in layers(result.model)] == [False, False]


def test_a_resume_keeps_the_layers_the_run_began_with_and_continues_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The times change between the stop and the resume (another machine, a new cache): the
    resumed run keeps the first one's layers, and ends bit for bit as a run without a stop."""
    monkeypatch.setattr(convplan, "time_products", _fake_times(3))
    whole = run(load_config("digits-cnn", CNN), out=tmp_path / "whole.h5")
    run(load_config("digits-cnn", [*CNN, "train.stop_at=3"]), out=tmp_path / "split.h5")
    flipped = _fake_times(99)  # now Winograd loses everywhere, and nothing is cached
    monkeypatch.setattr(convplan, "time_products", flipped)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "elsewhere"))
    rest = run(load_config("digits-cnn", CNN), out=tmp_path / "split.h5", resume="auto")
    assert flipped.timed == []
    assert [layer.uses_winograd() for layer in layers(rest.model)] == [False, True]
    assert all(np.array_equal(v, whole.model.state_dict()[k]) for k, v in rest.model.state_dict().items())


def test_a_run_made_before_the_key_continues_by_the_rule() -> None:
    stored = {k: v for k, v in load_config("digits-cnn").values.items() if not k.startswith("model.winograd")}
    cfg, lines = continue_legacy(load_config("digits-cnn"), stored)
    assert cfg["model.winograd"] == "rule" and any("model.winograd = 'rule'" in line for line in lines)


@pytest.mark.parametrize("mode", ["measure", "rule", "always", "never"])
def test_layers_set_by_hand_beside_another_mode_are_refused_in_one_line(mode: str) -> None:
    with pytest.raises(ConfigError, match=rf"model.winograd_layers names the layers of model.winograd = "
                       rf"'layers'; with '{mode}' leave it unset"):  # fmt: skip
        run(load_config("digits-cnn", [*CNN, f"model.winograd={mode!r}", "model.winograd_layers=['3']"]))


def test_layers_by_hand_are_the_layers_that_multiply_by_winograd(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_times(0)
    monkeypatch.setattr(convplan, "time_products", fake)
    result = run(load_config("digits-cnn", [*CNN, "model.winograd='layers'", "model.winograd_layers=['0']"]))
    assert [c.uses_winograd() for c in layers(result.model)] == [True, False] and fake.timed == []


def test_a_checkpoint_resumed_into_a_new_run_file_keeps_its_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--resume CHECKPOINT --out NEW: the checkpoint's config is the run's (it was measured again,
    and then refused by the checkpoint's fit with no way to set the layers)."""
    monkeypatch.setattr(convplan, "time_products", _fake_times(3))
    first = run(load_config("digits-cnn", [*CNN, "train.stop_at=3"]), out=tmp_path / "a.h5")
    flipped = _fake_times(99)
    monkeypatch.setattr(convplan, "time_products", flipped)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "elsewhere"))
    rest = run(load_config("digits-cnn", CNN), out=tmp_path / "b.h5", resume=str(first.checkpoint))
    assert flipped.timed == [] and rest.steps == 6
    assert [layer.uses_winograd() for layer in layers(rest.model)] == [False, True]


def test_the_first_layer_is_timed_without_the_input_gradient_it_does_not_form(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _resnet()
    found = shapes(model, (3, 16, 16), 4)
    first = next(iter(layers(model)))
    assert not first.needs_input_grad and not found[first.name].input_grad
    assert found[first.name].key.endswith(" no-input-grad")
    assert all(s.input_grad for name, s in found.items() if name != first.name)
    formed: list[Any] = []
    backward = Conv2d.backward

    def record(self: Conv2d, gy: Any) -> Any:
        gx = backward(self, gy)
        formed.append(gx is not None)
        return gx

    monkeypatch.setattr(Conv2d, "backward", record)
    time_products(found[first.name], repeat=1, min_time=0.0)
    assert formed and not any(formed)
    formed.clear()
    time_products(ConvShape(2, 3, 4, 6, 6, 1, "float32"), repeat=1, min_time=0.0)
    assert formed and all(formed)


def test_timing_stops_at_the_budget_and_the_rest_take_the_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _fake_times(0)  # Winograd faster wherever timed
    monkeypatch.setattr(convplan, "time_products", fake)
    monkeypatch.setattr(convplan, "BUDGET", 0.0)  # the first shape only
    model = _resnet()
    cache = tmp_path / "c.json"
    chosen, _, lines = convplan.measure(model, (3, 16, 16), 4, "float32", cache)
    found = shapes(model, (3, 16, 16), 4)
    (timed,) = fake.timed
    said = "not timed within 0 s: Conv2d's rule chooses there (the next run times them)"
    assert any(said in line for line in lines)
    rule = {c.name: c.winograd_by_rule for c in layers(model)}  # 64 channels in the last stage
    assert chosen == [name for name, s in found.items() if s.key == timed or rule[name]]
    assert any(rule.values()) and not all(rule.values())
    entry = next(iter(json.loads(cache.read_text())["entries"].values()))
    assert list(entry["times"]) == [timed]
    fake.timed.clear()
    convplan.measure(_resnet(), (3, 16, 16), 4, "float32", cache)  # the next run times the next shape
    assert len(fake.timed) == 1 and fake.timed[0] != timed


def test_on_a_gpu_the_rule_chooses_without_timing(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from hpcdl.driver.settle import PlanInputs

    fake = _fake_times(0)
    monkeypatch.setattr(convplan, "time_products", fake)
    cfg = load_config("digits-cnn", [*CNN, "device='gpu'"])
    assert convplan.settle_winograd(cfg, PlanInputs(cfg)) == {"model.winograd": "rule"} and fake.timed == []
    assert "on a GPU Conv2d's rule chooses" in capsys.readouterr().err


def test_on_virtual_ranks_rank_0_times_and_every_rank_follows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpcdl.simulate import main as simulate

    fake = _fake_times(3)
    monkeypatch.setattr(convplan, "time_products", fake)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    built: list[list[bool]] = []
    apply_config = convplan.apply_config

    def record(model: Any, cfg: Any) -> None:
        apply_config(model, cfg)
        built.append([c.uses_winograd() for c in layers(model)])

    monkeypatch.setattr("hpcdl.driver.factory.apply_config", record)
    measured: list[Any] = []
    measure = convplan.measure

    def counted(*args: Any, **kw: Any) -> Any:
        measured.append(args)
        return measure(*args, **kw)

    monkeypatch.setattr(convplan, "measure", counted)
    argv = ["-n", "3", "--network", "ib-hdr", "-m", "hpcdl.train", "--config", "digits-cnn",
            "--progress", "none", "--out", str(tmp_path / "r.h5"), *(f"--set={x}" for x in CNN)]  # fmt: skip
    assert simulate(argv) == 0
    assert len(measured) == 1 and len(fake.timed) == 2  # one rank measured its two shapes
    # the memory check's models come first, by the rule (3 channels: no Winograd); every model after
    # the choice follows it, on each of the 3 ranks
    first = built.index([False, True])
    assert set(map(tuple, built[:first])) == {(False, False)}
    assert set(map(tuple, built[first:])) == {(False, True)} and len(built) - first >= 3


def test_a_shape_that_runs_out_of_memory_is_chosen_by_the_rule_and_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch too large to time (the run itself will say so, in its own words): the layers of that
    shape take Conv2d's rule, the other shapes their times, and only the timed shapes are cached."""
    fake = _fake_times(0)  # Winograd faster wherever timed

    def short_of_memory(shape: ConvShape, **kw: Any) -> dict[str, float]:
        if shape.in_channels in (8, 64):  # the rule: im2row at 8 channels, Winograd at 64
            raise MemoryError
        return fake(shape, **kw)

    monkeypatch.setattr(convplan, "time_products", short_of_memory)
    cache = tmp_path / "conv.json"
    model = _resnet()
    chosen, _, lines = convplan.measure(model, (3, 16, 16), 4, "float32", cache)
    found = shapes(model, (3, 16, 16), 4)
    starved = {name: s.in_channels for name, s in found.items() if s.in_channels in (8, 64)}
    assert set(starved.values()) == {8, 64} and any("not timed (out of memory)" in line for line in lines)
    assert set(chosen) == set(found) - {name for name, c in starved.items() if c == 8}
    entry = next(iter(json.loads(cache.read_text())["entries"].values()))
    assert not any(" c8 " in key or " c64 " in key for key in entry["times"])


@pytest.mark.parametrize(("ratio", "winograd"), [(0.97, False), (0.93, True)])
def test_a_near_tie_is_left_to_im2row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ratio: float, winograd: bool
) -> None:
    monkeypatch.setattr(convplan, "time_products", lambda s, **_: {"im2row": 1e-3, "winograd": ratio * 1e-3})
    model = _resnet()
    chosen, eligible, _ = convplan.measure(model, (3, 16, 16), 4, "float32", tmp_path / "c.json")
    assert chosen == ([layer.name for layer in layers(model)] if winograd else []) and eligible


@pytest.mark.parametrize(("mode", "used"), [("rule", [False, False]), ("always", [True, True]),
                                            ("never", [False, False])])  # fmt: skip
def test_a_resume_under_the_default_keeps_the_mode_the_run_began_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, used: list[bool]
) -> None:
    fake = _fake_times(0)
    monkeypatch.setattr(convplan, "time_products", fake)
    first = [*CNN, f"model.winograd={mode!r}"]
    run(load_config("digits-cnn", [*first, "train.stop_at=3"]), out=tmp_path / "r.h5")
    rest = run(load_config("digits-cnn", CNN), out=tmp_path / "r.h5", resume="auto")  # measure, by default
    assert fake.timed == [] and rest.steps == 6
    assert [c.uses_winograd() for c in layers(rest.model)] == used


def test_layer_names_that_are_not_eligible_convolutions_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"model.winograd_layers names '3.conv1', not a 3x3 stride-1 "
                       r"convolution of model.name = 'cnn': those are 0, 3$"):  # fmt: skip
        sets = [*CNN, "model.winograd='layers'", "model.winograd_layers=['3', '3.conv1']"]
        run(load_config("digits-cnn", sets))
