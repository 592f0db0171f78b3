"""Refusal of a message too large for its receive and for private memory (protocol.py:
"Refusal"). Cold: no frame of an ordinary message comes here.

How it works
------------
The first frame of such a message that meets a receive bound to its position refuses it
(``_too_large``, ``_refuse``): its id is retired, its position is delivered as
``MessageRefused`` and the sender is told by REFUSE frames (``_send_refusals``, from
``poll_transmit``; repeated for every later frame of the message). Met before any receive,
the frame is dropped and remembered (MAX_OVERSIZED per peer) for the receive posted later
(``_refuse_remembered``). The sender, on a REFUSE that matches a message none of whose
segments was acknowledged (``_on_refuse``), forgets it and reports ``SendRefused``.
"""

from __future__ import annotations

from . import frames as F
from .delivery import Delivery
from .events import SendRefused, Transmit
from .peer_state import InMessage, PeerState, Stream

MAX_OVERSIZED = 16  # oversized first frames remembered per peer until a receive is posted


class Refusal(Delivery):
    """The refusals an ``Endpoint`` makes and receives."""

    def _too_large(self, rail: int, src: int, state: PeerState, stream: Stream | None,
                   frame: F.Frame) -> None:
        """The first frame of a message larger than private memory may ever hold, and than
        the receive bound to its position if any, was dropped: refuse the message if a
        receive is bound, else remember it for the receive posted later."""
        if stream is None or (posted := stream.bound.get(frame.seq)) is None:
            oversized = state.oversized
            if frame.msg_id not in oversized:
                for msg_id in [m for m in oversized if m in state.recv_done]:
                    del oversized[msg_id]  # (finished otherwise since)
                if len(oversized) < MAX_OVERSIZED:
                    oversized[frame.msg_id] = (frame.tag, frame.seq, frame.total, rail)
            return
        if stream.owner.get(frame.seq, frame.msg_id) != frame.msg_id:
            self._reject(rail, f"message {frame.msg_id} from rank {src} claims position "
                               f"{frame.seq} of tag {frame.tag}, which is taken")
            return
        self._refuse(rail, src, state, stream, frame.msg_id, frame.tag, frame.seq,
                     frame.total, posted.nbytes)

    def _refuse_remembered(self, src: int, state: PeerState, stream: Stream, tag: int,
                           position: int, nbytes: int) -> None:
        """A receive of ``nbytes`` was just bound to ``position``: refuse the message
        remembered there if it is too large for it."""
        for msg_id, (t, seq, total, rail) in list(state.oversized.items()):
            if t != tag or seq != position:
                continue
            del state.oversized[msg_id]
            if (total > nbytes and msg_id not in state.recv_done
                    and msg_id not in state.partial and position not in stream.owner):
                self._refuse(rail, src, state, stream, msg_id, tag, seq, total, nbytes)
            return

    def _refuse(self, rail: int, src: int, state: PeerState, stream: Stream, msg_id: int,
                tag: int, seq: int, total: int, expected: int) -> None:
        """Refuse message ``msg_id`` at ``seq`` of ``stream``: retire its id, consume its
        position (``MessageRefused`` in stream order) and tell the sender."""
        state.oversized.pop(msg_id, None)
        state.recv_done.add(msg_id)
        forget = state.recv_done.low - self.max_open_messages
        for old in [m for m in state.refused if m < forget]:
            del state.refused[old]  # (its sender has finished it: it opened later ones)
        state.refused[msg_id] = (tag, seq, total, expected)
        state.refusals_out[msg_id] = rail
        self.has_work = True
        self.stats["refused"] += 1
        stream.owner[seq] = msg_id
        stream.ready[seq] = InMessage(msg_id, tag, seq, total, None, refused=expected)
        self._deliver_ready(src, state, stream)

    def _send_refusals(self, peer: int, state: PeerState, out: list[Transmit]) -> None:
        pending, state.refusals_out = state.refusals_out, {}
        for msg_id, rail in pending.items():
            refused = state.refused.get(msg_id)
            if refused is None:
                continue
            if not state.rails[rail]:
                rail = self._pick_rail(state)
            tag, seq, total, expected = refused
            out.append(Transmit(peer, rail, F.encode_refuse(
                self.rank, peer, msg_id, tag, seq, total, expected, rail=rail, crc=self.crc)))

    def _on_refuse(self, rail: int, src: int, state: PeerState, frame: F.Frame) -> None:
        """``src`` refuses message ``frame.msg_id`` (protocol.py, "Refusal")."""
        msg = state.open.get(frame.msg_id)
        if msg is None:
            if frame.msg_id >= state.next_msg_id:
                self._reject(rail, f"rank {src} refused message {frame.msg_id}, which was "
                                   f"never sent to it")
            return  # finished (or refused, or cancelled) already: a late copy
        if ((msg.tag, msg.seq, msg.data.nbytes) != (frame.tag, frame.seq, frame.total)
                or msg.unacked < msg.next_seg):
            self._reject(rail, f"rank {src} refused message {frame.msg_id} as (tag {frame.tag}, "
                               f"seq {frame.seq}, {frame.total} bytes), which does not match "
                               f"the message (tag {msg.tag}, seq {msg.seq}, {msg.data.nbytes} "
                               f"bytes, {msg.next_seg - msg.unacked} segments acknowledged)")
            return
        self._forget(state, msg)
        self.pending_events.append(SendRefused(src, msg.msg_id, msg.tag, msg.data.nbytes,
                                        frame.offset))


__all__ = ["MAX_OVERSIZED", "Refusal"]
