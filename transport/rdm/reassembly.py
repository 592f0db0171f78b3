"""The rdm endpoint's receive path for frames it does not take whole: segments placed by
offset (protocol.py: "Reassembly", "Buffer ownership" and "Limits").

How it works
------------
``receive`` takes in a whole frame (a datagram driver's, or one a stream driver read
aside): it decodes and checks it, gives its acks to ``_on_ack`` and places a DATA segment
(``_on_data``). ``data_target`` and ``data_landed`` are the same in two halves for a
stream driver that reads a payload in place: the first claims the segment's range of the
message's buffer for the rail, the second counts it landed. A message's first segment
opens its record (``_start``): the posted buffer when it is large enough, else private
memory within the peer's budget (``_over_budget``). An exact duplicate is acked again, an
overlap is garbage, a range another rail is reading is dropped unacked. The last byte
hands the message to delivery (``_finish``). ``cancel_recv`` withdraws a posted buffer and
returns the rails that may still write into it; ``release_claims`` ends a rail's claims.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import TYPE_CHECKING

from . import frames as F
from .events import ProtocolError
from .peer_state import InMessage, PeerState, Stream
from .refusal import Refusal

if TYPE_CHECKING:
    from .frames import Bytes

NOTICE_BYTES = 4096  # a notice_tags message up to this size always finds memory


class Reassembly(Refusal):
    """Frames of an ``Endpoint``'s incoming messages, placed segment by segment."""

    def receive(self, rail: int, frame_bytes: Bytes, now: float) -> None:
        """Take in one frame that arrived on ``rail``; results come out of ``events()``.

        Frames may come in any order, duplicated, on any rail. Garbage produces
        ``FrameRejected`` and changes nothing else.
        """
        if not 0 <= rail < self.nrails:
            raise ValueError(f"no rail {rail} (rails 0..{self.nrails - 1})")
        try:
            frame = F.decode(frame_bytes, world_size=self.world_size,
                             max_message_bytes=self.max_message_bytes, require_crc=self.crc)
            if frame.dst != self.rank or frame.src == self.rank:
                raise F.FrameError(f"frame from {frame.src} to {frame.dst} reached rank {self.rank}")
        except F.FrameError as e:
            self._reject(rail, str(e))
            return
        if frame.src in self._failed:
            return
        try:
            state = self._peer(frame.src)
        except ProtocolError:
            return
        if frame.type == F.ACK or frame.piggyback:
            self._on_ack(frame.src, state, frame.acks)
        if frame.type == F.DATA:
            self._on_data(rail, state, frame, now)
        elif frame.type == F.REFUSE:
            self._on_refuse(rail, frame.src, state, frame)

    def _on_data(self, rail: int, state: PeerState, frame: F.Frame, now: float) -> None:
        if frame.msg_id in state.recv_done:
            if frame.msg_id in state.refused:  # never acked: it is refused again
                state.refusals_out.setdefault(frame.msg_id, rail)
                self.has_work = True
                return
            self.stats["duplicates"] += 1
            self._ack(state, rail, frame.msg_id, frame.offset, frame.total, now, urgent=True)
            return
        if frame.msg_id >= state.recv_done.low + self.max_open_messages:
            self._reject(rail, f"message {frame.msg_id} from rank {frame.src} is beyond the "
                               f"open-message window (oldest open {state.recv_done.low})")
            return
        r = state.partial.get(frame.msg_id)
        if r is None:
            stream = state.streams.get(frame.tag)
            if self._over_budget(state, stream, frame):
                if frame.total > self.max_reassembly_bytes:
                    self._too_large(rail, frame.src, state, stream, frame)
                return
            r = self._start(rail, state, frame)
            if r is None:
                return
        elif (r.tag, r.seq, r.total) != (frame.tag, frame.seq, frame.total):
            self._reject(rail, f"message {frame.msg_id} from rank {frame.src}: header "
                               f"(tag {frame.tag}, seq {frame.seq}, total {frame.total}) differs "
                               f"from its first segment ({r.tag}, {r.seq}, {r.total})")
            return
        duplicate = r.lengths.get(frame.offset) == len(frame.payload)
        if not self._place(rail, r, frame):
            return
        self._ack(state, rail, frame.msg_id, frame.offset, frame.total, now, urgent=duplicate)
        if r.complete:
            self._finish(frame.src, state, r)

    def _over_budget(self, state: PeerState, stream: Stream | None, header: F.Header | F.Frame,
                     count: bool = True) -> bool:
        """Would the first segment of ``header``'s message need private memory beyond the
        peer's budget? Then it is dropped unacked (and counted).

        A message that is not next in its stream may use only half the budget: messages
        waiting behind a missing one can then never leave the missing one no room."""
        due = header.seq == (0 if stream is None else stream.next_deliver)
        if stream is not None:
            posted = stream.bound.get(header.seq)
            if posted is not None and posted.nbytes >= header.total:
                return False  # lands in the caller's buffer
        if due and header.tag in self.notice_tags and header.total <= NOTICE_BYTES:
            return False  # a notice (a rank aborting) gets through whatever is held
        share = 1 if due else 2
        if (state.held + header.total <= self.max_reassembly_bytes // share
                and state.held_messages < self.max_held_messages // share):
            return False
        self.stats["dropped_full"] += count
        return True

    def _start(self, rail: int, state: PeerState, frame: F.Header | F.Frame) -> InMessage | None:
        """Open reassembly for the first segment of a message, or reject/drop the frame."""
        stream = self._stream(state, frame.tag)
        if frame.seq < stream.next_deliver or stream.owner.get(frame.seq, frame.msg_id) != frame.msg_id:
            self._reject(rail, f"message {frame.msg_id} from rank {frame.src} claims position "
                               f"{frame.seq} of tag {frame.tag}, which is taken")
            return None
        posted = stream.bound.get(frame.seq)
        if frame.seq in stream.cancelled:
            buf, owner, discard = None, None, True  # its receive was withdrawn
        elif posted is not None and posted.nbytes >= frame.total:
            buf, owner, discard = posted[:frame.total], posted, False
        else:
            try:
                buf = memoryview(bytearray(frame.total))
            except MemoryError:
                self.stats["dropped_full"] += 1
                return None  # not acked: the sender retries
            owner, discard = None, False
            state.held += frame.total
            state.held_messages += 1
            self.reassembly_bytes += frame.total
        r = InMessage(frame.msg_id, frame.tag, frame.seq, frame.total, buf, owner,
                        discard=discard)
        state.partial[frame.msg_id] = r
        stream.owner[frame.seq] = frame.msg_id
        return r

    def _place(self, rail: int, r: InMessage, frame: F.Frame) -> bool:
        """Copy a segment into place; False if it overlapped garbage or a range another
        rail is reading in place (then it is dropped unacked: that rail acks it)."""
        start, length = frame.offset, len(frame.payload)
        if r.lengths.get(start) == length:
            self.stats["duplicates"] += 1
            return True  # exact duplicate: ack again, copy nothing
        if start in r.claims or any(o < start + length and start < o + n
                                    for o, (n, _) in r.claims.items()):
            self.stats["dropped_claimed"] += 1
            return False
        i = bisect_left(r.starts, start)
        overlaps_prev = i > 0 and r.starts[i - 1] + r.lengths[r.starts[i - 1]] > start
        overlaps_next = i < len(r.starts) and (r.starts[i] < start + length or r.starts[i] == start)
        if overlaps_prev or overlaps_next or start + length > r.total:
            self._reject(rail, f"segment [{start}, {start + length}) of message {r.msg_id} "
                               f"overlaps one already received")
            return False
        if not r.discard:
            r.buf[start:start + length] = frame.payload  # type: ignore[index]  # (a buffer)
        insort(r.starts, start)
        r.lengths[start] = length
        r.received += length
        return True

    def data_target(self, rail: int, header: F.Header) -> memoryview | None:
        """Where a DATA segment announced by ``header`` may be read straight into, or None.

        For stream drivers (TCP rails): after reading a frame's header (``F.decode_header``),
        the driver asks for the segment's place in its message (the posted receive buffer
        or the reassembly buffer) and reads the payload there, then calls ``data_landed``
        (or ``release_claims`` if the read fails). The range is claimed by ``rail`` until
        then: nobody else gets it (protocol.py, "Buffer ownership"). None means "read the payload
        aside and hand the whole frame to ``receive``": ACKs, duplicates, ranges claimed
        by another rail, garbage and every other case take that path. The first segment of
        a message opens its reassembly record here (with the posted buffer, or a private
        one within ``max_reassembly_bytes``). Bytes read into the returned view but never
        landed are overwritten by the retransmission. With ``crc`` it is always None: a
        frame is verified before any byte of it is placed, so a corrupted header cannot
        aim its payload anywhere.
        """
        if self.crc or header.type != F.DATA or header.dst != self.rank or header.src == self.rank:
            return None
        if header.src in self._failed or header.length == 0:
            return None
        state = self._peer(header.src)  # (the header was validated against world_size)
        if header.msg_id in state.recv_done:
            return None
        if header.msg_id >= state.recv_done.low + self.max_open_messages:
            return None
        r = state.partial.get(header.msg_id)
        if r is None:
            stream = state.streams.get(header.tag)
            if stream is not None and (header.seq < stream.next_deliver or stream.owner.get(
                    header.seq, header.msg_id) != header.msg_id):
                return None
            if self._over_budget(state, stream, header, count=False):
                return None  # receive() drops it, and counts that
            r = self._start(rail, state, header)
            if r is None:
                return None
        if r.discard or (r.tag, r.seq, r.total) != (header.tag, header.seq, header.total):
            return None
        start, length = header.offset, header.length
        if start + length > r.total or self._overlaps(r, start, length):
            return None
        r.claims[start] = (length, rail)
        return r.buf[start:start + length]  # type: ignore[index]  # (not discarded: a buffer)

    @staticmethod
    def _overlaps(r: InMessage, start: int, length: int) -> bool:
        """Does [start, start + length) meet a landed or claimed range of ``r``?"""
        if start in r.lengths or start in r.claims:
            return True
        i = bisect_left(r.starts, start)
        if i > 0 and r.starts[i - 1] + r.lengths[r.starts[i - 1]] > start:
            return True
        if i < len(r.starts) and r.starts[i] < start + length:
            return True
        end = start + length
        for o, (n, _) in r.claims.items():  # (a handful: one per rail at most, mostly)
            if o < end and start < o + n:
                return True
        return False

    def data_landed(self, rail: int, header_bytes: Bytes, header: F.Header, now: float,
                    trailer: Bytes = b"") -> None:
        """The payload of ``header`` was read into the view ``data_target`` returned, and
        its ``header.nacks`` piggybacked ack entries into ``trailer``."""
        state = self._peers.get(header.src)
        if state is None:
            return  # the peer failed while the payload was being read
        if header.nacks:  # (never with crc: data_target declines those frames)
            self._on_ack(header.src, state, F.ACK_ENTRY.iter_unpack(trailer))
        r = state.partial.get(header.msg_id)
        if r is None or (claim := r.claims.get(header.offset)) is None or claim[1] != rail:
            return  # the claim ended (release_claims): whatever was read is not counted
        del r.claims[header.offset]
        if not r.discard:
            try:
                F.check_payload(header_bytes, header, r.buf[  # type: ignore[index]  # (kept)
                    header.offset:header.offset + header.length], trailer)
            except F.FrameError as e:
                self._reject(rail, str(e))
                return
        insort(r.starts, header.offset)
        r.lengths[header.offset] = header.length
        r.received += header.length
        self._ack(state, rail, header.msg_id, header.offset, header.total, now)
        if r.complete:
            self._finish(header.src, state, r)

    def cancel_recv(self, src: int, tag: int, position: int) -> list[int]:
        """Withdraw the buffer ``post_recv`` bound to ``position`` of ``(src, tag)``.

        No byte is written into it after the rails returned here have called
        ``data_landed`` or ``release_claims`` for the claims they hold on it (none: the
        buffer is free now). The message at that position, whenever it arrives, is
        acknowledged and discarded.

        Returns
        -------
        list of int
            Rails whose readers may still be writing into the buffer.
        """
        state = self._peers.get(src)
        if (state is None or (stream := state.streams.get(tag)) is None
                or stream.bound.pop(position, None) is None):
            return []
        stream.cancelled.add(position)
        msg_id = stream.owner.get(position)
        r = None if msg_id is None else state.partial.get(msg_id)
        if r is None or r.posted is None:
            return []  # not started, or reassembled privately: nothing points into buffer
        r.discard, r.posted, r.buf = True, None, None
        return sorted({rail for _, rail in r.claims.values()})

    def release_claims(self, peer: int, rail: int) -> None:
        """The reader of ``rail`` from ``peer`` stopped: its claims end unlanded (the
        segments are resent, to other rails if this one failed)."""
        state = self._peers.get(peer)
        if state is None:
            return
        for r in state.partial.values():
            for offset in [o for o, (_, rl) in r.claims.items() if rl == rail]:
                del r.claims[offset]


__all__ = ["NOTICE_BYTES", "Reassembly"]
