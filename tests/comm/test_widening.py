"""The compressed allreduce (float16 / bfloat16 on the wire, float32 sums) against exact references.

The reference gathers every rank's wire values, sums them in float64 (exact for up to
three 2-byte floats of moderate range) and rounds once to the wire format: the widening
allreduce must agree to within one rounding of float32's own sum (which may differ from
the float64 sum in its last bit, moving the final rounding by at most one unit of the
wire format). A 2-byte ring that rounds at every hop would be off by more at n >= 3.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import hpcdl.comm as hc
from hpcdl.comm import Communicator
from hpcdl.comm.collectives import Collectives, CollRequest
from hpcdl.comm.collectives.widening import allreduce
from hpcdl.comm.pack import _bfloat16_bits
from hpcdl.comm.pack import narrow_into as narrow
from hpcdl.comm.pack import widen_into as widen

from .test_mpi_conformance import run_everywhere

WIRES = {"float16": 2.0**-10, "bfloat16": 2.0**-7}  # one unit in the last place, relative


def to_wire(wire: str, x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16) if wire == "float16" else _bfloat16_bits(np, x.astype(np.float32))


def from_wire(wire: str, w: np.ndarray) -> np.ndarray:
    if wire == "float16":
        return w.astype(np.float64)
    return (w.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def test_widen_and_narrow_round_trip_exactly() -> None:
    x = np.random.default_rng(0).standard_normal(1001).astype(np.float32) * 100
    for wire in WIRES:
        w = to_wire(wire, x)
        wide = widen(wire, w, np.empty(w.size, np.float32))
        np.testing.assert_array_equal(wide, from_wire(wire, w).astype(np.float32))
        back = narrow(wire, wide, np.empty_like(w))
        np.testing.assert_array_equal(back, w)  # a wire value widened and narrowed is itself
        np.testing.assert_array_equal(narrow(wire, x, np.empty_like(w)), w)  # narrowing rounds as packing


def check_widening_allreduce(comm: Communicator) -> None:
    """Every length, in and out of place, both wire formats: one rounding of the exact sum."""
    rank, size = comm.Get_rank(), comm.Get_size()
    for wire, ulp in WIRES.items():
        for n in sorted({0, 1, size - 1, size + 1, 1000, 100003}):
            x = np.random.default_rng([3, rank, n]).standard_normal(n) * (1 + rank)
            w = to_wire(wire, x)
            every = comm.allgather(w)
            exact = sum(from_wire(wire, e) for e in every)
            expected = from_wire(wire, to_wire(wire, exact))
            out = np.zeros_like(w)
            CollRequest(allreduce(comm, w, out, tag=5, wire=wire)).Wait()
            got = from_wire(wire, out)
            assert np.all(np.abs(got - expected) <= ulp * np.abs(expected) + 2.0**-24), (wire, n)
            assert np.array_equal(w, to_wire(wire, x)), (wire, n, "sendbuf changed")
            buf = w.copy()
            req = CollRequest(allreduce(comm, buf, buf, tag=6, wire=wire))
            while not req.Test():
                pass
            np.testing.assert_array_equal(buf, out, err_msg=f"{wire} n={n} in place")
            digests = comm.allgather(out.tobytes())
            assert len(set(digests)) == 1, (wire, n, "ranks disagree")


def check_widening_beats_a_two_byte_ring(comm: Communicator) -> None:
    """Many small terms onto a large one: float32 accumulation keeps what float16 sums drop."""
    size = comm.Get_size()
    # rank 0 holds 1024, others 0.4 each: float16's spacing at 1024 is 1, so a float16
    # running sum drops each 0.4; the float32 sum keeps 0.4 (size - 1) and rounds once.
    x = np.full(8, 1024.0 if comm.Get_rank() == 0 else 0.4, dtype=np.float16)
    out = np.empty_like(x)
    CollRequest(allreduce(comm, x, out, tag=7, wire="float16")).Wait()
    expected = np.float16(1024.0 + float(np.float16(0.4)) * (size - 1))
    np.testing.assert_array_equal(out, np.full(8, expected))


def check_collectives_narrow(comm: Communicator) -> None:
    """``Collectives.Iallreduce(..., narrow=wire)`` runs the widening allreduce."""
    rank = comm.Get_rank()
    with Collectives(comm, "mpi") as coll:
        for wire in WIRES:
            w = to_wire(wire, np.arange(1, 101, dtype=np.float64) * (rank + 1))
            expected = np.empty_like(w)
            CollRequest(allreduce(comm, w, expected, tag=9, wire=wire)).Wait()
            out = np.empty_like(w)
            coll.Iallreduce(w, out, narrow=wire).Wait()
            np.testing.assert_array_equal(out, expected)
            with pytest.raises(ValueError, match="SUM"):
                coll.Iallreduce(w, out, op=hc.MAX, narrow=wire)


CHECKS: tuple[Callable[[Communicator], None], ...] = (
    check_widening_allreduce,
    check_widening_beats_a_two_byte_ring,
    check_collectives_narrow,
)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_widening_mpi(check: Callable[[Communicator], None], comm: Communicator) -> None:
    run_everywhere(check, comm)


@pytest.mark.skipif(hc.world().Get_size() != 1, reason="world-of-one tests run without mpiexec")
@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_widening_world_of_one(check: Callable[[Communicator], None], comm: Communicator) -> None:
    check(comm)
