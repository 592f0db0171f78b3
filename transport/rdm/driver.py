"""Socket driver of the rdm transport: N authenticated TCP rails per pair of ranks.

How it works
------------
Every process listens on one TCP socket per interface address (port 0; listener.py),
shared by all its groups, and a rank publishes ``host:port`` for each of its groups.
Connections are opened on first use: the first time a rank sends to a peer, it dials it
``rails`` times (``_open_rails``); each connection is authenticated for its group
(handshake.py) and becomes rail ``i`` of that pair at both ends, carrying traffic both
ways. So a rank holds connections only to the ranks it talks to: in a group that spans
nodes, its counterparts on the other nodes, not every rank (4 rails to each of 63 peers
would be 252 descriptors per group on 8 nodes of 8). When two ranks dial each other at
once, the higher rank's rails are kept and the lower rank waits for them (the listener
answers its dial with ``Crossed``). The rails of a pair of processes are shared by all
their groups (links.py): a group whose process already has rails to the peer's process
joins them with an authenticated JOIN instead of dialing, and one that closes while
others still use them sends LEAVE instead of closing the connections. All protocol logic
lives in the sans-I/O ``protocol.Endpoint`` (one per group); this module only moves its
frames, under the process's network lock (progress.NET_LOCK).

Rails are non-blocking sockets in the process's one progress engine (progress.py), which
every transport (every group) of the process shares. There are no reader or writer
threads: a thread that waits for a request drives the engine itself, so the bytes that
complete its request are read by the thread that wants them, and the engine's background
thread drives it only while nobody waits.

* **Reading** is a small state machine per rail (links.py), fed with whatever the socket
  has: the 8-byte prefix naming the frame's group and its 64-byte header (validated before
  anything else is read: ``frames.decode_header``, by that group's transport), then
  the payload, read straight into the place ``Endpoint.data_target`` gives (the posted
  receive buffer or the message's reassembly buffer, claimed for this rail until it
  lands: see "Buffer ownership" in protocol.py), so large messages are copied once, by
  the kernel; then the acks riding behind it, if any. While such a payload is still
  coming, the rail's ``SO_RCVLOWAT`` is raised to what is left of it (at most links.py's
  ``_LOWAT``), so epoll wakes the reader once per 256 KiB instead of for every few
  packets, which saves CPU on large messages (docs/design.md, "Thresholds and why"); it
  drops back to 1 byte for the next header. A frame found whole in the read-ahead
  buffer (prefix, header, payload and acks from one ``recv``) is first offered, before its
  header is even copied out, to ``_take_whole``: ``Endpoint.take_whole`` checks it,
  copies a one-segment message that is next in its stream into its posted receive (or a
  private copy) and hands back the delivery, and the receive waiting for it completes
  right there, with no event in between (the path of almost every small message). ACKs,
  duplicates and odd frames are read aside and go through ``Endpoint.receive``. Once the
  socket has nothing more, the acks of everything just read go out in one frame. A header
  that fails validation means the byte stream cannot be trusted any more: the rail is
  closed (and logged); its unacknowledged segments are resent on the other rails.
* **Writing**: frames go out as soon as the endpoint hands them over, with one
  scatter-gather ``sendmsg`` (header + a view of the user's buffer: no copy); what the
  socket does not take waits in the rail's queue until the engine sees it writable. A
  small send (``isend``) is framed by ``Endpoint.send_now`` and written by
  ``Link.send_frame`` in the same call, when nothing waits to go to the peer before it.
* **Timers**: the engine calls ``poll_transmit`` at the endpoint's next deadline (a
  retransmission, or acks held for ``ack_delay`` that found no DATA frame to ride on).

A rail whose connection breaks is reported to the endpoint (``rail_failed``): nothing is
lost while one rail to the peer is left; when the last one goes, every request to or from
that peer fails with ``PeerUnreachable`` naming it. Rails heal (``_heal``): while the link
keeps a live rail, the process that dialed it dials the lost one again from a thread of
its own, after a pause that doubles with every failed attempt (``_HEAL_PAUSE`` up to
``_HEAL_PAUSE_MAX``, with jitter); the peer's listener grants that dial only for a rail it
has lost too (``_may_dial``), and the new connection takes the old one's place for every
group on the link (``_add_rail``: ``Endpoint.rail_restored``). So a link that flaps keeps
its rails, instead of running down to its last one. A rail closed because its bytes could
not be trusted (malformed, corrupted, unauthenticated) is not dialed again by the end that
closed it, nor granted again to the other end.

Requests: ``isend``/``irecv`` return a ``Request``; ``wait(deadline)`` raises
``PeerTimeout`` naming the peer when the deadline passes; ``cancel`` withdraws one (a
payload being read into its buffer is diverted to scratch memory at once, queued frames
referring to a send's buffer are copied). Receives match sends per ``(peer, tag)`` in
order; a message that arrives before its receive is posted is kept (by the endpoint,
within its memory limit) until it is. A message larger than both its receive's buffer and
that limit is refused (protocol.py, "Refusal"): the receive and the send both fail with
``MessageSizeMismatch`` within a round trip, and the stream goes on with the next message.
Nothing here imports torch.
"""

from __future__ import annotations

import errno
import logging
import math
import random
import socket
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Sequence

from ..base import ClaimableRequest, SharedAnySource
from ..errors import (ABORTED, ABORTED_TIMEOUT, ChannelClosed, Claimed, MessageSizeMismatch,
                      PeerAborted, PeerTimeout, PeerUnreachable)
from ..requests import TIMEOUT_GRACE, Request as _Request
from . import frames as F
from . import handshake, links, progress
from .links import (_ASIDE, _HEADER, _OUT, _PAYLOAD, _TRAILER, AHEAD_AFTER_LARGE, CLEAN_EOF,
                    DEAD, INBUF, JOIN, LEAVE, Link, Rail, stage_to)
from .railmac import TAG as _MAC_TAG, RailMac
from .listener import HANDSHAKE_TIMEOUT
from .protocol import (DELAYED_ACK_BYTES, Endpoint, FrameRejected, MessageReceived,
                       MessageRefused, PeerFailed, SendCompleted, SendRefused, Transmit)

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from ..base import NetRequest
    from .frames import Bytes
    from .links import LinkKey

log = logging.getLogger("neuron_dist.rdm")

# Sends up to this size are copied and complete at once (isend). A message costs some
# 100 µs of Python on each side and a warm copy of this size a few µs, so up to here
# copying is cheaper than holding the caller until the ack comes. Larger sends keep using
# the caller's buffer: made eager, a stream of them is slower, since the copies cost more
# and fill the eager window (docs/design.md, "Thresholds and why").
EAGER_BYTES = DELAYED_ACK_BYTES
# How long the ack of an eager message may wait for a DATA frame to ride on (protocol.py,
# "Delayed acks"; at most DELAYED_ACK_HELD_BYTES of messages wait). The ranks of a
# collective exchange one message per peer and call: an ack that waits longer than the gap
# between two calls rides on the next call's message instead of costing a frame and a
# wake-up at both ends. The delay is long so that this holds even when many ranks share
# few cores and one call takes milliseconds (docs/design.md, "Thresholds and why").
ACK_DELAY = 0.1
_SMALL_COPY = 512  # eager copies up to this size come from Python's small-object allocator
_HEAD = links.PREFIX + F.HEADER_SIZE  # a frame's bytes on a rail before its payload
# Eager sends complete at once while less than this (or the send window, if smaller) waits
# unacknowledged to their peer; beyond it they wait for their acks like large ones. It bounds
# the copies a sender that runs ahead holds per peer, apart from the send window, which only
# bounds how much of the callers' own buffers is in flight. The send window
# (``window_bytes``) is larger: with 32 MiB of 8 MiB segments unacknowledged, a 64 MiB
# message stops halfway until the first acks come back (docs/design.md, "Thresholds and
# why").
EAGER_WINDOW_BYTES = 32 << 20
ABORT_TAG = (1 << 62) + 1  # a rank failed the group: [kind byte | reason] (see abort())
_DIALING, _ACCEPTING, _JOINING = "dialing", "accepting", "joining"  # how a peer's rails open
_REFUSED_RETRY = 2.0  # seconds a dial retries a refused connection (a listener starting)
# Pauses before dialing again after a dropped handshake: from the first, doubling up to the
# last (with jitter, so dialers shed together do not come back together).
_DROPPED_PAUSE, _DROPPED_PAUSE_MAX = 0.01, 0.5
# Pauses before dialing a lost rail again (``_heal``): the first lets the peer see the
# break too (it grants a rail it still holds to nobody), then doubling up to the last for
# as long as the link keeps another live rail. One attempt (connect and handshake) may take
# _HEAL_DIAL_SECONDS: a close waits that long at most for a healer in the middle of one.
_HEAL_PAUSE, _HEAL_PAUSE_MAX, _HEAL_DIAL_SECONDS = 0.05, 5.0, 2.0


class _Join:
    """A group joining a link to one peer (links.py): the rails it has sent its JOIN on and
    heard the peer's on."""

    __slots__ = ("link", "sent", "heard", "deadline")

    def __init__(self, link: Link):
        self.link = link
        self.sent: set[int] = set()
        self.heard: set[int] = set()
        # A live process answers at once (its engine reads rails at least every 100 ms
        # while nobody waits): like a dial's handshake, a join has HANDSHAKE_TIMEOUT.
        self.deadline = time.monotonic() + HANDSHAKE_TIMEOUT


