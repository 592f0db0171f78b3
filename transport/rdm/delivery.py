"""In-order delivery of the rdm endpoint's whole messages, and early messages
(protocol.py: "Ordering guarantee" and "Matching posted receives").

How it works
------------
A message whose last byte landed (``_finish``) waits in its stream's ``ready`` until every
earlier position of the stream is delivered (``_deliver_ready``). Delivering it
(``_deliver``) reports ``MessageReceived``: in the caller's buffer when it landed there or
fits the buffer posted meanwhile (then copied into it); else it is kept as an *early*
message, counted against the peer's private memory, in the endpoint's ``early`` (the
unexpected-message queue every transport shares: transport/matching.py) until
``post_recv``, ``take_early`` or ``take_early_any`` takes it. A position whose receive was withdrawn is
discarded; a refused one is reported as ``MessageRefused``.
"""

from __future__ import annotations

from .events import MessageReceived, MessageRefused
from .peer_state import InMessage, PeerState, Stream
from .sending import Sending


class Delivery(Sending):
    """Whole messages of an ``Endpoint`` handed out in stream order."""

    def _finish(self, src: int, state: PeerState, r: InMessage) -> None:
        del state.partial[r.msg_id]
        state.recv_done.add(r.msg_id)
        stream = self._stream(state, r.tag)
        stream.ready[r.seq] = r
        self._deliver_ready(src, state, stream)

    def _deliver_ready(self, src: int, state: PeerState, stream: Stream) -> None:
        """Deliver the complete messages that are next in ``stream``'s order."""
        while stream.next_deliver in stream.ready:
            self._deliver(src, state, stream, stream.ready.pop(stream.next_deliver))
            stream.next_deliver += 1

    def _deliver(self, src: int, state: PeerState, stream: Stream, r: InMessage) -> None:
        stream.owner.pop(r.seq, None)
        posted = stream.bound.pop(r.seq, None)
        if r.refused >= 0:  # (it never held memory, and no byte of it was placed)
            if r.seq in stream.cancelled:
                stream.cancelled.discard(r.seq)
                self.stats["discarded"] += 1
            else:
                self.pending_events.append(MessageRefused(src, r.tag, r.msg_id, r.total, r.refused))
            return
        private = r.posted is None and not r.discard
        if r.seq in stream.cancelled:
            stream.cancelled.discard(r.seq)
            if private:
                state.held -= r.total
                state.held_messages -= 1
                self.reassembly_bytes -= r.total
            self.stats["discarded"] += 1
            return
        # (r.buf is None only for a refused or a discarded message, gone above)
        if r.posted is not None:
            self.pending_events.append(MessageReceived(src, r.tag, r.msg_id,
                                                r.buf, True))  # type: ignore[arg-type]
            return
        if posted is not None and posted.nbytes >= r.total:
            state.held -= r.total
            state.held_messages -= 1
            self.reassembly_bytes -= r.total
            posted[:r.total] = r.buf  # type: ignore[assignment]
            self.pending_events.append(MessageReceived(src, r.tag, r.msg_id, posted[:r.total], True))
            return
        # (a private buffer: a view of its bytearray)
        data: bytearray = r.buf.obj  # type: ignore[union-attr, assignment]
        if posted is not None:  # too small for it: the receive gets the message to refuse
            state.held -= r.total
            state.held_messages -= 1
            self.reassembly_bytes -= r.total
        else:  # nobody asked for it yet: kept (and counted) until taken
            self.early.add(src, r.tag, data)
        self.pending_events.append(MessageReceived(src, r.tag, r.msg_id, data, False))

    def take_early(self, src: int, tag: int) -> bytearray | None:
        """The oldest early message of ``(src, tag)`` (a ``bytearray``), or None."""
        data = self.early.take(src, tag)
        if data is not None:  # (``_release``, written out: once per early message)
            state = self._peers.get(src) or self._left[src]
            state.held -= len(data)
            state.held_messages -= 1
            self.reassembly_bytes -= len(data)
        return data

    def take_early_any(self, tag: int) -> tuple[int, bytearray] | None:
        """``(src, message)`` of the earliest-arrived early message of ``tag`` from any
        peer, or None."""
        got = self.early.take_any(tag)
        if got is not None:
            self._release(*got)
        return got

    def peek_early_any(self, tag: int) -> int | None:
        """The source of the message ``take_early_any(tag)`` would take, or None."""
        return self.early.peek_any(tag)

    def _release(self, src: int, data: bytearray) -> None:
        """An early message of ``src`` was taken: its memory no longer counts against the
        peer (a failed one's state stays in ``_left`` for this)."""
        state = self._peers.get(src) or self._left[src]
        state.held -= len(data)
        state.held_messages -= 1
        self.reassembly_bytes -= len(data)


__all__ = ["Delivery"]
