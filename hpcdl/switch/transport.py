"""A worker's link to the switch: datagrams out and in, with seeded faults injected on the way.

A link has two methods, ``send(data)`` and ``poll(timeout) -> list[bytes]`` (what arrived
within ``timeout`` seconds; ``0``: only what is already there). :class:`UdpLink` is a UDP
socket connected to the switch's address; the switch rank's link in MPI form is built on the
communicator the same way. :class:`FaultyLink` wraps any link and, from one seeded
``numpy.random.Generator`` per worker, **loses**, **duplicates** and **reorders** datagrams in
both directions (contributions on ``send``, results on ``poll``) at the rates ``switch.loss``,
``switch.duplicate`` and ``switch.reorder``: the faults are the transport's, so they work the
same over UDP, over MPI and in the simulator, and a run is reproducible from its seed as far as
the faults go (not their timing on a real network).

A reordered datagram is held back and goes out (or is handed over) after the next one in the
same direction, or at the next ``poll`` when nothing follows it: it is overtaken, never lost.
"""

from __future__ import annotations

import select
import socket
from typing import Protocol

import numpy as np

__all__ = ["FaultyLink", "Link", "UdpLink", "parse_address"]

#: the largest datagram the protocol sends (the header and a 1,024-byte payload), with room
_RECV_SIZE = 2048


class Link(Protocol):
    """What a worker sends and receives through."""

    def send(self, data: bytes) -> None:
        """Put one datagram on the way to the switch."""

    def poll(self, timeout: float) -> list[bytes]:
        """The datagrams that arrive within ``timeout`` seconds (at least one if any arrives)."""

    def close(self) -> None:
        """Release the link."""


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` -> ``(host, port)``.

    Raises:
        ValueError: not ``HOST:PORT`` with a port in 1 .. 65535.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"a switch address is HOST:PORT with a port in 1 .. 65535 (got {text!r})")
    return host.strip("[]"), int(port)


class UdpLink:
    """A UDP socket connected to the switch: only the switch's datagrams are received.

    Args:
        address: the switch's ``(host, port)``.
        buffer_bytes: the socket's receive buffer asked of the kernel (a window of results
            arrives at once; the kernel may grant less).
    """

    def __init__(self, address: tuple[str, int], buffer_bytes: int = 4 * 2**20) -> None:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.address = address
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
            self.sock.connect(address)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.refused = 0  # sends refused by the kernel (ICMP port unreachable: no switch there)

    def send(self, data: bytes) -> None:
        try:
            self.sock.send(data)
        except (BlockingIOError, ConnectionRefusedError):  # a full buffer or no switch: a lost datagram
            self.refused += 1

    def poll(self, timeout: float) -> list[bytes]:
        out: list[bytes] = []
        if timeout > 0:
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                return out
        while True:
            try:
                out.append(self.sock.recv(_RECV_SIZE))
            except BlockingIOError:
                return out
            except ConnectionRefusedError:  # the ICMP error of an earlier send: nobody listens
                self.refused += 1

    def close(self) -> None:
        self.sock.close()


class FaultyLink:
    """``link`` with seeded loss, duplication and reordering in both directions.

    Args:
        link: the link to wrap.
        rng: this worker's generator (seeded from the run's seed and the worker).
        loss, duplicate, reorder: the probability that a datagram is lost, sent twice, or
            held back behind the next one; each direction separately.

    Attributes:
        injected: how many datagrams were lost, duplicated and reordered, per direction.
    """

    def __init__(self, link: Link, rng: np.random.Generator, loss: float = 0.0,
                 duplicate: float = 0.0, reorder: float = 0.0) -> None:  # fmt: skip
        for name, rate in (("loss", loss), ("duplicate", duplicate), ("reorder", reorder)):
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"switch.{name} must be in [0, 1) (got {rate})")
        self.link, self.rng = link, rng
        self.loss, self.duplicate, self.reorder = loss, duplicate, reorder
        self._held_out: list[bytes] = []
        self._held_in: list[bytes] = []
        kinds = ("lost", "duplicated", "reordered")
        self.injected = {f"{kind}_{way}": 0 for way in ("out", "in") for kind in kinds}

    def _through(self, data: bytes, held: list[bytes], way: str) -> list[bytes]:
        """What the network makes of ``data`` in one direction: the datagrams it passes on."""
        u = self.rng.random(3)
        if u[0] < self.loss:
            self.injected[f"lost_{way}"] += 1
            return []
        copies = [data, data] if u[1] < self.duplicate else [data]
        if len(copies) == 2:
            self.injected[f"duplicated_{way}"] += 1
        passed = copies
        if held:
            passed = copies + held
            held.clear()
        elif u[2] < self.reorder:
            self.injected[f"reordered_{way}"] += 1
            held.extend(copies)
            return []
        return passed

    def send(self, data: bytes) -> None:
        for out in self._through(data, self._held_out, "out"):
            self.link.send(out)

    def poll(self, timeout: float) -> list[bytes]:
        arrived = self.link.poll(timeout)
        if not arrived:  # nothing follows what is held back: let it through now
            for out in self._held_out:
                self.link.send(out)
            self._held_out.clear()
            late, self._held_in[:] = list(self._held_in), []
            return late
        delivered: list[bytes] = []
        for data in arrived:
            delivered.extend(self._through(data, self._held_in, "in"))
        return delivered

    def close(self) -> None:
        self.link.close()
