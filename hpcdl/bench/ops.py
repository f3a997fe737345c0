"""``bench ops``: K-FAC's ops timed at given sizes, as ``[[ops]]`` rows of a simulator cost table.

The simulator's cost tables charge K-FAC's work (:func:`hpcdl.nn.hooks.op`) from measured rows,
interpolated between the measured sizes by each op's law (:class:`hpcdl.store.costs.OpCosts`).
A run with ``profile.layers = true`` records them at its model's sizes; this measures them at
any: for each size n, ``eigh`` of an n × n symmetric positive definite factor (in float64, as
K-FAC runs it: :func:`~hpcdl.optim.kfac.eigen`), ``precondition`` of an n × n gradient
(:func:`~hpcdl.optim.kfac.preconditioned`) and ``factor`` of ``--rows`` samples of width n
(:func:`~hpcdl.optim.kfac.covariance`), in ``--dtype`` (the model's). Each figure is the median
of ``--repeat`` calls, the ops interleaved; the reference beside each is its time predicted by
the law from the previous size's (how far the law holds). ``--toml PATH`` writes the rows as
``[[ops]]`` tables, to be appended to a cost table.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.atomic import check_writable, write_text_atomic
from hpcdl.comm import on_root, world, wtime
from hpcdl.driver.cli import positive_int
from hpcdl.optim.kfac import covariance, eigen, preconditioned
from hpcdl.rng import generator
from hpcdl.store.costs import op_work

__all__ = ["add_parser", "bench_ops", "run", "toml_rows"]


def bench_ops(sizes: list[int], rows: int, dtype: str, repeat: int) -> list[dict[str, Any]]:
    """Median seconds of each op at each size, with the law's prediction from the previous size.

    Args:
        sizes: the factor sizes n.
        rows: the samples of a ``factor`` (a batch, or batch × positions for a convolution).
        dtype: the model's dtype (``float32`` or ``float64``); ``eigh`` runs in float64 anyway.
        repeat: calls per op and size; the medians are reported.

    Returns:
        One row per op and size: ``op``, ``dims``, ``seconds``, ``law_s`` (None at the first size).
    """
    rng = generator(0, "bench-ops")
    out: list[dict[str, Any]] = []
    previous: dict[str, dict[str, Any]] = {}
    for n in sorted(set(sizes)):
        a = rng.standard_normal((rows, n)).astype(dtype)
        factor = covariance(rng.standard_normal((max(rows, n), n)).astype(dtype)) + np.eye(n, dtype=dtype)
        q, lam = eigen(factor)
        grad = rng.standard_normal((n, n)).astype(dtype)
        calls = {
            "eigh": ((n,), lambda f=factor: eigen(f)),
            "precondition": ((n, n), lambda g=grad, q=q, lam=lam: preconditioned(g, q, lam, q, lam, 1e-3)),
            "factor": ((rows, n), lambda a=a: covariance(a)),
        }
        times: dict[str, list[float]] = {op: [] for op in calls}
        for _ in range(repeat):
            for op, (_, call) in calls.items():
                t0 = wtime()
                call()
                times[op].append(wtime() - t0)
        for op, (dims, _) in calls.items():
            row = {"op": op, "dims": list(dims), "seconds": statistics.median(times[op]), "law_s": None}
            before = previous.get(op)
            if before is not None:
                scale = op_work(op, dims) / op_work(op, tuple(before["dims"]))
                row["law_s"] = before["seconds"] * scale
            previous[op] = row
            out.append(row)
    return out


def toml_rows(rows: list[dict[str, Any]]) -> str:
    """The rows as ``[[ops]]`` tables of a cost table."""
    lines = []
    for r in rows:
        lines.append(f'[[ops]]\nop = "{r["op"]}"\ndims = {r["dims"]}\nseconds = {r["seconds"]!r}\n')
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    """Register ``ops`` on the ``bench`` subparsers."""
    p = sub.add_parser(
        "ops",
        help="K-FAC's ops (eigh, precondition, factor) timed by size: [[ops]] rows for cost tables",
        description="Times K-FAC's eigendecomposition, preconditioning and factor at each size, as the "
        "simulator's cost tables charge them, beside the time each op's law predicts from the previous size.",
    )
    p.add_argument(
        "--sizes",
        type=positive_int,
        nargs="+",
        default=[16, 64, 256, 1024],
        metavar="N",
        help="factor sizes n",
    )
    p.add_argument("--rows", type=positive_int, default=32, help="samples of a factor (the batch)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="the model's dtype")
    p.add_argument("--repeat", type=positive_int, default=5, help="calls per op and size; medians reported")
    p.add_argument(
        "--toml",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the rows to PATH as [[ops]] tables (default: not written)",
    )


def run(args: Any) -> list[dict[str, Any]]:
    """Run ``bench ops``; prints on rank 0 and returns the rows."""
    comm = world()
    if args.toml is not None:
        on_root(comm, lambda: check_writable(args.toml, what="the [[ops]] rows"))
    rows = bench_ops(args.sizes, args.rows, args.dtype, args.repeat)
    if comm.Get_rank() == 0:
        print(f"bench ops: K-FAC's ops, {args.dtype}, factor rows = {args.rows}, medians of {args.repeat}")
        print(f"{'op':<14}{'dims':>12}{'seconds':>12}{'law from the size before':>28}")
        for r in rows:
            law = f"{r['law_s']:.3e}" if r["law_s"] is not None else "-"
            print(f"{r['op']:<14}{'x'.join(map(str, r['dims'])):>12}{r['seconds']:>12.3e}{law:>28}")
    if args.toml is not None:
        on_root(comm, lambda: write_text_atomic(args.toml, toml_rows(rows), what="the [[ops]] rows"))
    return rows
