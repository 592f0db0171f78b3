"""Matching a transport's receives with the messages MPI holds, and the tags they travel on.

How it works
------------
*Matching.* Messages are not received with ``MPI_Irecv`` but matched with ``MPI_Improbe``
and received with ``MPI_Imrecv``: the probe gives the message's size before a byte lands,
so a receive whose buffer is not exactly the message's size fails with
``MessageSizeMismatch`` naming both sizes and carrying the message (it is consumed into
scratch memory; MPI never reports a truncation) and the next receive of that ``(peer,
tag)`` gets the next message. Only the head of each ``(peer, tag)`` queue of posted
receives is probed, and MPI matches messages of one ``(source, tag, communicator)`` in send
order, so receives match sends in order. A message sent before its receive is posted waits
in MPI's own unexpected-message queue (a large one as a rendezvous request: its payload
moves once, straight into the receive buffer). A receive from any rank probes with
``MPI_ANY_SOURCE``, which yields the earliest message of the tag; a message whose source
has a named receive waiting goes to that receive instead (named receives are matched
first in every poll, too), as in the rdm transport.

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

Abort notices (``abort_tag``) are read here too, with the notes (``read_control``).
Everything here runs under the transport's lock.
"""

from __future__ import annotations

import logging
import struct
from collections import deque
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..errors import ABORTED, PeerAborted, TransportError
from ..matching import PostedReceives
from .active import MISMATCH, NOTE_SEND, RECV

if TYPE_CHECKING:
    from mpi4py.MPI import Intracomm

    from .active import Active
    from .driver import MpiTransport
    from .request import Request

log = logging.getLogger("neuron_dist.mpi")

_NOTE = struct.Struct("!QQ")         # a sender's note: (transport tag, MPI tag)


