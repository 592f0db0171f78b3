"""Socket driver of the rdm transport: N authenticated TCP rails per pair of ranks.

How it works
------------
Every process listens on one TCP socket per interface address (port 0; listener.py),
shared by all its groups, and a rank publishes ``host:port`` for each of its groups. The
rails to a peer are opened on first use, by dialing or by joining another group's link to
the peer's process (opening.py, dialing.py, links.py). All protocol logic lives in the
sans-I/O ``protocol.Endpoint`` (one per group). This module is the transport's face: the
requests (``isend``, ``irecv``, ``irecv_any``, ``cancel``), abort and close. Its parts,
under the process's network lock (progress.NET_LOCK): the rails (opening.py), the frames
between the endpoint and the rails (wire.py), the requests not ended yet (pending.py) and
the abort notices (notices.py).

Rails are non-blocking sockets in the process's one progress engine (progress.py), which
every transport (every group) of the process shares. There are no reader or writer
threads: a thread that waits for a request drives the engine itself, so the bytes that
complete its request are read by the thread that wants them, and the engine's background
thread drives it only while nobody waits.

Frames go out as soon as the endpoint hands them over and are read into place as they
come (wire.py).

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
import socket
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

from ..base import ClaimableRequest, SharedAnySource
from ..errors import ABORTED, ChannelClosed, Claimed, PeerAborted, PeerUnreachable
from ..requests import TIMEOUT_GRACE, Request as _Request
from . import frames as F
from . import handshake, links, progress
from .links import Rail
from .notices import AbortNotices
from .opening import RailOpening
from .pending import Pending
from .wire import Wire
from .protocol import DELAYED_ACK_BYTES, Endpoint, PeerFailed

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

    __slots__ = ("_owner",)

    def __init__(self, peer: int | None, tag: int, buf: memoryview, is_send: bool,
                 owner: RdmTransport):
        super().__init__(peer, tag, buf, is_send, owner.engine.callbacks)
        self._owner = owner

    def on_complete(self, callback: Callable[[_Request], object]) -> None:
        super().on_complete(callback)
        if not self.completion.is_set():
            self._owner.engine.kick()  # someone waits for it without driving

    def wait(self, deadline: float) -> None:
        event = self.completion
        if not event.done and self.callback is None:
            # (the usual wait, in one step: no callback to run on the way out)
            start = time.monotonic()
            owner = self._owner
            if (not owner.engine.drive(event.is_set, deadline, event, owner.spin)
                    and not self._block(time.monotonic() + TIMEOUT_GRACE)):
                raise self._timed_out(deadline, start)
        elif not event.done:
            super().wait(deadline)
            return
        if self.error is not None:
            raise self.error

    def _block(self, deadline: float) -> bool:
        event = self.completion
        self._waiting.append(None)
        try:
            owner = self._owner
            owner.engine.drive(event.is_set, deadline, event, owner.spin)
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
        self.label = label or f"rank {rank}"
        self._mac = (frame_mac or payload_mac, payload_mac)
        self.ep = Endpoint(rank, world_size, rails, segment_bytes, 1 << 48, rto=rto,
                           max_rto=max(rto, 30.0), max_retries=6, window_bytes=window_bytes,
                           max_reassembly_bytes=max_unexpected_bytes, crc=crc,
                           ack_delay=ack_delay, notice_tags=(ABORT_TAG,))
        self._max_payload = max(segment_bytes, F.MAX_ACKS_PER_FRAME * F.ACK_ENTRY.size)
        # One lock for every transport of the process: they share rails (links.py). An
        # RLock: a callback may post from inside a completion.
        self.lock = progress.NET_LOCK
        self._eager_window = min(window_bytes, EAGER_WINDOW_BYTES)
        self.failed: dict[int, Exception] = {}  # peer -> why it is failed for this group
        self.closed = False
        # what closed it (close(error)), named by later calls
        self._close_error: Exception | None = None
        self._hosts = [host] if isinstance(host, str) else list(host)
        # The rails to the peers (opening.py); the three collections read on every message
        # are the opening's own, under names of their own here.
        self.opening = RailOpening(self, key=key, group=group, hosts=self._hosts,
                                   mac=self._mac, link_timeout=link_timeout)
        self._rails, self._up = self.opening.rails, self.opening.up
        self._expected = self.opening.expected
        # The requests not ended yet (pending.py); likewise its collections.
        self.notices = AbortNotices(self, ABORT_TAG)  # (notices.py)
        self.pending = Pending(self.ep, self._rails, self._expected, self.failed,
                               self._eager_window, self.notices.heard, ABORT_TAG)
        self._sends, self._copies, self._pool = (self.pending.sends, self.pending.copies,
                                                 self.pending.pool)
        self._recvs, self._positions = self.pending.recvs, self.pending.positions
        self._gid = handshake.group_id(group)
        self.context = links.context_of(self._gid)
        self.prefix = links.prefix_of(self.context)
        # The endpoint's frames to and from the rails (wire.py), before the engine sees us.
        self.wire = Wire(self, self._max_payload, EAGER_BYTES, ABORT_TAG)
        self.engine = progress.attach(self)
        try:
            self.address = ",".join(self.engine.listen(h, port_range) for h in self._hosts)
        except BaseException:
            progress.detach(self)
            raise
        self.engine.join_group(self._gid, rank, self, self.context)

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

    def rail_failed(self, index: int, peer: int) -> None:
        """Under the lock: rail ``index`` to ``peer`` is lost: the endpoint resends what it
        carried on the peer's other rails."""
        self.ep.rail_failed(index, peer)
        self.wire.pump()

    def rail_restored(self, index: int, peer: int) -> None:
        """Under the lock: rail ``index`` to ``peer`` is connected again: send on it."""
        if not self.closed:
            self.ep.rail_restored(index, peer)
            self.wire.pump()

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
        with self.lock:
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
                    self.wire.write_now(peer, sent, now)
                    if callback is None:
                        return _Request.completed(peer, tag, view)
                    req = Request(peer, tag, view, True, self)
                    req.callback = callback
                    req.finish()
                    return req
            if n > EAGER_BYTES or ep.backlog_bytes(peer) >= self._eager_window:
                req = Request(peer, tag, view, True, self)
                req.callback = callback
                self._sends[(peer, ep.send(peer, tag, view))] = req
                self.wire.pump()
                if callback is not None or ep.mid_transfer():
                    self.engine.kick()  # see Wire.bulk_pending
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
                self.wire.pump()
                if ep.mid_transfer():
                    self.engine.kick()
            else:
                if pooled is not None:
                    self._copies[(peer, sent[0])] = pooled
                self.wire.write_now(peer, sent, now)
        if callback is None:
            return _Request.completed(peer, tag, view)
        req = Request(peer, tag, view, True, self)
        req.callback = callback
        req.finish()
        return req

    def irecv(self, peer: int, tag: int, buf: Buffer,
              callback: Callable[[NetRequest], object] | None = None) -> Request:
        """Receive the next message of ``(peer, tag)`` into ``buf`` (exactly its size)."""
        view = memoryview(buf).cast("B")
        req = Request(peer, tag, view, False, self)
        req.callback = callback
        with self.lock:
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
            if ep.pending_events:  # (a message known to be too large for it was refused)
                self.wire.pump()
        if req.nbytes > EAGER_BYTES or callback is not None:
            self.engine.kick()  # see Wire.bulk_pending
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
        with self.lock:
            if self.closed:
                raise self._closed_error()
            if claim is not None and self.ep.peek_early_any(tag) is not None and not claim():
                req.finish(Claimed())
                return req
            early = self.ep.take_early_any(tag)
            if early is not None:
                req.source = early[0]
                self.pending.complete_recv(req, early[1])
                return req
            alive = [p for p in self._expected if p not in self.failed]
            if not alive:
                raise next(iter(self.failed.values()), ValueError("no peer connected"))
            self.pending.posted.post_any(req, tag)
        if req.nbytes > EAGER_BYTES or callback is not None:
            self.engine.kick()
        return req

    def drive_until(self, done: Callable[[], bool], deadline: float) -> bool:
        """Make progress from the calling thread until ``done()`` or ``deadline``; the
        result of ``done()``. For a waiter that also waits for something else (a receive
        from any rank that shared memory may satisfy too): whoever makes ``done()`` true
        from another thread calls ``wake`` so that this thread leaves ``epoll`` at once."""
        return self.engine.drive(done, deadline, None, self.spin)

    def wake(self) -> None:
        """Make a thread in ``drive_until`` look at its condition again now."""
        self.engine.wake()

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
        with self.lock:
            self.wire.handle_events()  # (a message the endpoint delivered completes it first)
            if req.completion.is_set():
                return False
            self.pending.withdraw(req, error)
            if peer is None:
                return True
            self.notices.withdrew(peer, error)
            self.wire.pump()
        self.engine.wake()  # (a waiter of another thread sees the news at once)
        return True

    def _closed_error(self) -> Exception:
        """What a request on the closed transport raises: the error that closed it (so a
        later call names the cause), unless that was a plain close."""
        error = self._close_error
        if error is None or isinstance(error, ChannelClosed):
            return ChannelClosed(f"rdm transport of {self.label} is closed")
        return error

    def abort(self, reason: str, kind: int = ABORTED, grace: float = 0.5) -> None:
        """Tell every peer that this rank failed the group, then close.

        Peers' pending and later requests to or from this rank fail with ``PeerAborted``
        carrying ``reason`` and ``kind`` (so every rank can raise the same error class).
        Rails not open yet are opened for it, within half of ``grace``; waits at most
        ``grace`` seconds in all for the notices to be acknowledged.
        """
        self.notices.tell_all(reason, kind, grace)
        self.close(PeerAborted(self.rank, reason, kind))

    def on_peer_failed(self, ev: PeerFailed) -> None:
        """Under the lock: the endpoint declared ``ev.peer`` failed (its last rail went)."""
        error = PeerUnreachable(ev.peer, f"rank {ev.peer} is unreachable: {ev.reason}")
        if isinstance(self.failed.get(ev.peer), PeerAborted):
            return  # it told us why before its rails went
        self.failed[ev.peer] = error
        busy = self.pending.busy_with(ev.peer)
        # A peer that closes its end while nothing is pending is usually just done.
        (log.error if busy and not self.closed else log.info)("neuron %s: %s", self.label,
                                                                 error)
        self.pending.fail_peer(ev.peer, error)
        self.opening.detach(ev.peer)  # (its rails close, or the peer is told with a LEAVE)

    def rail_lost(self, rail: Rail, peer: int, reason: str, claimed: bool) -> None:
        """Under the lock: ``rail`` of a link this group uses to ``peer`` broke (links.py);
        ``claimed``: a payload for this group was being read on it."""
        if claimed:  # (a trailer follows a payload read in place)
            self.ep.release_claims(peer, rail.index)
        self.opening.rail_lost(rail, peer, reason)

    # ------------------------------------------------------------------ teardown

    def stats(self) -> dict[str, int]:
        """Protocol counters (segments sent, retransmits, duplicates, rejected frames...)."""
        with self.lock:
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
        with self.lock:
            if self.closed:
                return
            self.closed = True
            error = error or ChannelClosed(f"rdm transport of {self.label} was closed")
            self._close_error = error
            self.pending.fail_all(error)
            self.opening.detach_all()
            self.wire.due = None
        self.engine.leave_group(self._gid, self.rank, self)
        self.engine.wake()
        self.opening.stop()
        progress.detach(self)

    def _drain(self, deadline: float) -> None:
        """Before a normal close: every message sent (eager ones completed long ago) must be
        acknowledged, so a peer still reading gets it all; then half-close the rails no
        other group uses and read until the peers' ends close too (no socket closes with
        unread bytes, which would send a reset that can destroy data the peer has not read
        yet). Rails other groups use stay: ``close`` sends a LEAVE on them (links.py),
        behind whatever this group still has queued there."""
        with self.lock:
            rails = []  # of the links no other group uses: this close closes them
            for link in set(self.opening.link_of.values()):
                if set(link.members) == {(self.context, self.rank)}:
                    link.closing = True  # (no group joins it any more)
                    self.engine.unpublish(link)
                    rails += [r for r in link.rails if r is not None]
            self.ep.release_acks()  # the peers' drains wait for them
            self.wire.pump()

        def settled() -> bool:
            with self.lock:
                peers = [p for p in self._rails if p not in self.failed]
                unacked = sum(self.ep.inflight_bytes(p) for p in peers)
                return unacked == 0 and not any(r.out for r in rails if r.alive)

        self.engine.drive(settled, deadline)
        with self.lock:
            for r in rails:
                if r.alive:
                    try:
                        r.sock.shutdown(socket.SHUT_WR)  # FIN after the queued bytes
                    except OSError:
                        pass
        self.engine.drive(lambda: not any(r.alive for r in rails),
                           min(deadline, time.monotonic() + 0.2))

