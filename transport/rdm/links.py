"""Links: the rails between two processes, shared by every group that has both.

How it works
------------
A *link* is the set of ``rails`` TCP connections between two processes (rail ``i`` at
both ends). The first group of the pair that talks opens it (opening.py: dial, handshake,
crossing rules); every later group of the same two processes *joins* it in band instead of
opening connections of its own, so a process holds one set of rails per peer process, not
one per group and peer.

Each group keeps its own protocol endpoint (sequence numbers, acks, resends, buffer
ownership: protocol.py); the link only carries their frames. On a rail every frame is
preceded by an 8-byte prefix, the group's *context* (the first 8 bytes of its group id,
never 0), and the reader routes it by ``(context, destination rank)`` to the member that
is the group's rank at this end (``members``). Frames of a context that has no member here
(a group that left; late bytes) are read and dropped, without touching any buffer. With
frame authentication the rail's tags cover the prefix too (railmac.py), so a frame cannot
be moved to another group.

Context 0 carries the link's own 64-byte control blocks::

    off size field
      0   2  magic     b"NC"
      2   1  kind      JOIN (1) or LEAVE (2)
      3   1  zero      (where a frame header has its type: 0 is none)
      4   1  rail      the rail it was sent on
      5   3  zero
      8   4  src       the sender's rank in the group
     12   4  dst       the receiver's rank in the group
     16   8  context   the group
     24  32  proof     JOIN: HMAC-SHA256(group key, "join" | group | rail session key
                               | src | dst | rail)  (handshake.join_proof)
     56   8  zero

* **JOIN** (opening.py, ``RailOpening.on_join``): a group that wants rails to a peer whose
  process it already has a link to sends a JOIN on every rail of the link, proving with its
  own group's key that it is rank ``src`` of that group (the proof names the rail's session
  key, so it is worth nothing on another connection). The peer checks the proof with its
  group's key, that the link's other end is the process its group lists for ``src``, and
  answers with its own JOIN on each rail it has not sent one on (or with LEAVE, when that
  group is closed there: the joiner fails at once, as a refused dial would; a JOIN not
  answered within the handshake's 10 s fails like a stalled handshake). A rank uses the
  link for a group once it has sent and heard a JOIN on every rail: the peer's frames on a
  rail follow its JOIN on that rail, so nothing arrives for a member before it exists.
  When both ranks
  join at once on different links, or one joins while the other dials, the higher rank's
  choice wins (as when two ranks dial each other: handshake.py, ``CROSSED``).
* **LEAVE**: a group that closes, or fails its peer, while other groups still use the link
  sends LEAVE on every rail instead of closing the connections: for that group the peer
  treats it as the end of each rail (its requests fail as when a connection closes). The
  last group to leave closes the connections (a graceful close half-closes them first).

A rail that breaks is lost to every group on the link: each one's endpoint resends on its
remaining rails. While one rail is left, the process that dialed the link dials the lost
one again, with a growing pause (dialing.py, ``Healer``), and the peer takes the new
connection as that rail (its old one must have broken there too): every group's endpoint
then sends on it again. A rail closed because its bytes could not be trusted (a malformed,
corrupted or unauthenticated frame) is not dialed again. All of this runs under the process's one network lock (progress.py), so
frames of different groups never interleave on a rail and no lock order is needed. The
price: while one group streams bulk bytes to a peer, another group's small frames to the
same peer wait behind them in the sockets' buffers (measured in design.md, "Rails").
"""

from __future__ import annotations

import logging
import platform
import select
import socket
import struct
from collections import deque
from itertools import islice
from typing import TYPE_CHECKING

from . import frames as F
from .railmac import TAG as _MAC_TAG

if TYPE_CHECKING:
    from typing_extensions import TypeAlias

    from .driver import RdmTransport
    from .frames import Bytes
    from .progress import Progress
    from .railmac import RailMac

    # what a link to a peer's process matches (``RailOpening.link_key``): the addresses
    # at both ends, the number of rails, the frame authentication
    LinkKey: TypeAlias = tuple[tuple[str, ...], str, int, tuple[bool, bool]]

