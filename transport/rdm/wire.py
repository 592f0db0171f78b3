"""The wire of one group's rdm transport: its endpoint's frames to and from the rails.

How it works
------------
The endpoint (protocol.py) is sans-I/O: it hands over frames to send and takes frames
read. This module is where they meet the rails (links.py), under the process's network
lock (progress.NET_LOCK).

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
  header is even copied out, to ``Wire.take_whole``: ``Endpoint.take_whole`` checks it,
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


The endpoint's events (a send acknowledged, a message delivered, a peer failed) are acted
on by ``handle_events``: requests complete or fail through pending.py.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from . import frames as F
from . import links
from .links import (_ASIDE, _HEADER, _OUT, _PAYLOAD, _TRAILER, AHEAD_AFTER_LARGE, INBUF, Rail,
                    stage_to)
from .protocol import (FrameRejected, MessageReceived, MessageRefused, PeerFailed,
                       SendCompleted, SendRefused, Transmit)
from .railmac import TAG as _MAC_TAG

if TYPE_CHECKING:
    from .driver import RdmTransport
    from .frames import Bytes

log = logging.getLogger("neuron_dist.rdm")

_HEAD = links.PREFIX + F.HEADER_SIZE  # a frame's bytes on a rail before its payload


class Wire:
    """Moves the frames of ``owner``'s endpoint between it and the owner's rails: writes
    what the endpoint sends (``write_now``, ``pump``), places what the rails read
    (``take_whole``, ``on_header``, ``on_stage``: links.py calls them), keeps the
    endpoint's timer (``due``, ``on_tick``) and acts on its events (``handle_events``).
    Made before the owner joins the progress engine, which reads ``due`` from then on.
    """

    def __init__(self, owner: RdmTransport, max_payload: int, eager_bytes: int,
                 abort_tag: int):
        self._owner = owner
        self.ep, self._pending, self._rails = owner.ep, owner.pending, owner.opening.rails
        self._lock = owner.lock
        self._rank, self._world_size, self._label = owner.rank, owner.world_size, owner.label
        self._prefix = owner.prefix
        self._max_payload, self._eager_bytes, self._abort_tag = (max_payload, eager_bytes,
                                                                 abort_tag)
        self._any = self._pending.any
        self._recvs, self._positions = self._pending.recvs, self._pending.positions
        # The endpoint's next deadline, as last computed: the engine calls on_tick once it
        # has passed (and sleeps in epoll no longer than until it).
        self.due: float | None = None

    def write_now(self, peer: int, sent: tuple[int, int, bytes, Bytes, bytes],
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
            self.put(Transmit(peer, index, header, payload, trailer))
        ep = self.ep
        due = self.due
        if due is None or due > now + ep.rto:
            self.due = due = ep.next_deadline()
            # (not None: the frame just written waits for its ack)
            self._owner.engine.due_changed(due)  # type: ignore[arg-type]
        if ep.has_work:
            self.pump()

    def put(self, tx: Transmit) -> None:
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

    def bulk_pending(self) -> bool:
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
        return self._pending.needs_progress(self._eager_bytes)

    def on_tick(self, now: float) -> None:
        due = self.due
        if due is not None and now >= due:
            with self._lock:
                if not self._owner.closed:
                    self.pump(deadline_passed=True)

    def take_whole(self, rail: Rail, peer: int, buf: memoryview, lo: int, hi: int,
                   touched: set[RdmTransport]) -> int:
        """Under the lock (links.read): a frame for this group from ``peer`` starts at
        ``buf[lo]`` (its prefix) and ``buf[:hi]`` is read. When the endpoint takes it whole
        (``Endpoint.take_whole``: a small message next in its stream) the receive waiting
        for it completes here, and the frame's end is returned; else 0 (nothing done: the
        link reads it stage by stage, ``on_header``). ``touched`` gets this transport if
        the endpoint has more for ``pump``."""
        ep = self.ep
        if ep.pending_events:  # (earlier frames' deliveries complete their receives first)
            self.handle_events()
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
                    req.finish()
                else:
                    self._pending.complete_recv(req, data)
        elif tag == self._abort_tag or self._any:
            self._pending.on_message(MessageReceived(peer, tag, msg_id, data, False))
        # (pump acts on the acks' events and on held acks' deadline: ack_delay)
        hint = ep.ack_hint
        if ep.pending_events or ep.has_work or (hint != math.inf and (self.due is None
                                                                 or hint < self.due)):
            touched.add(self._owner)
        return end

    def on_header(self, rail: Rail) -> None:
        """Under the lock: the header of a frame for this group is read on ``rail`` (its
        prefix named this group, and the link checked its tag: links.py); place the rest."""
        ep, mac, peer = self.ep, rail.mac, rail.rpeer
        try:
            h = F.decode_header(rail.head, world_size=self._world_size,
                                max_message_bytes=ep.max_message_bytes,
                                max_payload=self._max_payload, require_crc=ep.crc)
            if h.src != peer or h.dst != self._rank:
                raise F.FrameError(f"frame from rank {h.src} to {h.dst} on a rail "
                                   f"between ranks {peer} and {self._rank}")
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

    def on_stage(self, rail: Rail) -> None:
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

    def pump(self, deadline_passed: bool = False) -> None:
        """Under the lock: act on the endpoint's events (completing requests), then write
        the frames it wants sent."""
        ep = self.ep
        if ep.pending_events:
            self.handle_events()
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
            self.handle_events()  # poll_transmit may have declared a peer failed
        due = ep.next_deadline()
        hint = ep.take_ack_hint()
        if hint != math.inf and (due is None or hint < due):
            due = hint
        if due is not None and (self.due is None or due < self.due):
            self._owner.engine.due_changed(due)
        self.due = due

    def handle_events(self) -> None:
        for ev in self.ep.events():
            if isinstance(ev, SendCompleted):
                self._pending.send_completed(ev.peer, ev.msg_id)
            elif isinstance(ev, MessageReceived):
                self._pending.on_message(ev)
            elif isinstance(ev, PeerFailed):
                self._owner.on_peer_failed(ev)
            elif isinstance(ev, FrameRejected):
                log.error("neuron %s: rejected a frame on rail %d: %s", self._label, ev.rail,
                          ev.reason)
            elif isinstance(ev, MessageRefused):
                self._pending.on_refused(ev)
            elif isinstance(ev, SendRefused):
                error = self._pending.on_send_refused(ev)
                if error is not None:  # (an eager send, completed already)
                    log.error("neuron %s: %s", self._label, error)