class _CopyPool:
    """Buffers for the copies of eager sends, reused once their message is acknowledged.

    A fresh copy costs several times a reused one when the allocator has handed freed
    memory back to the kernel in between (page faults). A copy comes back when its
    message is acknowledged, and is reused only if no frame refers to it any more (a
    resend still queued on a rail holds a view of it: a bytearray with live views cannot
    change size, which is how that is checked). Holds at most ``limit`` bytes: the
    transport makes it its eager window (``EAGER_WINDOW_BYTES``), as many bytes of copies
    as can be unacknowledged at once, so a stream of eager sends finds its copies here
    instead of dropping half of them when acknowledgements come back in a batch and
    allocating them again. What it saves is allocations; the time per message of such a
    stream varies more from run to run than they cost (docs/design.md, "Thresholds and
    why"). It keeps only copies that were in flight together: at most what the busiest
    moment of the stream held.
    """

    def __init__(self, limit: int):
        self._free: dict[int, list[bytearray]] = {}  # size class -> [bytearray]
        self._bytes, self._limit = 0, limit

    def take(self, n: int) -> bytearray:
        size = 1 << max(10, (n - 1).bit_length())
        free = self._free.get(size)
        if free:
            self._bytes -= size
            return free.pop()
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        size = len(buf)
        if self._bytes + size > self._limit:
            return
        try:
            buf.append(0)
        except BufferError:
            return  # still referred to: let it go
        buf.pop()
        self._free.setdefault(size, []).append(buf)
        self._bytes += size




class Request(_Request, ClaimableRequest):
    """A pending ``isend``, ``irecv`` or ``irecv_any`` (see transport/requests.py).

    Waiting drives the process's progress engine from the waiting thread. ``claim``: see
    ``RdmTransport.irecv_any``."""

    __slots__ = ("_owner", "claim")

    def __init__(self, peer: int | None, tag: int, buf: memoryview, is_send: bool,
                 owner: RdmTransport):
        super().__init__(peer, tag, buf, is_send, owner._engine.callbacks)
        self._owner = owner
        self.claim: Callable[[], bool] | None = None

    def on_complete(self, callback: Callable[[_Request], object]) -> None:
        super().on_complete(callback)
        if not self._event.is_set():
            self._owner._engine.kick()  # someone waits for it without driving

    def wait(self, deadline: float) -> None:
        event = self._event
        if not event._set and self.callback is None:
            # (the usual wait, in one step: no callback to run on the way out)
            start = time.monotonic()
            owner = self._owner
            if (not owner._engine.drive(event.is_set, deadline, event, owner.spin)
                    and not self._block(time.monotonic() + TIMEOUT_GRACE)):
                raise self._timed_out(deadline, start)
        elif not event._set:
            super().wait(deadline)
            return
        if self.error is not None:
            raise self.error

    def _block(self, deadline: float) -> bool:
        event = self._event
        self._waiting.append(None)
        try:
            owner = self._owner
            owner._engine.drive(event.is_set, deadline, event, owner.spin)
        finally:
            self._waiting.pop()
        done = event.is_set()
        if done and self.callback is not None and self._sink is not None:
            self._run_callback()
        return done


