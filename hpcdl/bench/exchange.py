"""``bench exchange``: one gradient exchange of a model, through the UDP switch and through the ring,
beside MPI's own Allreduce of the same gradients (under mpiexec).

Every rank fills the model's gradients with the same seeded noise per repetition (its own
stream), and times ``exchange()`` alone (every bucket started there, nothing overlapped), with
a barrier before each. The variants, interleaved in every repetition:

* ``mpi``: the flat exchange, one ``MPI_Allreduce`` of the gradients (the reference);
* ``ring``: the bucketed exchange with hpcdl's ring in the gradients' dtype;
* ``ring-int32``: the same with int32 compression (what the switch sums);
* ``switch``, at each ``--loss``: the switch exchange through a switch program rank 0 spawned on
  loopback for that variant (its own job, so each keeps its slots' use numbers), with the
  injected loss in both directions of each worker's link.

Rows: the median milliseconds per exchange, the ratio to ``mpi``, and for the switch its
datagrams and retransmissions per exchange (per worker) and the ratio to its loss-free time.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from hpcdl import comm as ops  # ops.MAX resolved at use
from hpcdl.comm import world, wtime
from hpcdl.driver.cli import nonnegative_float, parse_size, positive_int
from hpcdl.errors import ConfigError
from hpcdl.models import MODELS, build_model
from hpcdl.nn.parameter import Parameter
from hpcdl.parallel.bucketed import BucketedExchange
from hpcdl.parallel.exchange import AllreduceExchange
from hpcdl.parallel.switched import (
    DEFAULT_TIMEOUT_MS,
    SwitchExchange,
    fault_seed,
    spawn_switch,
    stop_switch,
    switch_state,
)
from hpcdl.rng import generator
from hpcdl.switch.ranklink import CommLink, SwitchRank
from hpcdl.switch.udp import UdpSwitchClient
from hpcdl.switch.worker import FAST_RETRANSMIT

__all__ = ["VARIANTS", "add_parser", "bench_exchange", "run"]

#: what ``bench exchange`` times (module docstring)
VARIANTS = ("mpi", "ring", "ring-int32", "switch", "switch-rank")


def _parameters(model: str, size: int, seed: int) -> list[Any]:
    """The model's parameters, or (``size`` > 0) one float32 parameter of ``size`` bytes."""
    if size > 0:
        return [Parameter(np.zeros(size // 4, np.float32), name="vector")]
    shape: tuple[int, ...] = (1, 28, 28) if model.startswith("mlp") else (3, 32, 32)
    return build_model(model, shape, 10, rng=generator(seed, "init")).parameters()


def bench_exchange(
    model: str = "mlp32",
    losses: tuple[float, ...] = (0.0, 0.01, 0.1),
    repeat: int = 5,
    bucket_mb: float = 25.0,
    slots: int = 64,
    payload: int = 1024,
    timeout_ms: float = DEFAULT_TIMEOUT_MS,
    seed: int = 0,
    fast: int = FAST_RETRANSMIT,
    variants: tuple[str, ...] = ("mpi", "ring", "ring-int32", "switch"),
    size: int = 0,
) -> list[dict[str, Any]]:
    """Median ms per exchange of ``model``'s gradients (or a vector of ``size`` bytes) per variant
    (module docstring); collective. With ``switch-rank`` the last rank is the switch, and every
    variant runs on the others."""
    world_comm = world()
    ranked = "switch-rank" in variants
    if ranked and world_comm.Get_size() < 2:
        raise ConfigError("the switch-rank variant needs 2 ranks or more: N - 1 workers and the switch")
    links = world_comm.Dup()
    last = world_comm.Get_size() - 1
    serving = ranked and world_comm.Get_rank() == last
    comm = world_comm.Split(1 if serving else 0, world_comm.Get_rank())
    rank, workers = comm.Get_rank(), world_comm.Get_size() - int(ranked)
    params = _parameters(model, size, seed)
    built: dict[str, Any] = {}
    switch_rank = None
    processes = []
    try:
        if serving:
            switch_rank = SwitchRank(links, switch_state(workers, slots, payload, 1), list(range(workers)))
            built["switch-rank"] = None
        else:
            noise = generator(seed, rank, "bench-grads")
            grads = [noise.standard_normal(p.size).astype(p.dtype).reshape(p.shape) * 1e-2 for p in params]
            for name in variants:
                if name == "mpi":
                    built[name] = AllreduceExchange(comm, params)
                elif name in ("ring", "ring-int32"):
                    compression = "int32" if name == "ring-int32" else "none"
                    built[name] = BucketedExchange(comm, params, bucket_mb=bucket_mb, algorithm="ring",
                                                   compression=compression)  # fmt: skip
                elif name == "switch-rank":
                    link = CommLink(links, last, blocking=True)
                    built[name] = SwitchExchange(
                        comm, params, link=link, address=f"rank {last}", bucket_mb=bucket_mb, slots=slots,
                        payload=payload, job=1, timeout_ms=timeout_ms, timeout_s=600.0, rank_link=link,
                    )  # fmt: skip
                else:  # the UDP switch, one program (job) per loss rate
                    for job, loss in enumerate(losses, start=2):
                        address = ""
                        if rank == 0:
                            process, address = spawn_switch(comm.Get_size(), slots, payload, job)
                            processes.append(process)
                        address = comm.bcast(address, root=0)
                        client = UdpSwitchClient(address, job, rank, comm.Get_size(), slots, payload,
                                                 timeout_ms / 1000.0, 60.0, loss=loss,
                                                 seed=fault_seed(seed, rank, job), fast=fast)  # fmt: skip
                        built[f"switch loss {loss:g}"] = SwitchExchange(
                            comm, params, client=client, address=address, bucket_mb=bucket_mb, slots=slots,
                            payload=payload, job=job, timeout_ms=timeout_ms, timeout_s=60.0,
                        )  # fmt: skip
        names = world_comm.bcast(list(built), root=0)
        times: dict[str, list[float]] = {name: [] for name in names}
        sent = dict.fromkeys(names, 0)
        retransmitted = dict.fromkeys(names, 0)
        for _ in range(repeat + 1):  # the first repetition warms up, untimed
            for name in names:
                ex = built.get(name)
                if ex is not None:
                    for p, g in zip(params, grads):
                        p.grad[...] = g
                client = getattr(ex, "client", None)
                before = (client.datagrams_sent, client.state.retransmissions) if client else (0, 0)
                world_comm.Barrier()
                t0 = wtime()
                if serving and name == "switch-rank":
                    switch_rank.serve_step()
                elif ex is not None:
                    ex.exchange()
                dt = world_comm.allreduce(0.0 if serving else wtime() - t0, op=ops.MAX)
                times[name].append(dt)
                if client:
                    sent[name] = client.datagrams_sent - before[0]
                    retransmitted[name] = client.state.retransmissions - before[1]
        for ex in built.values():
            if ex is not None:
                ex.free()
    finally:
        for process in processes:
            stop_switch(process)
    counts = world_comm.gather((sent, retransmitted), root=0)
    comm.Free()
    links.Free()
    if world_comm.Get_rank() != 0:
        return []
    sent, retransmitted = counts[0]
    nbytes = sum(p.grad.nbytes for p in params)
    median = {name: statistics.median(times[name][1:]) for name in names}
    reference = median.get("mpi", float("nan"))
    clean = median.get("switch loss 0", float("nan"))
    rows = []
    for name in names:
        ms = median[name] * 1e3
        what = model if size <= 0 else f"{size} B"
        row = {"model": what, "ranks": world_comm.Get_size(), "workers": workers, "variant": name,
               "bytes": nbytes, "ms": ms, "vs_mpi": median[name] / reference, "repeat": repeat}  # fmt: skip
        if name.startswith("switch"):
            row.update({"datagrams": sent[name], "retransmissions": retransmitted[name],
                        "vs_no_loss": median[name] / clean})  # fmt: skip
        rows.append(row)
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    """The table: one line per variant."""
    first = rows[0]
    print(f"{first['model']} gradients ({first['bytes'] / 2**20:.1f} MiB) on {first['ranks']} ranks, "
          f"median of {first['repeat']}:")  # fmt: skip
    print(f"{'variant':<20}{'ms':>10}{'x mpi':>8}{'datagrams':>11}{'retrans':>9}{'x no loss':>11}")
    for r in rows:
        extra = ""
        if "datagrams" in r:
            extra = f"{r['datagrams']:>11}{r['retransmissions']:>9}{r['vs_no_loss']:>11.3f}"
        print(f"{r['variant']:<20}{r['ms']:>10.2f}{r['vs_mpi']:>8.2f}{extra}")


def add_parser(sub: Any) -> None:
    """Register ``exchange`` and its options on the ``bench`` subparsers."""
    p = sub.add_parser(
        "exchange",
        help="one gradient exchange through the UDP switch and the ring, beside MPI's Allreduce",
        description="Milliseconds per gradient exchange of a model through the UDP switch (spawned on "
        "loopback, at injected loss rates), hpcdl's ring (float and int32) and MPI's own Allreduce; "
        "under mpiexec.",
    )
    p.add_argument(
        "--model", default="mlp32", choices=MODELS, help="the network whose gradients are exchanged"
    )
    p.add_argument("--loss", type=nonnegative_float, nargs="+", default=[0.0, 0.01, 0.1], metavar="P",
                   help="injected loss rates of the switch variants, one each (each direction)")  # fmt: skip
    p.add_argument(
        "--repeat", type=positive_int, default=5, help="interleaved repetitions; the median is reported"
    )
    p.add_argument("--bucket-mb", type=nonnegative_float, default=25.0, help="bucket size in MiB")
    p.add_argument("--slots", type=positive_int, default=64, help="switch.slots")
    p.add_argument("--payload", type=int, choices=(256, 1024), default=1024, help="switch.payload")
    p.add_argument("--timeout-ms", type=float, default=DEFAULT_TIMEOUT_MS, help="switch.timeout_ms")
    p.add_argument("--fast", type=int, default=FAST_RETRANSMIT, metavar="K",
                   help="switch.fast_retransmit (0: retransmit after timeouts only)")  # fmt: skip
    p.add_argument("--variants", nargs="+", default=["mpi", "ring", "ring-int32", "switch"],
                   choices=VARIANTS, metavar="NAME",
                   help=f"what to time: {', '.join(VARIANTS)} (switch: the UDP program, once per --loss; "
                   "switch-rank: the last rank is the switch, the others the workers of every variant; "
                   "runs in the simulator)")  # fmt: skip
    p.add_argument("--size", type=lambda t: parse_size(t, "--size"), default=0, metavar="BYTES",
                   help="exchange one float32 vector of this many bytes instead of --model's gradients "
                   "(0: the model's)")  # fmt: skip


def run(args: Any) -> list[dict[str, Any]]:
    """Run ``bench exchange`` with parsed ``args``; prints the table on rank 0 and returns the rows."""
    if world().Get_size() < 2:
        raise ConfigError(
            "bench exchange compares exchanges between ranks: run it under mpiexec -n 2 or more"
        )
    if any(p >= 1 for p in args.loss) or args.timeout_ms <= 0 or args.fast < 0:
        raise ConfigError("--loss must be below 1, --timeout-ms positive and --fast at least 0")
    rows = bench_exchange(args.model, tuple(args.loss), args.repeat, args.bucket_mb, args.slots, args.payload,
                          args.timeout_ms, fast=args.fast, variants=tuple(dict.fromkeys(args.variants)),
                          size=args.size)  # fmt: skip
    if world().Get_rank() == 0:
        print_rows(rows)
    return rows
