"""The parameter servers' wire format: message tags, the float64 header of a push and a reply,
and where each part of the model sits in a message (:class:`MessageLayout`).

Every push and reply is one byte buffer: :data:`HEAD` float64 values, then the payload in
the parameters' dtype. A push to server k carries the worker's gradient for shard k (and,
to server 0, the worker's BatchNorm buffers after it); a reply carries shard k at the
server's version, or only the header when the phase is over. Nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hpcdl.comm.pack import Packer
from hpcdl.parallel.ps_plan import ShardPlan, shard_plan

__all__ = [
    "CLOCK", "CORRECT", "GO", "HEAD", "HEAD_BYTES", "IS_DONE", "IS_PUSH", "KIND", "LOSS", "PUSH", "READY",
    "REPLY", "SAMPLES", "SHARD", "SNAPSHOT", "START", "STOP", "VERSION", "VPULL", "MessageLayout",
    "done_head", "message", "write_push_head", "write_reply_head",
]  # fmt: skip

# message tags (on the strategy's own duplicate of the world)
PUSH, REPLY, READY, START, SNAPSHOT, SHARD = 1, 2, 3, 4, 5, 6
#: float64 values at the head of every push and reply
HEAD = 8
HEAD_BYTES = 8 * HEAD
# push header: kind, the worker's clock before the push, the version it pulled, its stop
# flag, samples, correct, loss
KIND, CLOCK, VPULL, STOP, SAMPLES, CORRECT, LOSS = range(7)
IS_PUSH, IS_DONE = 1.0, 2.0
# reply header: go (1: compute the next push, 0: the phase is over), the shard's version
GO, VERSION = 0, 1


def message(payload_bytes: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A message buffer (bytes), its float64 header view and its payload view in ``dtype``."""
    buf = np.zeros(HEAD_BYTES + payload_bytes, dtype=np.uint8)
    return buf, buf[:HEAD_BYTES].view(np.float64), buf[HEAD_BYTES:].view(dtype)


def write_push_head(
    head: np.ndarray, clock: int, v_pull: Any, stop: bool, samples: int, correct: int, loss: float
) -> None:
    """Fill a push's header: what the server needs to apply it and what server 0 records."""
    head[:] = 0.0
    head[KIND], head[CLOCK], head[VPULL], head[STOP] = IS_PUSH, clock, v_pull, stop
    head[SAMPLES], head[CORRECT], head[LOSS] = samples, correct, loss


def done_head() -> np.ndarray:
    """The header a worker stopped by server 0 sends the other servers instead of a push."""
    done = np.zeros(HEAD, dtype=np.float64)
    done[KIND] = IS_DONE
    return done


def write_reply_head(head: np.ndarray, go: bool, version: int) -> None:
    """Fill a reply's header: compute the next push (``go``) from the shard at ``version``."""
    head[GO], head[VERSION] = float(go), float(version)


class MessageLayout:
    """Where the model's packed parameters and BatchNorm buffers sit in pushes and replies.

    Args:
        params: the model's parameters, in the model's order (packed in that order).
        buffers: the model's BatchNorm buffers (sent to server 0 with each push).
        servers: the number of servers the packed parameters are cut among.
    """

    def __init__(self, params: Sequence[Any], buffers: Sequence[Any], servers: int) -> None:
        self.packer = Packer([p.data for p in params])
        self.dtype = self.packer.dtype
        self.shards: ShardPlan = shard_plan(self.packer.total, servers, self.dtype.itemsize)
        self.bn_packer = Packer(buffers) if buffers else None
        self.bn_bytes = self.bn_packer.nbytes if self.bn_packer is not None else 0

    def range(self, k: int) -> tuple[int, int]:
        """Shard k's ``(start, stop)`` in elements of the packed parameters."""
        return self.shards.ranges[k]

    def push_bytes(self, k: int) -> int:
        """Payload of a push to server k: its shard of the gradient (and BatchNorm buffers to server 0)."""
        return self.shards.nbytes(k) + (self.bn_bytes if k == 0 else 0)

    def reply_bytes(self, k: int) -> int:
        """Payload of a reply from server k: its shard."""
        return self.shards.nbytes(k)
