"""Socket driver of the rdm transport: N authenticated TCP rails per pair of ranks.

How it works
------------
Every process listens on one TCP socket per interface address (port 0; listener.py),
shared by all its groups, and a rank publishes ``host:port`` for each of its groups. The
rails to a peer are opened on first use, by dialing or by joining another group's link to
the peer's process (opening.py, dialing.py, links.py). All protocol logic lives in the
sans-I/O ``protocol.Endpoint`` (one per group); this module moves its frames, under the
process's network lock (progress.NET_LOCK), and keeps the requests.

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
that peer fails with ``PeerUnreachable`` naming it. Lost rails are dialed again
(dialing.py, ``Healer``).

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

import logging
import math
import socket
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

from ..base import ClaimableRequest, SharedAnySource
from ..errors import (ABORTED, ABORTED_TIMEOUT, ChannelClosed, Claimed,
                      PeerAborted, PeerTimeout, PeerUnreachable)
from ..requests import TIMEOUT_GRACE, Request as _Request
from . import frames as F
from . import handshake, links, progress
from .links import (_ASIDE, _HEADER, _OUT, _PAYLOAD, _TRAILER, AHEAD_AFTER_LARGE, INBUF, Rail,
                    stage_to)
from .opening import RailOpening
from .pending import Pending
from .railmac import TAG as _MAC_TAG
from .protocol import (DELAYED_ACK_BYTES, Endpoint, FrameRejected, MessageReceived,
                       MessageRefused, PeerFailed, SendCompleted, SendRefused, Transmit)

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from ..base import NetRequest
    from .frames import Bytes

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
        self._label = label or f"rank {rank}"
        self._mac = (frame_mac or payload_mac, payload_mac)
        self.ep = Endpoint(rank, world_size, rails, segment_bytes, 1 << 48, rto=rto,
                           max_rto=max(rto, 30.0), max_retries=6, window_bytes=window_bytes,
                           max_reassembly_bytes=max_unexpected_bytes, crc=crc,
                           ack_delay=ack_delay, notice_tags=(ABORT_TAG,))
        self._max_payload = max(segment_bytes, F.MAX_ACKS_PER_FRAME * F.ACK_ENTRY.size)
        # One lock for every transport of the process: they share rails (links.py). An
        # RLock: a callback may post from inside a completion.
        self._lock = progress.NET_LOCK
        self._notices: dict[int, bytes] = {}  # peer -> abort notice to send once its rails are up
        self._eager_window = min(window_bytes, EAGER_WINDOW_BYTES)
        self.failed: dict[int, Exception] = {}  # peer -> why it is failed for this group
        self.closed = False
        # what closed it (close(error)), named by later calls
        self._close_error: Exception | None = None
        self._due: float | None = None  # the endpoint's next deadline, as last computed: the engine
        # calls _on_tick once it has passed (and sleeps in epoll no longer than until it)
        self._hosts = [host] if isinstance(host, str) else list(host)
        # The rails to the peers (opening.py); the three collections read on every message
        # are the opening's own, under names of their own here.
        self.opening = RailOpening(self, key=key, group=group, hosts=self._hosts,
                                   mac=self._mac, link_timeout=link_timeout)
        self._rails, self._up = self.opening.rails, self.opening.up
        self._expected = self.opening.expected
        # The requests not ended yet (pending.py); likewise its collections.
        self.pending = Pending(self.ep, self._rails, self._expected, self.failed,
                               self._eager_window, self._on_abort, ABORT_TAG)
        self._sends, self._copies, self._pool = (self.pending.sends, self.pending.copies,
                                                 self.pending.pool)
        self._recvs, self._positions, self._any = (self.pending.recvs, self.pending.positions,
                                                   self.pending.any)
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

    # ------------------------------------------------------------------ set-up

    def connect(self, peers: dict[int, str], deadline: float) -> None:
        """Learn where the other ranks are: ``peers`` is {rank: address}, an address being
        ``"host:port"`` or several, comma-separated, one per interface.

        No connection is opened here: the rails to a peer are opened when a message is
        first sent to it (opening.py), so a rank holds connections only to the ranks it
        talks to (in a group spanning nodes: its counterparts on the other nodes, not
        every rank). Opening rails may take as long as ``deadline`` leaves now.
        """
        self.opening.connect(peers, deadline)

    # (the calls of opening.py: what happens to this group's traffic as rails come and go)

    def check_usable(self, peer: int) -> None:
        """Under the lock: raise what a request with ``peer`` raises now, if anything: the
        transport is closed, the peer has failed, or it is not a peer of this group."""
        if self.closed:
            raise self._closed_error()
        if peer in self.failed:
            raise self.failed[peer]
        if peer not in self._expected:
            raise ValueError(f"rank {peer} is not a peer of rank {self.rank} in this group "
                             f"(ranks 0..{self.world_size - 1})")

    def fail_peer(self, peer: int, error: Exception) -> None:
        """Under the lock: ``peer`` has failed with ``error`` (unless it had already):
        every request with it fails."""
        if peer not in self.failed:
            self.failed[peer] = error
            self.pending.fail_peer(peer, error)

    def has_notice(self, peer: int) -> bool:
        """Under the lock: does an abort notice wait for ``peer``'s rails to come up?"""
        return peer in self._notices

    def peer_up(self, peer: int) -> None:
        """Under the lock: the rails to ``peer`` are up: send the abort notice that waited
        for them, if any."""
        notice = self._notices.pop(peer, None)
        if notice is not None:  # (it failed us before there were rails to tell it)
            self._send_notice(peer, notice)
            self._pump()

    def rail_failed(self, index: int, peer: int) -> None:
        """Under the lock: rail ``index`` to ``peer`` is lost: the endpoint resends what it
        carried on the peer's other rails."""
        self.ep.rail_failed(index, peer)
        self._pump()

    def rail_restored(self, index: int, peer: int) -> None:
        """Under the lock: rail ``index`` to ``peer`` is connected again: send on it."""
        if not self.closed:
            self.ep.rail_restored(index, peer)
            self._pump()

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
            self.opening.open(peer)
        view = memoryview(buf).cast("B")
        n = view.nbytes
        data: Bytes
        with self._lock:
            if self.closed or peer in self.failed or peer not in self._expected:
                self.check_usable(peer)  # (raises)
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
            if self.closed:
                raise self._closed_error()
            ep = self.ep
            if peer in self.failed or peer not in self._expected:
                # A message that arrived whole is delivered even if its sender has since
                # closed or failed: a peer that sends its last message and exits is normal.
                early = ep.take_early(peer, tag)
                if early is not None:
                    self.pending.complete_recv(req, early)
                    return req
                self.check_usable(peer)  # (raises)
            got = ep.post_recv(peer, tag, view)  # (the oldest early message, or a position)
            if type(got) is not int:  # (the message, a bytearray)
                self.pending.complete_recv(req, got)  # type: ignore[arg-type]
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
            if self.closed:
                raise self._closed_error()
            if claim is not None and self.ep.peek_early_any(tag) is not None and not claim():
                req._finish(Claimed())
                return req
            early = self.ep.take_early_any(tag)
            if early is not None:
                req.source = early[0]
                self.pending.complete_recv(req, early[1])
                return req
            alive = [p for p in self._expected if p not in self.failed]
            if not alive:
                raise next(iter(self.failed.values()), ValueError("no peer connected"))
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
            self.pending.withdraw(req, error)
            if peer is None:
                return True
            self._break_peer(peer, error)
            self._pump()
        self._engine.wake()  # (a waiter of another thread sees the news at once)
        return True

    def _break_peer(self, peer: int, error: Exception) -> None:
        """Under the lock: stop talking to ``peer`` after a withdrawn request, and tell it."""
        if peer in self.failed:
            return
        self.failed[peer] = error
        kind = ABORTED_TIMEOUT if isinstance(error, PeerTimeout) else ABORTED
        payload = bytes([kind]) + (f"rank {self.rank} withdrew a request with this rank: "
                                   f"{error}").encode("utf-8", "replace")[:4000]
        if peer in self._up:
            self._send_notice(peer, payload)
        else:  # told when it opens its rails (to send to us: only then does it need to know)
            self._notices[peer] = payload
        self.pending.fail_peer(peer, error)

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
        return self.pending.needs_progress(EAGER_BYTES)

    def _on_tick(self, now: float) -> None:
        due = self._due
        if due is not None and now >= due:
            with self._lock:
                if not self.closed:
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
                    self.pending.complete_recv(req, data)
        elif tag == ABORT_TAG or self._any:
            self.pending.on_message(MessageReceived(peer, tag, msg_id, data, False))
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
                self.pending.send_completed(ev.peer, ev.msg_id)
            elif isinstance(ev, MessageReceived):
                self.pending.on_message(ev)
            elif isinstance(ev, PeerFailed):
                self._on_peer_failed(ev)
            elif isinstance(ev, FrameRejected):
                log.error("neuron %s: rejected a frame on rail %d: %s", self._label, ev.rail,
                          ev.reason)
            elif isinstance(ev, MessageRefused):
                self.pending.on_refused(ev)
            elif isinstance(ev, SendRefused):
                error = self.pending.on_send_refused(ev)
                if error is not None:  # (an eager send, completed already)
                    log.error("neuron %s: %s", self._label, error)

    def _on_abort(self, peer: int, data: bytes) -> None:
        kind = data[0] if data else ABORTED
        error = PeerAborted(peer, data[1:].decode("utf-8", "replace"), kind, network=True)
        self.failed[peer] = error
        log.info("neuron %s: %s", self._label, error)
        self.pending.fail_peer(peer, error)

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
            told = {p for p in self._expected if p not in self.failed or p in self._notices}
        if not self.closed:
            for peer in sorted(told - self._up):
                try:
                    self.opening.open(peer, deadline - grace / 2, notice=True)
                except Exception:  # noqa: BLE001 - best effort: it learns otherwise
                    pass
        with self._lock:
            if self.closed:
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
        if isinstance(self.failed.get(ev.peer), PeerAborted):
            return  # it told us why before its rails went
        self.failed[ev.peer] = error
        busy = self.pending.busy_with(ev.peer)
        # A peer that closes its end while nothing is pending is usually just done.
        (log.error if busy and not self.closed else log.info)("neuron %s: %s", self._label,
                                                                 error)
        self.pending.fail_peer(ev.peer, error)
        self.opening.detach(ev.peer)  # (its rails close, or the peer is told with a LEAVE)

    def _rail_lost(self, rail: Rail, peer: int, reason: str, claimed: bool) -> None:
        """Under the lock: ``rail`` of a link this group uses to ``peer`` broke (links.py);
        ``claimed``: a payload for this group was being read on it."""
        if claimed:  # (a trailer follows a payload read in place)
            self.ep.release_claims(peer, rail.index)
        self.opening.rail_lost(rail, peer, reason)

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
        if error is None and not self.closed:
            self._drain(time.monotonic() + 5.0)
        with self._lock:
            if self.closed:
                return
            self.closed = True
            error = error or ChannelClosed(f"rdm transport of {self._label} was closed")
            self._close_error = error
            self.pending.fail_all(error)
            self.opening.detach_all()
            self._due = None
        self._engine.leave_group(self._gid, self.rank, self)
        self._engine.wake()
        self.opening.stop()
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
            for link in set(self.opening.link_of.values()):
                if set(link.members) == {(self._context, self.rank)}:
                    link.closing = True  # (no group joins it any more)
                    self._engine.unpublish(link)
                    rails += [r for r in link.rails if r is not None]
            self.ep.release_acks()  # the peers' drains wait for them
            self._pump()

        def settled() -> bool:
            with self._lock:
                peers = [p for p in self._rails if p not in self.failed]
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