class RdmTransport(SharedAnySource):
    """Reliable tagged messages to the other ranks of a group, over N TCP rails per peer
    (``base.NetTransport``; a receive from any rank may be shared with shared memory:
    ``base.SharedAnySource``).

    Parameters
    ----------
    rank, world_size : int
        This rank and the group size (ranks are group ranks).
    host : str or list of str
        Address(es) to listen on, one per interface (never a wildcard). With several,
        rail ``i`` runs between the peers' addresses ``i % n`` (the interfaces take the
        rails in turn), so losing one interface loses only its rails.
    rails : int
        Connections per peer.
    key, group : bytes
        Job secret and group nonce for the handshake.
    segment_bytes, window_bytes : int
        Largest DATA payload, unacknowledged bytes allowed per peer.
    crc : bool
        CRC-32 on every frame (end-to-end check on top of TCP's).
    frame_mac, payload_mac : bool
        Authenticate every frame's header and acks with the rail's session key
        (railmac.py); ``payload_mac`` also its payload (implies ``frame_mac``).
    max_unexpected_bytes : int
        Memory per peer for messages that arrive before their receive is posted
        (``Endpoint``'s ``max_reassembly_bytes``); beyond it the peer is held back.
    link_timeout : float
        Seconds a rail may hold bytes the peer's TCP has not acknowledged
        (``TCP_USER_TIMEOUT``) before it is declared broken and its traffic moves to
        the other rails: a lost link or interface, not a slow peer (whose kernel still
        acknowledges).
    label : str
        Names the group in log messages.
    """

    column = None  # no collectives of its own (transport/base.py)

    def __init__(self, rank: int, world_size: int, *, host: str, rails: int, key: bytes,
                 group: bytes, segment_bytes: int = 1 << 20, window_bytes: int = 128 << 20,
                 crc: bool = False, rto: float = 5.0, ack_delay: float = ACK_DELAY,
                 max_unexpected_bytes: int = 512 << 20, link_timeout: float = 10.0,
                 label: str = "", frame_mac: bool = False, payload_mac: bool = False,
                 spin: int = 500, port_range: tuple[int, int] | None = None):
        self.rank, self.world_size, self.nrails = rank, world_size, rails
        self.spin = spin  # polls a waiting thread makes before it yields (progress.drive)
        self.segment_bytes = segment_bytes
        self._key, self._group, self._label = key, group, label or f"rank {rank}"
        self._mac = (frame_mac or payload_mac, payload_mac)
        self.ep = Endpoint(rank, world_size, rails, segment_bytes, 1 << 48, rto=rto,
                           max_rto=max(rto, 30.0), max_retries=6, window_bytes=window_bytes,
                           max_reassembly_bytes=max_unexpected_bytes, crc=crc,
                           ack_delay=ack_delay, notice_tags=(ABORT_TAG,))
        self._max_payload = max(segment_bytes, F.MAX_ACKS_PER_FRAME * F.ACK_ENTRY.size)
        # One lock for every transport of the process: they share rails (links.py). An
        # RLock: a callback may post from inside a completion.
        self._lock = progress.NET_LOCK
        # peer -> its rails by index (None: not yet; DEAD: let go of)
        self._rails: dict[int, Sequence[Rail | None]] = {}
        self._link_of: dict[int, Link] = {}  # peer -> the Link its rails are (once it has rails)
        self._joins: dict[int, _Join] = {}  # peer -> _Join while joining a link to it
        # peer -> rails it sent LEAVE on (it is leaving this group)
        self._left: dict[int, set[int]] = {}
        # JOINs that came before connect(): handled by it
        self._early_joins: list[tuple[Link, Rail, int, bytes]] = []
        self._up: set[int] = set()  # peers whose rails are all open
        # peer -> _DIALING, _ACCEPTING or _JOINING while rails open
        self._links: dict[int, str] = {}
        self._reserved: set[tuple[int, int]] = set()  # (peer, rail) accepted, not yet added
        self._notices: dict[int, bytes] = {}  # peer -> abort notice to send once its rails are up
        self._expected: set[int] = set()
        self._addresses: dict[int, str] = {}
        self._connect_timeout = 300.0
        self._connected = threading.Condition(self._lock)
        self._sends: dict[tuple[int, int], Request] = {}  # (peer, msg_id) -> its send
        # (peer, msg_id) -> the copy of an eager send, until acked
        self._copies: dict[tuple[int, int], bytearray] = {}
        self._eager_window = min(window_bytes, EAGER_WINDOW_BYTES)
        self._pool = _CopyPool(self._eager_window)
        self._recvs: dict[tuple[int, int], deque[Request]] = {}  # (peer, tag) -> posted receives
        self._positions: dict[Request, int] = {}  # receive -> its stream position (cancel_recv)
        self._any: dict[int, deque[Request]] = {}  # tag -> receives from any source
        self._failed: dict[int, Exception] = {}
        self._closed = False
        # what closed it (close(error)), named by later calls
        self._close_error: Exception | None = None
        self._due: float | None = None  # the endpoint's next deadline, as last computed: the engine
        # calls _on_tick once it has passed (and sleeps in epoll no longer than until it)
        self._hosts = [host] if isinstance(host, str) else list(host)
        self._link_timeout = link_timeout
        self._engine = progress.attach(self)
        try:
            self.address = ",".join(self._engine.listen(h, port_range) for h in self._hosts)
        except BaseException:
            progress.detach(self)
            raise
        self._gid = handshake.group_id(group)
        self._context = links.context_of(self._gid)
        self._prefix = links.prefix_of(self._context)
        self._engine.join_group(self._gid, rank, self, self._context)
        self._threads: list[threading.Thread] = []  # rail healers (_heal), joined by close
        self._healing: set[tuple[Link, int]] = set()  # (link, rail index) with a healer
        self._stopping = threading.Event()  # set by close: healers stop

    # ------------------------------------------------------------------ set-up

    def connect(self, peers: dict[int, str], deadline: float) -> None:
        """Learn where the other ranks are: ``peers`` is {rank: address}, an address being
        ``"host:port"`` or several, comma-separated, one per interface.

        No connection is opened here: the rails to a peer are opened when a message is
        first sent to it (``_open_rails``), so a rank holds connections only to the ranks
        it talks to (in a group spanning nodes: its counterparts on the other nodes, not
        every rank). Opening rails may take as long as ``deadline`` leaves now.
        """
        with self._lock:
            self._expected = set(peers) - {self.rank}
            self._addresses = {p: a for p, a in peers.items() if p != self.rank}
            self._connect_timeout = max(1.0, deadline - time.monotonic())
            for peer, link in self._link_of.items():  # (rails accepted before we knew)
                if None not in link.rails and link.key is None:
                    link.key = self._link_key(peer)
                    self._engine.publish(link)
            early, self._early_joins = self._early_joins, []
            for args in early:
                if args[1].alive:
                    self._on_join(*args)

    def _open_rails(self, peer: int, deadline: float | None = None, notice: bool = False) -> None:
        """Return once the ``rails`` connections to ``peer`` are up, opening them if nobody
        has. When this process has a link to the peer's process already (another group's
        rails: links.py), this group joins it; else this rank dials rail 0, 1, ... in turn
        (rail ``i`` goes from this rank's address ``i % n`` to the peer's address
        ``i % m``). When both ranks dial (or join) at once, the higher rank's rails are
        kept (its listener answers the other's dial with ``Crossed``; a JOIN from the
        lower rank is not answered) and the lower rank waits for them.

        Raises
        ------
        PeerUnreachable
            The rails could not be opened (the peer's process is gone, refused us, or a
            connection broke while opening); the peer is failed for this transport.
        PeerTimeout
            The peer's rails did not come up by ``deadline``.

        ``notice``: only to tell the peer of an abort, which may follow a withdrawal that
        failed the peer here already (see ``abort``).
        """
        if deadline is None:
            deadline = time.monotonic() + self._connect_timeout
        if self._wait_rails(peer, deadline, dial=True, notice=notice):
            return
        try:
            theirs = [_split(a) for a in self._addresses[peer].split(",")]
            for rail in range(self.nrails):
                host, port = theirs[rail % len(theirs)]
                self._dial(peer, host, port, rail, deadline)
        except handshake.Crossed:
            pass  # the peer opens them: wait below
        except BaseException as e:
            if isinstance(e, (PeerUnreachable, PeerTimeout)):
                error = e
            elif isinstance(e, TimeoutError):  # it took the connection but never answered
                error = PeerTimeout([peer], 0.0, f"rank {peer} did not answer rank "
                                                 f"{self.rank}'s connection in time (stalled?)",
                                    network=True)
            elif isinstance(e, handshake.HandshakeError):  # (its listener says why in its log)
                error = PeerUnreachable(peer, f"could not open rails to rank {peer}: it ended "
                                              f"the handshake ({e}): it has closed or aborted "
                                              f"this group, or did not take rank {self.rank}")
            else:
                error = PeerUnreachable(peer, f"could not open rails to rank {peer}: "
                                              f"{type(e).__name__}: {e}")
            with self._lock:
                self._link_failed(peer, error)
            raise error from None
        self._wait_rails(peer, deadline, dial=False, notice=notice)

    def _wait_rails(self, peer: int, deadline: float, dial: bool, notice: bool = False) -> bool:
        """Wait until ``peer``'s rails are up (True) or, with ``dial``, until nobody is
        opening them (False: the caller now is, and must dial). While this group joins a
        link, the waiting thread drives the progress engine (the answers come as frames)."""
        def joined() -> bool:
            return peer in self._up or self._links.get(peer) is not _JOINING

        while True:
            with self._lock:
                if peer in self._up:
                    return True
                if not (notice and peer in self._notices and not self._closed):
                    self._check_usable(peer)
                if dial and peer not in self._links:
                    link = self._joinable(peer)
                    if link is None:
                        self._links[peer] = _DIALING
                        return False
                    self._start_join(peer, link)  # (a link that closes meanwhile: dial)
                    continue
                now = time.monotonic()
                remaining = deadline - now
                join = self._joins.get(peer)
                if join is not None and join.deadline <= now < deadline:
                    error = PeerTimeout([peer], 0.0, f"rank {peer} did not answer rank "
                                                     f"{self.rank}'s JOIN in time (stalled?)",
                                        network=True)
                    self._link_failed(peer, error)
                    raise error
                if remaining <= 0:  # (half-open rails are no use: the pair is failed)
                    error = PeerTimeout([peer], 0.0, f"the rails between rank {self.rank} and "
                                                     f"rank {peer} did not come up in time",
                                        network=True)
                    self._link_failed(peer, error)
                    raise error
                if join is None:
                    self._connected.wait(min(remaining, 0.5))
                    continue
                until = min(deadline, join.deadline, now + 0.5)
            self._engine.drive(joined, until, None, self.spin)

    def _link_failed(self, peer: int, error: Exception) -> None:
        """Under the lock: opening the rails to ``peer`` failed; so does everything with it."""
        self._links.pop(peer, None)
        if peer not in self._failed:
            self._failed[peer] = error
            self._fail_peer_requests(peer, error)
        self._detach(peer)
        self._connected.notify_all()

    # ------------------------------------------------------------------ shared links

    def _link_key(self, peer: int) -> LinkKey | None:
        """What a link to ``peer``'s process must match for this group to use it: the
        addresses at both ends, the number of rails and the frame authentication."""
        address = self._addresses.get(peer)
        return None if address is None else (tuple(self._hosts), address, self.nrails,
                                             self._mac)

    def _joinable(self, peer: int) -> Link | None:
        """Under the lock: a link of another group to ``peer``'s process, or None."""
        key = self._link_key(peer)
        return None if key is None else self._engine.find_link(key, self._context)

    def _start_join(self, peer: int, link: Link) -> None:
        """Under the lock: join ``link`` for ``peer``: a JOIN on every rail (links.py)."""
        self._links[peer] = _JOINING
        self._joins[peer] = join = _Join(link)
        link.add(self._context, self.rank, self, peer)
        for rail in link.rails:  # (a link others may join has every rail)
            self._send_join(link, rail, peer, join)  # type: ignore[arg-type]

    def _send_join(self, link: Link, rail: Rail, peer: int, join: _Join) -> None:
        proof = handshake.join_proof(self._key, self._group, rail.session, self.rank, peer,
                                     rail.index)
        link.send_block(rail, JOIN, self.rank, peer, self._context, proof)
        join.sent.add(rail.index)

    def _on_join(self, link: Link, rail: Rail, peer: int, proof: bytes) -> None:
        """Under the lock: ``peer`` sent a JOIN for this group on ``rail`` of ``link``."""
        expect = handshake.join_proof(self._key, self._group, rail.session, peer, self.rank,
                                      rail.index)
        if not 0 <= peer < self.world_size or peer == self.rank or not handshake.same(proof,
                                                                                    expect):
            log.error("neuron %s: ignored a JOIN on rail %d claiming rank %d (wrong proof)",
                      self._label, rail.index, peer)
            return
        if not self._addresses and not self._closed:  # (connect() is a moment away)
            self._early_joins.append((link, rail, peer, proof))
            return
        if self._closed or peer in self._failed:
            link.send_block(rail, LEAVE, self.rank, peer, self._context)  # (it fails at once)
            return
        if peer in self._up:
            return  # (a late JOIN after a crossing)
        key = self._link_key(peer)
        if key is None or not link.reaches(key):
            log.error("neuron %s: ignored a JOIN on rail %d claiming rank %d: the link is not "
                      "to that rank's process", self._label, rail.index, peer)
            return
        state, join = self._links.get(peer), self._joins.get(peer)
        if join is not None and join.link is not link:  # both joined at once, elsewhere
            if self.rank > peer:
                return  # ours is kept: the peer takes it when our JOIN reaches it
            self._abandon_join(peer)
            state = join = None
        if state is _ACCEPTING or (state is _DIALING and self.rank > peer):
            return  # the peer's rails (or ours) are being opened: those are kept
        if join is None:
            if link.closing or link.closed or (self._context, self.rank) in link.members:
                return
            self._links[peer] = _JOINING
            self._joins[peer] = join = _Join(link)
            link.add(self._context, self.rank, self, peer)
        join.heard.add(rail.index)
        if rail.index not in join.sent:
            self._send_join(link, rail, peer, join)
        if len(join.heard) == len(join.sent) == self.nrails:
            del self._joins[peer]
            self._rails[peer] = link.rails
            self._link_of[peer] = link
            self._rail_up(peer)

    def _abandon_join(self, peer: int) -> None:
        """Under the lock: stop joining a link to ``peer`` (its rails are opened otherwise,
        or the link is gone); what was sent on it is ignored by the peer."""
        join = self._joins.pop(peer)
        join.link.remove(self._context, self.rank, self)
        if self._links.get(peer) is _JOINING:
            del self._links[peer]
        self._connected.notify_all()

    def _on_leave(self, link: Link, rail: Rail, peer: int) -> None:
        """Under the lock: ``peer`` left this group on ``rail`` (it closed the group, or
        failed this rank) while its process keeps the link for other groups: for this group
        that is the end of the rail, as a connection closing would be."""
        if peer in self._joins and self._joins[peer].link is link:
            self._abandon_join(peer)
            self._link_failed(peer, PeerUnreachable(
                peer, f"could not join the rails to rank {peer}: it has closed or aborted this "
                      f"group, or failed rank {self.rank}"))
            return
        if self._link_of.get(peer) is not link:
            return
        left = self._left.setdefault(peer, set())
        left.add(rail.index)
        if len(left) == self.nrails:
            self._detach(peer, leave=False)
        self._lose_rail(rail, peer, CLEAN_EOF + " (the group closed there)")

    def _detach(self, peer: int, leave: bool = True) -> None:
        """Under the lock: this group stops using its rails to ``peer``. Other groups may
        go on using them: the peer is told with a LEAVE on each (``leave``); the last group
        closes them."""
        join = self._joins.pop(peer, None)
        link = self._link_of.pop(peer, None) or (join.link if join else None)
        self._left.pop(peer, None)
        if peer in self._rails:
            self._rails[peer] = [DEAD] * self.nrails
        if link is None or link.closed:
            return
        others = [m for m in link.members if m != (self._context, self.rank)]
        if others and leave:
            for rail in link.rails:
                if rail is not None:
                    link.send_block(rail, LEAVE, self.rank, peer, self._context)
        link.remove(self._context, self.rank, self)

    def _dial(self, peer: int, host: str, port: int, rail: int, deadline: float) -> None:
        """Open rail ``rail`` to ``peer``: connect and authenticate (handshake.py).

        A refused connection is retried for ``_REFUSED_RETRY`` seconds (a listener
        starting), and a handshake dropped before it ended (``HandshakeDropped``: the
        listener sheds unfinished handshakes under a flood of strangers, listener.py) is
        dialed again with a growing pause, both until ``deadline``. A refusal (the peer
        answered NO: wrong key, a group it does not have) and a stalled peer
        (``HandshakeTimeout``) end the dial at once."""
        refused_until = time.monotonic() + _REFUSED_RETRY
        pause, dropped, silent = _DROPPED_PAUSE, None, False
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                why = (f" (the handshake was dropped: {dropped})" if dropped else
                       " (no answer to the connection: a firewall dropping that port, or an "
                       "address this host has no route to; NEURON_DIST_PORT_RANGE sets the "
                       "ports ranks listen on, NEURON_DIST_SOCKET_IFNAME the interface)"
                       if silent else "")
                raise PeerTimeout([peer], 0.0, f"could not connect rail {rail} to rank {peer} "
                                               f"at {where}{why}", network=True)
            source = self._hosts[rail % len(self._hosts)]
            try:
                sock = socket.create_connection(
                    (host, port), timeout=min(remaining, HANDSHAKE_TIMEOUT),
                    source_address=(source, 0) if len(self._hosts) > 1 else None)
            except ConnectionRefusedError:
                if time.monotonic() > refused_until:  # its listener is gone
                    raise PeerUnreachable(peer, f"connection refused at {where}, where rank "
                                                f"{peer} listens: its process has exited or "
                                                f"closed all its groups, or a firewall rejects "
                                                f"that port (NEURON_DIST_PORT_RANGE sets the "
                                                f"ports ranks listen on)") from None
                time.sleep(0.05)
                continue
            except TimeoutError:  # (socket.timeout) no SYN-ACK: dropped on the way
                silent = True
                continue
            except OSError as e:
                if e.errno not in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL):
                    raise
                raise PeerUnreachable(peer, f"cannot reach {where}, where rank {peer} listens, "
                                            f"from {source}: {e.strerror} (a wrong interface? "
                                            f"NEURON_DIST_SOCKET_IFNAME names the one to "
                                            f"use)") from None
            try:
                session = handshake.dial(sock, self._key, self._group, self.rank, rail, peer,
                                         min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT))
            except handshake.HandshakeDropped as e:
                sock.close()
                dropped = e
                log.info("neuron %s: rail %d to rank %d: %s; dialing again", self._label,
                         rail, peer, e)
                time.sleep(min(pause * random.uniform(0.5, 1.0),
                               max(0.0, deadline - time.monotonic())))
                pause = min(_DROPPED_PAUSE_MAX, pause * 2)
                continue
            except BaseException:
                sock.close()
                raise
            self._add_rail(sock, peer, rail, session, dialer=True)
            return

    def _may_dial(self, rank: int, rail: int) -> bool | bytes:
        """May ``rank`` open rail ``rail`` to this rank now (the listener asks)? True,
        False, or ``handshake.CROSSED`` (this rank is dialing ``rank`` too and has the
        higher rank: its own rails are kept)."""
        with self._lock:
            if (self._closed or not 0 <= rank < self.world_size or rank == self.rank
                    or not 0 <= rail < self.nrails):
                return False
            link = self._link_of.get(rank)
            if link is not None and rank in self._up and not link.dialer:
                lost = link.rails[rail]
                if (lost is not None and not lost.alive and link.healable()
                        and rail not in link.untrusted and (rank, rail) not in self._reserved):
                    self._reserved.add((rank, rail))  # a rail lost here too: healed (_heal)
                    return True
            state = self._links.get(rank)
            if rail == 0 and rank < self.rank and (state in (_DIALING, _JOINING)
                                                   or rank in self._up):
                return handshake.CROSSED  # (a dial that crossed ours may come in late)
            if rail == 0 and state is _JOINING:  # its dial is kept, not our JOIN
                self._abandon_join(rank)
                state = None
            if ((rank, rail) in self._reserved
                    or self._rails.get(rank, [None] * self.nrails)[rail] is not None):
                return False
            if rail == 0:
                if rank in self._up or state is _ACCEPTING:
                    return False
                self._links[rank] = _ACCEPTING  # (our own dial, if any, gets Crossed)
            elif state is not _ACCEPTING:
                return False  # rails after the first come from whoever opened rail 0
            self._reserved.add((rank, rail))
            return True

    def _release(self, rank: int, rail: int) -> None:
        """The listener granted ``rank`` rail ``rail`` (``_may_dial``), then its handshake
        failed: forget the reservation, so that a dial again can be granted. When it was
        the rank's first rail and no other is here or on its way, the link is as if never
        dialed; a later rail lost this way leaves the link half open, and the dialer, whose
        dial failed, fails the pair (its rails break at both ends)."""
        with self._lock:
            self._reserved.discard((rank, rail))
            rails = self._rails.get(rank)
            if (self._links.get(rank) is _ACCEPTING and rank not in self._up
                    and (rails is None or all(r is None for r in rails))
                    and not any(p == rank for p, _ in self._reserved)):
                self._links.pop(rank, None)
                self._connected.notify_all()

    def _heal(self, link: Link, peer: int, index: int) -> None:
        """Under the lock: rail ``index`` of ``link`` (this process dialed it; ``peer`` is the
        far end's rank in this group) broke while another rail lives: dial it again from a
        thread of its own (``_healer``), unless one does already."""
        if self._closed or (link, index) in self._healing:
            return
        healer = threading.Thread(target=self._healer, args=(link, peer, index), daemon=True,
                                  name=f"neuron-rail-heal-{peer}-{index}")
        try:
            healer.start()
        except RuntimeError as e:  # (a thread limit): the link goes on with fewer rails
            log.warning("neuron %s: cannot dial rail %d to rank %d again: %s", self._label,
                        index, peer, e)
            return
        self._healing.add((link, index))
        self._threads = [t for t in self._threads if t.is_alive()] + [healer]

    def _healer(self, link: Link, peer: int, index: int) -> None:
        """Dial rail ``index`` to ``peer`` again until it is back, with a pause before each
        attempt that doubles after each failure; stop when the link, the peer or this
        transport is gone, or the link has no other live rail (its peer has failed)."""
        pause = _HEAL_PAUSE
        try:
            while not self._stopping.wait(pause * random.uniform(0.5, 1.0)):
                with self._lock:
                    if (self._closed or peer in self._failed or not link.healable()
                            or self._link_of.get(peer) is not link
                            or link.rails[index].alive):  # type: ignore[union-attr]  # (healable)
                        return
                    theirs = [_split(a) for a in self._addresses[peer].split(",")]
                host, port = theirs[index % len(theirs)]
                try:
                    self._dial(peer, host, port, index,
                               time.monotonic() + _HEAL_DIAL_SECONDS)
                except Exception as e:  # noqa: BLE001 - the peer may not have seen the break yet
                    log.info("neuron %s: dialing rail %d to rank %d again failed: %s",
                             self._label, index, peer, e)
                    pause = min(_HEAL_PAUSE_MAX, pause * 2)
        except Exception:  # noqa: BLE001 - never a healer that dies unnoticed
            log.exception("neuron %s: the healer of rail %d to rank %d failed", self._label,
                          index, peer)
        finally:
            with self._lock:
                self._healing.discard((link, index))

    def _healed(self, link: Link, index: int) -> None:
        """Under the lock: rail ``index`` of ``link`` is connected again: every group on the
        link sends on it again, and other groups may join the link once all its rails are
        up."""
        log.info("neuron %s: rail %d is connected again", link.label, index)
        for t, peer in list(link.members.values()):
            if not t._closed:
                t.ep.rail_restored(index, peer)
                t._pump()
        if link.key is not None and all(r is not None and r.alive for r in link.rails):
            self._engine.publish(link)
        self._connected.notify_all()

    def _accepted(self, sock: socket.socket, peer: int, index: int,
                  session: bytes = b"") -> None:
        """An authenticated connection from ``peer`` for rail ``index`` (the listener)."""
        self._add_rail(sock, peer, index, session, dialer=False)

    def _add_rail(self, sock: socket.socket, peer: int, index: int, session: bytes = b"",
                  dialer: bool = False) -> None:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # a dead link breaks the rail (Linux)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                            max(1, int(self._link_timeout * 1000)))
            # ... also on a rail that only receives: one stalled half way through a payload
            # keeps its claim on that range (see the protocol's "Buffer ownership"), so the
            # resends of the range on other rails are dropped until the rail is found dead.
            # After KEEPIDLE seconds without a byte from the peer, TCP probes it, and a probe
            # unanswered for TCP_USER_TIMEOUT breaks the connection.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE,
                            max(1, int(self._link_timeout / 2)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setblocking(False)
        mac = RailMac(session, dialer, self._mac[1]) if self._mac[0] else None
        with self._lock:
            self._reserved.discard((peer, index))
            if self._closed:
                sock.close()
                return
            link = self._link_of.get(peer)
            if link is None:  # this group's first rail to the peer: a new link
                link = self._link_of[peer] = Link(self._engine, self.nrails,
                                                  f"{self._label}, rails to rank {peer}")
                link.dialer = dialer
                link.add(self._context, self.rank, self, peer)
                self._rails[peer] = link.rails
            lost = link.rails[index]
            if lost is not None and (lost.alive or not link.healable()):
                sock.close()  # (a rail healed while the link closed, or lost its last rail)
                return
            rail = Rail(sock, index, link, session, mac)
            link.rails[index] = rail
            self._engine.register(rail.fd, link, rail, rail.events)
            if lost is not None:
                self._healed(link, index)
            elif None not in link.rails:
                link.key = self._link_key(peer)  # other groups may join it from now on
                self._engine.publish(link)
                self._rail_up(peer)
            self._connected.notify_all()

    def _rail_up(self, peer: int) -> None:
        """Under the lock: every rail to ``peer`` is open (or joined) for this group."""
        self._up.add(peer)
        self._links.pop(peer, None)
        notice = self._notices.pop(peer, None)
        if notice is not None:  # (it failed us before there were rails to tell it)
            self._send_notice(peer, notice)
            self._pump()
        self._connected.notify_all()

    # ------------------------------------------------------------------ requests

    def isend(self, peer: int, tag: int, buf: Buffer,
              callback: Callable[[NetRequest], object] | None = None) -> _Request:
        """Send the bytes of ``buf`` (kept unchanged until the request completes).

        Messages up to ``EAGER_BYTES`` are copied (a ``bytes`` object, immutable, is kept
        as it is) and the request completes at once (like MPI's eager protocol): the copy
        stays with the protocol until the peer acknowledges it, so a small send costs no
        round trip. When nothing waits to go to the peer before it, its frame is written
        to the socket right here (``Endpoint.send_now``). Larger ones complete when
        acknowledged, and so do small ones while ``EAGER_WINDOW_BYTES`` or more waits to go
        to the peer (``Endpoint.backlog_bytes``): a sender that runs ahead of its peer then
        waits, so the copies it holds, and what a close must still deliver, stay bounded.
        ``callback(request)``, if given, runs on the engine's callback thread when the
        request completes (successfully or not).
        """
        if peer not in self._up:
            self._open_rails(peer)
        view = memoryview(buf).cast("B")
        n = view.nbytes
        data: Bytes
        with self._lock:
            if self._closed or peer in self._failed or peer not in self._expected:
                self._check_usable(peer)  # (raises)
            ep = self.ep
            if n <= _SMALL_COPY or (type(buf) is bytes and n <= EAGER_BYTES):
                # The commonest send, in one step: framed by the endpoint and written here,
                # from a copy that needs nothing when its ack comes (notify=False).
                data = buf if type(buf) is bytes else bytes(view)
                now = time.monotonic()
                sent = ep.send_now(peer, tag, data, now, False)
                if sent is not None:
                    self._write_now(peer, sent, now)
                    if callback is None:
                        return _Request.completed(peer, tag, view)
                    req = Request(peer, tag, view, True, self)
                    req.callback = callback
                    req._finish()
                    return req
            if n > EAGER_BYTES or ep.backlog_bytes(peer) >= self._eager_window:
                req = Request(peer, tag, view, True, self)
                req.callback = callback
                self._sends[(peer, ep.send(peer, tag, view))] = req
                self._pump()
                if callback is not None or ep.mid_transfer():
                    self._engine.kick()  # see _bulk_pending
                return req
            pooled = None
            if type(buf) is bytes:
                data = buf  # immutable: kept as it is until acknowledged, no copy
            elif n <= _SMALL_COPY:
                data = bytes(view)
            else:
                pooled = self._pool.take(n)
                data = memoryview(pooled)[:n]
                data[:] = view  # (into a bytearray itself, a slice goes through a temporary copy)
            now = time.monotonic()
            sent = ep.send_now(peer, tag, data, now)
            if sent is None:
                msg_id = ep.send(peer, tag, data)
                if pooled is not None:
                    self._copies[(peer, msg_id)] = pooled
                self._pump()
                if ep.mid_transfer():
                    self._engine.kick()
            else:
                if pooled is not None:
                    self._copies[(peer, sent[0])] = pooled
                self._write_now(peer, sent, now)
        if callback is None:
            return _Request.completed(peer, tag, view)
        req = Request(peer, tag, view, True, self)
        req.callback = callback
        req._finish()
        return req

    def _write_now(self, peer: int, sent: tuple[int, int, bytes, Bytes, bytes],
                   now: float) -> None:
        """Under the lock: put the frame ``Endpoint.send_now`` returned (``sent``) on its
        rail, and keep the engine's timer no later than its retransmission deadline."""
        _, index, header, payload, trailer = sent
        rails = self._rails.get(peer)
        rail = rails[index] if rails else None
        if rail is None or not rail.alive:
            pass  # (resent on another rail: the endpoint learns of the failure)
        elif rail.mac is None:
            if trailer:
                rail.link.send_frame(rail, [self._prefix + header, payload, trailer],
                                     _HEAD + len(payload) + len(trailer))
            else:
                rail.link.send_frame(rail, [self._prefix + header, payload],
                                     _HEAD + len(payload))
        else:
            self._put(Transmit(peer, index, header, payload, trailer))
        ep = self.ep
        due = self._due
        if due is None or due > now + ep.rto:
            self._due = due = ep.next_deadline()
            # (not None: the frame just written waits for its ack)
            self._engine.due_changed(due)  # type: ignore[arg-type]
        if ep.has_work:
            self._pump()

    def _put(self, tx: Transmit) -> None:
        """Under the lock: write frame ``tx`` now if its rail's socket is free, else queue it
        behind what waits there."""
        rails = self._rails.get(tx.peer)
        rail = rails[tx.rail] if rails else None
        if rail is None or not rail.alive:
            return  # (resent on another rail: the endpoint learns of the failure)
        self._queue(rail, tx)
        if not rail.events & _OUT:  # (else the socket is full: epoll says when not)
            rail.link.flush(rail)

    def _queue(self, rail: Rail, tx: Transmit) -> None:
        """Under the lock: frame ``tx`` goes behind what waits on ``rail``, after this
        group's prefix (links.py)."""
        head = self._prefix + tx.header
        if rail.mac is not None:
            tx = rail.mac.seal(tx, head)
            head = tx.header
        out = rail.out
        out.append(memoryview(head))
        if len(tx.payload):
            out.append(memoryview(tx.payload).cast("B"))
        if tx.trailer:
            out.append(memoryview(tx.trailer))

    def irecv(self, peer: int, tag: int, buf: Buffer,
              callback: Callable[[NetRequest], object] | None = None) -> Request:
        """Receive the next message of ``(peer, tag)`` into ``buf`` (exactly its size)."""
        view = memoryview(buf).cast("B")
        req = Request(peer, tag, view, False, self)
        req.callback = callback
        with self._lock:
            if self._closed:
                raise self._closed_error()
            ep = self.ep
            if peer in self._failed or peer not in self._expected:
                # A message that arrived whole is delivered even if its sender has since
                # closed or failed: a peer that sends its last message and exits is normal.
                early = ep.take_early(peer, tag)
                if early is not None:
                    self._complete_recv(req, early)
                    return req
                self._check_usable(peer)  # (raises)
            got = ep.post_recv(peer, tag, view)  # (the oldest early message, or a position)
            if type(got) is not int:  # (the message, a bytearray)
                self._complete_recv(req, got)  # type: ignore[arg-type]
                return req
            self._positions[req] = got
            waiting = self._recvs.get((peer, tag))
            if waiting is None:
                waiting = self._recvs[(peer, tag)] = deque()
            waiting.append(req)
            if ep._events:  # (a message known to be too large for it was refused)
                self._pump()
        if req.nbytes > EAGER_BYTES or callback is not None:
            self._engine.kick()  # see _bulk_pending
        return req

    def irecv_any(self, tag: int, buf: Buffer,
                  callback: Callable[[NetRequest], object] | None = None,
                  claim: Callable[[], bool] | None = None) -> Request:
        """Receive the next message of ``tag`` from whichever rank sends one first.

        The source is in ``request.source`` once complete. Messages go to receives naming
        their source first; a receive from any source takes the earliest message that no
        such receive was waiting for.

        ``claim``: a receive that another path (shared memory) may satisfy instead.
        ``claim()`` is called just before a message is bound to this receive; False means
        the other path got a message first: then the receive takes nothing, the message
        stays for the next receive, and the request ends with ``Claimed``. (It must not
        wait on anything: it runs under this transport's lock.)
        """
        view = memoryview(buf).cast("B")
        req = Request(None, tag, view, False, self)
        req.callback = callback
        req.claim = claim
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if claim is not None and self.ep.peek_early_any(tag) is not None and not claim():
                req._finish(Claimed())
                return req
            early = self.ep.take_early_any(tag)
            if early is not None:
                req.source = early[0]
                self._complete_recv(req, early[1])
                return req
            alive = [p for p in self._expected if p not in self._failed]
            if not alive:
                raise next(iter(self._failed.values()), ValueError("no peer connected"))
            self._any.setdefault(tag, deque()).append(req)
        if req.nbytes > EAGER_BYTES or callback is not None:
            self._engine.kick()
        return req

    def drive_until(self, done: Callable[[], bool], deadline: float) -> bool:
        """Make progress from the calling thread until ``done()`` or ``deadline``; the
        result of ``done()``. For a waiter that also waits for something else (a receive
        from any rank that shared memory may satisfy too): whoever makes ``done()`` true
        from another thread calls ``wake`` so that this thread leaves ``epoll`` at once."""
        return self._engine.drive(done, deadline, None, self.spin)

    def wake(self) -> None:
        """Make a thread in ``drive_until`` look at its condition again now."""
        self._engine.wake()

    # (only a request this transport made: ``req`` is one of its own)
    def cancel(self, req: Request, error: Exception) -> bool:  # type: ignore[override]
        """Withdraw ``req`` unless it has completed; True if it was withdrawn.

        On return the transport no longer touches the request's buffer: a payload being
        read into it goes on into scratch memory, and queued frames that refer to a send's
        buffer are replaced by copies. The request fails with ``error``. A withdrawn
        message leaves its stream between the two ranks out of step, so the peer is failed
        on both sides: later requests with it raise ``error`` here, and it is told (its
        requests with this rank fail with ``PeerAborted``). A receive from any source binds
        no stream and is simply withdrawn.
        """
        peer = req.peer
        with self._lock:
            self._handle_events()  # (a message the endpoint delivered completes it first)
            if req._event.is_set():
                return False
            if peer is None:  # a receive from any rank (a send names its peer)
                self._any.get(req.tag, deque()).remove(req)
                req._finish(error)
                return True
            if req.is_send:
                key = next((k for k, r in self._sends.items() if r is req), None)
                if key is not None:
                    del self._sends[key]
                    self.ep.cancel_send(*key)
                self._unhook(req.buf.obj, peer)
                req._finish(error)
            else:
                try:
                    self._recvs.get((peer, req.tag), deque()).remove(req)
                except ValueError:
                    pass
                self._fail_recv(req, error)
            self._break_peer(peer, error)
            self._pump()
        self._engine.wake()  # (a waiter of another thread sees the news at once)
        return True

    def _unhook(self, obj: object, peer: int | None) -> None:
        """Under the lock: nothing this transport holds refers to buffer ``obj`` any more.

        A payload being read into it goes on into scratch memory (the claim stays, so the
        endpoint counts the bytes of its cancelled message), which starts with a copy of
        what was read so far: with payload authentication the frame's tag covers the
        whole payload as it came, and is checked over that memory. Queued frames that
        refer to it are replaced by copies (the part already written stays written)."""
        rails = self._rails.values() if peer is None else [self._rails.get(peer, ())]
        for rail in (r for rs in rails for r in rs if r is not None):
            if rail.stage == _PAYLOAD and rail.view.obj is obj:
                scratch = memoryview(bytearray(rail.view.nbytes))
                scratch[:rail.got] = rail.view[:rail.got]
                rail.view = scratch
            if any(v.obj is obj for v in rail.out):
                rail.out = deque(memoryview(bytes(v)) if v.obj is obj else v
                                 for v in rail.out)

    def _break_peer(self, peer: int, error: Exception) -> None:
        """Under the lock: stop talking to ``peer`` after a withdrawn request, and tell it."""
        if peer in self._failed:
            return
        self._failed[peer] = error
        kind = ABORTED_TIMEOUT if isinstance(error, PeerTimeout) else ABORTED
        payload = bytes([kind]) + (f"rank {self.rank} withdrew a request with this rank: "
                                   f"{error}").encode("utf-8", "replace")[:4000]
        if peer in self._up:
            self._send_notice(peer, payload)
        else:  # told when it opens its rails (to send to us: only then does it need to know)
            self._notices[peer] = payload
        self._fail_peer_requests(peer, error)

    def _send_notice(self, peer: int, payload: bytes) -> int | None:
        """Under the lock: send ``peer`` an abort notice; its msg_id, or None."""
        try:
            return self.ep.send(peer, ABORT_TAG, payload)
        except Exception:  # noqa: BLE001 - the peer is gone already
            return None

    def _closed_error(self) -> Exception:
        """What a request on the closed transport raises: the error that closed it (so a
        later call names the cause), unless that was a plain close."""
        error = self._close_error
        if error is None or isinstance(error, ChannelClosed):
            return ChannelClosed(f"rdm transport of {self._label} is closed")
        return error

    def _check_usable(self, peer: int) -> None:
        if self._closed:
            raise self._closed_error()
        if peer in self._failed:
            raise self._failed[peer]
        if peer not in self._expected:
            raise ValueError(f"rank {peer} is not a peer of rank {self.rank} in this group "
                             f"(ranks 0..{self.world_size - 1})")

    def _complete_recv(self, req: Request, data: memoryview | bytearray) -> None:
        n = len(data) if not isinstance(data, memoryview) else data.nbytes
        if n != req.nbytes:
            # (source: known once a message is bound to it)
            error = MessageSizeMismatch(req.source, req.tag,  # type: ignore[arg-type]
                                        n, req.nbytes, data)
            req._finish(error)
            return
        if not (isinstance(data, memoryview) and data.obj is req.buf.obj):
            req.buf[:n] = data
        req._finish()

    def _fail_recv(self, req: Request, error: Exception) -> None:
        """Under the lock: fail a receive. Its buffer is the caller's again at once: the
        endpoint withdraws it (the message bound to it is discarded whenever it arrives),
        and a payload being read into it goes on into scratch memory."""
        position = self._positions.pop(req, None)
        if position is not None:  # (a position: a receive naming its peer)
            self.ep.cancel_recv(req.peer, req.tag, position)  # type: ignore[arg-type]
        self._unhook(req.buf.obj, req.peer)
        req._finish(error)

    # ------------------------------------------------------------------ progress

    def _bulk_pending(self) -> bool:
        """Is there work that only progress moves on and that someone is waiting for
        without driving it: bytes queued behind a full socket, a message part way (segments
        held back by the window, or partly received), a posted receive larger than an eager message (its sender's request
        completes only when this end reads it and acknowledges), or a request with a
        completion callback (a future or hook is armed on it)? The engine's background
        thread then takes over sooner when nobody waits (progress.py). A send waited for
        with ``wait`` needs none of this: the waiting thread drives. Read without the lock,
        from snapshots: a hint, checked again on every decision."""
        if self.ep.mid_transfer():
            return True
        for rails in list(self._rails.values()):
            for r in rails:
                if r is not None and r.out:
                    return True
        for req in list(self._positions):
            if req.nbytes > EAGER_BYTES or req.callback is not None:
                return True
        for req in list(self._sends.values()):
            if req.callback is not None:
                return True
        return any(req.nbytes > EAGER_BYTES or req.callback is not None
                   for q in list(self._any.values()) for req in list(q))

    def _on_tick(self, now: float) -> None:
        due = self._due
        if due is not None and now >= due:
            with self._lock:
                if not self._closed:
                    self._pump(deadline_passed=True)

    def _take_whole(self, rail: Rail, peer: int, buf: memoryview, lo: int, hi: int,
                    touched: set[RdmTransport]) -> int:
        """Under the lock (links.read): a frame for this group from ``peer`` starts at
        ``buf[lo]`` (its prefix) and ``buf[:hi]`` is read. When the endpoint takes it whole
        (``Endpoint.take_whole``: a small message next in its stream) the receive waiting
        for it completes here, and the frame's end is returned; else 0 (nothing done: the
        link reads it stage by stage, ``_on_header``). ``touched`` gets this transport if
        the endpoint has more for ``_pump``."""
        ep = self.ep
        if ep._events:  # (earlier frames' deliveries complete their receives first)
            self._handle_events()
        got = ep.take_whole(rail.index, peer, buf, lo + links.PREFIX, hi, time.monotonic())
        if got is None:
            return 0
        end, tag, msg_id, data, posted = got
        if posted:  # (the oldest receive of the stream is the one bound to it: _on_message)
            waiting = self._recvs.get((peer, tag))
            if waiting:
                req = waiting.popleft()
                del self._positions[req]
                if data.nbytes == req.nbytes:  # type: ignore[union-attr]  # (posted: a view)
                    req._finish()
                else:
                    self._complete_recv(req, data)
        elif tag == ABORT_TAG or self._any:
            self._on_message(MessageReceived(peer, tag, msg_id, data, False))
        # (_pump acts on the acks' events and on held acks' deadline: ack_delay)
        hint = ep._ack_hint
        if ep._events or ep.has_work or (hint != math.inf and (self._due is None
                                                                 or hint < self._due)):
            touched.add(self)
        return end

    def _on_header(self, rail: Rail) -> None:
        """Under the lock: the header of a frame for this group is read on ``rail`` (its
        prefix named this group, and the link checked its tag: links.py); place the rest."""
        ep, mac, peer = self.ep, rail.mac, rail.rpeer
        try:
            h = F.decode_header(rail.head, world_size=self.world_size,
                                max_message_bytes=ep.max_message_bytes,
                                max_payload=self._max_payload, require_crc=ep.crc)
            if h.src != peer or h.dst != self.rank:
                raise F.FrameError(f"frame from rank {h.src} to {h.dst} on a rail "
                                   f"between ranks {peer} and {self.rank}")
        except F.FrameError as e:
            log.error("neuron %s: closing rail %d to rank %d after a malformed frame: %s",
                      self._label, rail.index, peer, e)
            rail.link.rail_down(rail, f"malformed frame: {e}", heal=False)
            return
        lo, end = rail.lo, rail.lo + h.length + h.trailer_bytes
        rail.ahead = rail.inbuf[:AHEAD_AFTER_LARGE] if h.length >= INBUF else rail.inbuf
        if mac is None and end <= rail.hi:  # the whole frame is read ahead already
            inbuf, mid = rail.inbuf, lo + h.length
            if ep.land_whole(rail.index, rail.head, h, inbuf[lo:mid], inbuf[mid:end],
                             time.monotonic()):
                rail.lo = end
                stage_to(rail, _HEADER, rail.hview)
                return
        rail.header = h
        target = ep.data_target(rail.index, h)
        if target is not None:  # claimed for this rail: see "Buffer ownership"
            if mac is None and end <= rail.hi:  # all read ahead already: land it now
                inbuf = rail.inbuf
                target[:] = inbuf[lo:lo + h.length]
                rail.lo = end
                rail.header = None  # (the trailer is read before inbuf is refilled)
                ep.data_landed(rail.index, rail.head, h, time.monotonic(),
                               inbuf[lo + h.length:end])
                stage_to(rail, _HEADER, rail.hview)
                return
            stage_to(rail, _PAYLOAD, target)
            return
        tail = _MAC_TAG if mac is not None and mac.tail(h.type, h.nacks) else 0
        frame = bytearray(F.HEADER_SIZE + h.length + h.trailer_bytes + tail)
        frame[:F.HEADER_SIZE] = rail.head
        rail.buf = frame
        stage_to(rail, _ASIDE, memoryview(frame)[F.HEADER_SIZE:])

    def _on_stage(self, rail: Rail) -> None:
        """Under the lock: the current stage (after the header) of ``rail``'s frame for
        this group is read; go to the next."""
        ep, mac, stage = self.ep, rail.mac, rail.stage
        h: F.Header = rail.header  # type: ignore[assignment]  # (set: past its header)
        tail = mac is not None and mac.tail(h.type, h.nacks)
        if stage == _PAYLOAD and (h.nacks or tail):
            if mac is not None and mac.payload:
                mac.absorb(rail.view)  # (what was read: scratch memory if cancelled meanwhile)
            rail.buf = bytearray(h.trailer_bytes + (_MAC_TAG if tail else 0))
            stage_to(rail, _TRAILER, memoryview(rail.buf))
            return
        # (set: the frame read aside, or the trailer)
        frame: bytearray | memoryview = rail.buf  # type: ignore[assignment]
        if tail and mac is not None:  # check the acks (and payload) before they are acted on
            try:
                if stage == _TRAILER:
                    mac.check_tail(memoryview(frame)[:-_MAC_TAG], frame[-_MAC_TAG:])
                else:
                    covered = F.HEADER_SIZE if mac.payload or h.type == F.ACK else \
                        F.HEADER_SIZE + h.length
                    mac.check_tail(memoryview(frame)[covered:-_MAC_TAG], frame[-_MAC_TAG:])
            except F.FrameError as e:
                log.error("neuron %s: closing rail %d to rank %d: %s", self._label, rail.index,
                          rail.rpeer, e)
                rail.link.rail_down(rail, f"unauthenticated frame: {e}",  # (releases the claim)
                                   heal=False)
                return
            frame = memoryview(frame)[:-_MAC_TAG]
        if stage in (_PAYLOAD, _TRAILER):
            trailer = frame if stage == _TRAILER else b""
            ep.data_landed(rail.index, rail.head, h, time.monotonic(), trailer)
        else:  # _ASIDE
            rejected = ep.stats["rejected"]
            ep.receive(rail.index, frame, time.monotonic())
            if ep.stats["rejected"] > rejected and ep.crc:
                # a path that corrupts data (past TCP's checksum) is not used again
                stage_to(rail, _HEADER, rail.hview)
                rail.link.rail_down(rail, "corrupted frame (CRC mismatch)", heal=False)
                return
        rail.buf = rail.header = None
        stage_to(rail, _HEADER, rail.hview)

    def _pump(self, deadline_passed: bool = False) -> None:
        """Under the lock: act on the endpoint's events (completing requests), then write
        the frames it wants sent."""
        ep = self.ep
        if ep._events:
            self._handle_events()
        if ep.has_work or deadline_passed:
            touched = set()
            for tx in ep.poll_transmit(time.monotonic()):
                rails = self._rails.get(tx.peer)
                rail = rails[tx.rail] if rails else None
                if rail is None or not rail.alive:
                    continue
                self._queue(rail, tx)
                touched.add(rail)
            for rail in touched:
                if not rail.events & _OUT:  # (else the socket is full: epoll says when not)
                    rail.link.flush(rail)
            self._handle_events()  # poll_transmit may have declared a peer failed
        due = ep.next_deadline()
        hint = ep.take_ack_hint()
        if hint != math.inf and (due is None or hint < due):
            due = hint
        if due is not None and (self._due is None or due < self._due):
            self._engine.due_changed(due)
        self._due = due

    def _handle_events(self) -> None:
        for ev in self.ep.events():
            if isinstance(ev, SendCompleted):
                req = self._sends.pop((ev.peer, ev.msg_id), None)
                if req is not None:
                    req._finish()
                else:
                    copy = self._copies.pop((ev.peer, ev.msg_id), None)
                    if copy is not None:
                        self._pool.give(copy)
            elif isinstance(ev, MessageReceived):
                self._on_message(ev)
            elif isinstance(ev, PeerFailed):
                self._on_peer_failed(ev)
            elif isinstance(ev, FrameRejected):
                log.error("neuron %s: rejected a frame on rail %d: %s", self._label, ev.rail,
                          ev.reason)
            elif isinstance(ev, MessageRefused):
                self._on_refused(ev)
            elif isinstance(ev, SendRefused):
                self._on_send_refused(ev)

    def _on_refused(self, ev: MessageRefused) -> None:
        """Under the lock: the message due for the oldest receive of ``(src, tag)`` was too
        large for it and for the memory kept for unexpected messages: it was refused
        (protocol.py, "Refusal"), its sender is told, and the receive fails."""
        waiting = self._recvs.get((ev.src, ev.tag))
        if not waiting:
            return  # (its receive was withdrawn: the endpoint discards it then)
        req = waiting.popleft()
        self._positions.pop(req, None)
        req._finish(MessageSizeMismatch(
            ev.src, ev.tag, ev.size, ev.expected, b"",
            f"rank {ev.src} sent {ev.size} bytes, the receive expects {ev.expected} (tag "
            f"{ev.tag}); the message was refused, not kept: it exceeds the "
            f"{self.ep.max_reassembly_bytes} bytes this rank holds for unexpected messages "
            f"from a peer"))

    def _on_send_refused(self, ev: SendRefused) -> None:
        """Under the lock: ``ev.peer`` refused a message (too large for its receive and its
        memory): the send fails at once instead of being resent until the peer is
        declared unreachable."""
        error = MessageSizeMismatch(
            ev.peer, ev.tag, ev.size, ev.expected, b"",
            f"rank {ev.peer} refused a message of {ev.size} bytes on tag {ev.tag}: its "
            f"receive expects {ev.expected} bytes, and the message exceeds the memory it "
            f"holds for unexpected messages")
        req = self._sends.pop((ev.peer, ev.msg_id), None)
        if req is not None:
            self._unhook(req.buf.obj, ev.peer)  # (frames still queued must not read it)
            req._finish(error)
            return
        self._copies.pop((ev.peer, ev.msg_id), None)  # (a frame may still hold a view)
        log.error("neuron %s: %s", self._label, error)  # an eager send, completed already

    def _on_message(self, ev: MessageReceived) -> None:
        if ev.tag == ABORT_TAG:
            if not ev.posted:
                self.ep.take_early(ev.src, ev.tag)
            self._on_abort(ev.src, bytes(ev.data))
            return
        waiting = self._recvs.get((ev.src, ev.tag))
        if waiting:  # (its buffer was bound to this position: posted, or too small)
            req = waiting.popleft()
            self._positions.pop(req, None)
            if ev.posted:
                self._complete_recv(req, ev.data)
            else:
                req._finish(MessageSizeMismatch(ev.src, ev.tag, len(ev.data), req.nbytes,
                                                ev.data))
            return
        if ev.posted:
            return  # it landed in a receive that was withdrawn since: nobody gets it
        anyone = self._any.get(ev.tag)
        while anyone and anyone[0].claim is not None and not anyone[0].claim():
            anyone.popleft()._finish(Claimed())  # (satisfied by another path meanwhile)
        if anyone:  # an early message (kept by the endpoint): the oldest such receive takes it
            req = anyone.popleft()
            req.source = ev.src
            # (the endpoint keeps the message this event reports)
            self._complete_recv(req, self.ep.take_early(ev.src, ev.tag))  # type: ignore[arg-type]

    def _on_abort(self, peer: int, data: bytes) -> None:
        kind = data[0] if data else ABORTED
        error = PeerAborted(peer, data[1:].decode("utf-8", "replace"), kind, network=True)
        self._failed[peer] = error
        log.info("neuron %s: %s", self._label, error)
        self._fail_peer_requests(peer, error)

    def _fail_peer_requests(self, peer: int, error: Exception) -> None:
        if all(p in self._failed for p in self._expected):  # nobody left to send to us
            for q in self._any.values():
                for req in q:
                    req._finish(error)
            self._any.clear()
        for key in [k for k in self._sends if k[0] == peer]:
            req = self._sends.pop(key)
            self.ep.cancel_send(*key)  # no segment of it goes out again, and none that is
            self._unhook(req.buf.obj, peer)  # queued on a rail (another group's, too) reads
            req._finish(error)  # its buffer after it failed
        for key in [k for k in self._copies if k[0] == peer]:
            del self._copies[key]
        for key in [k for k in self._recvs if k[0] == peer]:
            for req in self._recvs.pop(key):
                self._fail_recv(req, error)

    def abort(self, reason: str, kind: int = ABORTED, grace: float = 0.5) -> None:
        """Tell every peer that this rank failed the group, then close.

        Peers' pending and later requests to or from this rank fail with ``PeerAborted``
        carrying ``reason`` and ``kind`` (so every rank can raise the same error class).
        Rails not open yet are opened for it, within half of ``grace``; waits at most
        ``grace`` seconds in all for the notices to be acknowledged.
        """
        payload = bytes([kind]) + reason.encode("utf-8", "replace")[:4000]
        reqs = []
        deadline = time.monotonic() + grace
        with self._lock:
            # Every peer but those that failed us: a peer this rank failed itself by
            # withdrawing a request, and has not told yet, is told now too.
            told = {p for p in self._expected if p not in self._failed or p in self._notices}
        if not self._closed:
            for peer in sorted(told - self._up):
                try:
                    self._open_rails(peer, deadline - grace / 2, notice=True)
                except Exception:  # noqa: BLE001 - best effort: it learns otherwise
                    pass
        with self._lock:
            if self._closed:
                return
            for peer in sorted(self._up):
                if peer in told:
                    msg_id = self._send_notice(peer, payload)
                    if msg_id is None:
                        continue
                    req = Request(peer, ABORT_TAG, memoryview(payload), True, self)
                    self._sends[(peer, msg_id)] = req
                    reqs.append(req)
            self._pump()
        for req in reqs:
            try:
                req.wait(deadline)
            except Exception:  # noqa: BLE001 - best effort
                pass
        self.close(PeerAborted(self.rank, reason, kind))

    def _on_peer_failed(self, ev: PeerFailed) -> None:
        error = PeerUnreachable(ev.peer, f"rank {ev.peer} is unreachable: {ev.reason}")
        if isinstance(self._failed.get(ev.peer), PeerAborted):
            return  # it told us why before its rails went
        self._failed[ev.peer] = error
        busy = any(k[0] == ev.peer for k in self._sends) or any(
            k[0] == ev.peer and q for k, q in self._recvs.items())
        # A peer that closes its end while nothing is pending is usually just done.
        (log.error if busy and not self._closed else log.info)("neuron %s: %s", self._label,
                                                                 error)
        self._fail_peer_requests(ev.peer, error)
        self._detach(ev.peer)  # (its rails close, or the peer is told with a LEAVE)

    def _rail_lost(self, rail: Rail, peer: int, reason: str, claimed: bool) -> None:
        """Under the lock: ``rail`` of a link this group uses to ``peer`` broke (links.py);
        ``claimed``: a payload for this group was being read on it."""
        if claimed:  # (a trailer follows a payload read in place)
            self.ep.release_claims(peer, rail.index)
        join = self._joins.get(peer)
        if join is not None and join.link is rail.link:
            self._abandon_join(peer)  # (whoever waits for the rails dials instead)
            return
        if self._link_of.get(peer) is rail.link:
            self._lose_rail(rail, peer, reason)

    def _lose_rail(self, rail: Rail, peer: int, reason: str) -> None:
        """Under the lock: this group has lost ``rail`` to ``peer``; its traffic moves to the
        peer's other rails.

        While the rails are being opened, a broken one fails the pair at the acceptor,
        unless the peer has dialed every rail and been answered: it holds them up and sends
        already, though the listener's threads may not have handed the last ones over here
        yet (``_answered_all``); then it is one rail lost, as a moment later. At the dialer
        it is one rail lost too: the acceptor may hold every rail up already (its answer to
        the last dial is on its way here) and send on them; the dials left decide. When the
        acceptor failed the pair, it refuses them, and the dialer fails it too.
        """
        if not self._closed:
            log.log(logging.INFO if reason.startswith(CLEAN_EOF) else logging.WARNING,
                    "neuron %s: rail %d to rank %d failed: %s", self._label, rail.index,
                    peer, reason)
        if peer not in self._failed and not self._closed:
            if (peer not in self._up and not self._answered_all(peer)
                    and self._links.get(peer) is not _DIALING):
                self._link_failed(peer, PeerUnreachable(
                    peer, f"rail {rail.index} to rank {peer} broke while the rails "
                          f"were being opened: {reason}"))
                return
            self.ep.rail_failed(rail.index, peer)
            self._pump()

    def _answered_all(self, peer: int) -> bool:
        """Under the lock: has ``peer`` dialed every rail to this rank and been answered OK
        (each one here, or reserved until the listener's thread hands it over)?"""
        rails = self._rails.get(peer)
        return rails is not None and all(r is not None or (peer, i) in self._reserved
                                         for i, r in enumerate(rails))

    # ------------------------------------------------------------------ teardown

    def stats(self) -> dict[str, int]:
        """Protocol counters (segments sent, retransmits, duplicates, rejected frames...)."""
        with self._lock:
            return dict(self.ep.stats)

    def close(self, error: Exception | None = None) -> None:
        """Close every rail (the process's listener stops serving this group); pending
        requests fail with ``error``.

        Without ``error`` (a normal shutdown) the close is graceful: frames already queued
        (acknowledgements of what we received, above all) are written first and each rail
        is half-closed, so a peer still waiting for those acks completes normally.
        """
        if error is None and not self._closed:
            self._drain(time.monotonic() + 5.0)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            error = error or ChannelClosed(f"rdm transport of {self._label} was closed")
            self._close_error = error
            for req in self._sends.values():
                self._unhook(req.buf.obj, req.peer)  # (rails other groups keep write on)
                req._finish(error)
            for q in self._recvs.values():
                for req in q:
                    self._fail_recv(req, error)
            for q in self._any.values():
                for req in q:
                    req._finish(error)
            self._sends.clear()
            self._copies.clear()
            self._recvs.clear()
            self._any.clear()
            for peer in list(self._link_of) + list(self._joins):
                self._detach(peer)
            self._due = None
            self._connected.notify_all()
        self._stopping.set()
        self._engine.leave_group(self._gid, self.rank, self)
        self._engine.wake()
        me = threading.current_thread()
        for t in list(self._threads):
            if t is not me:
                t.join(timeout=2.0)
        progress.detach(self)

    def _drain(self, deadline: float) -> None:
        """Before a normal close: every message sent (eager ones completed long ago) must be
        acknowledged, so a peer still reading gets it all; then half-close the rails no
        other group uses and read until the peers' ends close too (no socket closes with
        unread bytes, which would send a reset that can destroy data the peer has not read
        yet). Rails other groups use stay: ``close`` sends a LEAVE on them (links.py),
        behind whatever this group still has queued there."""
        with self._lock:
            rails = []  # of the links no other group uses: this close closes them
            for link in set(self._link_of.values()):
                if set(link.members) == {(self._context, self.rank)}:
                    link.closing = True  # (no group joins it any more)
                    self._engine.unpublish(link)
                    rails += [r for r in link.rails if r is not None]
            self.ep.release_acks()  # the peers' drains wait for them
            self._pump()

        def settled() -> bool:
            with self._lock:
                peers = [p for p in self._rails if p not in self._failed]
                unacked = sum(self.ep.inflight_bytes(p) for p in peers)
                return unacked == 0 and not any(r.out for r in rails if r.alive)

        self._engine.drive(settled, deadline)
        with self._lock:
            for r in rails:
                if r.alive:
                    try:
                        r.sock.shutdown(socket.SHUT_WR)  # FIN after the queued bytes
                    except OSError:
                        pass
        self._engine.drive(lambda: not any(r.alive for r in rails),
                           min(deadline, time.monotonic() + 0.2))


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)
