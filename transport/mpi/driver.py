"""MPI driver: the rdm transport's API (tagged, ordered, exact-size messages) over mpi4py.

How it works
------------
*Communicator.* A transport serves one group over a communicator of its own, created
collectively by its members once all have arrived (communicator.py), so tags of different
groups, and of the user's own MPI traffic, never meet; communicator rank ``k`` is group
rank ``k``.

*Matching and tags.* Receives are matched with MPI's messages by probing
(``MPI_Improbe``), so a receive of the wrong size fails naming both sizes; transport tags
of any size travel on MPI's tags, with a note the first time a large one is used
(matching.py).

*Progress.* A thread that waits for a request polls MPI itself; a progress thread per
transport completes what nobody waits for (polling.py). ``isend`` tests its request at
once (small messages complete inline) and ``irecv`` probes once at once. Completion
callbacks run on a separate callback thread, never under the transport's lock and never
on a polling thread.

*Threads.* Every MPI call is made under the transport's lock. That needs
``MPI_THREAD_MULTIPLE`` (what mpi4py asks for by default and the mpich wheel provides):
transports of different groups, and the user's own MPI calls, run concurrently. With
``MPI_THREAD_SERIALIZED`` all transports share one process-wide lock instead, and MPI
allows no two threads in it at once: while transports are open, the user's own MPI calls
(a barrier, a send...) must each be made holding ``mpi_lock()`` too (one call at a time:
a blocking call that waits for other ranks would hold back this rank's transports, so use
the nonblocking ones and ``Test`` them under the lock). An MPI call made without it while a
progress thread is inside MPI corrupts MPI's state (crashes, hangs). With ``FUNNELED`` or
``SINGLE`` a transport cannot work (it calls MPI from several threads) and refuses to start.

*Failures.* ``Request.wait(deadline)`` raises ``PeerTimeout`` (``network=True``) naming the
peer (none for a receive from any rank), after a 0.5 s grace in which an abort notice from
a peer that failed at the same moment may still arrive; the request stays posted until
``cancel`` withdraws it. ``abort(reason, kind)`` sends every peer a notice; a peer's
requests to or from the aborting rank then fail with ``PeerAborted`` (``network=True``),
as in the rdm transport. An MPI error on a request fails the peer with
``PeerUnreachable``. MPI itself does not report dead peers: with most MPI libraries a rank
that dies takes the job down (the process manager kills the rest); otherwise the deadlines
bound every wait. ``close(error)`` fails every pending request. Closing frees the
communicator (``MPI_Comm_free`` is local in MPICH and Open MPI); after a failure MPI may
still hold messages sent on it. Open transports are closed at interpreter exit, before
mpi4py finalizes MPI (its hook runs after Python's ``atexit``).

*Buffers.* MPI works on the callers' buffers themselves (no copy: a message moves once),
so a request's buffer goes back to its caller only once MPI no longer owns it; a request
that must end while MPI still owns a caller's buffer gets ``CANCEL_GRACE`` for MPI to
complete it, or the job ends (active.py).

*Collectives.* MPI's own nonblocking collectives run on the rank's column (column.py).

Nothing here imports torch; mpi4py is imported (and MPI initialised, if it is not yet)
when the first transport is created.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import socket
import threading
import time
import weakref
from types import ModuleType
from typing import TYPE_CHECKING, Callable, ContextManager, Iterable

from ..base import ColumnCollectives
from ..errors import ABORTED, ABORTED_TIMEOUT, ChannelClosed, PeerAborted, PeerTimeout
from ..requests import Request as _Request, run_callbacks
from . import communicator
from .active import (ABORT_ERRORCODE, ABORT_SEND, CANCEL_GRACE, HELLO_RECV, HELLO_SEND,
                     OUTGOING, SEND, Active)
from .column import CollectiveRequest, ColumnCalls
from .matching import Matcher
from .orphans import sweep as sweep_orphans
from .polling import Polling
from .request import Request, writable

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from mpi4py.MPI import Comm, Intracomm

    from ..base import NetRequest

__all__ = ["ABORT_ERRORCODE", "CANCEL_GRACE", "CollectiveRequest", "MpiTransport", "Request",
           "mpi_lock", "thread_level", "world_rank"]

log = logging.getLogger("neuron_dist.mpi")

_ABORT_REASON_BYTES = 1000           # notices stay small: MPI sends them eagerly
_HOT_SLEEP = 2e-4                    # a close's sleeps between polls while MPI finishes
_DRAIN_SECONDS = 2.0                 # graceful close: how long sends may take to finish

_SERIALIZED_LOCK = threading.Lock()  # every transport's MPI calls, below THREAD_MULTIPLE
_LIVE: "weakref.WeakSet[MpiTransport]" = weakref.WeakSet()
_atexit_registered = False


def _mpi() -> ModuleType:
    """mpi4py's ``MPI`` module (imported on first use)."""
    from mpi4py import MPI  # initialises MPI (per mpi4py.rc) on first import

    return MPI