log = logging.getLogger("neuron_dist.rdm")

PREFIX = F.LINK_PREFIX  # bytes before every frame on a rail: the group's context
CONTROL = 0  # the context of the link's control blocks
JOIN, LEAVE = 1, 2
_CONTROL_MAGIC = b"NC"
_BLOCK = struct.Struct("!2sBBB3xIIQ32s8x")  # a control block (64 bytes, like a header)
assert _BLOCK.size == F.HEADER_SIZE
_ROUTE = struct.Struct("!Q12xI")  # the prefix's context and the header's dst (offset 12)
_WHOLE_MIN = PREFIX + F.HEADER_SIZE  # a frame may be whole in the read-ahead buffer
_ZERO_PREFIX = bytes(PREFIX)

_IN = select.EPOLLIN | select.EPOLLRDHUP
_OUT = select.EPOLLOUT
_HEADER, _PAYLOAD, _TRAILER, _ASIDE, _SKIP = range(5)  # what a rail is reading
CLEAN_EOF = "connection closed by the peer"
_IOV_MAX = 512
INBUF = 64 << 10  # a rail reads small frames in bulk into this much read-ahead ...
_DIRECT = 16 << 10  # ... and the rest of a payload from this size straight into place
# After a frame with a payload of INBUF or more, the next read ahead asks for this much only:
# the next frame is likely as large, and a full read ahead would take most of its payload
# into inbuf, to be copied again (docs/design.md, "Thresholds and why").
AHEAD_AFTER_LARGE = 8 << 10
_LOWAT = 256 << 10  # a payload read in place wakes its reader once this much (or all) is in
# One visit of the engine to a rail reads at most this much (the socket, still readable,
# is reported again at the next poll; visits for bulk bytes come after the others:
# progress.poll), so a sender that keeps one socket full cannot hold up every other rail of
# the process; a smaller cap costs bulk transfers more visits per byte, and writes are not
# capped: a message's tail leaves with its head (docs/design.md, "Rails").
_VISIT_BYTES = 1 << 20
_SKIP_BYTES = 64 << 10  # a dropped frame's bytes are read through this much scratch memory
_SCRATCH = memoryview(bytearray(_SKIP_BYTES))  # (written, never read: shared is fine)


def context_of(gid: bytes) -> int:
    """The context of group ``gid`` (handshake.group_id) on a rail: never ``CONTROL``."""
    return int.from_bytes(gid[:PREFIX], "big") or 1


def prefix_of(context: int) -> bytes:
    return context.to_bytes(PREFIX, "big")


def pack_block(kind: int, rail: int, src: int, dst: int, context: int,
               proof: bytes = bytes(32)) -> bytes:
    """A control block with its prefix, as it goes on rail ``rail``."""
    return _ZERO_PREFIX + _BLOCK.pack(_CONTROL_MAGIC, kind, 0, rail, src, dst, context, proof)


def unpack_block(block: Bytes) -> tuple[int, int, int, int, int, bytes]:
    """``(kind, rail, src, dst, context, proof)`` of a 64-byte control block.

    Raises
    ------
    FrameError
        Not a well-formed control block.
    """
    magic, kind, zero, rail, src, dst, context, proof = _BLOCK.unpack(bytes(block))
    if magic != _CONTROL_MAGIC or kind not in (JOIN, LEAVE) or zero or context == CONTROL:
        raise F.FrameError(f"malformed link control block (magic {magic!r}, kind {kind}, "
                           f"context {context})")
    return kind, rail, src, dst, context, proof


