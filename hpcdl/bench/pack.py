"""``bench pack``: packing and unpacking a model's gradients, beside one memcpy of the same bytes."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from hpcdl.comm import world, wtime
from hpcdl.comm.buckets import Buckets
from hpcdl.comm.pack import HAVE_EXT, int32_exponent, int32_pow2_scale
from hpcdl.driver.cli import nonnegative_float
from hpcdl.errors import ConfigError
from hpcdl.models import MODELS, build_model
from hpcdl.rng import generator

__all__ = ["add_parser", "bench_pack", "run"]

#: mode name -> (buffer format, unpack scale)
BENCH_MODES: dict[str, tuple[str, float]] = {
    "plain": ("plain", 1.0),
    "scaled": ("plain", 0.5),
    "float16": ("float16", 0.5),
    "bfloat16": ("bfloat16", 0.5),
    "int32": ("int32", 0.5),
}


def _gradients(model: str, seed: int) -> list[np.ndarray]:
    """The model's gradient arrays (its real shapes and order), filled with normal noise."""
    shape: tuple[int, ...] = (1, 28, 28) if model.startswith("mlp") else (3, 32, 32)
    net = build_model(model, shape, 10, rng=generator(seed, "init"))
    grads = [p.grad for p in net.parameters()]
    rng = generator(seed, "bench-data")
    for g in grads:
        g[...] = rng.standard_normal(g.shape, dtype=g.dtype)
    return grads


def _time(fn: Callable[[], Any], inner: int) -> float:
    t0 = wtime()
    for _ in range(inner):
        fn()
    return (wtime() - t0) / inner


def bench_pack(
    model: str = "mlp32",
    bucket_mb: list[float] | None = None,
    modes: list[str] | None = None,
    repeat: int = 7,
    inner: int = 5,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Pack/unpack GB/s of a model's gradients per bucket size and mode, beside memcpy.

    Every repetition times, in turn, one ``np.copyto`` of a flat array of the gradients'
    bytes (the physical limit), the packing of all buckets, and their unpacking, each
    averaged over ``inner`` calls; figures are medians over ``repeat`` repetitions. GB/s
    count the gradients' bytes (float16 packing writes half as many).

    Args:
        model: a model name of :data:`hpcdl.models.MODELS`.
        bucket_mb: bucket capacities in MiB of the packed format; 0 means one buffer.
        modes: names of :data:`BENCH_MODES`.
        repeat: interleaved repetitions (median reported).
        inner: calls per timed sample.
        seed: seed of the model and the gradient values.

    Returns:
        One row per (bucket size, mode).
    """
    grads = _gradients(model, seed)
    outs = [np.empty_like(g) for g in grads]
    nbytes = sum(g.nbytes for g in grads)
    src = np.concatenate([g.ravel() for g in grads])
    dst = np.empty_like(src)
    rows = []
    for mb in bucket_mb or [0.0]:
        cap = None if mb <= 0 else max(1, int(mb * 2**20))
        for mode in modes or list(BENCH_MODES):
            fmt, scale = BENCH_MODES[mode]
            buckets = Buckets(grads, cap, mode=fmt)
            # the rule in force (exchange.int32_scale = "pow2"), as if for two ranks
            q = int32_pow2_scale(int32_exponent(buckets.maxabs(grads)), 2) if fmt == "int32" else None
            bufs = buckets.pack(grads, qscale=q)
            impl = buckets.packer(0).last_impl

            def pack(buckets: Buckets = buckets, q: float | None = q) -> None:
                for b in range(len(buckets)):
                    buckets.pack_bucket(b, grads, qscale=q)

            def unpack(buckets: Buckets = buckets, bufs: list = bufs, q: float | None = q, s: float = scale):
                for b in range(len(buckets)):
                    buckets.unpack_bucket(b, bufs[b], outs, s, qscale=q)

            def memcpy() -> None:
                np.copyto(dst, src)

            times: dict[str, list[float]] = {"memcpy": [], "pack": [], "unpack": []}
            for fn in (memcpy, pack, unpack):  # warm-up: page faults, caches
                fn()
            for _ in range(repeat):
                for name, fn in (("memcpy", memcpy), ("pack", pack), ("unpack", unpack)):
                    times[name].append(_time(fn, inner))
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append(
                {
                    "model": model,
                    "bytes": nbytes,
                    "arrays": len(grads),
                    "bucket_mb": mb,
                    "buckets": len(buckets),
                    "mode": mode,
                    "impl": impl,
                    "pack_GBps": nbytes / med["pack"] / 1e9,
                    "unpack_GBps": nbytes / med["unpack"] / 1e9,
                    "memcpy_GBps": nbytes / med["memcpy"] / 1e9,
                    "pack_s": med["pack"],
                    "unpack_s": med["unpack"],
                    "memcpy_s": med["memcpy"],
                    "repeat": repeat,
                    "inner": inner,
                }
            )
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    r0 = rows[0]
    print(
        f"bench pack: {r0['model']}, {r0['arrays']} arrays, {r0['bytes']} bytes "
        f"({r0['bytes'] / 2**20:.2f} MiB), median of {r0['repeat']} interleaved repetitions "
        f"x {r0['inner']} calls (kernel built: {HAVE_EXT})"
    )
    print(
        f"{'bucket MiB':>10}{'buckets':>8}  {'mode':<9}{'impl':<7}{'pack GB/s':>10}{'unpack GB/s':>12}"
        f"{'memcpy GB/s':>12}{'pack/memcpy':>12}{'unpack/memcpy':>14}"
    )
    for r in rows:
        mb = "one" if r["bucket_mb"] <= 0 else f"{r['bucket_mb']:g}"
        print(
            f"{mb:>10}{r['buckets']:>8}  {r['mode']:<9}{r['impl']:<7}{r['pack_GBps']:>10.2f}"
            f"{r['unpack_GBps']:>12.2f}{r['memcpy_GBps']:>12.2f}"
            f"{r['pack_GBps'] / r['memcpy_GBps']:>12.3f}{r['unpack_GBps'] / r['memcpy_GBps']:>14.3f}"
        )


def add_parser(sub: Any) -> None:
    """Register ``pack`` and its options on the ``bench`` subparsers."""
    p = sub.add_parser(
        "pack",
        help="pack/unpack GB/s of a model's gradients beside memcpy",
        description="GB/s of packing a model's gradients into buckets and unpacking them, beside one memcpy.",
    )
    p.add_argument("--model", default="mlp32", choices=MODELS, help="the network whose gradients are packed")
    p.add_argument(
        "--bucket-mb",
        type=nonnegative_float,
        nargs="+",
        default=[0.0],
        metavar="MIB",
        help="bucket capacities in MiB, one row each; 0: all gradients in one buffer",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=list(BENCH_MODES),
        choices=list(BENCH_MODES),
        metavar="MODE",
        help=f"wire formats to time: {', '.join(BENCH_MODES)}; scaled: plain with a scale on unpacking",
    )
    p.add_argument("--repeat", type=int, default=7, help="interleaved repetitions; the median is reported")
    p.add_argument("--inner", type=int, default=5, help="calls per timed sample")


def run(args: Any) -> list[dict[str, Any]]:
    """Run ``bench pack`` with parsed ``args``; prints the table on rank 0 and returns the rows."""
    if args.repeat < 1 or args.inner < 1:
        raise ConfigError("--repeat and --inner must be positive integers")
    rows = bench_pack(args.model, args.bucket_mb, args.modes, args.repeat, args.inner)
    if world().Get_rank() == 0:
        print_rows(rows)
    return rows
