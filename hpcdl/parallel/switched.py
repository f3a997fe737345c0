"""``exchange.name = "switch"``: sync's buckets summed by an aggregation switch (in-network aggregation).

The bucketed exchange's buckets (``exchange.bucket_mb``), quantised to int32 with one
power-of-two scale per bucket, are summed by a switch instead of a ring: each worker sends
its bucket in chunks of ``switch.payload`` bytes through ``switch.slots`` slots, and the
switch returns the sum of the W chunks (:mod:`hpcdl.switch`, SwitchML's protocol). A bucket
takes two rounds through the switch: the **exponent round** (the maximum of the workers'
``int32_exponent(max|g|)``, what the int32 ring reduces with a MAX allreduce), then the
bucket packed by the same kernel at the same scale ``2**k`` (:func:`~hpcdl.comm.pack.int32_pow2_scale`)
— so the switch sums the integers the ring sums, and the run's parameters are the int32 ring's
bit for bit.

Where the switch is (``exchange.switch``):

* ``HOST:PORT``: a running ``python -m hpcdl.switch --workers N --job J`` (``switch.job``);
* ``spawn``: rank 0 starts one on loopback for the job (``--parent-pid``: it never outlives
  the job) and stops it at the end; its counters go to rank 0's output.

Buckets go through the switch in bucket order on every worker (a bucket's data round right
after its exponent round), as the protocol's per-slot use numbers need; while backward runs,
each layer's end progresses what is in flight, as the bucketed exchange does with its
collectives. Over UDP (``HOST:PORT``, ``spawn``) each worker's datagrams go through the
compiled loop (:class:`~hpcdl.switch.udp.UdpSwitchClient`); the rank form keeps the Python state
machine. Loss, duplication and reordering (``switch.loss``, ``switch.duplicate``,
``switch.reorder``) are injected in each worker's loop or link, seeded from ``seed`` and the rank.
A switch that stops answering fails every worker within ``switch.timeout_s``, naming its
address and the chunks outstanding.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl._ext.switchloop import SwitchLoop
from hpcdl.backend import synchronize
from hpcdl.comm import Communicator, sleep, slow_down, wtime
from hpcdl.comm.pack import INT32_NONFINITE_EXPONENT, int32_exponent, int32_pow2_scale
from hpcdl.components import Declares, Key
from hpcdl.errors import ConfigError
from hpcdl.nn.parameter import Parameter
from hpcdl.parallel.bucketed import DEFAULT_BUCKET_MB, BucketedExchange
from hpcdl.parallel.exchange import ExchangeError
from hpcdl.parallel.memory import RankMemory
from hpcdl.rng import generator
from hpcdl.switch import WorkerState
from hpcdl.switch.client import Reduction, SwitchClient, SwitchUnreachable
from hpcdl.switch.protocol import PAYLOADS
from hpcdl.switch.ranklink import CommLink, SwitchRank
from hpcdl.switch.transport import FaultyLink, Link, parse_address
from hpcdl.switch.udp import UdpSwitchClient
from hpcdl.switch.worker import FAST_RETRANSMIT

__all__ = [
    "DECLARES",
    "DEFAULT_TIMEOUT_MS",
    "SWITCH_ROLE",
    "SwitchExchange",
    "SwitchSpawnError",
    "fault_seed",
    "make_switch_exchange",
    "spawn_switch",
    "stop_switch",
    "switch_communicators",
    "switch_memory",
    "switch_note",
    "switch_ranks",
    "switch_state",
]

#: the role of the rank that runs the switch (``exchange.switch = "rank"``)
SWITCH_ROLE = "switch"

#: ``switch.timeout_ms``'s default (docs/switch.md: measured with the compiled worker loop)
DEFAULT_TIMEOUT_MS = 1.0

#: the ``[switch]`` section: the protocol's sizes, its timeouts, and injected faults
DECLARES = Declares(
    keys={
        "switch.slots": Key(
            int,
            64,
            "switch exchange: slots used, the chunks in flight per worker (the switch must have as many)",
            minimum=1,
            below=65536,
        ),
        "switch.payload": Key(
            int, 1024, "switch exchange: int32 payload bytes per datagram", choices=PAYLOADS
        ),
        "switch.job": Key(
            int, 1, "switch exchange: the job id (a running switch's --job)", minimum=0, below=2**32
        ),
        "switch.timeout_ms": Key(
            float,
            DEFAULT_TIMEOUT_MS,
            "switch exchange: a chunk without result is sent again after this many ms",
            above=0.0,
        ),
        "switch.fast_retransmit": Key(
            int,
            FAST_RETRANSMIT,
            "switch exchange: a chunk still without result when the result of a chunk sent this many "
            "sends after it arrives is sent again at once (0: only after switch.timeout_ms)",
            minimum=0,
        ),
        "switch.timeout_s": Key(
            float,
            10.0,
            "switch exchange: no result for this long, chunks outstanding: "
            "the switch is unreachable, every worker fails",
            above=0.0,
        ),
        "switch.loss": Key(
            float,
            0.0,
            "switch exchange: injected probability a datagram is lost, each direction",
            minimum=0.0,
            below=1.0,
        ),
        "switch.duplicate": Key(
            float,
            0.0,
            "switch exchange: injected probability a datagram is sent twice",
            minimum=0.0,
            below=1.0,
        ),
        "switch.reorder": Key(
            float,
            0.0,
            "switch exchange: injected probability a datagram is overtaken by the next",
            minimum=0.0,
            below=1.0,
        ),
    },
)

#: an exponent that tells the others a gradient is not finite (the i16 field's largest)
_NONFINITE = 0x7FFF
_SPAWN_WAIT_S = 20.0


class SwitchSpawnError(ExchangeError):
    """Rank 0 could not start the switch program."""


class SwitchExchange(BucketedExchange):
    """The bucketed exchange with every bucket summed by an aggregation switch.

    Args:
        comm: the workers (rank = worker id, size = W).
        params: the parameters whose gradients are exchanged.
        debug: check buffer sizes and finite gradients across ranks first (``exchange.debug``).
        link: this worker's link to the switch (faults already wrapped around it), driven by
            the Python state machine; or None with ``client``.
        address: the switch's address, for messages.
        bucket_mb: bucket size in MiB (``exchange.bucket_mb``).
        slots, payload, job, timeout_ms, timeout_s, fast: the ``switch.*`` keys (``fast``:
            ``switch.fast_retransmit``).
        process: the switch program this rank spawned (stopped by :meth:`free`), or None.
        rank_link: the link to a switch rank (told after each exchange that this worker is
            done), or None.
        client: the worker's client, built by the caller (a
            :class:`~hpcdl.switch.udp.UdpSwitchClient`), instead of ``link``.
    """

    def __init__(
        self,
        comm: Communicator,
        params: Sequence[Parameter],
        debug: bool = False,
        *,
        link: Link | None = None,
        address: str,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        slots: int = 64,
        payload: int = 1024,
        job: int = 1,
        timeout_ms: float = DEFAULT_TIMEOUT_MS,
        timeout_s: float = 10.0,
        fast: int = 0,
        process: subprocess.Popen | None = None,
        rank_link: CommLink | None = None,
        client: SwitchClient | None = None,
    ) -> None:
        if (link is None) == (client is None):
            raise ValueError("SwitchExchange takes either a link (the Python state machine) or a client")
        super().__init__(
            comm, params, debug, bucket_mb=bucket_mb, algorithm="mpi", compression="int32", int32_scale="pow2"
        )
        if client is None:
            state = WorkerState(job, comm.Get_rank(), comm.Get_size(), slots, payload, timeout_ms / 1000.0,
                                fast=fast)  # fmt: skip
            client = SwitchClient(state, link, wtime, timeout_s, address)
        self.client = client
        self.address = address
        self.process = process
        self.rank_link = rank_link

    def _start(self, b: int) -> None:
        """Queue bucket ``b``'s exponent round; its data round follows it when the maximum is known."""
        t0 = wtime() if self.tracer is not None else 0.0
        members = self.buckets.plan.buckets[b].arrays
        grads = self._grads
        local = int32_exponent(self.buckets.packer(b).maxabs([grads[i] for i in members]))
        exponent = _NONFINITE if local == INT32_NONFINITE_EXPONENT else max(local, -0x8000)
        round_ = self.client.exponent(exponent, f"bucket {b}", then=lambda r: self._data_round(b, r.exponent))
        self._reqs.append(_Bucket(self.client, round_))
        if self.tracer is not None:
            self.tracer("pack", t0, wtime(), b)

    def _data_round(self, b: int, exponent: int) -> np.ndarray:
        """Bucket ``b`` packed at the scale of the workers' maximum ``exponent``: the switch's next sum."""
        if exponent > 1024:  # some worker's gradient is not finite: the same on every worker
            members = self.buckets.plan.buckets[b].arrays
            names = ", ".join(self.params[i].name for i in members[:3])
            raise ExchangeError(
                f"a gradient in the bucket of {names}{', ...' * (len(members) > 3)} is not finite on some "
                "rank: the switch sums int32 and cannot quantize it (lower optimizer.lr; exchange.debug = "
                "true names the parameter and rank)"
            )
        qscale = int32_pow2_scale(exponent, self.comm.Get_size())
        self._qscales[b] = qscale
        buf = self.buckets.pack_bucket(b, self._grads, qscale=qscale)
        synchronize(buf)
        self.bytes_sent += int(buf.nbytes)
        return buf

    def _wait_all(self) -> None:
        """The UDP client serves the buckets in order: wait on each in turn, blocking in its loop
        (polling them all with ``Test`` would spin every worker and starve a switch sharing the
        cores); the rank form keeps ``waitall`` (the simulator blocks it in virtual time)."""
        if not isinstance(self.client, UdpSwitchClient):
            super()._wait_all()
            return
        for req in self._reqs:
            if req:
                req.Wait()

    def exchange(self) -> None:
        """Finish every bucket through the switch and unpack the averages; tell a switch rank."""
        super().exchange()
        if self.rank_link is not None:
            self.rank_link.done()

    def free(self) -> None:
        """Close the link, stop a switch this rank spawned, free the collectives."""
        self.client.close()
        if self.process is not None:
            stop_switch(self.process)
            self.process = None
        super().free()