class Rail:
    """One connection of a link, with its reading state and its queue of bytes to write.

    ``reader`` and ``rpeer``: the member (transport) whose frame is being read, and the
    rank of this rail's far end in that member's group."""

    __slots__ = ("sock", "fd", "index", "link", "session", "out", "alive", "events", "stage",
                 "got", "hbuf", "hview", "header", "view", "buf", "inbuf", "lo", "hi", "mac",
                 "head", "lowat", "ahead", "reader", "rpeer", "skip")

    def __init__(self, sock: socket.socket, index: int, link: Link, session: bytes,
                 mac: RailMac | None = None):
        self.sock, self.fd, self.index, self.link = sock, sock.fileno(), index, link
        self.session = session  # the handshake's session key: JOIN proofs name it
        self.out: deque[memoryview] = deque()  # byte views still to write
        self.alive = True
        self.events = _IN
        self.mac = mac  # railmac.RailMac when frames are authenticated: headers carry a tag
        self.hbuf = bytearray(PREFIX + F.HEADER_SIZE + (_MAC_TAG if mac else 0))
        self.hview = memoryview(self.hbuf)
        self.head = self.hview[PREFIX:PREFIX + F.HEADER_SIZE]  # the frame's header proper
        self.stage, self.got = _HEADER, 0
        self.header: F.Header | None = None
        self.view = self.hview  # where the bytes of the current stage go
        self.buf: bytearray | None = None  # the frame read aside, or the trailer
        self.inbuf = memoryview(bytearray(INBUF))  # bytes read ahead: inbuf[lo:hi]
        self.ahead = self.inbuf  # what the next read ahead asks for
        self.lo = self.hi = 0
        self.lowat = 1  # the socket's SO_RCVLOWAT
        self.reader: RdmTransport | None = None
        self.rpeer, self.skip = -1, 0


class DeadRail:
    """Stands for the rails of a peer a transport has let go of (failed, or left)."""

    alive = False
    stage = _HEADER
    out = ()
    view = None
    sock = None


# (typed as a Rail: it stands in for one, and whoever meets it checks ``alive`` first)
DEAD: Rail = DeadRail()  # type: ignore[assignment]


