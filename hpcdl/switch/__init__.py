"""In-network aggregation (SwitchML-style): the wire protocol and the switch's and workers' slot logic.

Pure, transport-agnostic code; the UDP switch process, the ``switch`` exchange of ``sync``
and the simulator's model of it are built on it later.
"""

from __future__ import annotations

from hpcdl.switch.protocol import Header, Limits, Malformed, encode, encode_into, parse, pow2_scale_exponent
from hpcdl.switch.slots import MULTICAST, Counter, Send, SwitchState
from hpcdl.switch.worker import WorkerState, exponent_of

__all__ = [
    "MULTICAST",
    "Counter",
    "Header",
    "Limits",
    "Malformed",
    "Send",
    "SwitchState",
    "WorkerState",
    "encode",
    "encode_into",
    "exponent_of",
    "parse",
    "pow2_scale_exponent",
]