class _Bucket:
    """A bucket in flight through the switch: its exponent round, then its data round.

    A request for :func:`hpcdl.comm.waitall` (``Test``/``Wait``, truthy while active).
    """

    __slots__ = ("_active", "client", "exponent")

    def __init__(self, client: SwitchClient, exponent: Reduction) -> None:
        self.client, self.exponent = client, exponent
        self._active = True

    def __bool__(self) -> bool:
        return self._active

    @property
    def finished(self) -> bool:
        """Both rounds are done."""
        return self.exponent.next is not None and self.exponent.next.done

    def Test(self, status: object = None) -> bool:  # noqa: N802 - an mpi4py request's name
        """Progress without blocking; True (once, then inactive) when the bucket is summed."""
        if not self.finished:
            _progress(self.client, block=False)
        if self.finished:
            self._active = False
        return self.finished

    def Wait(self, status: object = None) -> None:  # noqa: N802
        """Progress, blocking, until the bucket is summed (raises SwitchUnreachable)."""
        while not self.finished:
            _progress(self.client, block=True)
        self._active = False


def _progress(client: SwitchClient, block: bool) -> None:
    """``client.progress``, an unreachable switch raised as the exchange's error (one line)."""
    try:
        client.progress(block)
    except SwitchUnreachable as e:
        raise ExchangeError(str(e)) from None