class Link:
    """The rails to one peer process, and the groups (members) that use them here.

    ``members`` maps ``(context, rank here)`` to ``(transport, peer rank)``. ``key`` is what
    another group must match to join it (published in the engine once every rail is up:
    ``Progress.find_link``); None while it must not be joined."""

    def __init__(self, engine: Progress, nrails: int, label: str):
        self.engine = engine
        self.rails: list[Rail | None] = [None] * nrails
        # (context, rank here) -> (transport, peer rank)
        self.members: dict[tuple[int, int], tuple[RdmTransport, int]] = {}
        self.key: LinkKey | None = None
        self.label = label
        self.closing = False  # its last member is closing it: no new members
        self.closed = False
        self.dialer = False  # this process dialed its rails: it dials a lost one again
        self.untrusted: set[int] = set()  # rails closed for bytes not to be trusted: never again

    def reaches(self, key: LinkKey) -> bool:
        """Does this link go to the process a group with link key ``key`` names (the key
        its members compute for their peers: ``RailOpening.link_key``)?"""
        return any(t.opening.link_key(p) == key for t, p in self.members.values())

    def joinable(self, context: int) -> bool:
        """May a group (``context``) join this link now? (Not a group it carries already:
        one process has one rank per group, so that would be another process's rank.)"""
        return (not self.closing and not self.closed and bool(self.members)
                and all(r is not None and r.alive for r in self.rails)
                and all(c != context for c, _ in self.members))

    # -------------------------------------------------------------- engine handler

    def in_bulk(self, rail: Rail, mask: int) -> bool:
        """Is the engine's visit to ``rail`` for bulk bytes (a payload being read in place,
        or only writing)? Those visits come after the others (progress.poll)."""
        return rail.stage == _PAYLOAD or not mask & ~_OUT

    def on_ready(self, rail: Rail, mask: int) -> None:
        """The engine saw ``rail`` readable or writable: read and write what it can."""
        with self.engine.lock:
            if not rail.alive:
                return
            if mask & _OUT:
                self.flush(rail)
            if mask & ~_OUT and rail.alive:
                touched: set[RdmTransport] = set()
                try:
                    self.read(rail, touched)
                except OSError as e:
                    self.rail_down(rail, str(e) or type(e).__name__)
                except Exception as e:  # noqa: BLE001 - never a rail that dies unnoticed
                    log.exception("neuron %s: reading rail %d failed", self.label, rail.index)
                    self.rail_down(rail, f"reader failed: {type(e).__name__}: {e}")
                for t in touched:  # (the members that took frames and have work left)
                    if not t.closed:
                        t.wire.pump()

    # -------------------------------------------------------------- reading

    def read(self, rail: Rail, touched: set[RdmTransport]) -> None:
        """Under the lock: take in what ``rail``'s socket has, frame by frame (each one goes
        to its member: ``advance``; the members that got frames are added to ``touched``).

        Small frames arrive in bulk: one ``recv`` fills the read-ahead buffer with as many
        as the socket holds, and they are cut from it. The rest of a payload of ``_DIRECT``
        bytes or more is read straight into its place. A read that returns less than it
        asked for emptied the socket: stop there (epoll says when more comes); so does a
        visit that has read ``_VISIT_BYTES`` (epoll reports the socket again).

        A frame that starts in the read-ahead buffer is first offered whole to its member
        (``Wire.take_whole``: a small message, landed and delivered in one step,
        header unread by this link); what it declines is read stage by stage (``advance``).
        """
        sock, inbuf, hview = rail.sock, rail.inbuf, rail.hview
        whole = rail.mac is None  # (frames with tags take the general path)
        members = self.members
        drained = False
        budget = _VISIT_BYTES
        while rail.alive:
            view = rail.view
            need = view.nbytes - rail.got
            if need:
                have = rail.hi - rail.lo
                if have:
                    if whole and view is hview and have >= _WHOLE_MIN and not rail.got:
                        # A frame starts here: its member may take it whole in one step.
                        lo = rail.lo
                        member = members.get(_ROUTE.unpack_from(inbuf, lo))
                        if member is not None:
                            end = member[0].wire.take_whole(rail, member[1], inbuf, lo, rail.hi,
                                                        touched)
                            if end:
                                rail.lo = end
                                rail.ahead = inbuf  # (it was small)
                                continue
                    k = have if have < need else need
                    lo = rail.lo
                    view[rail.got:rail.got + k] = inbuf[lo:lo + k]
                    rail.lo = lo + k
                    rail.got += k
                    if k < need:
                        continue
                elif drained:
                    return
                elif budget <= 0:  # more to read: the engine reports the rail again
                    if rail.lowat != 1:
                        wake_at(rail, 1)  # (what is left may be less than the old mark)
                    return
                else:
                    direct = need >= _DIRECT
                    if not direct and rail.lowat != 1:
                        wake_at(rail, 1)  # a header wakes the reader at once
                    want = need if need < budget else budget
                    try:
                        n = sock.recv_into(view[rail.got:rail.got + want] if direct
                                           else rail.ahead)
                    except (BlockingIOError, InterruptedError):
                        if direct and _RCVLOWAT_SIZES_BUFFER:
                            wake_at(rail, min(need, _LOWAT))
                        return
                    budget -= n
                    if n == 0:
                        raise ConnectionError(
                            f"{CLEAN_EOF} ({rail.got} of {view.nbytes} bytes of a frame read)"
                            if rail.got or rail.stage else CLEAN_EOF)
                    if direct:
                        rail.got += n
                        drained = n < want
                        if drained and _RCVLOWAT_SIZES_BUFFER:
                            wake_at(rail, min(need - n, _LOWAT))
                    else:
                        rail.lo, rail.hi = 0, n
                        drained = n < rail.ahead.nbytes
                    continue
            self.advance(rail, touched)

    def advance(self, rail: Rail, touched: set[RdmTransport]) -> None:
        """Under the lock: the current stage of ``rail``'s frame is read; go to the next.
        A header (after its tag, with authentication) names the frame's member: the rest
        of the frame is that member's (``Wire.on_header``, ``on_stage``)."""
        stage = rail.stage
        if stage == _HEADER:
            if rail.mac is not None:
                try:
                    rail.mac.check_header(rail.hbuf)
                except F.FrameError as e:
                    log.error("neuron %s: closing rail %d: %s", self.label, rail.index, e)
                    self.rail_down(rail, f"unauthenticated frame: {e}", heal=False)
                    return
            context, dst = _ROUTE.unpack_from(rail.hbuf)
            if context == CONTROL:
                stage_to(rail, _HEADER, rail.hview)
                self.control(rail)
                return
            member = self.members.get((context, dst))
            if member is None:  # a group that left (its late frames), or never joined
                self._skip(rail)
                return
            t, rail.rpeer = member
            rail.reader = t
            touched.add(t)
            t.wire.on_header(rail)
            return
        if stage == _SKIP:
            rail.skip -= rail.view.nbytes
            if rail.skip:
                stage_to(rail, _SKIP, _SCRATCH[:min(rail.skip, _SKIP_BYTES)])
            else:
                stage_to(rail, _HEADER, rail.hview)
            return
        # (past a header: the rail has a reader until its frame is read)
        touched.add(rail.reader)  # type: ignore[arg-type]
        rail.reader.wire.on_stage(rail)  # type: ignore[union-attr]

    def _skip(self, rail: Rail) -> None:
        """Under the lock: read the frame whose header is in ``rail.hbuf`` and drop it."""
        try:
            h = F.decode_header(rail.head)
        except F.FrameError as e:
            log.error("neuron %s: closing rail %d after a malformed frame: %s", self.label,
                      rail.index, e)
            self.rail_down(rail, f"malformed frame: {e}", heal=False)
            return
        tail = _MAC_TAG if rail.mac is not None and rail.mac.tail(h.type, h.nacks) else 0
        log.debug("neuron %s: dropped a frame on rail %d for a group not here", self.label,
                  rail.index)
        rail.skip = h.length + h.trailer_bytes + tail
        rail.reader = None
        if rail.skip:
            stage_to(rail, _SKIP, _SCRATCH[:min(rail.skip, _SKIP_BYTES)])
        else:
            stage_to(rail, _HEADER, rail.hview)

    # -------------------------------------------------------------- writing

    def flush(self, rail: Rail) -> None:
        """Under the lock: write what ``rail``'s socket takes now; wait for it to be
        writable for the rest."""
        out = rail.out
        while out and rail.alive:
            chunk = list(islice(out, _IOV_MAX)) if len(out) > 1 else [out[0]]
            try:
                sent = _send_some(rail.sock, chunk)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self.rail_down(rail, f"send failed: {e}")
                return
            while sent:
                v = out[0]
                if sent >= v.nbytes:
                    sent -= v.nbytes
                    out.popleft()
                else:
                    out[0] = v[sent:]
                    sent = 0
        want = _IN | _OUT if out else _IN
        if want != rail.events and rail.alive:
            rail.events = want
            self.engine.modify(rail.fd, want)
            if out:
                self.engine.kick()  # bytes wait behind a full socket

    def send_frame(self, rail: Rail, views: list[Bytes], nbytes: int) -> None:
        """Under the lock: put one frame, the byte views ``views`` (``nbytes`` in all), on
        ``rail``: written now as far as the socket takes it when nothing waits there, the
        rest queued behind what does (``flush``). Dropped on a rail that is down (the
        endpoint resends it elsewhere)."""
        if not rail.alive:
            return
        sent = 0
        if not rail.out:
            try:
                sent = _send_some(rail.sock, views)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                self.rail_down(rail, f"send failed: {e}")
                return
            if sent == nbytes:
                return
        out = rail.out
        for v in views:
            v = memoryview(v).cast("B")
            if sent >= v.nbytes:
                sent -= v.nbytes
                continue
            out.append(v[sent:] if sent else v)
            sent = 0
        if not rail.events & _OUT:
            self.flush(rail)

    def send_block(self, rail: Rail, kind: int, src: int, dst: int, context: int,
                   proof: bytes = bytes(32)) -> None:
        """Under the lock: queue a control block on ``rail`` (after what waits there)."""
        if not rail.alive:
            return
        block = pack_block(kind, rail.index, src, dst, context, proof)
        if rail.mac is not None:
            block = rail.mac.seal_block(block)
        rail.out.append(memoryview(block))
        if not rail.events & _OUT:
            self.flush(rail)

    # -------------------------------------------------------------- membership

    def add(self, context: int, rank: int, transport: RdmTransport, peer: int) -> None:
        self.members[(context, rank)] = (transport, peer)

    def remove(self, context: int, rank: int, transport: RdmTransport) -> None:
        """Under the lock: ``transport`` no longer uses this link; the last one to go closes
        the connections (a graceful close has half-closed them already)."""
        m = self.members.get((context, rank))
        if m is not None and m[0] is transport:
            del self.members[(context, rank)]
        if not self.members:
            self.close()

    def close(self) -> None:
        """Under the lock: close every rail for good."""
        self.closed = True
        self.engine.unpublish(self)
        for rail in self.rails:
            if rail is not None:
                self.drop(rail)

    def drop(self, rail: Rail) -> None:
        """Under the lock: close ``rail``'s connection."""
        if rail.fd < 0:
            return
        rail.alive = False
        rail.out.clear()
        self.engine.unregister(rail.fd)
        try:
            rail.sock.close()
        except OSError:
            pass
        rail.fd = -1

    def rail_down(self, rail: Rail, reason: str, heal: bool = True) -> None:
        """Under the lock: ``rail`` broke (or, ``heal`` False, must not be trusted any more):
        close it; every member loses it (its traffic moves to the member's other rails).
        With ``heal``, a dialer whose link keeps a live rail dials this one again."""
        if not rail.alive:
            return
        claimed = rail.reader if rail.stage in (_PAYLOAD, _TRAILER) else None
        self.drop(rail)
        self.engine.unpublish(self)
        if not heal:
            self.untrusted.add(rail.index)
        for t, peer in list(self.members.values()):
            t.rail_lost(rail, peer, reason, t is claimed)
        if heal and self.dialer and self.healable():
            t, peer = next(iter(self.members.values()))
            t.opening.heal(self, peer, rail.index)

    def healable(self) -> bool:
        """Is this link one whose lost rails are worth dialing again: in use, not closing,
        opened whole once, and with a live rail left (without one its peer has failed)?"""
        return (not self.closing and not self.closed and bool(self.members)
                and None not in self.rails and any(r is not None and r.alive for r in self.rails))

    def control(self, rail: Rail) -> None:
        """Under the lock: act on the control block just read on ``rail``."""
        try:
            kind, index, src, dst, context, proof = unpack_block(rail.head)
            if index != rail.index:
                raise F.FrameError(f"a control block for rail {index} came on rail {rail.index}")
        except F.FrameError as e:
            log.error("neuron %s: closing rail %d: %s", self.label, rail.index, e)
            self.rail_down(rail, str(e), heal=False)
            return
        if kind == JOIN:
            t = self.engine.resolve_context(context, dst)
            if t is None:  # (closed already): the joiner fails at once, as a dial would
                log.info("neuron %s: a JOIN on rail %d for a group this process does not have "
                         "(closed already?)", self.label, rail.index)
                self.send_block(rail, LEAVE, dst, src, context)
                return
            t.opening.on_join(self, rail, src, proof)
        else:
            m = self.members.get((context, dst))
            if m is not None and m[1] == src:
                m[0].opening.on_leave(self, rail, src)



def stage_to(rail: Rail, stage: int, view: memoryview) -> None:
    """``rail`` reads ``view`` next, as stage ``stage``."""
    rail.stage, rail.view, rail.got = stage, view, 0


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        found = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
    except ValueError:
        return False
    return found >= (major, minor)


# From Linux 4.18 on, raising SO_RCVLOWAT also grows the socket's receive buffer to hold
# that much (tcp_set_rcvlowat), so a reader that waits for it cannot stall the sender.
_RCVLOWAT_SIZES_BUFFER = _kernel_at_least(4, 18)


def wake_at(rail: Rail, nbytes: int) -> None:
    """Make epoll call ``rail`` readable only once ``nbytes`` are in (or the peer closes)."""
    if nbytes != rail.lowat:
        rail.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
        rail.lowat = nbytes


# One non-blocking scatter-gather write, ``_send_some(sock, views)``: the bytes the socket
# took. (The socket's own method, called as a function: tests replace it to hold writes.)
_send_some = socket.socket.sendmsg
