"""The rdm endpoint's send path (protocol.py: "Sending" and "Retransmission").

How it works
------------
``send`` numbers a message, gives it the next position of its ``(peer, tag)`` stream and
queues it. ``_send_new`` (from ``poll_transmit``) cuts it into segments as the window and
the open-message limit allow, each on the rail ``_pick_rail`` chooses; ``_transmit``
frames a segment, with the acks waiting for that peer behind it, and sets its
retransmission deadline. ``send_now`` does all of that in one step for a message of one
segment when nothing waits to go before it: the small message's fast path.
``_resend_due`` resends the segments moved off a failed rail and those past their
deadline (backed off, on another rail), and fails the peer after ``max_retries`` resends
of one segment. ``cancel_send`` (and a refusal) forgets a message (``_forget``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from . import frames as F
from .acks import Acks
from .events import Transmit
from .peer_state import OutMessage, PeerState, Segment, byte_view

if TYPE_CHECKING:
    from .frames import Bytes

# A message is cut into one segment per rail only while segments stay MIN_SPRAY_BYTES or
# more (protocol.py, "Sending"): small and mid-sized messages move faster on one rail than
# spread evenly over all (docs/design.md, "Thresholds and why").
MIN_SPRAY_BYTES = 4 << 20


class Sending(Acks):
    """The messages an ``Endpoint`` sends, until every segment is acknowledged."""

    def send(self, peer: int, tag: int, data: Bytes) -> int:
        """Queue message ``data`` for ``peer`` on stream ``tag``.

        Parameters
        ----------
        peer : int
            Destination rank (not this rank).
        tag : int
            Non-negative tag; messages of one ``(peer, tag)`` are delivered in send order.
        data : bytes-like
            The message. Not copied: keep it unchanged until ``SendCompleted``.

        Returns
        -------
        int
            The message id, as reported by ``SendCompleted``.

        Raises
        ------
        ProtocolError
            ``peer`` has failed.
        ValueError
            Bad peer or tag, or the message is larger than ``max_message_bytes``.
        """
        state = self._peer(peer)
        if not 0 <= tag <= 0x7FFFFFFFFFFFFFFF:
            raise ValueError(f"tag must be a non-negative 64-bit integer, not {tag!r}")
        view = byte_view(data)
        if view.nbytes > self.max_message_bytes:
            raise ValueError(f"message of {view.nbytes} bytes exceeds max_message_bytes "
                             f"{self.max_message_bytes}")
        seq = state.tag_seq.get(tag, 0)
        state.tag_seq[tag] = seq + 1
        # Cut into at least one segment per rail (when segments stay >= MIN_SPRAY_BYTES),
        # so a mid-sized message is sprayed over every rail instead of riding one.
        seg_bytes = min(self.segment_bytes,
                        max(MIN_SPRAY_BYTES, -(-view.nbytes // self.nrails)))
        msg = OutMessage(state.next_msg_id, tag, seq, view, seg_bytes,
                          nsegs=max(1, -(-view.nbytes // seg_bytes)))
        state.next_msg_id += 1
        state.open[msg.msg_id] = msg
        state.queue.append(msg)
        state.backlog += view.nbytes
        self.has_work = True
        return msg.msg_id

    def send_now(self, peer: int, tag: int, data: Bytes, now: float, notify: bool = True
                 ) -> tuple[int, int, bytes, Bytes, bytes] | None:
        """``send`` a message of one segment and frame it at once, when nothing waits to go
        to ``peer`` before it: ``(msg_id, rail, header, payload, trailer)``, the frame to
        put on ``rail`` (as a ``Transmit`` of those fields would carry it), or None when the
        message was not taken (then ``send`` it: it queues behind what waits, or raises
        what ``send`` raises).

        The fast path of small messages: what ``send`` then ``poll_transmit`` would do for
        it, without visiting every peer. Acks waiting for ``peer`` ride on the frame; the
        segment's retransmission deadline is ``now + rto`` (``next_deadline`` may now be
        earlier than the driver thought). ``data`` must not change until acknowledged.
        ``notify=False``: no ``SendCompleted`` is reported for it (a driver that completed
        the send already, holding no buffer to free on the ack, has nothing to do then).
        """
        state = self._peers.get(peer)
        n = len(data)
        if (state is None or state.queue or state.urgent or self.crc
                or n > self.segment_bytes or n > self.max_message_bytes
                or (state.inflight and state.inflight + n + F.HEADER_SIZE > self.window_bytes)
                or state.next_msg_id >= state.sent_done.low + self.max_open_messages
                or not 0 <= tag <= 0x7FFFFFFFFFFFFFFF):
            return None
        seq = state.tag_seq.get(tag, 0)
        state.tag_seq[tag] = seq + 1
        msg_id = state.next_msg_id
        state.next_msg_id = msg_id + 1
        msg = OutMessage(msg_id, tag, seq, memoryview(data), n or 1, 1, 1, 1, notify)
        state.open[msg_id] = msg
        rail = self._pick_rail(state)
        cost = n + F.HEADER_SIZE  # (Segment.cost)
        state.rail_bytes[rail] += cost
        state.inflight += cost
        deadline = now + self.rto  # (_transmit's, for a first send: max_rto >= rto)
        state.unacked[(msg_id, 0)] = Segment(msg, 0, n, rail, deadline)
        if deadline < state.scan_at:
            state.scan_at = deadline
        trailer = self._take_acks(state) if state.acks_out else b""
        self.stats["sent"] += 1
        return msg_id, rail, F.HEADER.pack(F.MAGIC, F.VERSION, F.DATA, 0, rail,
                                           len(trailer) >> 4, self.rank, peer, msg_id, tag,
                                           seq, n, 0, n, 0), data, trailer

    def _transmit(self, peer: int, seg: Segment, now: float) -> Transmit:
        msg = seg.msg
        payload = msg.data[seg.offset:seg.offset + seg.length]
        state = self._peers[peer]
        trailer = self._take_acks(state) if state.acks_out else b""
        if self.crc:
            header = F.encode_header(F.DATA, self.rank, peer, msg_id=msg.msg_id, tag=msg.tag,
                                     seq=msg.seq, total=msg.data.nbytes, offset=seg.offset,
                                     payload=payload, rail=seg.rail, crc=True, trailer=trailer)
        else:
            header = F.pack_data_header(self.rank, peer, msg.msg_id, msg.tag, msg.seq,
                                        msg.data.nbytes, seg.offset, seg.length, seg.rail,
                                        len(trailer) // F.ACK_ENTRY.size)
        seg.deadline = deadline = now + min(self.rto * self.backoff ** seg.retries, self.max_rto)
        if deadline < state.scan_at:
            state.scan_at = deadline
        self.stats["sent"] += 1
        return Transmit(peer, seg.rail, header, payload, trailer)

    def _move(self, state: PeerState, seg: Segment, rail: int) -> None:
        state.rail_bytes[seg.rail] -= seg.cost
        seg.rail = rail
        state.rail_bytes[rail] += seg.cost

    def _resend_due(self, peer: int, state: PeerState, now: float, out: list[Transmit]) -> bool:
        """Resend moved and timed-out segments; False if the peer failed meanwhile."""
        resent: set[tuple[int, int]] = set()
        while state.urgent:
            key = state.urgent.popleft()
            seg = state.unacked.get(key)
            if seg is None or key in resent:
                continue
            if not state.rails[seg.rail]:
                self._move(state, seg, self._pick_rail(state))
            out.append(self._transmit(peer, seg, now))
            self.stats["retransmits"] += 1
            resent.add(key)
        if now < state.scan_at:
            return True  # nothing can be due yet: spare the scan on every call
        for key, seg in list(state.unacked.items()):
            if seg.deadline > now or key in resent:
                continue
            if seg.retries >= self.max_retries:
                self._fail(peer, f"rank {peer} did not acknowledge message {key[0]} "
                                 f"(offset {key[1]}) after {seg.retries} retransmissions")
                return False
            seg.retries += 1
            self._move(state, seg, self._pick_rail(state, avoid=seg.rail))
            out.append(self._transmit(peer, seg, now))
            self.stats["retransmits"] += 1
        state.scan_at = min((seg.deadline for seg in state.unacked.values()), default=math.inf)
        return True

    def _send_new(self, peer: int, state: PeerState, now: float, out: list[Transmit]) -> None:
        while state.queue:
            msg = state.queue[0]
            if msg.next_seg == 0 and msg.msg_id >= state.sent_done.low + self.max_open_messages:
                return
            offset = msg.next_seg * msg.seg_bytes
            length = min(msg.seg_bytes, msg.data.nbytes - offset)
            cost = length + F.HEADER_SIZE  # (Segment.cost)
            if state.inflight and state.inflight + cost > self.window_bytes:
                return  # the window is full (one segment may always be outstanding)
            seg = Segment(msg, offset, length, rail=self._pick_rail(state))
            state.rail_bytes[seg.rail] += cost
            state.inflight += cost
            state.unacked[(msg.msg_id, offset)] = seg
            state.backlog -= length
            msg.unacked += 1
            msg.next_seg += 1
            if msg.next_seg == msg.nsegs:
                state.queue.popleft()
            out.append(self._transmit(peer, seg, now))

    def cancel_send(self, peer: int, msg_id: int) -> bool:
        """Forget message ``msg_id`` to ``peer``: no segment of it is sent or resent again,
        so its data is free once the driver has dropped the frames it still holds.

        The receiver never completes it, so its stream is stuck from then on: the caller
        must fail the stream's users (tell the peer). Returns False if it had completed.
        """
        state = self._peers.get(peer)
        if state is None or (msg := state.open.get(msg_id)) is None:
            return False
        self._forget(state, msg)
        return True

    def _forget(self, state: PeerState, msg: OutMessage) -> None:
        """No segment of ``msg`` is sent or resent again; its id is done."""
        del state.open[msg.msg_id]
        try:
            state.queue.remove(msg)
            state.backlog -= max(0, msg.data.nbytes - msg.next_seg * msg.seg_bytes)
        except ValueError:
            pass
        for key in [k for k in state.unacked if k[0] == msg.msg_id]:
            seg = state.unacked.pop(key)
            state.inflight -= seg.cost
            state.rail_bytes[seg.rail] -= seg.cost
        state.sent_done.add(msg.msg_id)
        self.has_work = True  # the window may have opened


__all__ = ["MIN_SPRAY_BYTES", "Sending"]
