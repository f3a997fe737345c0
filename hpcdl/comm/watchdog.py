"""The stall watchdog of real MPI runs: every wait polls with a deadline, and a stalled rank
finds out which rank holds it up.

Horovod's stall inspector, without its background thread (docs/design.md: no threads in
``comm/``). A :class:`Watchdog` waits for requests by polling ``Test()``; when one wait has
lasted ``stall_s`` seconds, the rank *asks* every other rank, on a private duplicate of the
world, what it is doing. Ranks that are waiting too answer from inside their own waits
(they poll the private communicator every :data:`CHECK_S`); a rank that is computing,
stopped (SIGSTOP), dead or stuck outside hpcdl's waits does not. After ``grace_s`` the
asking rank raises :class:`StallError` with the report: the ranks that did not answer
(those holding the others up), and what each waiting rank waits for (operation, peer,
tag, communicator, and the notes the caller left: step, phase, buckets). When every rank
answers, every rank is waiting for another: a deadlock, and each rank's wait is listed.

The first rank to stall reports; ranks that stall while another rank's question is
recent leave the report to it (when two ask at once, the lower rank reports), and ask
and report themselves if the job is still alive :data:`FALLBACK_S` after that. A wait that
completes while its rank is asking was slow, not hung: it withdraws its question, prints
one warning line and goes on. When the rank that reports is not rank 0 and rank 0 answered,
it hands the report to rank 0 (which writes the run file: its status becomes ``stalled``,
the report recorded) and rank 0 raises it and ends the job; if the job is still alive
:data:`FALLBACK_S` later, the reporting rank raises it itself.

A wait counts from when it began, or from when one of its requests became *due*, if the
caller said so (:func:`hpcdl.comm.due`: a parameter server's receive of a push is due once
the worker's pull was answered, however many other pushes it serves meanwhile); a
``waitany`` stalls when one of its requests has been waited for ``stall_s``, even while
others complete. Waits a strategy means to be long are wrapped in
:meth:`Watchdog.long_wait` (an idle parameter server, a worker held back by a staleness
bound, ranks waiting while rank 0 writes a checkpoint): they answer questions ("waits by
design") and stall only after their own limit, if they have one.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from hpcdl.errors import HpcdlError

__all__ = ["CHECK_S", "FALLBACK_S", "StallError", "Watchdog"]

#: seconds between looks at the clock and at the other ranks' questions while a wait goes on
CHECK_S = 0.01
#: seconds a rank that left the report to another one waits for the job to end before it
#: reports itself (the reporter may have died)
FALLBACK_S = 10.0
#: polls of a wait before each further poll yields the core (``sched_yield``): on a node with
#: more ranks than cores, a rank spinning in Python would otherwise hold up the rank it waits for
SPIN_POLLS = 64
#: ranks listed one per line in a report; more are summarised
LISTED = 8

# tags on the watchdog's private communicator: a question, an answer, a question withdrawn,
# the members-only barrier of a sub-communicator being created, and a report handed to rank 0
_ASK, _REPLY, _WITHDRAW, _SYNC, _REPORT = 1, 2, 3, 4, 5
_NOTE_TAGS = (_ASK, _REPLY, _WITHDRAW, _REPORT)


class StallError(HpcdlError):
    """A wait lasted longer than ``debug.stall_s``: the report of what every rank waits for.

    The entry points print it and end the job with exit status 3 (the simulator's status for
    a deadlock). ``requests`` are the requests still pending when it was raised: a caller
    that recovers in-process must complete them before their buffers go away.
    """

    exit_status = 3

    def __init__(self, message: str, requests: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.requests = list(requests)


class Watchdog:
    """Polling waits with a stall deadline, over an MPI communicator of all the ranks.

    Creating it duplicates ``comm`` (collective); :meth:`free` releases the duplicate.

    Args:
        comm: the world (an ``mpi4py`` intracommunicator); every rank creates its watchdog.
        stall_s: seconds one wait may last before the rank asks the others and reports.
        grace_s: seconds the asking rank waits for answers (default: ``stall_s / 10``
            within [1, 5]).
        stream: where warnings go (stderr).
    """

    def __init__(
        self, comm: Any, stall_s: float, *, grace_s: float | None = None, stream: TextIO | None = None
    ) -> None:
        from hpcdl.comm import mpi

        if stall_s <= 0:
            raise ValueError(f"stall_s must be > 0 (got {stall_s})")
        self.stall_s = float(stall_s)
        self.grace_s = float(grace_s) if grace_s is not None else min(5.0, max(1.0, stall_s / 10))
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._clock = mpi.wtime
        self._any_source, self._proc_null = mpi.ANY_SOURCE, mpi.PROC_NULL
        self._probe_status = mpi.new_status()
        self._notes = comm.Dup()  # questions and answers never match the program's messages
        self._stream = stream
        #: what the caller is doing (step, phase, buckets): shown in reports
        self.context: dict[str, Any] = {}
        self._check_at = 0.0  # when waits next look at the clock's deadline and the questions
        self._patient: list[tuple[str, float]] = []  # (reason, limit in seconds)
        self._seq = 0
        self._asked: tuple[int, float] | None = None  # (lowest recent asker, when)
        self._replies: dict[int, tuple[str, bool]] | None = None  # while asking
        self._outbox: list[Any] = []
        self._sent = [0] * self.size  # notes sent to each rank, received from each rank:
        self._received = [0] * self.size  # free() drains what is still in flight

    # -- what the program tells the watchdog -----------------------------------------------
    @contextlib.contextmanager
    def long_wait(self, reason: str, limit_s: float | None = None) -> Iterator[None]:
        """Waits inside are long by design: they answer questions, and stall only after ``limit_s``."""
        self._patient.append((reason, float("inf") if limit_s is None else float(limit_s)))
        try:
            yield
        finally:
            self._patient.pop()

    def _limit(self) -> float:
        """Seconds the current wait may last."""
        return self._patient[-1][1] if self._patient else self.stall_s

    # -- waiting ---------------------------------------------------------------------------
    def wait(self, reqs: Sequence[Any], what: Any, status: Any = None) -> None:
        """Wait until every request of ``reqs`` has completed.

        Args:
            reqs: MPI requests or hpcdl's (``CollRequest``); ``None`` and inactive ones
                are skipped.
            what: the operation, for reports: a string, or a tuple ``(op, peer, tag,
                comm)`` formatted only when needed.
            status: filled by the first request's completion (a receive's status).

        Raises:
            StallError: the wait lasted ``stall_s`` and the rank reported it.
        """
        first = reqs[0] if status is not None and reqs else None  # the request whose status is asked
        pending = _test(reqs, status, first)
        if not pending:
            return
        clock = self._clock
        now = clock()
        t0 = min(_since(r, now) for r in pending)
        limit = self._limit()
        polls = 0
        while True:
            if now >= self._check_at:
                self._check_at = now + CHECK_S
                self._serve(what, pending, now - t0)
                if now - t0 >= limit:
                    self._stalled(_AllOf(pending, status, first), what, t0)
                    return
            pending = _test(pending, status, first)
            if not pending:
                return
            polls += 1
            if polls > SPIN_POLLS:  # give the core to a rank that shares it (as MPICH's waits do)
                _yield()
            now = clock()

    def wait_one(self, req: Any, status: Any = None) -> None:
        """``req.Wait(status)`` of a :class:`~hpcdl.comm.mpi.WatchedRequest`: :meth:`wait` for it alone.

        After :meth:`free` (the request outlived its ``watch`` block) it is MPI's own wait,
        unwatched, as every wait outside the block is.
        """
        if self._notes is None:
            from hpcdl.comm import mpi

            mpi.wait(req, status)
            return
        self.wait([req], "wait", status)

    def wait_any(self, reqs: Sequence[Any], what: Any, status: Any = None) -> int | None:
        """Wait until one request of ``reqs`` completes; its index (None: none is active).

        Each request is waited for since the wait began or since it became due, whichever
        is earlier: the wait stalls when one of them has been waited for ``stall_s``, and
        then only those can end the stall (the others are left untested, so that the
        caller sees each completion).

        Raises:
            StallError: a request was waited for ``stall_s`` and the rank reported it.
        """
        active = [i for i, r in enumerate(reqs) if r is not None and r]
        if not active:
            return None
        clock = self._clock
        now = clock()
        since = [_since(reqs[i], now) for i in active]
        t0 = min(since)
        limit = self._limit()
        waiting = _AnyOf(reqs, active, status)
        polls = 0
        while True:
            if now >= self._check_at:
                self._check_at = now + CHECK_S
                self._serve(what, waiting.pending(), now - t0)
            if now - t0 >= limit:  # checked on every call: a server's short waits outlive a late push
                late = _AnyOf(reqs, [i for i, t in zip(active, since) if now - t >= limit], status)
                if late.poll():  # it came (it is tested first: the others may always be ready)
                    return late.found
                try:
                    self._stalled(late, what, t0)
                except StallError as err:  # the caller must complete them all, not only the late
                    err.requests = waiting.pending()
                    raise
                return late.found
            if waiting.poll():
                return waiting.found
            polls += 1
            if polls > SPIN_POLLS:
                _yield()
            now = clock()

    # -- a stall ---------------------------------------------------------------------------
    def _stalled(self, waiting: _AllOf | _AnyOf, what: Any, t0: float) -> None:
        """Ask the others, collect their answers for ``grace_s``, then raise the report.

        When another rank asked recently it is reporting: this rank waits for the job to
        end, and asks itself if it is still alive :data:`FALLBACK_S` after that question.

        Args:
            waiting: the requests waited for.
            what: the operation waited in.
            t0: when the wait began.

        Returns only when the wait completed meanwhile (after a warning line).
        """
        clock = self._clock
        now = clock()
        reporting = not self._someone_else_reports(now)
        if reporting:
            self._ask(what, waiting.pending(), now - t0)
            deadline = now + self.grace_s
        else:
            deadline = self._asked[1] + self.grace_s + FALLBACK_S  # type: ignore[index]
        check = now
        try:
            while True:
                if waiting.poll():
                    if reporting:
                        self._withdraw()
                    self._warn(what, clock() - t0)
                    return
                _yield()
                now = clock()
                if now >= check:
                    check = now + CHECK_S
                    self._serve(what, waiting.pending(), now - t0)
                    if reporting and self._someone_else_reports(now):  # a lower rank asked too
                        reporting = False
                        deadline = self._asked[1] + self.grace_s + FALLBACK_S  # type: ignore[index]
                    if reporting and len(self._replies or ()) == self.size - 1:
                        break
                if now >= deadline:
                    if reporting:
                        break
                    # the rank that asked did not end the job (it died, or its wait completed
                    # and its withdrawal was lost): ask and report here
                    self._asked = None
                    self._ask(what, waiting.pending(), now - t0)
                    reporting, deadline = True, now + self.grace_s
            waited = clock() - t0
            mine = self._describe(what, waiting.pending(), waited)
            replies = self._replies or {}
            report = self._report(mine, replies, waited)
            if self.rank != 0 and 0 in replies:
                self._hand_off(report, what, waiting.pending(), waited)
            raise StallError(report, waiting.pending())
        finally:
            self._replies = None

    def _hand_off(self, report: str, what: Any, pending: Sequence[Any], waited: float) -> None:
        """Give rank 0 the report to record and raise; return if the job outlives :data:`FALLBACK_S`.

        Rank 0 answered, so it is alive and waiting: it raises the report from its wait, its
        driver records it in the run file (status ``stalled``), and it ends the job. Meanwhile
        this rank goes on answering questions.
        """
        self._outbox.append(self._notes.isend((self._seq, report), 0, _REPORT))
        self._sent[0] += 1
        clock = self._clock
        deadline = clock() + FALLBACK_S
        while clock() < deadline:
            time.sleep(CHECK_S)
            self._serve(what, pending, waited + FALLBACK_S - (deadline - clock()))

    def _ask(self, what: Any, pending: Sequence[Any], waited: float) -> None:
        """Send every other rank this rank's question; answers are collected in ``_replies``."""
        self._seq += 1
        self._replies = {}
        mine = self._describe(what, pending, waited)
        self._send_all((self._seq, mine), _ASK)

    def _withdraw(self) -> None:
        """This rank's wait completed while it asked: the others need not wait for its report."""
        self._send_all((self._seq, ""), _WITHDRAW)

    def _send_all(self, note: Any, tag: int) -> None:
        for r in range(self.size):
            if r != self.rank:
                self._outbox.append(self._notes.isend(note, r, tag))
                self._sent[r] += 1

    def _someone_else_reports(self, now: float) -> bool:
        """A lower rank (or, before this rank asked, any rank) asked recently."""
        if self._asked is None:
            return False
        asker, when = self._asked
        recent = now - when < self.grace_s + FALLBACK_S
        return recent and (self._replies is None or asker < self.rank)

    def _serve(self, what: Any, pending: Sequence[Any], waited: float) -> None:
        """Answer the questions of stalled ranks; collect answers to this rank's own."""
        notes, st = self._notes, self._probe_status
        while any(notes.Iprobe(self._any_source, t, st) for t in _NOTE_TAGS):  # not _SYNC: a barrier's
            source, tag = st.Get_source(), st.Get_tag()
            seq, text = notes.recv(source=source, tag=tag)
            self._received[source] += 1
            if tag == _REPORT:  # (rank 0) another rank's report, to record and raise here
                raise StallError(text, pending)
            if tag == _WITHDRAW:
                if self._asked is not None and self._asked[0] == source:
                    self._asked = None
            elif tag == _ASK:
                now = self._clock()
                if (
                    self._asked is None
                    or now - self._asked[1] >= self.grace_s + FALLBACK_S
                    or (source < self._asked[0])
                ):
                    self._asked = (source, now)
                answer = (self._describe(what, pending, waited), bool(self._patient))
                self._outbox.append(notes.isend((seq, answer), source, _REPLY))
                self._sent[source] += 1
            elif self._replies is not None and seq == self._seq:  # stale answers are dropped
                self._replies[source] = text
        self._outbox = [r for r in self._outbox if not r.Test()]

    # -- words -----------------------------------------------------------------------------
    def _describe(self, what: Any, pending: Sequence[Any], waited: float) -> str:
        """``12.0 s in Recv from rank 1 tag 0 on world (step 7, phase exchange): ...``"""
        text = f"{waited:.1f} s in {self._what_text(what)}"
        if self._patient:
            text += f" (by design: {self._patient[-1][0]})"
        first = [k for k in ("step", "phase") if k in self.context]
        keys = first + [k for k in self.context if k not in first]
        notes = ", ".join(f"{k} {self.context[k]}" for k in keys if self.context[k] is not None)
        if notes:
            text += f" ({notes})"
        parts = [self._request_text(r) for r in pending[:4]]
        parts = [p for p in parts if p]
        if parts:
            text += ": " + "; ".join(parts) + ("; ..." if len(pending) > 4 else "")
        return text

    def _request_text(self, req: Any) -> str:
        inner = getattr(req, "round_requests", None)
        if inner is not None:  # one of hpcdl's collectives: its name and its round's requests
            rounds = ", ".join(filter(None, (self._request_text(r) for r in inner)))
            return f"{req.name}" + (f" ({rounds})" if rounds else "")
        what = getattr(req, "what", None)  # a watched request's (hpcdl.comm.mpi.WatchedRequest)
        return "" if what is None else self._what_text(what)

    def _what_text(self, what: Any) -> str:
        """``Recv from rank 1 tag 7 on world``, ``Barrier on world.dup1``, or ``what`` itself."""
        if not isinstance(what, tuple):
            return str(what)
        op, peer, tag, comm = what
        if peer is None:
            return f"{op} on {comm}"
        who = f"rank {peer}"
        if peer == self._any_source:
            who = "any rank"
        elif peer == self._proc_null:
            who = "no rank (PROC_NULL)"
        tag_text = "" if tag is None else " tag any" if tag < 0 else f" tag {tag}"
        return f"{op} {who}{tag_text} on {comm}"

    # -- a barrier of some ranks, watched --------------------------------------------------
    def members_barrier(self, world_ranks: Sequence[int], what: Any) -> None:
        """Wait until every rank of ``world_ranks`` (this one included) has arrived: a watched wait.

        For a sub-communicator created by its members only (MPI's ``Create_group`` blocks
        with no nonblocking form): once all have arrived it completes at once. The first
        member gathers a byte from each and answers each, on the private communicator.
        """
        import numpy as np

        lead, others = world_ranks[0], [r for r in world_ranks if r != self.rank]
        token = np.zeros(1, dtype=np.uint8)
        inbox = np.zeros(max(1, len(others)), dtype=np.uint8)
        if self.rank == lead:
            self.wait([self._notes.Irecv(inbox[i : i + 1], r, _SYNC) for i, r in enumerate(others)], what)
            self.wait([self._notes.Isend(token, r, _SYNC) for r in others], what)
        else:
            self.wait([self._notes.Isend(token, lead, _SYNC)], what)
            self.wait([self._notes.Irecv(inbox[:1], lead, _SYNC)], what)

    def _report(self, mine: str, replies: dict[int, tuple[str, bool]], waited: float) -> str:
        silent = [r for r in range(self.size) if r != self.rank and r not in replies]
        waits = {self.rank: mine, **{r: text for r, (text, _) in replies.items()}}
        if silent:
            head = (
                f"stall: {_ranks_text(silent)} did not respond (stopped, dead, or busy outside any "
                f"communication for longer than debug.stall_s = {self.stall_s:g} s); "
                f"{'it holds' if len(silent) == 1 else 'they hold'} up the others"
            )
        else:
            head = (
                f"stall: every rank is waiting for another (a deadlock): no communication completed "
                f"for {waited:.1f} s (debug.stall_s = {self.stall_s:g} s)"
            )
        lines = [head]
        shown = sorted(waits)[:LISTED]
        lines += [f"  rank {r} waits {waits[r]}" for r in shown]
        if len(waits) > LISTED:
            lines.append(f"  ... and {len(waits) - LISTED} more waiting ranks")
        lines.append(
            "  the job is aborted; if such waits are expected, raise debug.stall_s (0 turns the watchdog off)"
        )
        return "\n".join(lines)

    def _warn(self, what: Any, waited: float) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        stream.write(
            f"hpcdl: rank {self.rank} waited {waited:.1f} s in {self._what_text(what)}, longer than "
            f"debug.stall_s = {self.stall_s:g} s, and it completed: raise debug.stall_s if this is expected\n"
        )
        stream.flush()

    def free(self) -> None:
        """Release the private communicator (collective over the world; a second call does nothing).

        Questions and answers still in flight (a rank that asked while another was busy,
        then went on) are received first: MPI reuses a freed communicator's context, and a
        stray message would match a receive of the next communicator created.
        """
        if self._notes is None:
            return
        notes, self._notes = self._notes, None
        expected = notes.alltoall(self._sent)  # what each rank sent to this one
        for source in range(self.size):
            for _ in range(expected[source] - self._received[source]):
                notes.recv(source=source)
        for req in self._outbox:  # small: sent eagerly, complete locally
            req.Wait()
        self._outbox = []
        notes.Free()


