"""The MPI requests of one transport that MPI has not completed yet, and how each ends.

How it works
------------
Every MPI request the transport starts (a send, a matched receive, a note, a notice, a
hello, one of MPI's collectives) is kept with an entry saying what it is: ``(kind, Request
or peer, buffer)``. ``test`` completes those MPI has finished (``MPI_Testsome``; when that
raises, each is tested alone and the failed ones fail their peers).

*Buffers.* MPI works on the callers' buffers themselves, so a request's buffer goes back to
its caller (the request completes, fails or is withdrawn) only once MPI no longer owns it.
MPI cannot withdraw a receive it has matched nor a send it has started (``MPI_Cancel``
cannot; MPICH cancels no send). So a matched receive or a started send that must end (its
peer failed, the transport closed) becomes ``FAILING``: it gets ``CANCEL_GRACE`` for MPI
to complete it, then finishes with its error. If MPI still owns the buffer at the end of
the grace, the job ends (``end_job``): a critical message on stderr names the request and
``MPI_Abort`` (code ``ABORT_ERRORCODE``) stops every rank, so none completes a call with
bytes written after a withdrawal. A size mismatch's receive (MPI has scratch memory) and
MPI's collectives (MPI has the call's staging buffers, never a caller's tensor) fail at
once; their MPI requests then keep their buffers alive (orphans.py) until MPI completes
them, as do the transport's own notes and notices.

Everything here runs under the transport's lock.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..errors import MessageSizeMismatch, PeerUnreachable, TransportError
from .orphans import keep as keep_orphans
from .request import Request

if TYPE_CHECKING:
    from mpi4py.MPI import Intracomm
    from typing_extensions import TypeAlias

    from .driver import MpiTransport

    # an active MPI request's entry: (kind, Request or peer, buffer); what the last two
    # hold depends on the kind (see the kinds below)
    Entry: TypeAlias = tuple[int, Any, Any]

log = logging.getLogger("neuron_dist.mpi")

CANCEL_GRACE = 1.0                   # a withdrawn request MPI already owns may finish this long
ABORT_ERRORCODE = 70                 # MPI_Abort's code when MPI keeps a caller's buffer (end_job)

# what an active MPI request is
(SEND, RECV, NOTE_SEND, DISCARD, HELLO_SEND, HELLO_RECV, ABORT_SEND, MISMATCH,
 COLL, FAILING) = range(10)
# FAILING: a send or receive on a caller's buffer that has failed (its peer failed, the
# transport closed) while MPI still owns the buffer; its buffer entry is
# (kind, buffer, error, time by which MPI must have completed it). It finishes with the
# error once MPI completes it; at that time the job ends (end_job).
OUTGOING = (SEND, NOTE_SEND, HELLO_SEND, ABORT_SEND)


class Active:
    """The MPI requests of ``owner`` in flight (``reqs``) and what each is (``entries``).

    The owner is told of what happens through ``hello`` (a peer's hello arrived),
    ``fail_peer`` (MPI failed a request with a peer) and ``polling.wake`` (a failing
    request needs polling); its ``failed`` maps each failed peer to its error.
    """

    def __init__(self, owner: MpiTransport, MPI: ModuleType, comm: Intracomm, label: str,
                 stats: dict[str, int]):
        self._owner, self._MPI, self._comm, self._label = owner, MPI, comm, label
        self._stats = stats
        self.reqs: list[Any] = []      # active MPI requests (mpi4py's) ...
        self.entries: list[Entry] = []  # ... and what each is: (kind, Request or peer, buffer)
        self.failing = 0               # FAILING entries (MPI owns a failed request's buffer)

    def add(self, mpi_req: Any, kind: int, obj: object, buf: object) -> None:
        """Keep ``mpi_req`` until MPI completes it: a request of ``kind`` for ``obj``."""
        self.reqs.append(mpi_req)
        self.entries.append((kind, obj, buf))

    def retire(self, mpi_req: object) -> None:
        """Forget a request MPI has completed (tested by its waiter)."""
        for i, r in enumerate(self.reqs):
            if r is mpi_req:
                del self.reqs[i]
                del self.entries[i]
                return

    def sending(self, kinds: tuple[int, ...] = OUTGOING) -> bool:
        """Is a request of one of ``kinds`` (by default: anything outgoing) in flight?"""
        return any(e[0] in kinds for e in self.entries)

    # ------------------------------------------------------------------ completing

    def test(self) -> bool:
        """Complete the requests MPI has finished; True if there were any."""
        if not self.reqs:
            return False
        MPI = self._MPI
        try:
            done = MPI.Request.Testsome(self.reqs)
        except MPI.Exception:
            done = self._test_each()
        if not done:
            return False
        entries = self.entries
        drop = set(done)
        self.reqs = [r for i, r in enumerate(self.reqs) if i not in drop]
        self.entries = [e for i, e in enumerate(entries) if i not in drop]
        for i in done:
            self._completed(entries[i])
        return True

    def _test_each(self) -> list[int]:
        """Testsome failed: find the requests that failed; fail their peers."""
        owner = self._owner
        done: list[int] = []
        failed: list[tuple[Any, Exception, Request | None, Exception | None]] = []
        for i, r in enumerate(self.reqs):
            try:
                if r.Test():
                    done.append(i)
            except self._MPI.Exception as e:
                self._stats["mpi_errors"] += 1
                kind, obj, info = self.entries[i]
                if kind == COLL:
                    obj.finish(TransportError(f"{self._label}: MPI failed the {obj.name} of "
                                               f"column {owner.column}: {e}"))
                    self.entries[i] = (DISCARD, None, None)
                    done.append(i)
                    continue
                is_request = kind in (SEND, RECV, MISMATCH, FAILING)
                peer = obj.source if is_request else obj
                own = None  # a failing request's own error
                if kind == FAILING:
                    self.failing -= 1
                    own = info[2]
                failed.append((peer, e, obj if is_request else None, own))
                self.entries[i] = (DISCARD, peer, None)
                done.append(i)
        for peer, exc, req, own in failed:
            log.error("neuron %s: MPI failed a request with rank %s: %s", self._label, peer,
                      exc)
            error = PeerUnreachable(peer, f"rank {peer} is unreachable: MPI failed a request "
                                          f"with it: {exc}")
            if isinstance(peer, int) and peer not in owner.failed:
                owner.fail_peer(peer, error)
            if req is not None:  # MPI completed it (with an error): its buffer is free
                req.finish(own or owner.failed.get(peer, error))
        return done

    def _completed(self, entry: Entry) -> None:
        kind, obj, buf = entry
        if kind in (SEND, COLL):
            obj.finish()
            if kind == COLL:
                obj.mpi = None
        elif kind == RECV:
            self._stats["messages_received"] += 1
            self._stats["bytes_received"] += obj.nbytes
            obj.finish()
        elif kind == MISMATCH:
            obj.finish(MessageSizeMismatch(obj.source, obj.tag, len(buf), obj.nbytes, buf))
        elif kind == FAILING:  # MPI is done with the buffer: the caller may have it back
            self.failing -= 1
            obj.finish(buf[2])
        elif kind == HELLO_RECV:
            self._owner.hello(obj)

    # ------------------------------------------------------------------ failing

    def fail_peer(self, peer: int, error: Exception, column: list[int] | None) -> None:
        """``peer`` is gone: its sends and matched receives fail with ``error`` once MPI
        has completed them (``FAILING``); its size mismatches, and MPI's collectives if
        it is in ``column``, fail at once (their buffers kept alive for MPI: orphans)."""
        keep_r: list[Any] = []
        keep_e: list[Entry] = []
        orphans: list[tuple[Any, object]] = []
        for r, e in zip(self.reqs, self.entries):
            kind, obj, buf = e
            if kind in (SEND, RECV) and obj.source == peer:
                keep_r.append(r)
                keep_e.append(self._failing_entry(kind, obj, buf, error))
            elif ((kind == MISMATCH and obj.source == peer)
                    or (kind == COLL and column is not None and peer in column)):
                obj.finish(error)
                orphans.append((r, buf))
            else:
                keep_r.append(r)
                keep_e.append(e)
        self.reqs, self.entries = keep_r, keep_e
        keep_orphans(orphans)

    def fail_all(self, error: Exception) -> None:
        """Every request ends with ``error``: sends and matched receives on callers'
        buffers stay (``FAILING``) until MPI completes them; MPI's other requests go to the
        orphans."""
        orphans, keep_r, keep_e = [], [], []
        for r, e in zip(self.reqs, self.entries):
            kind, obj, buf = e
            if kind in (SEND, RECV):
                keep_r.append(r)
                keep_e.append(self._failing_entry(kind, obj, buf, error))
            elif kind == FAILING:
                keep_r.append(r)
                keep_e.append(e)
            else:
                if isinstance(obj, Request):
                    obj.finish(error)
                orphans.append((r, buf))
        self.reqs, self.entries = keep_r, keep_e
        keep_orphans(orphans)

    def _failing_entry(self, kind: int, req: Request, buf: object, error: Exception) -> Entry:
        """The entry of a send or receive that fails with ``error`` once MPI has completed
        it (MPI owns ``buf``, the caller's), within ``CANCEL_GRACE``."""
        self.failing += 1
        self._owner.polling.wake()  # it completes it (or ends the job) if nobody waits
        return (FAILING, req, (kind, buf, error, time.monotonic() + CANCEL_GRACE))

    def check_failing(self) -> None:
        """End the job if MPI still owns a failed request's buffer past its grace (see
        ``end_job``)."""
        now = time.monotonic()
        for kind, obj, info in self.entries:
            if kind == FAILING and now > info[3]:
                self.end_job(obj, info[2])

    def end_job(self, req: Request, error: Exception) -> None:
        """MPI still owns ``req``'s buffer, and ``req`` must end (withdrawn or failed with
        ``error``). Never returns: say why on stderr and end the whole job with
        ``MPI_Abort`` on the transport's communicator.

        MPI cannot withdraw a matched receive or a started send; handing the buffer back
        would let MPI write into (or, for a send, read from) memory its caller owns again
        (a peer's receive could then complete with bytes written after the withdrawal: a
        silent wrong answer). No rank may complete a call with such bytes, so no rank goes
        on. (The transport layer has no flight recorder to dump: it imports nothing of
        the layers above.)
        """
        owner = self._owner
        peer = req.source
        what = (f"send to rank {peer}" if req.is_send else f"receive from rank {peer}")
        me = f"rank {owner.rank} of {self._label}, MPI rank {owner.world_ranks[owner.rank]}"
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
