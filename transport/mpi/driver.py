"""MPI driver: the rdm transport's API (tagged, ordered, exact-size messages) over mpi4py.

How it works
------------
*Communicator.* A transport serves one group whose rank ``k`` is rank ``world_ranks[k]`` of
``MPI_COMM_WORLD``. The constructor builds the group's own communicator with
``MPI_Comm_create_group``, which is collective over the group's members only (every member
creates the transport together, as it opens the group) and gives the communicator a fresh
context, so tags of different groups, and of the user's own MPI traffic, never meet.
Communicator rank ``k`` is group rank ``k``: no rank translation afterwards.
``MPI_Comm_create_group`` blocks until every member calls it, and nothing can interrupt it;
so each member first sends every other a 9-byte arrival note (a digest of the member list)
on the parent communicator, tag ``_ARRIVE_TAG`` (0x4E45, reserved there), with nonblocking
calls tested under the lock and sleeps between, and calls ``MPI_Comm_create_group`` only once
it has every member's note (and none withdrew: see ``_await_members``). A member that never
comes costs that group a ``PeerTimeout`` naming it at the deadline; the lock (at SERIALIZED,
every transport's) is not held by a call that waits for a member that is not there.

*Matching.* Messages are not received with ``MPI_Irecv`` but matched with ``MPI_Improbe`` and
received with ``MPI_Imrecv``: the probe gives the message's size before a byte lands, so a
receive whose buffer is not exactly the message's size fails with ``MessageSizeMismatch``
naming both sizes and carrying the message (it is consumed into scratch memory; MPI never
reports a truncation)
and the next receive of that ``(peer, tag)`` gets the next message. Only the head of each
``(peer, tag)`` queue of posted receives is probed, and MPI matches messages of one
``(source, tag, communicator)`` in send order, so receives match sends in order. A message
sent before its receive is posted waits in MPI's own unexpected-message queue (a large one
as a rendezvous request: its payload moves once, straight into the receive buffer).
``irecv_any`` probes with ``MPI_ANY_SOURCE``, which yields the earliest message of the tag;
a message whose source has a named receive waiting goes to that receive instead (named
receives are matched first in every poll, too), as in the rdm transport.

*Tags.* Transport tags are any integers in [0, 2**64) (send/recv uses tags >= 2**32); MPI's
are ``0..MPI_TAG_UB`` (2**29 - 1 with the mpich wheel; at least 32767 anywhere). Tags below
``D = (MPI_TAG_UB + 1) // 2`` are used as they are. A larger tag ``t`` travels on MPI tag
``D + (t - D) % M`` (``M``: the upper half less three reserved tags), the same towards
every peer so ``MPI_ANY_SOURCE`` works. So that two tags sharing an MPI tag can never be
confused, the first message of a large tag to a peer is preceded by a 16-byte note
``(tag, mpi_tag)``; a receiver takes messages of a large tag from a peer only once that
peer's note for it is in, and fails a receive loudly (``TransportError`` naming both tags)
if the peer announced another tag on that MPI tag. A sender refuses to use one MPI tag for
two tags towards the same peer. Tags 2**28 - 3 apart never meet in practice.

*Progress.* A poll reads the notes (and abort notices) that arrived, matches the heads of
the posted receives (``MPI_Improbe``) and calls ``MPI_Testsome`` over the transport's active
requests. A thread in ``Request.wait`` polls for itself, so no thread hand-off sits on a
message's critical path: back to back with ``sched_yield`` in between for 1 ms after the
last progress, then with sleeps growing to 0.2 ms. ``isend`` tests its request at once
(small messages complete inline) and ``irecv`` probes once at once. A progress thread per
transport completes what nobody waits for (async work, callbacks): it polls with sleeps
growing to 2 ms (every 2 ms while some thread polls for itself: two threads polling in turn
only trade the GIL), and after 50 ms with nothing pending it sleeps until a request is
posted (no polling, no MPI calls; waking it then is the only notification a post ever
makes: a wake-up costs ~0.1 ms on a busy machine). Completion callbacks run on a separate
callback thread, never under the transport's lock and never on a polling thread.

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
so the ownership rule of transport/base.py rests on this: a request's buffer goes back to
its caller (the request completes, fails or is withdrawn) only once MPI no longer owns it.
MPI cannot withdraw a receive it has matched nor a send it has started (``MPI_Cancel``
cannot; MPICH cancels no send), so:

* a receive MPI has not matched yet (still queued here) is withdrawn or failed at once;
* a matched receive or a started send that must end (``cancel``, its peer failed by an
  abort notice or an MPI error, ``close(error)``) gets ``CANCEL_GRACE`` for MPI to complete
  it, both ranks driving MPI meanwhile. It then completes (``cancel``: False) or fails with
  the error (the other paths: ``_FAILING``). If MPI still owns the buffer at the end of
  the grace, the job ends: a critical message on stderr names the request (send to or
  receive from which rank, bytes, tag), says why and gives the error that ended it, and
  ``MPI_Abort`` (code ``ABORT_ERRORCODE``) stops every rank, so none completes a call
  with bytes written after a withdrawal (``_end_job``). This is what a library does when
  it cannot take a buffer back (NCCL's communicators abort the process); staging every
  message to avoid it cost two copies a message (docs/design.md, "Tried and dropped");
* a size mismatch's receive (MPI has scratch memory) and MPI's collectives (MPI has the
  call's staging buffers, collectives/net_mpi.py, never a caller's tensor) fail at once;
  MPI's requests then keep their buffers alive (a module-level list) until MPI completes
  them, as do the transport's own notes and notices.

Nothing here imports torch; mpi4py is imported (and MPI initialised, if it is not yet)
when the first transport is created.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import socket
import struct
import sys
import threading
import time
import weakref
from collections import deque
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Iterator, Sequence

from ..base import ColumnCollectives
from ..requests import Request as _Request, run_callbacks
from ..errors import (ABORTED, ABORTED_TIMEOUT, ChannelClosed, MessageSizeMismatch, PeerAborted,
                      PeerTimeout, PeerUnreachable, TransportError)

if TYPE_CHECKING:
    from typing_extensions import Buffer, TypeAlias

    from mpi4py.MPI import Comm, Intracomm

    from ..base import NetRequest
    from ..requests import Completion

    # an active MPI request's entry: (kind, Request or peer, buffer); what the last two
    # hold depends on the kind (see the kinds above)
    Entry: TypeAlias = tuple[int, Any, Any]

log = logging.getLogger("neuron_dist.mpi")

_NOTE = struct.Struct("!QQ")         # a sender's note: (transport tag, MPI tag)
_ABORT_REASON_BYTES = 1000           # notices stay small: MPI sends them eagerly
_CREATE_TAG = 0x4E44                 # tag of MPI_Comm_create_group (any value <= 32767)
_ARRIVE_TAG = 0x4E45                 # members' arrival notes before it, on the parent
_SPIN_SECONDS = 1e-3                 # a waiting thread polls (yielding the CPU) this long ...
_COLL_SPIN_SECONDS = 0.05            # ... or this long for a collective (_drive_collective)
_HOT_SLEEP = 2e-4                    # ... then sleeps up to this long between polls
_IDLE_POLLS = 4                      # the progress thread's back-to-back polls, then
_COLD_SLEEP = 2e-3                   # sleeps growing to this between polls
_PARK_AFTER = 0.05                   # idle this long: sleep until woken (no polling)
_DRAIN_SECONDS = 2.0                 # graceful close: how long sends may take to finish
CANCEL_GRACE = 1.0                   # a withdrawn request MPI already owns may finish this long
ABORT_ERRORCODE = 70                 # MPI_Abort's code when MPI keeps a caller's buffer (_end_job)

# what an active MPI request is
(_SEND, _RECV, _NOTE_SEND, _DISCARD, _HELLO_SEND, _HELLO_RECV, _ABORT_SEND, _MISMATCH,
 _COLL, _FAILING) = range(10)
# _FAILING: a send or receive on a caller's buffer that has failed (its peer failed, the
# transport closed) while MPI still owns the buffer; its buffer entry is
# (kind, buffer, error, time by which MPI must have completed it). It finishes with the
# error once MPI completes it; at that time the job ends (_end_job).
_OUTGOING = (_SEND, _NOTE_SEND, _HELLO_SEND, _ABORT_SEND)

_SERIALIZED_LOCK = threading.Lock()  # every transport's MPI calls, below THREAD_MULTIPLE
_LIVE: "weakref.WeakSet[MpiTransport]" = weakref.WeakSet()
_ORPHANS: list[tuple[Any, object]] = []  # [(mpi request, buffer)] MPI still owns after a failure
_ORPHANS_LOCK = threading.Lock()
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


def _members_digest(world_ranks: Iterable[int]) -> bytes:
    """8 bytes naming a member list (what arrival notes carry)."""
    import hashlib

    return hashlib.blake2b(repr(list(world_ranks)).encode(), digest_size=8).digest()


class Request(_Request):
    """A pending ``isend``, ``irecv`` or ``irecv_any`` (see transport/requests.py).

    Waiting drives MPI's progress from the waiting thread (``MpiTransport._drive``).
    """

    __slots__ = ("_owner",)
    VIA = "MPI"

    def __init__(self, peer: int | None, tag: int, buf: memoryview, is_send: bool,
                 owner: MpiTransport):
        super().__init__(peer, tag, buf, is_send, owner._callbacks)
        self._owner = owner

    def _block(self, deadline: float) -> bool:
        return self._owner._drive(self._event, deadline)


class CollectiveRequest(Request):
    """One of MPI's collectives on the column (``MpiTransport.iallgather`` ...).

    Unlike a send or receive, it fails at once when a column member fails (or the transport
    closes), although MPI may still own its buffers: those are always the call's staging
    buffers (collectives/net_mpi.py copies in before and out after, and drops a failed
    call's buffers from its pool), never a caller's tensor, and they stay alive until MPI
    completes the request (orphans).
    """

    __slots__ = ("name", "mpi")

    def __init__(self, name: str, owner: "MpiTransport", nbytes: int):
        super().__init__(None, -1, memoryview(b""), False, owner)
        self.name, self.nbytes = name, nbytes
        self.mpi: Any = None  # MPI's request (an mpi4py Request), while MPI has it

    def _block(self, deadline: float) -> bool:
        return self._owner._drive_collective(self, deadline)

    def wait(self, deadline: float) -> None:
        try:
            super().wait(deadline)
        except PeerTimeout as e:
            if self.error is not None:
                raise
            raise PeerTimeout([], e.waited,
                              f"MPI's {self.name} ({self.nbytes} bytes) with column "
                              f"{self._owner.column} did not complete in time: a member is "
                              f"late or made another call", network=True) from None


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
        self._lock = threading.Lock() if level >= MPI.THREAD_MULTIPLE else _SERIALIZED_LOCK
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
        self._label = label or f"rank {rank}"
        self.thread_level = thread_level()
        self._cond = threading.Condition(self._lock)
        self._comm = self._create_comm(parent, world_ranks, deadline)
        with self._lock:
            comm_rank = self._comm.Get_rank()
            tag_ub = int(self._comm.Get_attr(MPI.TAG_UB))  # type: ignore[arg-type]  # (always set)
        if comm_rank != rank:  # Create_group orders ranks as the group does
            raise RuntimeError(f"MPI gave rank {comm_rank} for group rank {rank}")
        self.column: list[int] | None = None
        self._column_comm: Comm | None = None
        if column is not None:
            self._split_column([int(k) for k in column])
        self.tag_ub = tag_ub
        self._direct = (tag_ub + 1) // 2          # [0, direct): tags as they are
        self._abort_tag, self._hello_tag, self._note_tag = tag_ub, tag_ub - 1, tag_ub - 2
        self._modulus = tag_ub - 3 - self._direct + 1  # [direct, tag_ub - 3]: larger tags
        self.address = f"mpi:{me}@{socket.gethostname()}"
        self._status = MPI.Status()
        self._reqs: list[Any] = []      # active MPI requests (mpi4py's) ...
        self._entries: list[Entry] = []  # ... and what each is: (kind, Request or peer, buffer)
        # (peer, tag) -> deque of posted, unmatched Requests
        self._recvq: dict[tuple[int, int], deque[Request]] = {}
        self._anyq: dict[int, deque[Request]] = {}  # tag -> deque of receives from any rank
        self._sent_notes: dict[int, dict[int, int]] = {}  # peer -> {mpi tag: tag} announced to it
        self._notes: dict[int, dict[int, int]] = {}  # peer -> {mpi tag: tag} it announced to us
        self._failed: dict[int, Exception] = {}  # peer -> the error its requests fail with
        self._failing = 0            # _FAILING entries (MPI owns a failed request's buffer)
        self._hello: set[int] = set()
        self._waiting_threads = 0
        self._parked = False         # the progress thread sleeps until woken
        self._closed = False
        self._stats = dict(messages_sent=0, bytes_sent=0, messages_received=0,
                           bytes_received=0, size_mismatches=0, notes_sent=0,
                           notes_received=0, aborts_received=0, polls=0, mpi_errors=0)
        self._callbacks: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._progress = threading.Thread(target=self._progress_loop, daemon=True,
                                          name=f"neuron-mpi-progress-{rank}")
        self._callback_thread = threading.Thread(target=self._callback_loop, daemon=True,
                                                 name=f"neuron-mpi-callbacks-{rank}")
        self._progress.start()
        self._callback_thread.start()
        _register(self)

    def _create_comm(self, parent: Intracomm, world_ranks: list[int],
                     deadline: float | None) -> Intracomm:
        # Create_group blocks until every member calls it, and is made under the lock (at
        # SERIALIZED the process's one lock, which every transport's MPI calls need). So it
        # is called only once every member is known to be here (``_await_members``): a
        # member that never comes costs this group a PeerTimeout, and never a call that
        # holds the lock forever while the process's other groups wait for it.
        self._await_members(parent, world_ranks, deadline)
        with self._lock:
            whole = parent.Get_group()
            try:
                group = whole.Incl(world_ranks)
            finally:
                whole.Free()
            try:
                return parent.Create_group(group, _CREATE_TAG)
            finally:
                group.Free()

    def _await_members(self, parent: Intracomm, world_ranks: list[int],
                       deadline: float | None) -> None:
        """Wait until every member has reached the communicator's creation.

        Each member sends every other an arrival note (a digest of the member list, then
        ``A``) on ``parent``, tag ``_ARRIVE_TAG``, and waits for theirs, with nonblocking
        calls tested under the lock one at a time (never held while waiting). A member
        whose deadline passes withdraws: it cancels its receives and sends every other a
        withdrawal note (digest, ``W``), which a member that came late finds right after
        the arrival notes, so it fails too instead of waiting in ``MPI_Comm_create_group``
        for a member that left. (A withdrawal left over from an earlier abandoned creation
        is skipped.) Only a member that withdraws in the instant between another's last
        arrival note and its check can still leave that one waiting.

        Raises PeerTimeout naming the members not heard from by ``deadline`` (None: wait as
        long as it takes) or the members that withdrew; TransportError if a member's note
        names another member list (groups created in different orders)."""
        MPI = self._MPI
        digest = _members_digest(world_ranks)
        arrived, withdrawn = digest + b"A", digest + b"W"
        me = world_ranks[self.rank]
        others = {k: r for k, r in enumerate(world_ranks) if r != me}
        bufs = {k: bytearray(len(arrived)) for k in others}
        start, pause = time.monotonic(), 1e-4
        with self._lock:
            sends = [parent.Isend(arrived, dest=r, tag=_ARRIVE_TAG) for r in others.values()]
            recvs = {k: parent.Irecv(bufs[k], source=r, tag=_ARRIVE_TAG)
                     for k, r in others.items()}
        while True:
            with self._lock:
                sent = MPI.Request.Testall(sends)
                for k in sorted(recvs):
                    if not recvs[k].Test():
                        continue
                    if bufs[k].endswith(b"W"):  # an earlier, abandoned creation's: skip it
                        recvs[k] = parent.Irecv(bufs[k], source=others[k], tag=_ARRIVE_TAG)
                    elif bytes(bufs[k]) == arrived:
                        del recvs[k]
                    else:
                        raise TransportError(
                            f"{self._label}: group rank {k} (MPI rank {others[k]}) is creating "
                            f"a communicator over other members than {world_ranks} (do all "
                            f"ranks create their groups in the same order?)")
                if sent and not recvs:
                    left = [k for k, r in others.items() if self._withdrew(parent, r, withdrawn)]
                    if not left:
                        return
                    raise PeerTimeout(left, time.monotonic() - start,
                                      f"{self._label}: group rank(s) {left} gave up waiting for "
                                      f"the creation of the group's MPI communicator (members "
                                      f"{world_ranks}) before this rank joined it")
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(pause)
            pause = min(2 * pause, _COLD_SLEEP)
        status = MPI.Status()
        late = []
        with self._lock:  # withdraw: cancel the receives, tell every member
            for k, req in recvs.items():
                req.Cancel()
                req.Wait(status)
                if status.Is_cancelled() or bufs[k].endswith(b"W"):
                    late.append(k)
            orphans = [(q, arrived) for q in sends if not q.Test()]
            for r in others.values():
                q = parent.Isend(withdrawn, dest=r, tag=_ARRIVE_TAG)
                if not q.Test():
                    orphans.append((q, withdrawn))
        if orphans:
            with _ORPHANS_LOCK:
                _ORPHANS.extend(orphans)
        late = sorted(late) or sorted(others)
        raise PeerTimeout(late, time.monotonic() - start,
                          f"{self._label}: group rank(s) {late} (MPI ranks "
                          f"{[world_ranks[k] for k in late]}) did not join the creation of the "
                          f"group's MPI communicator (members {world_ranks}) in time")

    def _withdrew(self, parent: Comm, source: int, withdrawn: bytes) -> bool:
        """True if ``source``'s next note (if one is there) is its withdrawal (under the
        lock; a matched probe, so no other thread can take the note in between)."""
        msg = parent.Improbe(source=source, tag=_ARRIVE_TAG)
        if msg is None:
            return False
        note = bytearray(len(withdrawn))
        msg.Recv(note)
        return bytes(note) == withdrawn

    def _split_column(self, column: list[int]) -> None:
        """Split the column communicator off the group's (collective over the group: every
        member does it right after the group's creation, so all are there)."""
        if self.rank not in column or len(set(column)) != len(column):
            raise ValueError(f"column {column} must list distinct group ranks, {self.rank} "
                             f"among them")
        with self._lock:
            sub = self._comm.Split(column[0], column.index(self.rank))
            size = sub.Get_size()
        if size != len(column):
            sub.Free()
            raise ValueError(f"{self._label}: column {column} has {size} members in MPI (do "
                             f"all ranks pass the same columns?)")
        self.column, self._column_comm = column, sub

    # ------------------------------------------------------------------ collectives
    # MPI's own nonblocking collectives on the column communicator. Every member of the
    # column must start the same collectives in the same order with matching sizes (MPI's
    # rule): collectives/net_mpi.py checks the calls' descriptors with a fixed-size
    # ``iallgather`` before any other. Buffers belong to MPI until the request completes;
    # one that never does (a deadline, a failed member) keeps them alive (orphans).

    _MPI_OPS = {"SUM": "SUM", "PRODUCT": "PROD", "MIN": "MIN", "MAX": "MAX",
                "BAND": "BAND", "BOR": "BOR", "BXOR": "BXOR"}
    _MPI_TYPES = {"float32": "FLOAT", "float64": "DOUBLE", "int8": "INT8_T",
                  "int16": "INT16_T", "int32": "INT32_T", "int64": "INT64_T",
                  "uint8": "UINT8_T"}

    def reduces(self, dtype: str, op: str) -> bool:
        """Can MPI reduce elements of ``dtype`` (torch's name: ``float32``...) with ``op``
        (``SUM``, ``PRODUCT``, ``MIN``, ``MAX``, ``BAND``, ``BOR``, ``BXOR``)?"""
        if dtype not in self._MPI_TYPES or op not in self._MPI_OPS:
            return False
        return dtype.startswith(("int", "uint")) or op not in ("BAND", "BOR", "BXOR")

    def iallgather(self, send: Buffer, recv: Buffer) -> CollectiveRequest:
        """Every column member's ``send`` bytes, in column order, into ``recv``."""
        s, r = memoryview(send).cast("B"), _writable(recv)
        P = len(self._need_column())
        if r.nbytes != s.nbytes * P:
            raise ValueError(f"iallgather: {r.nbytes} bytes cannot hold {P} x {s.nbytes}")
        B = self._MPI.BYTE
        return self._collective("all_gather", r.nbytes,
                                lambda c: c.Iallgather([s, B], [r, B]), (s, r))

    def ialltoall(self, send: Buffer, recv: Buffer) -> CollectiveRequest:
        """Block ``b`` of ``send`` to column member ``b``; member ``b``'s block for this rank
        into block ``b`` of ``recv`` (blocks of one size)."""
        s, r = memoryview(send).cast("B"), _writable(recv)
        P = len(self._need_column())
        if r.nbytes != s.nbytes or s.nbytes % P:
            raise ValueError(f"ialltoall: {s.nbytes} and {r.nbytes} bytes are not "
                             f"{P} blocks each")
        B = self._MPI.BYTE
        return self._collective("all_to_all", r.nbytes,
                                lambda c: c.Ialltoall([s, B], [r, B]), (s, r))

    def iallreduce(self, buf: Buffer, dtype: str, op: str) -> CollectiveRequest:
        """Reduce ``buf`` (elements of ``dtype``) over the column with ``op``, in place."""
        b = _writable(buf)
        t, o = self._typed(dtype, op, b.nbytes)
        IN_PLACE = self._MPI.IN_PLACE
        return self._collective("all_reduce", b.nbytes,
                                lambda c: c.Iallreduce(IN_PLACE, [b, t], o), (b,))

    def ireduce_scatter(self, send: Buffer, recv: Buffer, dtype: str, op: str
                        ) -> CollectiveRequest:
        """Reduce ``send`` (one block per column member, in order) with ``op``; this rank's
        block of the result into ``recv``."""
        s, r = memoryview(send).cast("B"), _writable(recv)
        P = len(self._need_column())
        if s.nbytes != r.nbytes * P:
            raise ValueError(f"ireduce_scatter: {s.nbytes} bytes are not {P} "
                             f"blocks of {r.nbytes}")
        t, o = self._typed(dtype, op, r.nbytes)
        return self._collective("reduce_scatter", s.nbytes,
                                lambda c: c.Ireduce_scatter_block([s, t], [r, t], o), (s, r))

    def ibcast(self, buf: Buffer, root: int) -> CollectiveRequest:
        """Column member ``root``'s (an index into ``column``) ``buf`` into everyone's."""
        b = _writable(buf)
        if not 0 <= root < len(self._need_column()):
            raise ValueError(f"ibcast: root {root} is not an index into column {self.column}")
        B = self._MPI.BYTE
        return self._collective("broadcast", b.nbytes, lambda c: c.Ibcast([b, B], root), (b,))

    def _need_column(self) -> list[int]:
        if self.column is None:
            raise ValueError(f"{self._label}: MPI collectives need the transport's column")
        return self.column

    def _typed(self, dtype: str, op: str, nbytes: int) -> tuple[Any, Any]:
        if not self.reduces(dtype, op):
            raise ValueError(f"MPI does not reduce {dtype} with {op} here")
        MPI = self._MPI
        t = getattr(MPI, self._MPI_TYPES[dtype])
        if nbytes % t.Get_size():
            raise ValueError(f"{nbytes} bytes are not whole {dtype} elements")
        return t, getattr(MPI, self._MPI_OPS[op])

    def _collective(self, name: str, nbytes: int, start: Callable[[Comm], Any],
                    bufs: tuple[memoryview, ...]) -> CollectiveRequest:
        req = CollectiveRequest(name, self, nbytes)
        with self._lock:
            self._check_open()
            column = self._need_column()
            self._read_control()
            for k in column:
                if k in self._failed:
                    raise self._failed[k]
            mpi_req = start(self._column_comm)  # type: ignore[arg-type]  # (set with column)
            if mpi_req.Test():
                req._finish()
            else:
                req.mpi = mpi_req
                self._add(mpi_req, _COLL, req, bufs)
                self._wake()
        return req

    def _drive_collective(self, req: CollectiveRequest, deadline: float) -> bool:
        """Wait for collective ``req``, driving MPI from this thread; False on timeout.

        A collective moves on only while its members call into MPI, and shows no progress
        until its last round: so its waiter tests its request (which drives all of MPI)
        back to back, yielding the CPU in between, for up to ``_COLL_SPIN_SECONDS`` (as a
        blocking MPI collective would), with a whole poll (peers' notices, other requests)
        every ``_SPIN_SECONDS``; then it polls with sleeps as ``_drive`` does. One test
        costs a few µs of Python where a whole poll costs several times that, and on
        crowded cores every µs a waiter spends is taken from the members it waits for.
        """
        event = req._event
        with self._waiting():
            start = now = time.monotonic()
            full_at = now + _SPIN_SECONDS
            while not event.is_set() and now - start < _COLL_SPIN_SECONDS:
                with self._lock:
                    if self._closed:
                        break
                    mpi_req = req.mpi
                    try:
                        if now >= full_at:
                            self._poll()
                            full_at = now + _SPIN_SECONDS
                        elif mpi_req is not None and mpi_req.Test():
                            self._retire(mpi_req)
                            req._finish()
                    except Exception:  # noqa: BLE001 - the whole poll below reports it
                        full_at = now
                if event.is_set():
                    break
                now = time.monotonic()
                if now >= deadline:
                    return False
                os.sched_yield()
        return event.is_set() or self._drive(event, deadline)

    def _retire(self, mpi_req: object) -> None:
        """Under the lock: forget a request MPI has completed (tested by its waiter)."""
        for i, r in enumerate(self._reqs):
            if r is mpi_req:
                del self._reqs[i]
                del self._entries[i]
                return

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
        with self._lock:
            self._check_open()
            for p in want:
                self._check_peer(p)
                self._add(self._comm.Isend([b"", MPI.BYTE], p, self._hello_tag), _HELLO_SEND,
                          p, b"")
                box = bytearray(0)
                self._add(self._comm.Irecv([box, MPI.BYTE], p, self._hello_tag), _HELLO_RECV,
                          p, box)
            self._wake()
            self._waiting_threads += 1
            start = time.monotonic()
            try:
                while True:
                    missing = [p for p in want if p not in self._hello]
                    if not missing:
                        return
                    self._check_open()
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        error = PeerTimeout(missing, time.monotonic() - start,
                                            f"rank(s) {missing} did not answer rank {self.rank} "
                                            f"of {self._label} over MPI in time", network=True)
                        raise error
                    if not self._poll():
                        self._cond.wait(min(remaining, 0.001))
            finally:
                self._waiting_threads -= 1

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
        with self._lock:
            self._check_open()
            _check_tag(tag)
            self._read_control()  # a peer that aborted fails the post, as in rdm
            self._check_peer(peer)
            mpi_tag = self._send_tag(peer, tag)
            mpi_req = self._comm.Isend([view, MPI.BYTE], peer, mpi_tag)
            self._stats["messages_sent"] += 1
            self._stats["bytes_sent"] += view.nbytes
            if mpi_req.Test():  # small messages usually leave at once
                req._finish()
            else:
                self._add(mpi_req, _SEND, req, view)
                self._wake()
        return req

    def irecv(self, peer: int, tag: int, buf: Buffer,
              callback: Callable[[NetRequest], object] | None = None) -> Request:
        """Receive the next message of ``(peer, tag)`` into ``buf`` (exactly its size).

        A message of another size fails the request with ``MessageSizeMismatch`` (a
        ``ValueError``) naming both sizes (and is consumed).
        """
        view = _writable(buf)
        req = Request(peer, tag, view, False, self)
        req.callback = callback
        with self._lock:
            self._check_open()
            _check_tag(tag)
            self._read_control()
            self._check_peer(peer)
            key = (peer, tag)
            q = self._recvq.get(key)
            if q is None:
                q = self._recvq[key] = deque()
            q.append(req)
            if len(q) == 1:
                self._match(key, q)  # already here? matched without any thread
            self._wake()
        return req

    def irecv_any(self, tag: int, buf: Buffer,
                  callback: Callable[[NetRequest], object] | None = None) -> Request:
        """Receive the next message of ``tag`` from whichever rank sends one first.

        The source is in ``request.source`` once complete. Messages go to receives naming
        their source first; a receive from any rank takes the earliest message that no
        such receive was waiting for.
        """
        view = _writable(buf)
        req = Request(None, tag, view, False, self)
        req.callback = callback
        with self._lock:
            self._check_open()
            _check_tag(tag)
            self._read_control()
            if not self._alive_peers():
                raise next(iter(self._failed.values()),
                           ValueError(f"{self._label}: no other rank to receive from"))
            q = self._anyq.get(tag)
            if q is None:
                q = self._anyq[tag] = deque()
            q.append(req)
            if len(q) == 1:
                self._match_any(tag, q)
            self._wake()
        return req

    def abort(self, reason: str, kind: int = ABORTED, grace: float = 0.5) -> None:
        """Tell every peer that this rank failed the group, then close.

        Peers' pending and later requests to or from this rank fail with ``PeerAborted``
        carrying ``reason`` and ``kind`` (so every rank can raise the same error class).
        Waits at most ``grace`` seconds for the notices to leave.
        """
        payload = bytes([kind]) + reason.encode("utf-8", "replace")[:_ABORT_REASON_BYTES]
        with self._lock:
            if self._closed:
                return
            for p in self._alive_peers():
                try:
                    r = self._comm.Isend([payload, self._MPI.BYTE], p, self._abort_tag)
                except self._MPI.Exception:  # noqa: BLE001 - best effort
                    continue
                self._add(r, _ABORT_SEND, p, payload)
        end = time.monotonic() + grace
        while time.monotonic() < end:
            with self._lock:
                self._poll()
                if not any(e[0] == _ABORT_SEND for e in self._entries):
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
        a critical message on stderr naming the request (``_end_job``). In practice:
        withdrawing a send larger than MPI's eager limit (a few KiB) whose receiver never
        posted its receive ends the job, as does one whose peer is stuck mid-message.
        """
        with self._lock:
            if req._event.is_set():
                return False
            if req.peer is None:
                q = self._anyq.get(req.tag)
                if q is not None and req in q:
                    q.remove(req)
                    req._finish(error)
                    return True
            else:
                q = self._recvq.get((req.peer, req.tag))
                if q is not None and req in q:  # not matched yet: MPI never saw it
                    q.remove(req)
                    req._finish(error)
                    self._break_peer(req.peer, error)
                    return True
        self._drive(req._event, time.monotonic() + CANCEL_GRACE)
        with self._lock:
            if req._event.is_set():
                return False
            self._end_job(req, error)  # never returns: MPI still owns the buffer
        return False  # (not reached)

    def _break_peer(self, peer: int | None, error: Exception) -> None:
        """Under the lock: after a withdrawn request, stop talking to ``peer`` and tell it."""
        if peer is None or peer in self._failed:
            return
        kind = ABORTED_TIMEOUT if isinstance(error, PeerTimeout) else ABORTED
        payload = bytes([kind]) + (f"rank {self.rank} withdrew a request with this rank: "
                                   f"{error}").encode("utf-8", "replace")[:_ABORT_REASON_BYTES]
        try:
            self._add(self._comm.Isend([payload, self._MPI.BYTE], peer, self._abort_tag),
                      _ABORT_SEND, peer, payload)
        except self._MPI.Exception:  # noqa: BLE001 - best effort
            pass
        self._fail_peer(peer, error)

    def _check_open(self) -> None:
        if self._closed:
            raise ChannelClosed(f"MPI transport of {self._label} is closed")

    def _check_peer(self, peer: int) -> None:
        if not (isinstance(peer, int) and 0 <= peer < self.world_size):
            raise ValueError(f"rank {peer} is not in the group of {self.world_size} ranks "
                             f"of {self._label}")
        if peer in self._failed:
            raise self._failed[peer]

    def _alive_peers(self) -> list[int]:
        return [p for p in range(self.world_size) if p != self.rank and p not in self._failed]

    def _mpi_tag(self, tag: int) -> int:
        if tag < self._direct:
            return tag
        return self._direct + (tag - self._direct) % self._modulus

    def _send_tag(self, peer: int, tag: int) -> int:
        """Under the lock: the MPI tag of ``tag``; notes a large tag's first use per peer."""
        mpi_tag = self._mpi_tag(tag)
        if mpi_tag == tag:
            return tag
        sent = self._sent_notes.setdefault(peer, {})
        owner = sent.get(mpi_tag)
        if owner is None:
            sent[mpi_tag] = tag
            note = bytearray(_NOTE.pack(tag, mpi_tag))
            self._add(self._comm.Isend([note, self._MPI.BYTE], peer, self._note_tag),
                      _NOTE_SEND, peer, note)
            self._stats["notes_sent"] += 1
        elif owner != tag:
            raise TransportError(f"{self._label}: tags {owner} and {tag} would share MPI tag "
                                 f"{mpi_tag} towards rank {peer}; use tags that are not "
                                 f"{self._modulus} apart")
        return mpi_tag

    def _add(self, mpi_req: Any, kind: int, obj: object, buf: object) -> None:
        self._reqs.append(mpi_req)
        self._entries.append((kind, obj, buf))

    # ------------------------------------------------------------------ matching

    def _read_control(self) -> None:
        """Under the lock: take in the notes and abort notices that arrived."""
        MPI, st, comm = self._MPI, self._status, self._comm
        while True:  # notes (16 bytes) and notices (< 1 KiB) came eagerly: Recv is at once
            msg = comm.Improbe(MPI.ANY_SOURCE, self._note_tag, st)
            if msg is None:
                break
            src, box = st.Get_source(), bytearray(_NOTE.size)
            msg.Recv([box, MPI.BYTE])
            tag, mpi_tag = _NOTE.unpack(box)
            self._notes.setdefault(src, {})[mpi_tag] = tag
            self._stats["notes_received"] += 1
        while True:
            msg = comm.Improbe(MPI.ANY_SOURCE, self._abort_tag, st)
            if msg is None:
                break
            src, box = st.Get_source(), bytearray(st.Get_count(MPI.BYTE))
            msg.Recv([box, MPI.BYTE])
            self._stats["aborts_received"] += 1
            kind = box[0] if box else ABORTED
            error = PeerAborted(src, bytes(box[1:]).decode("utf-8", "replace"), kind,
                                network=True)
            log.info("neuron %s: %s", self._label, error)
            self._fail_peer(src, error)

    def _announced(self, src: int, tag: int) -> bool | int | None:
        """True if ``src`` announced ``tag`` on its MPI tag, None if not yet, else the
        other tag it announced there."""
        mpi_tag = self._mpi_tag(tag)
        if mpi_tag == tag:
            return True
        owner = self._notes.get(src, {}).get(mpi_tag)
        return None if owner is None else (True if owner == tag else owner)

    def _conflict(self, src: int, tag: int, other: int) -> TransportError:
        return TransportError(f"{self._label}: rank {src} sends tag {other} on MPI tag "
                              f"{self._mpi_tag(tag)}, which a receive of tag {tag} would "
                              f"take; use tags that are not {self._modulus} apart")

    def _match(self, key: tuple[int, int], q: deque[Request]) -> bool:
        """Under the lock: match the receives queued on ``key`` with arrived messages."""
        peer, tag = key
        ok = self._announced(peer, tag)
        if ok is None:
            return False  # the peer's note is on its way
        if ok is not True:
            error = self._conflict(peer, tag, ok)
            for req in q:
                req._finish(error)
            del self._recvq[key]
            return True
        mpi_tag, status, progressed = self._mpi_tag(tag), self._status, False
        while q:
            msg = self._comm.Improbe(peer, mpi_tag, status)
            if msg is None:
                break
            self._take(msg, q.popleft(), peer)
            progressed = True
        if not q:
            del self._recvq[key]
        return progressed

    def _match_any(self, tag: int, q: deque[Request]) -> bool:
        """Under the lock: match the receives from any rank queued on ``tag``."""
        MPI, st, comm = self._MPI, self._status, self._comm
        mpi_tag, progressed = self._mpi_tag(tag), False
        while q:
            if mpi_tag == tag:
                msg = comm.Improbe(MPI.ANY_SOURCE, mpi_tag, st)
                if msg is None:
                    break
                src = st.Get_source()
            else:  # look first: the source's note must say the message is of this tag
                if not comm.Iprobe(MPI.ANY_SOURCE, mpi_tag, st):
                    break
                src = st.Get_source()
                ok = self._announced(src, tag)
                if ok is None:
                    break
                if ok is not True:
                    error = self._conflict(src, tag, ok)
                    for req in q:
                        req._finish(error)
                    q.clear()
                    break
                msg = comm.Improbe(src, mpi_tag, st)  # the same message: src's first one
            named = self._recvq.get((src, tag))
            if named:  # a receive naming the source goes first
                self._take(msg, named.popleft(), src)
                if not named:
                    del self._recvq[(src, tag)]
            else:
                self._take(msg, q.popleft(), src)
            progressed = True
        if not q:
            self._anyq.pop(tag, None)
        return progressed

    def _take(self, msg: Any, req: Request, src: int) -> None:
        """Under the lock: receive the probed message ``msg`` (size in the status) for ``req``."""
        MPI = self._MPI
        n = self._status.Get_count(MPI.BYTE)
        req.source = src
        if n == req.nbytes:
            self._add(msg.Irecv([req.buf, MPI.BYTE]), _RECV, req, req.buf)
            return
        scratch = bytearray(n)  # the request fails with the message once it is in
        self._add(msg.Irecv([scratch, MPI.BYTE]), _MISMATCH, req, scratch)
        self._stats["size_mismatches"] += 1

    # ------------------------------------------------------------------ progress

    def _poll(self) -> bool:
        """Under the lock: one round of progress; True if anything happened."""
        self._stats["polls"] += 1
        if self._failing:
            self._check_failing()
        self._read_control()
        progressed = False
        for key in list(self._recvq):
            q = self._recvq.get(key)
            if q and self._match(key, q):
                progressed = True
        for tag in list(self._anyq):
            q = self._anyq.get(tag)
            if q and self._match_any(tag, q):
                progressed = True
        if not self._reqs:
            return progressed
        MPI = self._MPI
        try:
            done = MPI.Request.Testsome(self._reqs)
        except MPI.Exception:
            done = self._test_each()
        if done:
            entries = self._entries
            drop = set(done)
            self._reqs = [r for i, r in enumerate(self._reqs) if i not in drop]
            self._entries = [e for i, e in enumerate(entries) if i not in drop]
            for i in done:
                self._completed(entries[i])
            progressed = True
        return progressed

    def _test_each(self) -> list[int]:
        """Testsome failed: find the requests that failed; fail their peers."""
        done: list[int] = []
        failed: list[tuple[Any, Exception, Request | None, Exception | None]] = []
        for i, r in enumerate(self._reqs):
            try:
                if r.Test():
                    done.append(i)
            except self._MPI.Exception as e:
                self._stats["mpi_errors"] += 1
                kind, obj, info = self._entries[i]
                if kind == _COLL:
                    obj._finish(TransportError(f"{self._label}: MPI failed the {obj.name} of "
                                               f"column {self.column}: {e}"))
                    self._entries[i] = (_DISCARD, None, None)
                    done.append(i)
                    continue
                peer = obj.source if isinstance(obj, Request) else obj
                own = None  # a failing request's own error
                if kind == _FAILING:
                    self._failing -= 1
                    own = info[2]
                failed.append((peer, e, obj if isinstance(obj, Request) else None, own))
                self._entries[i] = (_DISCARD, peer, None)
                done.append(i)
        for peer, exc, req, own in failed:
            log.error("neuron %s: MPI failed a request with rank %s: %s", self._label, peer, exc)
            error = PeerUnreachable(peer, f"rank {peer} is unreachable: MPI failed a request "
                                          f"with it: {exc}")
            if isinstance(peer, int) and peer not in self._failed:
                self._fail_peer(peer, error)
            if req is not None:  # MPI completed it (with an error): its buffer is free
                req._finish(own or self._failed.get(peer, error))
        return done

    def _completed(self, entry: Entry) -> None:
        kind, obj, buf = entry
        if kind in (_SEND, _COLL):
            obj._finish()
            if kind == _COLL:
                obj.mpi = None
        elif kind == _RECV:
            self._stats["messages_received"] += 1
            self._stats["bytes_received"] += obj.nbytes
            obj._finish()
        elif kind == _MISMATCH:
            obj._finish(MessageSizeMismatch(obj.source, obj.tag, len(buf), obj.nbytes, buf))
        elif kind == _FAILING:  # MPI is done with the buffer: the caller may have it back
            self._failing -= 1
            obj._finish(buf[2])
        elif kind == _HELLO_RECV:
            self._hello.add(obj)
            self._cond.notify_all()

    def _fail_peer(self, peer: int, error: Exception) -> None:
        """Under the lock: ``peer`` is gone; its requests (and later ones) fail with ``error``.

        Receives MPI has not matched fail at once. A matched receive or a started send
        fails only once MPI has completed it (``_FAILING``; ``CANCEL_GRACE`` at most, else
        the job ends): MPI owns the caller's buffer until then. A size mismatch's
        receive (MPI has scratch memory) and a collective (MPI has the call's staging
        buffers, collectives/net_mpi.py; never a caller's) fail at once, their buffers
        kept alive for MPI (orphans).
        """
        self._failed[peer] = error
        for key in [k for k in self._recvq if k[0] == peer]:
            for req in self._recvq.pop(key):
                req._finish(error)
        keep_r: list[Any] = []
        keep_e: list[Entry] = []
        orphans: list[tuple[Any, object]] = []
        for r, e in zip(self._reqs, self._entries):
            kind, obj, buf = e
            if kind in (_SEND, _RECV) and obj.source == peer:
                keep_r.append(r)
                keep_e.append(self._failing_entry(kind, obj, buf, error))
            elif ((kind == _MISMATCH and obj.source == peer)
                    # (a collective: the column is set)
                    or (kind == _COLL and peer in self.column)):  # type: ignore[operator]
                obj._finish(error)
                orphans.append((r, buf))
            else:
                keep_r.append(r)
                keep_e.append(e)
        self._reqs, self._entries = keep_r, keep_e
        if orphans:
            with _ORPHANS_LOCK:
                _ORPHANS.extend(orphans)
        if not self._alive_peers():  # nobody left to send to a receive from any rank
            for q in self._anyq.values():
                for req in q:
                    req._finish(error)
            self._anyq.clear()

    def _failing_entry(self, kind: int, req: Request, buf: object, error: Exception) -> Entry:
        """Under the lock: the entry of a send or receive that fails with ``error`` once MPI
        has completed it (MPI owns ``buf``, the caller's), within ``CANCEL_GRACE``."""
        self._failing += 1
        self._wake()  # the progress thread completes it (or ends the job) if nobody waits
        return (_FAILING, req, (kind, buf, error, time.monotonic() + CANCEL_GRACE))

    def _check_failing(self) -> None:
        """Under the lock: end the job if MPI still owns a failed request's buffer past
        its grace (see ``_end_job``)."""
        now = time.monotonic()
        for kind, obj, info in self._entries:
            if kind == _FAILING and now > info[3]:
                self._end_job(obj, info[2])

    def _end_job(self, req: Request, error: Exception) -> None:
        """Under the lock: MPI still owns ``req``'s buffer, and ``req`` must end (withdrawn
        or failed with ``error``). Never returns: say why on stderr and end the whole job
        with ``MPI_Abort`` on this transport's communicator.

        MPI cannot withdraw a matched receive or a started send; handing the buffer back
        would let MPI write into (or, for a send, read from) memory its caller owns again
        (a peer's receive could then complete with bytes written after the withdrawal: a
        silent wrong answer). No rank may complete a call with such bytes, so no rank goes
        on. (The transport layer has no flight recorder to dump: it imports nothing of
        the layers above.)
        """
        peer = req.source
        what = (f"send to rank {peer}" if req.is_send else f"receive from rank {peer}")
        me = f"rank {self.rank} of {self._label}, MPI rank {self.world_ranks[self.rank]}"
        msg = (f"neuron_dist FATAL ({me}, pid {os.getpid()}): MPI still owns the buffer of a "
               f"{what} ({req.nbytes} bytes, tag {req.tag}) {CANCEL_GRACE:g} s after it had "
               f"to end ({type(error).__name__}: {error}). MPI cannot withdraw a matched "
               f"receive or a started send, and handing the buffer back would let MPI "
               f"{'read from' if req.is_send else 'write into'} memory its caller owns "
               f"again (a wrong answer). Ending the job: MPI_Abort({ABORT_ERRORCODE}).")
        try:
            if log.hasHandlers():
                log.critical("%s", msg)
            sys.stderr.write(msg + "\n")
            sys.stderr.flush()
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - nothing stops the abort
            try:
                os.write(2, (msg + "\n").encode("utf-8", "replace"))
            except OSError:
                pass
        try:
            self._comm.Abort(ABORT_ERRORCODE)
        finally:  # MPI_Abort does not return; if it did, this process must not go on
            os._exit(ABORT_ERRORCODE)

    def _drive(self, event: Completion, deadline: float) -> bool:
        """Wait for ``event`` until ``deadline``, polling MPI from this thread meanwhile.

        Polls back to back for 1 ms after the last progress, with ``sched_yield`` in between
        (~1 us when the CPU is free; runnable processes go first when it is not, where
        ``sleep(0)`` or a 25 us timed wait cost ~0.1 ms), then with sleeps growing to
        0.2 ms. False on timeout.
        """
        with self._waiting():
            idle = 0
            spin_until = time.monotonic() + _SPIN_SECONDS
            while not event.is_set():
                with self._lock:
                    if self._closed:
                        break
                    try:
                        progressed = self._poll()
                    except Exception:  # noqa: BLE001 - the progress thread reports it
                        progressed = False
                if event.is_set():
                    break
                now = time.monotonic()
                if now >= deadline:
                    return False
                if progressed:
                    idle, spin_until = 0, now + _SPIN_SECONDS
                if now < spin_until:
                    os.sched_yield()
                else:
                    idle += 1
                    event.wait(min(deadline - now, _HOT_SLEEP, 2.5e-5 * (1 << min(idle, 4))))
            return event.wait(max(0.0, deadline - time.monotonic()))

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """Count the calling thread as one that drives MPI for itself while inside (the
        progress thread then polls less often)."""
        with self._lock:
            self._waiting_threads += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiting_threads -= 1

    def _wake(self) -> None:
        """Under the lock: wake the progress thread if it sleeps until woken."""
        if self._parked:
            self._cond.notify_all()

    def _busy(self) -> bool:
        return bool(self._reqs or self._recvq or self._anyq)

    def _progress_loop(self) -> None:
        idle, idle_since = 0, None
        with self._lock:
            while not self._closed:
                if not self._busy():
                    idle = 0
                    now = time.monotonic()
                    if idle_since is None:
                        idle_since = now
                    if now - idle_since < _PARK_AFTER:
                        self._cond.wait(_COLD_SLEEP)
                    else:  # long idle: sleep until a request is posted (no polling)
                        self._parked = True
                        self._cond.wait()
                        self._parked = False
                    continue
                idle_since = None
                try:
                    progressed = self._poll()
                except Exception as e:  # noqa: BLE001 - never die silently with work pending
                    if not self._failing:  # (once: what MPI owns may still complete)
                        log.exception("neuron %s: MPI progress failed", self._label)
                    self._fail_all(TransportError(f"MPI progress of {self._label} failed: {e!r}"))
                    if self._failing:
                        self._check_failing()
                        self._cond.wait(_COLD_SLEEP)
                    continue
                idle = 0 if progressed else idle + 1
                if self._waiting_threads > 0:   # a waiting thread polls for itself
                    self._cond.wait(_COLD_SLEEP)
                elif idle > _IDLE_POLLS:
                    self._cond.wait(min(_COLD_SLEEP, 2e-5 * (1 << min(idle - _IDLE_POLLS, 10))))
                else:
                    self._cond.wait(0)          # let posting threads take the lock

    def _callback_loop(self) -> None:
        run_callbacks(self._callbacks)

    # ------------------------------------------------------------------ teardown

    def stats(self) -> dict[str, int]:
        """Counters: messages/bytes sent and received, size mismatches, notes, polls..."""
        with self._lock:
            out = dict(self._stats)
            out["pending_requests"] = len(self._reqs)
            out["posted_receives"] = (sum(len(q) for q in self._recvq.values())
                                      + sum(len(q) for q in self._anyq.values()))
            return out

    def _fail_all(self, error: Exception) -> None:
        """Under the lock: fail every pending request. Sends and matched receives on
        callers' buffers stay (``_FAILING``) until MPI completes them (see ``_fail_peer``);
        MPI's other requests go to the orphans."""
        for queues in (self._recvq, self._anyq):
            for q in queues.values():
                for req in q:
                    req._finish(error)
            queues.clear()
        orphans, keep_r, keep_e = [], [], []
        for r, e in zip(self._reqs, self._entries):
            kind, obj, buf = e
            if kind in (_SEND, _RECV):
                keep_r.append(r)
                keep_e.append(self._failing_entry(kind, obj, buf, error))
            elif kind == _FAILING:
                keep_r.append(r)
                keep_e.append(e)
            else:
                if isinstance(obj, Request):
                    obj._finish(error)
                orphans.append((r, buf))
        self._reqs, self._entries = keep_r, keep_e
        if orphans:
            with _ORPHANS_LOCK:
                _ORPHANS.extend(orphans)

    def close(self, error: Exception | None = None) -> None:
        """Fail pending requests with ``error`` (default ``ChannelClosed``) and free the
        communicator.

        Without ``error`` (a normal shutdown), sends still in flight get up to 2 s to
        complete first, so a peer still receiving what we sent gets it.
        """
        if error is None:
            end = time.monotonic() + _DRAIN_SECONDS
            with self._lock:
                while (not self._closed and time.monotonic() < end
                       and any(e[0] in _OUTGOING for e in self._entries)):
                    if not self._poll():
                        self._cond.wait(0.001)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._fail_all(error or ChannelClosed(f"MPI transport of {self._label} was closed"))
            self._cond.notify_all()
            # Requests MPI still owns the callers' buffers of complete first (both ranks
            # drive MPI meanwhile), or the job ends at their grace: never handed back.
            while self._failing:
                try:
                    progressed = self._poll()
                except Exception:  # noqa: BLE001 - the grace still bounds it
                    self._check_failing()
                    progressed = False
                if self._failing and not progressed:
                    self._cond.wait(_HOT_SLEEP)  # (MPI moves a large message a piece a poll)
        self._callbacks.put(None)
        me = threading.current_thread()
        for t in (self._progress, self._callback_thread):
            if t is not me:
                t.join(timeout=5.0)
        with self._lock:
            _sweep_orphans(self._MPI)
            if not self._MPI.Is_finalized() and self._column_comm is not None:
                try:
                    self._column_comm.Free()
                except self._MPI.Exception as e:  # noqa: BLE001 - closing anyway
                    log.warning("neuron %s: MPI_Comm_free failed: %s", self._label, e)
            if not self._MPI.Is_finalized() and self._comm != self._MPI.COMM_NULL:
                try:
                    self._comm.Free()
                except self._MPI.Exception as e:  # noqa: BLE001 - closing anyway
                    log.warning("neuron %s: MPI_Comm_free failed: %s", self._label, e)
        _LIVE.discard(self)


def _writable(buf: Buffer) -> memoryview:
    view = memoryview(buf).cast("B")
    if view.readonly:
        raise ValueError("a receive needs a writable buffer")
    return view


def _check_tag(tag: int) -> int:
    if not isinstance(tag, int) or not 0 <= tag < 1 << 64:
        raise ValueError(f"tag must be an integer in [0, 2**64), not {tag!r}")
    return tag


def _sweep_orphans(MPI: ModuleType) -> None:
    """Drop the orphaned requests MPI has completed since (their buffers may go now)."""
    with _ORPHANS_LOCK:
        if not _ORPHANS or MPI.Is_finalized():
            return
        keep = []
        for r, buf in _ORPHANS:
            try:
                if not r.Test():
                    keep.append((r, buf))
            except MPI.Exception:
                pass
        _ORPHANS[:] = keep


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