def thread_level() -> str:
    """MPI's thread support in this process ("multiple", "serialized", ...); inits MPI."""
    MPI = _mpi()
    return {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
            MPI.THREAD_SERIALIZED: "serialized",
            MPI.THREAD_MULTIPLE: "multiple"}.get(MPI.Query_thread(), "unknown")


def world_rank() -> int:
    """This process's rank in ``MPI_COMM_WORLD`` (what ``world_ranks`` lists); inits MPI."""
    MPI = _mpi()
    with mpi_lock():
        rank: int = MPI.COMM_WORLD.Get_rank()
        return rank


def mpi_lock() -> ContextManager[object]:
    """What to hold around one's own MPI calls while transports are open; inits MPI.

    At ``MPI_THREAD_SERIALIZED``: the process-wide lock every transport makes its MPI calls
    under (MPI must never be entered by two threads at once). Hold it for one call at a
    time (``with mpi_lock(): done = req.Test()``), never across a wait for other ranks:
    this rank's transports make no progress meanwhile. At ``MPI_THREAD_MULTIPLE``: a
    context that does nothing (MPI serialises concurrent calls itself).
    """
    MPI = _mpi()
    return _lock_for(MPI, MPI.Query_thread())


def _lock_for(MPI: ModuleType, level: int) -> ContextManager[object]:
    if level >= MPI.THREAD_MULTIPLE:
        return contextlib.nullcontext()
    return _SERIALIZED_LOCK


