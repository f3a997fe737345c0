"""What the pipeline strategy declares (:class:`hpcdl.components.Declares`): its config section
``[pipeline]`` and the keys that fix its trajectory (a resume with another value is refused)."""

from __future__ import annotations

from hpcdl.components import Declares, Key

__all__ = ["DECLARES"]

#: the section's keys
KEYS: dict[str, Key] = {
    "pipeline.microbatches": Key(
        int,
        4,
        "microbatches of data.batch_size per step (m: the stages overlap on them)",
        minimum=1,
    ),
    "pipeline.schedule": Key(
        str,
        "1f1b",
        "gpipe (all forwards, then all backwards), 1f1b (at most p - s microbatches held "
        "on stage s) or interleaved (1F1B over pipeline.virtual_stages chunks per stage)",
        choices=("gpipe", "1f1b", "interleaved"),
    ),
    "pipeline.virtual_stages": Key(
        int,
        1,
        "interleaved: model chunks per stage (v >= 2; stage s holds virtual stages s, s + p, ...; "
        "pipeline.microbatches a multiple of p)",
        minimum=1,
    ),
    "pipeline.balance": Key(
        str,
        "uniform",
        "top-level layers per stage [n1, ..., np], or the automatic contiguous partition "
        "minimising the slowest stage by layer count, parameters, profiled time or output bytes; "
        "plan: the hybrid planner chooses the cut, each stage's replicas and the microbatch cut of "
        "the global batch (pipeline.microbatches x data.batch_size)",
        choices=("uniform", "params", "time", "memory", "plan"),
        item=int,
        or_list=True,
    ),
    "pipeline.split": Key(
        list,
        [],
        "names of the top-level layers at which stages 1, 2, ... start (instead of pipeline.balance)",
        item=str,
        pattern=r"[A-Za-z0-9_.]+",
        pattern_doc="naming top-level layers",
    ),
    "pipeline.replicas": Key(
        list,
        [],
        "ranks per stage [r1, ..., rp] (sum = the world size): stage s's replicas share its "
        "microbatches (k on replica k mod r_s) and sum their gradients; empty: one rank per stage",
        item=int,
    ),
    "pipeline.stages": Key(
        int,
        0,
        "stages p, each on world size / p replicas (instead of pipeline.replicas); 0: one stage per rank",
        minimum=0,
    ),
    "pipeline.memory_mb": Key(
        float,
        0.0,
        'balance = "plan": the most activation memory per rank a plan may need, in MiB (0: no limit)',
        minimum=0,
    ),
    "pipeline.network": Key(
        str,
        "shm-local",
        'balance = "plan": the network the planner predicts with (a simulator network file: a '
        "packaged name or a path)",
    ),
    "pipeline.planned": Key(
        str,
        "",
        'set by balance = "plan" (leave it empty): the plan chosen and its predicted step, as JSON; '
        "a resume reuses it",
    ),
    "pipeline.profile": Key(
        str,
        "",
        'balance = "time": a run file made with profile.layers = true, or a TOML/CSV cost '
        "table; empty: rank 0 profiles a few steps first",
    ),
}

#: what the pipeline declares
DECLARES = Declares(
    keys=KEYS,
    fit_keys=(
        "pipeline.microbatches",
        "pipeline.schedule",
        "pipeline.virtual_stages",
        "pipeline.replicas",
        "pipeline.stages",
    ),
)