def switch_ranks(cfg: Any, world: int) -> int:
    """The ranks the exchange sets aside from the workers: 1 for ``exchange.switch = "rank"`` (the last).

    Raises:
        ConfigError: the rank form on fewer than 2 ranks, or with ``fault.*``.
    """
    if cfg["exchange.name"] != "switch" or cfg["exchange.switch"] != "rank":
        return 0
    if world < 2:
        raise ConfigError(
            "exchange.switch = 'rank' makes the last rank the switch: run on 2 ranks or more (N - 1 workers)"
        )
    if cfg["fault.p"] > 0 or cfg["fault.schedule"]:
        raise ConfigError(
            "fault.* with exchange.switch = 'rank' is not built (the switch rank has no outages to "
            "record); use exchange.switch = 'spawn'"
        )
    return 1


def switch_note(cfg: Any, workers: int) -> str:
    """The ``--plan`` line of the switch rank."""
    return (
        f"rank {workers}: the aggregation switch (exchange.switch = 'rank'): {cfg['switch.slots']} slots of "
        f"{cfg['switch.payload']} bytes, summing {workers} workers' int32 buckets"
    )


def switch_memory(cfg: Any, workers: int) -> RankMemory:
    """The switch rank's memory: its slots (two sets of int64 sums, the bitmaps) and the model it builds."""
    slots = cfg["switch.slots"] * 2 * (cfg["switch.payload"] // 4 * 8 + 8 * ((workers + 63) // 64) + 32)
    return RankMemory(SWITCH_ROLE, {"slots": slots}, (), cfg["data.batch_size"])


def switch_communicators(
    cfg: Any, world: Communicator, placement: Any
) -> tuple[Communicator, Communicator, SwitchRank | None]:
    """The rank form's communicators (collective over ``world``): the links' own, the workers',
    and on the switch rank its serving loop (None on a worker, whose workers' communicator it is)."""
    aside = [r for r, place in enumerate(placement.ranks) if place.role == SWITCH_ROLE]
    links = world.Dup()
    rank = world.Get_rank()
    split = world.Split(1 if rank in aside else 0, rank)
    if rank not in aside:
        return links, split, None
    workers = [r for r in range(world.Get_size()) if r not in aside]
    state = switch_state(len(workers), cfg["switch.slots"], cfg["switch.payload"], cfg["switch.job"])
    slow_down(0.0)  # in the simulator its compute is free: [switch]'s per_packet_us is its processing
    return links, split, SwitchRank(links, state, workers)


def switch_state(workers: int, slots: int, payload: int, job: int) -> Any:
    """The switch rank's slot logic: the compiled loop's (``SwitchState``'s rules, byte for byte, in C)."""
    return SwitchLoop(workers, slots, payload, job)


def make_switch_exchange(
    cfg: Any, comm: Communicator, params: Sequence[Parameter], links: Communicator | None = None
) -> SwitchExchange:
    """The ``switch`` exchange the config asks for (``exchange.switch``, ``switch.*``); collective.

    Raises:
        ConfigError: an exchange key the switch cannot honour, or a malformed address.
        SwitchSpawnError: ``spawn`` and the program did not start (on every rank).
    """
    if cfg["exchange.int32_scale"] != "pow2":
        raise ConfigError(
            "exchange.name = 'switch' quantizes with exchange.int32_scale = 'pow2' (the "
            f"switch's exponent round); got {cfg['exchange.int32_scale']!r}"
        )
    if cfg["exchange.compression"] not in ("none", "int32"):
        raise ConfigError(
            f"exchange.name = 'switch' sends int32; exchange.compression = "
            f"{cfg['exchange.compression']!r} does not apply (leave it 'none' or "
            "'int32')"
        )
    where = cfg["exchange.switch"]
    process = None
    rates = (cfg["switch.loss"], cfg["switch.duplicate"], cfg["switch.reorder"])
    rank = comm.Get_rank()
    rank_link = None
    link: Link | None = None
    client: SwitchClient | None = None
    if where == "rank":
        if links is None:
            raise ConfigError("exchange.switch = 'rank' needs the switch rank the placement sets aside")
        switch = links.Get_size() - 1
        text = f"rank {switch}"
        rank_link = CommLink(links, switch, blocking=not any(rates), quantum=cfg["switch.timeout_ms"] / 4000)
        link = rank_link
        if any(rates):
            rng = np.random.default_rng([cfg["seed"], rank, 0x5357])  # this worker's fault stream
            link = FaultyLink(link, rng, *rates)
    elif where == "spawn":
        text, process, error = "", None, ""
        if comm.Get_rank() == 0:
            try:
                process, text = spawn_switch(
                    comm.Get_size(), cfg["switch.slots"], cfg["switch.payload"], cfg["switch.job"]
                )
            except SwitchSpawnError as e:
                error = str(e)
        text, error = comm.bcast((text, error), root=0)
        if error:
            raise SwitchSpawnError(error)
    else:
        text = where
    if rank_link is None:
        try:
            parse_address(text)
        except ValueError as e:
            raise ConfigError(f"exchange.switch: {e}; or 'spawn' or 'rank'") from None
        client = UdpSwitchClient(
            text, cfg["switch.job"], rank, comm.Get_size(), cfg["switch.slots"], cfg["switch.payload"],
            cfg["switch.timeout_ms"] / 1000.0, cfg["switch.timeout_s"], loss=rates[0], duplicate=rates[1],
            reorder=rates[2], seed=fault_seed(cfg["seed"], rank), fast=cfg["switch.fast_retransmit"],
        )  # fmt: skip
    return SwitchExchange(
        comm,
        params,
        debug=cfg["exchange.debug"],
        link=link,
        address=text,
        bucket_mb=cfg["exchange.bucket_mb"],
        slots=cfg["switch.slots"],
        payload=cfg["switch.payload"],
        job=cfg["switch.job"],
        timeout_ms=cfg["switch.timeout_ms"],
        timeout_s=cfg["switch.timeout_s"],
        fast=cfg["switch.fast_retransmit"] if any(rates) else 0,  # the rank form: MPI loses nothing else
        process=process,
        rank_link=rank_link,
        client=client,
    )


def fault_seed(seed: int, *key: int) -> int:
    """A worker's u64 fault seed for the compiled loop: the first draw of the run's seeded stream
    for ``key`` (the rank, ...; :func:`hpcdl.rng.generator`)."""
    return int(generator(seed, "switch-faults", *key).integers(2**64, dtype=np.uint64))


def spawn_switch(workers: int, slots: int, payload: int, job: int) -> tuple[subprocess.Popen, str]:
    """Start ``python -m hpcdl.switch`` on loopback (a free port) for this process's job.

    Returns:
        The process and its ``HOST:PORT``.

    Raises:
        SwitchSpawnError: it exited or did not report its address within 20 s.
    """
    with tempfile.TemporaryDirectory(prefix="hpcdl-switch-") as tmp:
        ready = Path(tmp) / "address"
        argv = [sys.executable, "-m", "hpcdl.switch", "--workers", str(workers), "--port", "0",
                "--slots", str(slots), "--payload", str(payload), "--job", str(job),
                "--ready-file", str(ready), "--parent-pid", str(os.getpid())]  # fmt: skip
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        deadline = wtime() + _SPAWN_WAIT_S
        while not ready.exists():
            if process.poll() is not None:
                raise SwitchSpawnError(
                    f"the switch program exited with status {process.returncode} before "
                    f"listening (its message is above): {' '.join(argv[1:])}"
                )
            if wtime() > deadline:
                stop_switch(process)
                raise SwitchSpawnError(
                    f"the switch program did not listen within {_SPAWN_WAIT_S:g} s: {' '.join(argv[1:])}"
                )
            sleep(0.02)
        return process, ready.read_text().strip()


def stop_switch(process: subprocess.Popen, wait_s: float = 5.0) -> None:
    """SIGTERM (the program prints its counters and exits), SIGKILL after ``wait_s``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(wait_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