class MpiTransport(ColumnCollectives):
    """Reliable tagged messages to the other ranks of a group, over MPI
    (``base.NetTransport``; MPI's own collectives on a column: ``base.ColumnCollectives``).

    Parameters
    ----------
    rank, world_size : int
        This rank and the group size (ranks are group ranks).
    world_ranks : list of int
        ``world_ranks[k]`` is the rank of group rank ``k`` in ``comm`` (``MPI_COMM_WORLD``).
        Every rank of the group must construct its transport with the same list, at the
        same point (creating the communicator is collective over the group).
    label : str
        Names the group in log and error messages.
    comm : mpi4py.MPI.Comm, optional
        Parent communicator (default ``MPI.COMM_WORLD``).
    deadline : float, optional
        ``time.monotonic()`` by which every member must have joined the communicator's
        creation; ``PeerTimeout`` naming the members that had not otherwise (or, for a
        member that comes late, those that gave up). Default: wait as long as it takes.
    column : list of int, optional
        The group ranks (this one among them) with which this rank runs MPI's own
        collectives (``iallgather`` ...): its column, the ranks of the same local index on
        every node, in node order. Columns are disjoint; every member passes its own, or
        none does (the column communicators are split from the group's, collectively).

    Raises
    ------
    RuntimeError
        MPI is not initialised or is finalised, or its thread level is below SERIALIZED.
    ValueError
        ``world_ranks`` does not fit ``world_size``, ``rank`` or this process's MPI rank.
    """

    def __init__(self, rank: int, world_size: int, world_ranks: list[int], label: str = "", *,
                 comm: Intracomm | None = None, deadline: float | None = None,
                 column: Iterable[int] | None = None):
        MPI = self._MPI = _mpi()
        if not MPI.Is_initialized() or MPI.Is_finalized():
            raise RuntimeError("MpiTransport needs an initialised MPI (mpi4py.rc.initialize) "
                               "that is not finalised")
        level = MPI.Query_thread()
        if level < MPI.THREAD_SERIALIZED:
            raise RuntimeError(
                f"MpiTransport needs MPI_THREAD_MULTIPLE (or at least SERIALIZED), but MPI "
                f"runs at thread level {thread_level()!r}: the transport calls MPI from "
                f"several threads. Leave mpi4py.rc.thread_level at 'multiple'")
        parent = comm if comm is not None else MPI.COMM_WORLD
        # At SERIALIZED every MPI call, these queries included, is made under the shared
        # lock: other transports' threads may be inside MPI right now.
        self.lock = threading.Lock() if level >= MPI.THREAD_MULTIPLE else _SERIALIZED_LOCK
        with _lock_for(MPI, level):
            me, parent_size = parent.Get_rank(), parent.Get_size()
        world_ranks = [int(r) for r in world_ranks]
        if len(world_ranks) != world_size or len(set(world_ranks)) != world_size:
            raise ValueError(f"world_ranks must list {world_size} distinct MPI ranks, got "
                             f"{world_ranks} (were the processes started by one mpiexec? "
                             f"Processes started otherwise are each an MPI world of 1)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of {world_size}")
        if world_ranks[rank] != me:
            raise ValueError(f"group rank {rank} is MPI rank {world_ranks[rank]} in world_ranks "
                             f"{world_ranks}, but this process is MPI rank {me}")
        bad = [r for r in world_ranks if not 0 <= r < parent_size]
        if bad:
            raise ValueError(f"MPI rank(s) {bad} are not in the parent communicator of "
                             f"{parent_size} ranks")
        self.rank, self.world_size, self.world_ranks = rank, world_size, world_ranks
        self.label = label or f"rank {rank}"
        self.thread_level = thread_level()
        self._comm = communicator.create(MPI, self.lock, parent, world_ranks, rank, self.label,
                                         deadline)
        with self.lock:
            comm_rank = self._comm.Get_rank()
        if comm_rank != rank:  # Create_group orders ranks as the group does
            raise RuntimeError(f"MPI gave rank {comm_rank} for group rank {rank}")
        self.address = f"mpi:{me}@{socket.gethostname()}"
        self.failed: dict[int, Exception] = {}  # peer -> the error its requests fail with
        self.closed = False
        self._stats = dict(messages_sent=0, bytes_sent=0, messages_received=0,
                           bytes_received=0, size_mismatches=0, notes_sent=0,
                           notes_received=0, aborts_received=0, polls=0, mpi_errors=0)
        # The MPI requests in flight (active.py) and the posted receives with the tags
        # they travel on (matching.py).
        self.active = Active(self, MPI, self._comm, self.label, self._stats)
        with self.lock:
            self.matcher = Matcher(self, MPI, self._comm, self.active, self.label, self._stats)
        self.tag_ub = self.matcher.tag_ub
        self.column: list[int] | None = None
        self._columns: ColumnCalls | None = None  # MPI's collectives on the column (column.py)
        self._column_comm: Comm | None = None
        if column is not None:
            self.column = [int(k) for k in column]
            self._column_comm = communicator.split_column(self.lock, self._comm, self.column,
                                                          rank, self.label)
            self._columns = ColumnCalls(self, MPI, self._column_comm, self.column)
        self._hello: set[int] = set()
        self.callbacks: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self.polling = Polling(self, self.lock, rank)  # (polling.py)
        self._cond = self.polling.cond
        self._callback_thread = threading.Thread(target=self._callback_loop, daemon=True,
                                                 name=f"neuron-mpi-callbacks-{rank}")
        self.polling.start()
        self._callback_thread.start()
        _register(self)

    # ------------------------------------------------------------------ collectives
    # MPI's own, on the column (column.py): ColumnCollectives.

    def reduces(self, dtype: str, op: str) -> bool:
        """Can MPI reduce elements of ``dtype`` (torch's name: ``float32``...) with ``op``
        (``SUM``, ``PRODUCT``, ``MIN``, ``MAX``, ``BAND``, ``BOR``, ``BXOR``)?"""
        return ColumnCalls.reduces(dtype, op)

    def iallgather(self, send: Buffer, recv: Buffer) -> CollectiveRequest:
        """Every column member's ``send`` bytes, in column order, into ``recv``."""
        return self._column_calls().iallgather(send, recv)

    def ialltoall(self, send: Buffer, recv: Buffer) -> CollectiveRequest:
        """Block ``b`` of ``send`` to column member ``b``; member ``b``'s block for this rank
        into block ``b`` of ``recv`` (blocks of one size)."""
        return self._column_calls().ialltoall(send, recv)

    def iallreduce(self, buf: Buffer, dtype: str, op: str) -> CollectiveRequest:
        """Reduce ``buf`` (elements of ``dtype``) over the column with ``op``, in place."""
        return self._column_calls().iallreduce(buf, dtype, op)

    def ireduce_scatter(self, send: Buffer, recv: Buffer, dtype: str, op: str
                        ) -> CollectiveRequest:
        """Reduce ``send`` (one block per column member, in order) with ``op``; this rank's
        block of the result into ``recv``."""
        return self._column_calls().ireduce_scatter(send, recv, dtype, op)

    def ibcast(self, buf: Buffer, root: int) -> CollectiveRequest:
        """Column member ``root``'s (an index into ``column``) ``buf`` into everyone's."""
        return self._column_calls().ibcast(buf, root)

    def _column_calls(self) -> ColumnCalls:
        if self._columns is None:
            raise ValueError(f"{self.label}: MPI collectives need the transport's column")
        return self._columns

    # ------------------------------------------------------------------ set-up

    def connect(self, peers: Iterable[int], deadline: float) -> None:
        """Check every peer answers: one empty message each way with each of ``peers``.

        ``peers`` is any iterable of group ranks (a ``{rank: address}`` dict works; the
        addresses are not used: the communicator already reaches every member).

        Raises
        ------
        PeerTimeout
            Some peers had not answered by ``deadline`` (named in ``ranks``).
        """
        MPI = self._MPI
        want = sorted({int(p) for p in peers} - {self.rank})
        with self.lock:
            self.check_open()
            hello = self.matcher.hello_tag
            for p in want:
                self._check_peer(p)
                self.active.add(self._comm.Isend([b"", MPI.BYTE], p, hello), HELLO_SEND, p, b"")
                box = bytearray(0)
                self.active.add(self._comm.Irecv([box, MPI.BYTE], p, hello), HELLO_RECV, p, box)
            self.polling.wake()
            self.polling.waiting_threads += 1
            start = time.monotonic()
            try:
                while True:
                    missing = [p for p in want if p not in self._hello]
                    if not missing:
                        return
                    self.check_open()
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        error = PeerTimeout(missing, time.monotonic() - start,
                                            f"rank(s) {missing} did not answer rank {self.rank} "
                                            f"of {self.label} over MPI in time", network=True)
                        raise error
                    if not self.poll():
                        self._cond.wait(min(remaining, 0.001))
            finally:
                self.polling.waiting_threads -= 1

    # ------------------------------------------------------------------ requests

    def isend(self, peer: int, tag: int, buf: Buffer,
              callback: Callable[[NetRequest], object] | None = None) -> Request:
        """Send the bytes of ``buf`` (kept unchanged until the request completes).

        ``callback(request)``, if given, runs on the transport's callback thread when the
        request completes (successfully or not).
        """
        view = memoryview(buf).cast("B")
        req = Request(peer, tag, view, True, self)
        req.callback = callback
        MPI = self._MPI
        with self.lock:
            self.check_open()
            _check_tag(tag)
            self.matcher.read_control()  # a peer that aborted fails the post, as in rdm
            self._check_peer(peer)
            mpi_tag = self.matcher.send_tag(peer, tag)
            mpi_req = self._comm.Isend([view, MPI.BYTE], peer, mpi_tag)
            self._stats["messages_sent"] += 1
            self._stats["bytes_sent"] += view.nbytes
            if mpi_req.Test():  # small messages usually leave at once
                req.finish()
            else:
                self.active.add(mpi_req, SEND, req, view)
                self.polling.wake()
        return req

    def irecv(self, peer: int, tag: int, buf: Buffer,
              callback: Callable[[NetRequest], object] | None = None) -> Request:
        """Receive the next message of ``(peer, tag)`` into ``buf`` (exactly its size).

        A message of another size fails the request with ``MessageSizeMismatch`` (a
        ``ValueError``) naming both sizes (and is consumed).
        """
        view = writable(buf)
        req = Request(peer, tag, view, False, self)
        req.callback = callback
        with self.lock:
            self.check_open()
            _check_tag(tag)
            self.matcher.read_control()
            self._check_peer(peer)
            q = self.matcher.posted.post(req, peer, tag)
            if len(q) == 1:
                self.matcher.match((peer, tag), q)  # already here? matched without any thread
            self.polling.wake()
        return req

    def irecv_any(self, tag: int, buf: Buffer,
                  callback: Callable[[NetRequest], object] | None = None) -> Request:
        """Receive the next message of ``tag`` from whichever rank sends one first.

        The source is in ``request.source`` once complete. Messages go to receives naming
        their source first; a receive from any rank takes the earliest message that no
        such receive was waiting for.
        """
        view = writable(buf)
        req = Request(None, tag, view, False, self)
        req.callback = callback
        with self.lock:
            self.check_open()
            _check_tag(tag)
            self.matcher.read_control()
            if not self._alive_peers():
                raise next(iter(self.failed.values()),
                           ValueError(f"{self.label}: no other rank to receive from"))
            q = self.matcher.posted.post_any(req, tag)
            if len(q) == 1:
                self.matcher.match_any(tag, q)
            self.polling.wake()
        return req

    def abort(self, reason: str, kind: int = ABORTED, grace: float = 0.5) -> None:
        """Tell every peer that this rank failed the group, then close.

        Peers' pending and later requests to or from this rank fail with ``PeerAborted``
        carrying ``reason`` and ``kind`` (so every rank can raise the same error class).
        Waits at most ``grace`` seconds for the notices to leave.
        """
        payload = bytes([kind]) + reason.encode("utf-8", "replace")[:_ABORT_REASON_BYTES]
        with self.lock:
            if self.closed:
                return
            for p in self._alive_peers():
                try:
                    r = self._comm.Isend([payload, self._MPI.BYTE], p, self.matcher.abort_tag)
                except self._MPI.Exception:  # noqa: BLE001 - best effort
                    continue
                self.active.add(r, ABORT_SEND, p, payload)
        end = time.monotonic() + grace
        while time.monotonic() < end:
            with self.lock:
                self.poll()
                if not any(e[0] == ABORT_SEND for e in self.active.entries):
                    break
            time.sleep(0.001)
        self.close(PeerAborted(self.rank, reason, kind))

    # (only a request this transport made: ``req`` is one of its own)
    def cancel(self, req: Request, error: Exception) -> bool:  # type: ignore[override]
        """Withdraw ``req`` unless it has completed; True if it was withdrawn.

        A receive MPI has not matched yet is withdrawn at once (True), and the peer is
        failed on both sides, as in the rdm transport: later requests with it raise
        ``error`` and it is told. A receive MPI has matched (the message is arriving) or
        a send it has started cannot be undone in MPI (``MPI_Cancel`` cannot withdraw
        them; MPICH does not cancel sends at all): the caller's thread drives MPI for up
        to ``CANCEL_GRACE`` seconds so it can finish (then False: it completed, possibly
        with an error if its peer failed meanwhile). If MPI still owns the buffer then,
        this never returns: handing the buffer back would let MPI write into it (a
        receive) or read it while its caller changes it (a send: the peer's receive
        could complete with the changed bytes), so the job ends with ``MPI_Abort`` after
        a critical message on stderr naming the request (``Active.end_job``). In practice:
        withdrawing a send larger than MPI's eager limit (a few KiB) whose receiver never
        posted its receive ends the job, as does one whose peer is stuck mid-message.
        """
        with self.lock:
            if req.completion.is_set():
                return False
            if not req.is_send and self.matcher.posted.withdraw(req, req.peer):
                # not matched yet: MPI never saw it
                req.finish(error)
                if req.peer is not None:
                    self._break_peer(req.peer, error)
                return True
        self.polling.drive(req.completion, time.monotonic() + CANCEL_GRACE)
        with self.lock:
            if req.completion.is_set():
                return False
            self.active.end_job(req, error)  # never returns: MPI still owns the buffer
        return False  # (not reached)

    def _break_peer(self, peer: int | None, error: Exception) -> None:
        """Under the lock: after a withdrawn request, stop talking to ``peer`` and tell it."""
        if peer is None or peer in self.failed:
            return
        kind = ABORTED_TIMEOUT if isinstance(error, PeerTimeout) else ABORTED
        payload = bytes([kind]) + (f"rank {self.rank} withdrew a request with this rank: "
                                   f"{error}").encode("utf-8", "replace")[:_ABORT_REASON_BYTES]
        try:
            self.active.add(self._comm.Isend([payload, self._MPI.BYTE], peer,
                                             self.matcher.abort_tag), ABORT_SEND, peer, payload)
        except self._MPI.Exception:  # noqa: BLE001 - best effort
            pass
        self.fail_peer(peer, error)

    def check_open(self) -> None:
        if self.closed:
            raise ChannelClosed(f"MPI transport of {self.label} is closed")

    def _check_peer(self, peer: int) -> None:
        if not (isinstance(peer, int) and 0 <= peer < self.world_size):
            raise ValueError(f"rank {peer} is not in the group of {self.world_size} ranks "
                             f"of {self.label}")
        if peer in self.failed:
            raise self.failed[peer]

    def _alive_peers(self) -> list[int]:
        return [p for p in range(self.world_size) if p != self.rank and p not in self.failed]

    # ------------------------------------------------------------------ progress

    def poll(self) -> bool:
        """Under the lock: one round of progress (notes and notices read, receives matched,
        MPI's completed requests completed); True if anything happened."""
        self._stats["polls"] += 1
        active = self.active
        if active.failing:
            active.check_failing()
        matcher = self.matcher
        matcher.read_control()
        progressed = matcher.match_all()
        return active.test() or progressed

    def fail_peer(self, peer: int, error: Exception) -> None:
        """Under the lock: ``peer`` is gone; its requests (and later ones) fail with ``error``.

        Receives MPI has not matched fail at once. A matched receive or a started send
        fails only once MPI has completed it (active.py: ``CANCEL_GRACE`` at most, else
        the job ends): MPI owns the caller's buffer until then.
        """
        self.failed[peer] = error
        self.matcher.fail_peer(peer, error)
        self.active.fail_peer(peer, error, self.column)
        if not self._alive_peers():  # nobody left to send to a receive from any rank
            self.matcher.fail_any(error)

    def hello(self, peer: int) -> None:
        """Under the lock: ``peer``'s hello arrived (``connect``)."""
        self._hello.add(peer)
        self._cond.notify_all()

    def busy(self) -> bool:
        """Under the lock: is anything posted or in flight (the progress thread polls)?"""
        return bool(self.active.reqs or self.matcher.posted)

    def _callback_loop(self) -> None:
        run_callbacks(self.callbacks)

    # ------------------------------------------------------------------ teardown

    def stats(self) -> dict[str, int]:
        """Counters: messages/bytes sent and received, size mismatches, notes, polls..."""
        with self.lock:
            out = dict(self._stats)
            out["pending_requests"] = len(self.active.reqs)
            out["posted_receives"] = len(self.matcher.posted)
            return out

    def fail_all(self, error: Exception) -> None:
        """Under the lock: fail every pending request (see ``Active.fail_all``)."""
        self.matcher.fail_all(error)
        self.active.fail_all(error)

    def close(self, error: Exception | None = None) -> None:
        """Fail pending requests with ``error`` (default ``ChannelClosed``) and free the
        communicator.

        Without ``error`` (a normal shutdown), sends still in flight get up to 2 s to
        complete first, so a peer still receiving what we sent gets it.
        """
        if error is None:
            end = time.monotonic() + _DRAIN_SECONDS
            with self.lock:
                while (not self.closed and time.monotonic() < end
                       and any(e[0] in OUTGOING for e in self.active.entries)):
                    if not self.poll():
                        self._cond.wait(0.001)
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.fail_all(error or ChannelClosed(f"MPI transport of {self.label} was closed"))
            self._cond.notify_all()
            # Requests MPI still owns the callers' buffers of complete first (both ranks
            # drive MPI meanwhile), or the job ends at their grace: never handed back.
            while self.active.failing:
                try:
                    progressed = self.poll()
                except Exception:  # noqa: BLE001 - the grace still bounds it
                    self.active.check_failing()
                    progressed = False
                if self.active.failing and not progressed:
                    self._cond.wait(_HOT_SLEEP)  # (MPI moves a large message a piece a poll)
        self.callbacks.put(None)
        me = threading.current_thread()
        self.polling.join(5.0)
        if self._callback_thread is not me:
            self._callback_thread.join(timeout=5.0)
        with self.lock:
            sweep_orphans(self._MPI)
            if not self._MPI.Is_finalized() and self._column_comm is not None:
                try:
                    self._column_comm.Free()
                except self._MPI.Exception as e:  # noqa: BLE001 - closing anyway
                    log.warning("neuron %s: MPI_Comm_free failed: %s", self.label, e)
            if not self._MPI.Is_finalized() and self._comm != self._MPI.COMM_NULL:
                try:
                    self._comm.Free()
                except self._MPI.Exception as e:  # noqa: BLE001 - closing anyway
                    log.warning("neuron %s: MPI_Comm_free failed: %s", self.label, e)
        _LIVE.discard(self)


def _check_tag(tag: int) -> int:
    if not isinstance(tag, int) or not 0 <= tag < 1 << 64:
        raise ValueError(f"tag must be an integer in [0, 2**64), not {tag!r}")
    return tag


def _register(transport: MpiTransport) -> None:
    global _atexit_registered
    _LIVE.add(transport)
    if not _atexit_registered:
        # Runs before mpi4py's MPI_Finalize (a Py_AtExit hook, called after atexit's).
        atexit.register(_close_all)
        _atexit_registered = True


def _close_all() -> None:
    for t in list(_LIVE):
        try:
            t.close(ChannelClosed("the interpreter is exiting"))
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
