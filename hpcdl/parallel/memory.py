"""What each rank of a strategy will allocate, estimated before anything is built: :class:`RankMemory`.

A strategy says it in :meth:`~hpcdl.parallel.Strategy.memory`, from its placement, the config
and a :class:`~hpcdl.nn.MemoryProbe` of the model (parameters and measured activations of any
slice of its top-level layers); ``--plan`` prints it and the driver refuses a run whose ranks
cannot fit in the memory they have (:mod:`hpcdl.driver.memory`). The figures are of the
arrays hpcdl allocates (NumPy's, which the probe measures); the interpreter, the libraries
and the data set are what a process already uses when the driver compares.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hpcdl.nn.memory import Activations

__all__ = ["RankMemory", "evaluation", "format_bytes", "model_parts"]


def format_bytes(nbytes: float) -> str:
    """``512 B``, ``3.2 KiB``, ``1020 KiB``, ``41.5 GiB`` (binary units, three significant digits)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        whole = unit == "B" or abs(value) >= 99.95  # 100 and up: no decimals (and no exponent)
        shown = round(value) if whole else float(f"{value:.3g}")
        if abs(shown) < 1024 or unit == "TiB":  # as printed: 1023.7 KiB is 1024 KiB, so 1 MiB
            return f"{shown:.0f} {unit}" if whole else f"{shown:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def model_parts(cfg: Any, nbytes: int, largest: int) -> dict[str, int]:
    """A model's (or a slice's, a shard's) parameters, their gradients and the optimizer's state.

    Args:
        cfg: the config (``optimizer.*``).
        nbytes: bytes of the parameters.
        largest: bytes of the largest of them (the optimizer's scratch buffer).
    """
    name = cfg["optimizer.name"]
    states = (1 if cfg["optimizer.momentum"] > 0 else 0) if name == "sgd" else 2  # adam(w): two moments
    return {"parameters": nbytes, "gradients": nbytes, "optimizer": states * nbytes + largest}


def evaluation(act: Activations, images: int) -> list[tuple[int, int, str]]:
    """The activation lines of evaluating ``images`` test images at once, in the batch size b:
    the training caches of a batch (``act.held``), which the evaluation's forward replaces layer
    by layer, and its own forward's peak."""
    hf, hs = act.held
    return [(hf + f + s * images, hs, f"evaluating {images} test images at a time") for f, s in act.forward]


@dataclass(frozen=True)
class RankMemory:
    """What one rank will allocate, estimated before anything is built (bytes).

    Attributes:
        role: the rank's role (its place's).
        parts: what it holds all along, by name: ``parameters``, ``gradients``,
            ``optimizer``, the exchange's or messages' ``buffers``, ...
        activations: lines in ``data.batch_size`` b, each ``(fixed, per sample, what)``: the
            activations at b are the highest of them (a training step's, an evaluation's).
        batch: ``data.batch_size``.
        building: bytes held for a while when the rank builds (a pipeline stage builds the
            whole model before keeping its slice); 0: nothing beyond :attr:`parts`.
        hint: how a refused run may fit beside a smaller batch: an alternative ("or cut the
            model into more stages (more ranks)") or a remark in parentheses.
        note: a caveat of the estimate, printed with it.
    """

    role: str
    parts: Mapping[str, int]
    activations: tuple[tuple[int, int, str], ...]
    batch: int
    building: int = 0
    hint: str = ""
    note: str = field(default="", compare=False)

    def activation_bytes(self, batch: int | None = None) -> int:
        """The activations at ``batch`` samples (default: :attr:`batch`)."""
        b = self.batch if batch is None else batch
        return max((f + b * s for f, s, _ in self.activations), default=0)

    def total(self, batch: int | None = None) -> int:
        """Everything at ``batch`` samples: the parts and the activations, or what building holds."""
        return max(sum(self.parts.values()) + self.activation_bytes(batch), self.building)

    def describe(self, batch: int | None = None) -> str:
        """``41.5 GiB: activations 41.2 GiB (a batch: 100000 x 432 KiB a sample), parameters ...``."""
        b = self.batch if batch is None else batch
        text = f"{format_bytes(self.total(b))}: {self.breakdown(b)}"
        steady = sum(self.parts.values()) + self.activation_bytes(b)
        if self.building > steady:
            text += f"; {format_bytes(steady)} once built, {format_bytes(self.building)} while building"
        return text

    def breakdown(self, batch: int | None = None) -> str:
        """``activations 41.2 GiB (a batch: 100000 x 432 KiB a sample), parameters 128 MiB, ...``."""
        b = self.batch if batch is None else batch
        act = self.activation_bytes(b)
        parts = [f"activations {format_bytes(act)}{self.what(b)}"] if self.activations else []
        parts += [f"{name} {format_bytes(n)}" for name, n in self.parts.items() if n]
        return ", ".join(parts)

    def what(self, b: int) -> str:
        """What the activations at batch ``b`` are for: `` (a batch: 32 x 5 KiB a sample)``."""
        f, s, what = max(self.activations, key=lambda line: line[0] + b * line[1])
        return f" ({what}: {b} x {format_bytes(s)} a sample)" if s * b > f else f" ({what})"