class Matcher:
    """The posted receives of ``owner`` (``recvq`` by ``(peer, tag)``, ``anyq`` by tag),
    matched with MPI's messages on ``comm``, and the tag notes both ways. Matched receives
    and sent notes go to ``active``; a peer's abort notice fails it (``owner.fail_peer``).
    """

    def __init__(self, owner: MpiTransport, MPI: ModuleType, comm: Intracomm,
                 active: Active, label: str, stats: dict[str, int]):
        self._owner, self._MPI, self._comm, self._active = owner, MPI, comm, active
        self._label, self._stats = label, stats
        self._status = MPI.Status()
        tag_ub = int(comm.Get_attr(MPI.TAG_UB))  # type: ignore[arg-type]  # (always set)
        self.tag_ub = tag_ub
        self._direct = (tag_ub + 1) // 2          # [0, direct): tags as they are
        self.abort_tag, self.hello_tag, self._note_tag = tag_ub, tag_ub - 1, tag_ub - 2
        self.modulus = tag_ub - 3 - self._direct + 1  # [direct, tag_ub - 3]: larger tags
        # the posted, unmatched receives (transport/matching.py): ``recvq`` by (peer, tag),
        # ``anyq`` by tag, its queues
        self.posted: PostedReceives[Request] = PostedReceives()
        self.recvq, self.anyq = self.posted.named, self.posted.any
        self._sent_notes: dict[int, dict[int, int]] = {}  # peer -> {mpi tag: tag} announced to it
        self._notes: dict[int, dict[int, int]] = {}  # peer -> {mpi tag: tag} it announced to us

    # ------------------------------------------------------------------ tags

    def mpi_tag(self, tag: int) -> int:
        if tag < self._direct:
            return tag
        return self._direct + (tag - self._direct) % self.modulus

    def send_tag(self, peer: int, tag: int) -> int:
        """Under the lock: the MPI tag of ``tag``; notes a large tag's first use per peer."""
        mpi_tag = self.mpi_tag(tag)
        if mpi_tag == tag:
            return tag
        sent = self._sent_notes.setdefault(peer, {})
        owner = sent.get(mpi_tag)
        if owner is None:
            sent[mpi_tag] = tag
            note = bytearray(_NOTE.pack(tag, mpi_tag))
            self._active.add(self._comm.Isend([note, self._MPI.BYTE], peer, self._note_tag),
                      NOTE_SEND, peer, note)
            self._stats["notes_sent"] += 1
        elif owner != tag:
            raise TransportError(f"{self._label}: tags {owner} and {tag} would share MPI tag "
                                 f"{mpi_tag} towards rank {peer}; use tags that are not "
                                 f"{self.modulus} apart")
        return mpi_tag

    # ------------------------------------------------------------------ matching

    def read_control(self) -> None:
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
            msg = comm.Improbe(MPI.ANY_SOURCE, self.abort_tag, st)
            if msg is None:
                break
            src, box = st.Get_source(), bytearray(st.Get_count(MPI.BYTE))
            msg.Recv([box, MPI.BYTE])
            self._stats["aborts_received"] += 1
            kind = box[0] if box else ABORTED
            error = PeerAborted(src, bytes(box[1:]).decode("utf-8", "replace"), kind,
                                network=True)
            log.info("neuron %s: %s", self._label, error)
            self._owner.fail_peer(src, error)

    def _announced(self, src: int, tag: int) -> bool | int | None:
        """True if ``src`` announced ``tag`` on its MPI tag, None if not yet, else the
        other tag it announced there."""
        mpi_tag = self.mpi_tag(tag)
        if mpi_tag == tag:
            return True
        owner = self._notes.get(src, {}).get(mpi_tag)
        return None if owner is None else (True if owner == tag else owner)

    def _conflict(self, src: int, tag: int, other: int) -> TransportError:
        return TransportError(f"{self._label}: rank {src} sends tag {other} on MPI tag "
                              f"{self.mpi_tag(tag)}, which a receive of tag {tag} would "
                              f"take; use tags that are not {self.modulus} apart")

    def match(self, key: tuple[int, int], q: deque[Request]) -> bool:
        """Under the lock: match the receives queued on ``key`` with arrived messages."""
        peer, tag = key
        ok = self._announced(peer, tag)
        if ok is None:
            return False  # the peer's note is on its way
        if ok is not True:
            error = self._conflict(peer, tag, ok)
            for req in q:
                req.finish(error)
            del self.recvq[key]
            return True
        mpi_tag, status, progressed = self.mpi_tag(tag), self._status, False
        while q:
            msg = self._comm.Improbe(peer, mpi_tag, status)
            if msg is None:
                break
            self._take(msg, q.popleft(), peer)
            progressed = True
        if not q:
            del self.recvq[key]
        return progressed

    def match_any(self, tag: int, q: deque[Request]) -> bool:
        """Under the lock: match the receives from any rank queued on ``tag``."""
        MPI, st, comm = self._MPI, self._status, self._comm
        mpi_tag, progressed = self.mpi_tag(tag), False
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
                        req.finish(error)
                    q.clear()
                    break
                msg = comm.Improbe(src, mpi_tag, st)  # the same message: src's first one
            # (a receive naming the source goes first; q has one: not None)
            self._take(msg, self.posted.next_for(src, tag), src)  # type: ignore[arg-type]
            progressed = True
        if not q:
            self.anyq.pop(tag, None)
        return progressed

    def _take(self, msg: Any, req: Request, src: int) -> None:
        """Under the lock: receive the probed message ``msg`` (size in the status) for ``req``."""
        MPI = self._MPI
        n = self._status.Get_count(MPI.BYTE)
        req.source = src
        if n == req.nbytes:
            self._active.add(msg.Irecv([req.buf, MPI.BYTE]), RECV, req, req.buf)
            return
        scratch = bytearray(n)  # the request fails with the message once it is in
        self._active.add(msg.Irecv([scratch, MPI.BYTE]), MISMATCH, req, scratch)
        self._stats["size_mismatches"] += 1

    def match_all(self) -> bool:
        """Match every queue of posted receives with what MPI holds; True if any matched."""
        progressed = False
        for key in list(self.recvq):
            q = self.recvq.get(key)
            if q and self.match(key, q):
                progressed = True
        for tag in list(self.anyq):
            q = self.anyq.get(tag)
            if q and self.match_any(tag, q):
                progressed = True
        return progressed

    def fail_peer(self, peer: int, error: Exception) -> None:
        """The receives naming ``peer`` fail with ``error`` (MPI has not matched them)."""
        for req in self.posted.take_peer(peer):
            req.finish(error)

    def fail_any(self, error: Exception) -> None:
        """The receives from any rank fail with ``error`` (nobody is left to send)."""
        for req in self.posted.take_any():
            req.finish(error)

    def fail_all(self, error: Exception) -> None:
        """Every posted receive fails with ``error``."""
        for req in self.posted.take_all():
            req.finish(error)
