"""Sans-I/O core of the reliable-datagram (rdm) transport, in the style of h11.

The ``Endpoint`` never touches a socket, a thread or the clock. A driver feeds it the
frames that arrived (``receive(rail, bytes, now)``) and the time (``poll_transmit(now)``),
puts the frames it returns on the named rails, and acts on the events it reports
(``events()``). Everything here is therefore deterministic and testable with a simulated
lossy network.

Model
-----
Each pair of ranks is joined by N *rails* (parallel paths: TCP connections, ZeroMQ
sockets, ...) that may drop, duplicate, reorder, delay or corrupt frames, and may die.
On top of them the endpoint gives reliable, message-oriented, tagged delivery, like EFA's
SRD / libfabric RDM.

Sending
    ``send(peer, tag, data)`` numbers the message (``msg_id``: 0, 1, 2, ... per peer) and
    gives it the next ``seq`` of its ``(peer, tag)`` stream. ``poll_transmit`` cuts it into
    segments of at most ``segment_bytes``, and small enough that every rail gets one when
    that keeps them >= MIN_SPRAY_BYTES (a 0-byte message is one empty segment), one DATA
    frame each (see ``frames``). A segment goes to the first live rail with less than
    FILL_BYTES unacknowledged, else to the least loaded one (ties go round-robin): small
    and mid-sized traffic keeps to one rail, whose reader then finds a burst waiting
    instead of every rail's reader waking up for a piece of it, and large transfers
    spread over all of them. ``data`` is not copied: keep it unchanged until
    ``SendCompleted``.

Acknowledgement: per segment, batched
    The receiver acknowledges every DATA frame it accepts, duplicates included (the first
    ack may have been lost), with an ``(msg_id, offset)`` entry; entries are batched into
    ACK frames (up to ``MAX_ACKS_PER_FRAME``) at the next ``poll_transmit``, sent back on
    the rail the data came on (another live one if that rail failed). So a rail that dies
    takes with it only acks of segments it carried, which the sender resends anyway.
    Per-segment acks are idempotent and order-free, which suits unordered multi-rail
    delivery better than a cumulative ack. When the last segment of a message is acked,
    the sender reports ``SendCompleted(peer, msg_id)`` (unless it was sent with
    ``send_now(..., notify=False)``: a driver that completed it at once, holding nothing
    to free). Rail numbers name the same path
    at both ends (the driver's connection ``i`` to a peer is rail ``i`` on both sides).

Delayed acks (``ack_delay`` > 0)
    Acks of small messages (``total`` <= ``DELAYED_ACK_BYTES``: a driver completes their
    sends at once, so nobody waits for these acks) are held for up to ``ack_delay``, or
    until ``DELAYED_ACK_HELD_BYTES`` of such messages wait, and ride behind the next DATA
    frames to that peer, like TCP's delayed ack. A ping-pong
    then costs no ACK frame and no wake-up per message at either end. Acks of larger
    messages, duplicates' acks and a full batch go at the next ``poll_transmit``. Whenever
    DATA frames go to a peer, every ack waiting for it rides on them (``nacks`` entries
    behind the payload, see ``frames``); an ACK frame is sent only when no data goes.

Retransmission
    Every unacked segment has a deadline: ``rto * backoff**retries`` (capped at
    ``max_rto``) after it was last sent, measured only with the ``now`` values passed in.
    An expired segment is resent on another live rail when there is one. After
    ``max_retries`` resends of one segment, the peer is declared dead: ``PeerFailed``.
    ``rail_failed(rail)`` moves that rail's unacked segments to the remaining rails at the
    next ``poll_transmit`` (without counting a retry); when a peer has no live rail left,
    ``PeerFailed``. ``rail_restored(rail, peer)`` (the driver reopened it) makes a failed
    rail take new segments again. ``PeerFailed`` lists the peer's unfinished ``msg_id``s, and the peer's
    state is dropped (later frames from it are ignored, ``send`` to it raises).

Reassembly
    A DATA frame is placed by ``(src, msg_id, offset)``. The first segment of a message
    decides its buffer: the caller's buffer posted with ``post_recv`` for that stream
    position, when there is one and it is large enough (the data lands there directly),
    else a private ``bytearray``. Received byte ranges are tracked as disjoint intervals:
    an exact duplicate is ignored (and re-acked), a partial overlap or conflicting header
    is garbage (``FrameRejected``). A message is complete when its intervals cover
    ``total`` bytes. A completed ``msg_id`` is remembered (a low-water mark plus a set
    above it), so late duplicates are re-acked but never delivered twice.

Buffer ownership (one writer per byte, nothing after the end)
    A stream driver reads a segment's payload straight into place: ``data_target`` hands
    out the segment's slice of the message's buffer and records a *claim* on it for that
    rail; ``data_landed`` (or ``release_claims``, when that rail's reader gives up) ends
    it. A claimed range is handed to nobody else: a second copy of the segment (a resend
    on another rail after a stall longer than the RTO) is read aside and dropped unacked
    while the first is being read, so two readers never write one range and the message
    cannot complete while a reader still writes into it. ``cancel_recv`` withdraws a
    posted buffer: no new claim is made on it, the message it was bound to is discarded
    as it arrives (acked, delivered nowhere), and the rails still holding claims on it are
    returned, so the driver can wait until their readers are out of it before it gives
    the buffer back. ``cancel_send`` forgets a message: none of its segments is sent or
    resent again. ``take_whole`` is the one-step form for a whole one-segment frame the
    driver has read ahead: it checks the header, copies the payload and delivers the
    message inside the call, so it needs no claim, and it declines (leaving the general
    path to decide) anything but a message next in its stream whose position is neither
    taken nor withdrawn. It reports that delivery as its result instead of an event, so
    a driver completes the waiting receive at once.

Ordering guarantee
    Messages are delivered (``MessageReceived``) exactly once, intact, and per
    ``(src, tag)`` in the order they were sent (by ``seq``), however their segments
    arrived. There is no order between different tags or different sources: a complete
    message of tag 1 is not held back by an incomplete message of tag 2.

Matching posted receives
    ``post_recv(src, tag, buffer)`` matches the oldest message of the ``(src, tag)`` stream
    that was delivered before any receive was posted for it (an *early* message, kept
    here) and returns it; else it binds ``buffer`` to the next not-yet-bound position of
    the stream, so posted buffers match messages in send order (like MPI's
    non-overtaking rule). A message that arrives before its buffer is posted is
    reassembled privately and copied into the buffer when it is delivered after the
    post; otherwise it is kept as an early message (``MessageReceived`` with
    ``posted=False`` says so) until ``post_recv`` or ``take_early`` takes it.

Limits (bounded memory)
    * ``window_bytes`` per peer: unacked payload plus ``HEADER_SIZE`` per unacked segment
      (so even 0-byte messages count). One segment may always be outstanding.
    * ``max_open_messages`` per peer: a message is started only if its ``msg_id`` is within
      this distance of the oldest unfinished one; the receiver rejects frames beyond it.
      This bounds the completed-id set. Both sides must use the same value.
    * ``max_reassembly_bytes`` per peer: private reassembly buffers plus early messages
      nobody has taken yet. A frame that would start a private buffer beyond it is dropped
      unacked (the sender retries later; a receive posted meanwhile takes the message
      straight into its buffer, which costs no private memory). Messages that are not
      next in their stream may fill only half of it, so the one they wait for always
      finds room. A header can therefore never make this rank allocate more than the
      limit, whatever ``total`` it claims, and an allocation that fails drops the frame
      the same way. Early messages hold memory until taken: a peer that sends more than
      the limit nobody receives is held back until receives are posted (its sends fail
      after ``max_retries`` resends if they never are). Only the next notice on a
      ``notice_tags`` stream (at most NOTICE_BYTES per peer) may pass the limit. A
      message larger than the whole limit and than the receive posted for it can never
      be taken: it is refused (see "Refusal").
    * ``max_held_messages`` per peer: the same for the number of messages held privately,
      whatever their size (each costs its stream entry and buffer object even when it
      holds no byte: without it a flood of 0-byte messages on new tags would grow memory
      without bound while ``max_reassembly_bytes`` sees nothing). A message that would
      pass it is dropped unacked before anything is built for it.
    * ``max_message_bytes``: ``send`` refuses larger messages, the decoder rejects frames
      claiming larger ones.

Refusal (a message too large for its receive and for private memory)
    A message whose receive buffer is smaller than the message is normally reassembled
    privately and delivered with ``posted=False`` (the driver fails the receive with the
    message attached). When the message is also larger than ``max_reassembly_bytes`` it
    could never be held: instead of being dropped unacked until its sender gives up, it
    is refused on its first frame that meets a receive bound to its stream position.
    The receiver retires its ``msg_id`` (as if completed), consumes its stream position
    (``MessageRefused`` is reported for that position, in stream order, and the posted
    buffer is released untouched: no byte of it is placed anywhere) and sends a REFUSE
    frame (see ``frames``) naming the message and the buffer's size. Later frames of a
    refused message are never acknowledged; each is answered with the REFUSE again (at
    most one per message per ``poll_transmit``), so a lost REFUSE is repeated when the
    sender resends. The sender, on a REFUSE for a message it is still sending and whose
    tag, seq and size match and none of whose segments was acknowledged, forgets the
    message as ``cancel_send`` does and reports ``SendRefused``; its stream position was
    used when it was sent, so both ends move on to the next message of the stream alike.
    A REFUSE for a message never sent, or that contradicts it, is garbage
    (``FrameRejected``); one for a message finished already (a late copy) is ignored.
    A first frame that comes before any receive is bound to its position, and is too
    large for private memory, is dropped unacked as usual but remembered (a few per
    peer): a too-small receive posted for that position later refuses it at once.

Integrity
    With ``crc=True`` every frame carries a CRC-32 over header and payload and frames
    without one are rejected; a corrupted frame is dropped (``FrameRejected``) and, never
    acked, it is retransmitted. Both sides must agree on ``crc``.

Layout
------
The endpoint is one object whose class is built in layers, one file each, each a subclass
of the one below. A layer calls only the layers below it (the type checker holds it to
that: a layer's class has no method of the layers above), and all of them work on the
same per-peer records (``peer_state``), since one frame touches both directions of a
peer's state (a DATA frame carries acks of this rank's sends). From the bottom:

* ``endpoint_core``: settings, peers, rails, events (``EndpointCore``);
* ``acks``: acknowledgements sent and received (``Acks``);
* ``sending``: the send path and retransmission (``Sending``);
* ``delivery``: whole messages in stream order, early messages (``Delivery``);
* ``refusal``: messages too large to take (``Refusal``, cold);
* ``reassembly``: frames placed segment by segment (``Reassembly``);
* here, ``Endpoint``: the entry points that span the layers: ``post_recv``, the one-step
  ``take_whole`` and ``poll_transmit``.

Layers, not parts with state of their own: the per-message paths (``send_now``,
``take_whole``, ``data_target`` / ``data_landed``, the acks) cross layers as calls of
methods of one object, with no delegating call or extra lookup on the way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import frames as F
from .acks import DELAYED_ACK_BYTES, DELAYED_ACK_HELD_BYTES
from .endpoint_core import FILL_BYTES, MAX_HELD_MESSAGES
from .events import (Event, FrameRejected, MessageReceived, MessageRefused, PeerFailed,
                     ProtocolError, SendCompleted, SendRefused, Transmit)
from .peer_state import byte_view
from .reassembly import NOTICE_BYTES, Reassembly
from .refusal import MAX_OVERSIZED
from .sending import MIN_SPRAY_BYTES

if TYPE_CHECKING:
    from .frames import Bytes


class Endpoint(Reassembly):
    """One rank's end of the reliable-datagram protocol, towards every peer.

    Parameters
    ----------
    rank, world_size : int
        This rank and the number of ranks.
    rails : int
        Rails per peer (1..256).
    segment_bytes : int
        Payload bytes per DATA frame.
    max_message_bytes : int
        Largest message accepted in either direction.
    rto : float
        Initial retransmission timeout, in the units of ``now`` (seconds, say).
    backoff : float
        Factor applied to the timeout for every retry of a segment.
    max_rto : float
        Ceiling of the backed-off timeout.
    max_retries : int
        Resends of one segment before its peer is declared failed.
    window_bytes : int
        Unacked bytes (payload + header per segment) allowed per peer.
    max_reassembly_bytes : int
        Private memory per peer for messages no receive was posted for: reassembly
        buffers and early messages not yet taken.
    max_held_messages : int
        Messages per peer held in private memory (reassembling or early) at once.
    max_open_messages : int
        Distance allowed between the oldest unfinished and the newest started message
        per peer; must be equal on both sides.
    crc : bool
        Protect every frame with a CRC-32 and require it on every frame received.
    ack_delay : float
        How long acks of small messages may wait for DATA frames to ride behind (0: every
        ``poll_transmit`` sends them). See "Delayed acks".
    notice_tags : iterable of int
        Tags of notices that must get through when the memory budget is full (a rank
        telling its peers it failed): the message due next on such a tag, up to
        NOTICE_BYTES, is taken beyond ``max_reassembly_bytes``.
    """

    def post_recv(self, src: int, tag: int, buffer: Bytes) -> bytearray | int:
        """Offer ``buffer`` for the next message of ``(src, tag)`` not yet taken or matched.

        Parameters
        ----------
        src, tag : int
            The stream.
        buffer : writable bytes-like
            Where the message should land; it must hold the whole message, else the
            message is delivered in its own ``bytearray`` (``posted=False``).

        Returns
        -------
        bytearray or int
            The oldest early message of the stream (it arrived before any receive was
            posted for it: the caller copies it, ``buffer`` is not kept), or else the
            stream position ``buffer`` is now bound to (for ``cancel_recv``). When the
            message of that position is known already to be too large for ``buffer`` and
            for private memory, it is refused at once (see "Refusal"): ``events()`` then
            holds its ``MessageRefused`` if it is next in the stream.
        """
        state = self._peers.get(src)
        if (state is not None and (stream := state.streams.get(tag)) is not None
                and (src, tag) not in self.early.kept and not state.oversized
                and type(buffer) is memoryview and buffer.ndim == 1 and buffer.format == "B"
                and buffer.c_contiguous and not buffer.readonly):
            # the commonest case, in one step: a byte view for a stream with nothing early
            position = stream.next_post
            if position < stream.next_deliver:
                position = stream.next_deliver
            stream.bound[position] = buffer
            stream.next_post = position + 1
            return position
        view = byte_view(buffer, writable=True)
        early = self.take_early(src, tag)
        if early is not None:
            return early  # (even from a peer that failed since: it sent it whole)
        state = self._peer(src)
        stream = self._stream(state, tag)
        position = max(stream.next_post, stream.next_deliver)
        stream.bound[position] = view
        stream.next_post = position + 1
        if state.oversized:
            self._refuse_remembered(src, state, stream, tag, position, view.nbytes)
        return position

    def take_whole(self, rail: int, src: int, buf: memoryview, start: int, end: int,
                   now: float) -> tuple[int, int, int, memoryview | bytearray, bool] | None:
        """The fast path of the commonest frame, for a stream driver that reads ahead: the
        frame at ``buf[start:]`` (what came on ``rail`` from ``src``; bytes up to ``end``
        are in), taken in one step when it is a whole one-segment DATA message, payload and
        piggybacked acks included, that is next in its stream and whose position is neither
        taken nor withdrawn. It is copied into its posted receive buffer, or, when none is
        posted yet, into a private copy kept as an early message (within
        ``max_reassembly_bytes``), and delivered: what ``decode_header``, ``data_target``,
        the copy and ``data_landed`` would do, without a reassembly record or a claim (the
        copy happens inside this call, so no other rail can meet the range meanwhile).

        Returns None (nothing done, not even the header checked: take the general path,
        which decides) whenever any other case applies, the header included: anything
        ``decode_header`` would not pass as such a frame. Else ``(stop, tag, msg_id, data,
        posted)``: the frame ended at ``buf[stop]``, and its delivery is this result, as a
        ``MessageReceived(src, tag, msg_id, data, posted)`` would report it, and not an
        event; the events the call queued (``SendCompleted`` of the acks it carried) come
        after it. ``buf`` must be a byte ``memoryview`` (slices of it are views).
        """
        if end - start < F.HEADER_SIZE or self.crc:
            return None
        (magic, version, ftype, flags, _, nacks, fsrc, dst, msg_id, tag, seq, total, offset,
         length, crc) = F.HEADER.unpack_from(buf, start)
        body = start + F.HEADER_SIZE
        mid = body + length
        stop = mid + nacks * F.ACK_ENTRY.size
        if (stop > end or ftype != F.DATA or flags or crc or offset or length != total
                or not length or fsrc != src or dst != self.rank or magic != F.MAGIC
                or version != F.VERSION or nacks > F.MAX_ACKS_PER_FRAME
                or length > self.segment_bytes or total > self.max_message_bytes or tag < 0):
            return None
        state = self._peers.get(src)  # (None: failed, or not heard from yet)
        if state is None or msg_id in state.partial:
            return None
        done = state.recv_done
        low = done.low
        if msg_id < low or msg_id >= low + self.max_open_messages or msg_id in done.above:
            return None
        stream = state.streams.get(tag)
        if stream is None:
            if seq or state.held_messages >= self.max_held_messages:
                return None  # (the general path drops the latter, and counts that)
            stream = self._stream(state, tag)
        elif (seq != stream.next_deliver or stream.ready or seq in stream.owner
              or seq in stream.cancelled):
            return None
        posted = stream.bound.get(seq)
        data: memoryview | bytearray
        if posted is None:
            if (state.held + total > self.max_reassembly_bytes
                    or state.held_messages >= self.max_held_messages):
                return None  # (the general path drops it, and counts that)
            try:
                data = bytearray(buf[body:mid])
            except MemoryError:
                return None  # (the general path drops it unacked: the sender retries)
            state.held += total
            state.held_messages += 1
            self.reassembly_bytes += total
        elif posted.nbytes < total:
            return None
        else:
            data = posted[:total]
            data[:] = buf[body:mid]
            del stream.bound[seq]
        if nacks:
            self._on_ack(src, state, F.ACK_ENTRY.iter_unpack(buf[mid:stop]))
        if msg_id == low and not done.above:
            done.low = low + 1  # (IdWindow.add, in order)
        else:
            done.add(msg_id)
        self._ack(state, rail, msg_id, 0, total, now)
        stream.next_deliver = seq + 1
        if posted is None:  # (data is the private copy, a bytearray)
            self.early.add(src, tag, data)  # type: ignore[arg-type]
            return stop, tag, msg_id, data, False
        return stop, tag, msg_id, data, True

    def land_whole(self, rail: int, header_bytes: Bytes, header: F.Header, payload: Bytes,
                   trailer: Bytes, now: float) -> bool:
        """``take_whole`` for a frame held as its header (``header_bytes``, decoded as
        ``header``), ``payload`` and piggybacked acks ``trailer``, with the delivery
        reported as a ``MessageReceived`` event instead (after the events of its acks);
        False when declined. (It copies the frame first: drivers use ``take_whole``.)"""
        frame = memoryview(b"".join((header_bytes, payload, trailer)))
        got = self.take_whole(rail, header.src, frame, 0, frame.nbytes, now)
        if got is None:
            return False
        _, tag, msg_id, data, posted = got
        self.pending_events.append(MessageReceived(header.src, tag, msg_id, data, posted))
        return True

    def poll_transmit(self, now: float) -> list[Transmit]:
        """Frames to send now: acks, resends (timed out or moved off a dead rail), new segments.

        Parameters
        ----------
        now : float
            The current time; deadlines of the frames returned are counted from it.

        Returns
        -------
        list of Transmit
            ``(peer, rail, data)`` for each frame, in the order to send them.
        """
        out: list[Transmit] = []
        self.has_work = False
        for peer in sorted(self._peers):
            state = self._peers[peer]
            if not self._resend_due(peer, state, now, out):
                continue  # the peer just failed
            self._send_new(peer, state, now, out)  # waiting acks ride on this data
            if state.acks_out and now >= state.acks_due:
                self._flush_acks(peer, state, out)
            if state.refusals_out:
                self._send_refusals(peer, state, out)
        return out


__all__ = ["DELAYED_ACK_BYTES", "DELAYED_ACK_HELD_BYTES", "Endpoint", "Event", "FILL_BYTES",
           "FrameRejected", "MAX_HELD_MESSAGES", "MAX_OVERSIZED", "MIN_SPRAY_BYTES",
           "MessageReceived", "MessageRefused", "NOTICE_BYTES", "PeerFailed", "ProtocolError",
           "SendCompleted", "SendRefused", "Transmit"]