def _since(req: Any, now: float) -> float:
    """When a wait for ``req`` began: ``now``, or earlier if it was due before (``req.due``)."""
    due = getattr(req, "due", None)
    return now if due is None or due > now else due


def _test(reqs: Sequence[Any], status: Any, first: Any) -> list[Any]:
    """The requests of ``reqs`` still pending after one ``Test()`` each (``status``: ``first``'s)."""
    pending = []
    for r in reqs:
        if r is not None and r and not r.Test(status if r is first else None):
            pending.append(r)
    return pending


_yield = getattr(os, "sched_yield", lambda: None)


class _AllOf:
    """The requests of a wait for all of them (a stalled one: tested from :meth:`Watchdog._stalled`)."""

    __slots__ = ("first", "reqs", "status")

    def __init__(self, reqs: list[Any], status: Any, first: Any) -> None:
        self.reqs, self.status, self.first = reqs, status, first

    def poll(self) -> bool:
        self.reqs = _test(self.reqs, self.status, self.first)
        return not self.reqs

    def pending(self) -> list[Any]:
        return self.reqs


class _AnyOf:
    """The requests of a wait for any one of them; ``found`` is the index that completed."""

    __slots__ = ("active", "found", "reqs", "status")

    def __init__(self, reqs: Sequence[Any], active: list[int], status: Any) -> None:
        self.reqs, self.active, self.status = reqs, active, status
        self.found: int | None = None

    def poll(self) -> bool:
        for i in self.active:
            if self.reqs[i].Test(self.status):
                self.found = i
                return True
        return False

    def pending(self) -> list[Any]:
        return [self.reqs[i] for i in self.active]


def _ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 1, 4``, ``ranks 2-7, 9`` (runs of consecutive ranks joined)."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"
