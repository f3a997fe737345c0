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
from hpcdl.driver.cli import nonnegative_float, positive_int
from hpcdl.errors import ConfigError
from hpcdl.models import MODELS, build_model
from hpcdl.parallel.bucketed import BucketedExchange
from hpcdl.parallel.exchange import AllreduceExchange
from hpcdl.parallel.switched import SwitchExchange, spawn_switch, stop_switch
from hpcdl.rng import generator
from hpcdl.switch.transport import FaultyLink, Link, UdpLink, parse_address

__all__ = ["add_parser", "bench_exchange", "run"]


def _model_params(model: str, seed: int) -> list[Any]:
    shape: tuple[int, ...] = (1, 28, 28) if model.startswith("mlp") else (3, 32, 32)
    return build_model(model, shape, 10, rng=generator(seed, "init")).parameters()


def bench_exchange(
    model: str = "mlp32",
    losses: tuple[float, ...] = (0.0, 0.01, 0.1),
    repeat: int = 5,
    bucket_mb: float = 25.0,
    slots: int = 64,
    payload: int = 1024,
    timeout_ms: float = 1.0,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Median ms per exchange of ``model``'s gradients per variant (module docstring); collective."""
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    params = _model_params(model, seed)
    noise = generator(seed, rank, "bench-grads")
    grads = [noise.standard_normal(p.size).astype(p.dtype).reshape(p.shape) * 1e-2 for p in params]
    variants: dict[str, Any] = {
        "mpi": AllreduceExchange(comm, params),
        "ring": BucketedExchange(comm, params, bucket_mb=bucket_mb, algorithm="ring"),
        "ring-int32": BucketedExchange(
            comm, params, bucket_mb=bucket_mb, algorithm="ring", compression="int32"
        ),
    }
    processes = []
    try:
        for job, loss in enumerate(losses, start=1):
            address = ""
            if rank == 0:
                process, address = spawn_switch(size, slots, payload, job)
                processes.append(process)
            address = comm.bcast(address, root=0)
            link: Link = UdpLink(parse_address(address))
            if loss > 0:
                link = FaultyLink(link, np.random.default_rng([seed, rank, job]), loss=loss)
            variants[f"switch loss {loss:g}"] = SwitchExchange(
                comm, params, link=link, address=address, bucket_mb=bucket_mb, slots=slots,
                payload=payload, job=job, timeout_ms=timeout_ms, timeout_s=60.0,
            )  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in variants}
        sent = dict.fromkeys(variants, 0)
        retransmitted = dict.fromkeys(variants, 0)
        for _ in range(repeat + 1):  # the first repetition warms up, untimed
            for name, ex in variants.items():
                for p, g in zip(params, grads):
                    p.grad[...] = g
                client = getattr(ex, "client", None)
                before = (client.datagrams_sent, client.state.retransmissions) if client else (0, 0)
                comm.Barrier()
                t0 = wtime()
                ex.exchange()
                dt = comm.allreduce(wtime() - t0, op=ops.MAX)
                times[name].append(dt)
                if client:
                    sent[name] = client.datagrams_sent - before[0]
                    retransmitted[name] = client.state.retransmissions - before[1]
        for ex in variants.values():
            ex.free()
    finally:
        for process in processes:
            stop_switch(process)
    nbytes = sum(p.grad.nbytes for p in params)
    reference = statistics.median(times["mpi"][1:])
    clean = next((statistics.median(times[n][1:]) for n in variants if n == "switch loss 0"), float("nan"))
    rows = []
    for name in variants:
        ms = statistics.median(times[name][1:]) * 1e3
        row = {
            "model": model, "ranks": size, "variant": name, "bytes": nbytes, "ms": ms,
            "vs_mpi": ms / (reference * 1e3), "repeat": repeat,
        }  # fmt: skip
        if name.startswith("switch"):
            row.update({"datagrams": sent[name], "retransmissions": retransmitted[name],
                        "vs_no_loss": ms / (clean * 1e3)})  # fmt: skip
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
    p.add_argument("--timeout-ms", type=float, default=1.0, help="switch.timeout_ms")


def run(args: Any) -> list[dict[str, Any]]:
    """Run ``bench exchange`` with parsed ``args``; prints the table on rank 0 and returns the rows."""
    if world().Get_size() < 2:
        raise ConfigError(
            "bench exchange compares exchanges between ranks: run it under mpiexec -n 2 or more"
        )
    if any(p >= 1 for p in args.loss) or args.timeout_ms <= 0:
        raise ConfigError("--loss must be below 1 and --timeout-ms positive")
    rows = bench_exchange(args.model, tuple(args.loss), args.repeat, args.bucket_mb, args.slots, args.payload,
                          args.timeout_ms)  # fmt: skip
    if world().Get_rank() == 0:
        print_rows(rows)
    return rows
