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
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, NamedTuple, Union

from ..errors import TransportError
from . import frames as F

if TYPE_CHECKING:
    from typing_extensions import TypeAlias

    from .frames import Bytes

# A message is cut into one segment per rail only while segments stay MIN_SPRAY_BYTES or
# more, and a segment goes to the first rail with less than FILL_BYTES unacknowledged (see
# "Sending"): small and mid-sized messages move faster on one rail than spread evenly over
# all, and large ones lose nothing by filling the rails in turn (docs/design.md,
# "Thresholds and why").
MIN_SPRAY_BYTES = 4 << 20
FILL_BYTES = 4 << 20
# Acks of messages up to this size may wait (ack_delay): the driver's eager sends
# (driver.EAGER_BYTES), which complete at once, so nobody waits for their acks.
DELAYED_ACK_BYTES = 256 << 10
# ... until this many bytes of such messages wait for their acks: then they go at once, so
# the copies a streaming sender keeps for its unacknowledged eager sends stay bounded
# whatever ``ack_delay`` is.
DELAYED_ACK_HELD_BYTES = 4 << 20
NOTICE_BYTES = 4096  # a notice_tags message up to this size always finds memory
MAX_OVERSIZED = 16  # oversized first frames remembered per peer until a receive is posted
MAX_HELD_MESSAGES = 1 << 16  # messages held privately per peer (max_held_messages)

# ----------------------------------------------------------------------------- events


class MessageReceived(NamedTuple):
    """A whole message arrived and is next in order on its ``(src, tag)`` stream.

    Attributes
    ----------
    src, tag, msg_id : int
        Where it came from and which message it is.
    data : memoryview or bytearray
        The message: a view of the first ``len(message)`` bytes of the posted buffer when
        ``posted`` is true, else a fresh ``bytearray``.
    posted : bool
        Whether the message landed in (or was copied into) the buffer of ``post_recv``.
        False with a buffer posted for this position means the buffer was too small; the
        buffer is then released untouched.
    """

    src: int
    tag: int
    msg_id: int
    data: memoryview | bytearray
    posted: bool = False


class SendCompleted(NamedTuple):
    """Every segment of message ``msg_id`` to ``peer`` was acknowledged."""

    peer: int
    msg_id: int


class PeerFailed(NamedTuple):
    """``peer`` is unreachable; ``msg_ids`` are the sends to it that will never complete."""

    peer: int
    reason: str
    msg_ids: tuple[int, ...] = ()


class MessageRefused(NamedTuple):
    """The message at the next position of ``(src, tag)`` was refused (see "Refusal"):
    ``size`` bytes, larger than the ``expected`` bytes of the receive bound to that
    position and than this rank's private memory for the peer. The receive's buffer is
    released untouched; the next message of the stream goes to the next receive."""

    src: int
    tag: int
    msg_id: int
    size: int
    expected: int


class SendRefused(NamedTuple):
    """``peer`` refused message ``msg_id`` (``tag``, ``size`` bytes): its receive holds
    ``expected`` bytes and the message exceeds its private memory. No segment of it is
    sent again; its buffer is free once the driver has dropped the frames it holds."""

    peer: int
    msg_id: int
    tag: int
    size: int
    expected: int


class FrameRejected(NamedTuple):
    """A frame that arrived on ``rail`` was garbage and was dropped."""

    rail: int
    reason: str


class Transmit(NamedTuple):
    """A frame to put on the wire: on ``rail`` towards ``peer``, ``header`` then ``payload``.

    ``payload`` is a view of the sender's buffer (not copied); a stream driver writes both
    with one scatter-gather send, a datagram driver sends ``data``.
    """

    peer: int
    rail: int
    header: bytes
    payload: Bytes = b""
    trailer: bytes = b""  # piggybacked ack entries (DATA frames)

    @property
    def data(self) -> bytes:
        """The whole frame as one bytes object (a copy of the payload)."""
        return self.header + bytes(self.payload) + self.trailer


class ProtocolError(TransportError):
    """The caller misused the endpoint (for example, sent to a peer that failed)."""


# what ``events()`` returns
Event: TypeAlias = Union[MessageReceived, SendCompleted, PeerFailed, MessageRefused, SendRefused,
                         FrameRejected]


# ----------------------------------------------------------------------------- state


class _IdWindow:
    """Which ids of 0, 1, 2, ... are done: everything below ``low``, plus ``above``."""

    def __init__(self) -> None:
        self.low = 0
        self.above: set[int] = set()

    def __contains__(self, i: int) -> bool:
        return i < self.low or i in self.above

    def add(self, i: int) -> None:
        if i < self.low:
            return
        self.above.add(i)
        while self.low in self.above:
            self.above.remove(self.low)
            self.low += 1


@dataclass(eq=False, slots=True)
class _OutMessage:
    msg_id: int
    tag: int
    seq: int
    data: memoryview
    seg_bytes: int
    nsegs: int
    next_seg: int = 0
    unacked: int = 0
    notify: bool = True  # report SendCompleted (send_now's callers may not need it)


@dataclass(eq=False, slots=True)
class _Segment:
    msg: _OutMessage
    offset: int
    length: int
    rail: int
    deadline: float = 0.0
    retries: int = 0

    @property
    def cost(self) -> int:
        return self.length + F.HEADER_SIZE


@dataclass(eq=False, slots=True)
class _Reassembly:
    msg_id: int
    tag: int
    seq: int
    total: int
    buf: memoryview | None  # (None: refused, or discarded)
    posted: memoryview | None = None  # the caller's buffer when data lands there directly
    starts: list[int] = field(default_factory=list)  # sorted offsets of received segments
    lengths: dict[int, int] = field(default_factory=dict)  # offset -> length
    received: int = 0
    # offset -> (length, rail) being read in place
    claims: dict[int, tuple[int, int]] = field(default_factory=dict)
    discard: bool = False  # its receive was cancelled: count bytes, store nothing
    refused: int = -1  # refused (see "Refusal"): the size of the receive it was refused for

    @property
    def complete(self) -> bool:
        return self.received == self.total and bool(self.lengths)


@dataclass(eq=False, slots=True)
class _Stream:
    next_deliver: int = 0
    next_post: int = 0
    bound: dict[int, memoryview] = field(default_factory=dict)  # seq -> posted buffer
    ready: dict[int, _Reassembly] = field(default_factory=dict)  # seq -> complete _Reassembly
    owner: dict[int, int] = field(default_factory=dict)  # seq -> msg_id, messages in progress
    # (arrival, message): delivered, not taken
    early: deque[tuple[int, bytearray]] = field(default_factory=deque)
    cancelled: set[int] = field(default_factory=set)  # positions whose receive was withdrawn


@dataclass(eq=False, slots=True)
class _Peer:
    rails: list[bool]  # alive flag per rail
    # sending
    next_msg_id: int = 0
    tag_seq: dict[int, int] = field(default_factory=dict)
    queue: deque[_OutMessage] = field(default_factory=deque)  # messages with segments not yet sent
    backlog: int = 0  # bytes of those segments (see backlog_bytes)
    # msg_id -> _OutMessage, not yet completed
    open: dict[int, _OutMessage] = field(default_factory=dict)
    sent_done: _IdWindow = field(default_factory=_IdWindow)
    unacked: dict[tuple[int, int], _Segment] = field(default_factory=dict)  # (msg_id, offset)
    urgent: deque[tuple[int, int]] = field(default_factory=deque)  # segment keys to resend now
    inflight: int = 0
    scan_at: float = math.inf  # no unacked segment's deadline is earlier (a lower bound)
    rail_bytes: list[int] = field(default_factory=list)
    rr: int = 0
    # receiving
    # rail the data came on -> [(msg_id, offset)]
    acks_out: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    acks_due: float = math.inf  # when the held acks must go (now, for urgent ones)
    acks_held: int = 0
    acks_bytes: int = 0  # bytes of the messages those acks are for (segments counted whole)
    recv_done: _IdWindow = field(default_factory=_IdWindow)
    partial: dict[int, _Reassembly] = field(default_factory=dict)  # msg_id -> _Reassembly
    held: int = 0  # private reassembly + early bytes from this peer (max_reassembly_bytes)
    held_messages: int = 0  # the messages those bytes belong to (max_held_messages)
    streams: dict[int, _Stream] = field(default_factory=dict)  # tag -> _Stream
    # msg_id -> (tag, seq, total, buffer bytes)
    refused: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)
    refusals_out: dict[int, int] = field(default_factory=dict)  # msg_id -> rail: REFUSEs to send
    # first frames too large for private memory that met no receive yet:
    # msg_id -> (tag, seq, total, rail), at most MAX_OVERSIZED (see "Refusal")
    oversized: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)

    def live_rails(self) -> list[int]:
        return [r for r, ok in enumerate(self.rails) if ok]


def _byte_view(buffer: Bytes, writable: bool = False) -> memoryview:
    view = memoryview(buffer)
    if not view.contiguous:
        raise ValueError("buffer must be contiguous")
    view = view.cast("B")
    if writable and view.readonly:
        raise ValueError("buffer must be writable")
    return view


# ----------------------------------------------------------------------------- endpoint


class Endpoint:
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

    def __init__(self, rank: int, world_size: int, rails: int, segment_bytes: int,
                 max_message_bytes: int, *, rto: float = 0.2, backoff: float = 2.0,
                 max_rto: float = 5.0, max_retries: int = 8, window_bytes: int = 4 << 20,
                 max_reassembly_bytes: int = 64 << 20, max_open_messages: int = 4096,
                 crc: bool = False, ack_delay: float = 0.0, notice_tags: Iterable[int] = (),
                 max_held_messages: int = MAX_HELD_MESSAGES):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        if not 1 <= rails <= 256:
            raise ValueError(f"rails must be 1..256, not {rails}")
        if not 1 <= segment_bytes <= F.MAX_SEGMENT_BYTES:
            raise ValueError(f"segment_bytes must be 1..{F.MAX_SEGMENT_BYTES}, not {segment_bytes}")
        if rto <= 0 or backoff < 1 or max_rto < rto or max_retries < 0:
            raise ValueError("need rto > 0, backoff >= 1, max_rto >= rto, max_retries >= 0")
        self.rank, self.world_size, self.nrails = rank, world_size, rails
        self.segment_bytes, self.max_message_bytes = segment_bytes, max_message_bytes
        self.rto, self.backoff, self.max_rto, self.max_retries = rto, backoff, max_rto, max_retries
        self.window_bytes, self.max_reassembly_bytes = window_bytes, max_reassembly_bytes
        self.max_open_messages, self.crc = max_open_messages, crc
        self.max_held_messages = max_held_messages
        self.ack_delay = ack_delay
        self.notice_tags = frozenset(notice_tags)
        # Something for poll_transmit besides deadlines (new messages, a window that opened,
        # urgent acks or resends): a driver may skip the call while this is False and no
        # deadline (next_deadline) has passed.
        self.has_work = False
        self._ack_hint = math.inf  # earliest ack deadline set since take_ack_hint()
        self.reassembly_bytes = 0  # held by every peer together (see _Peer.held)
        self._arrivals = 0  # numbers early messages across streams (take_early_any)
        self.stats = {"sent": 0, "retransmits": 0, "duplicates": 0, "rejected": 0,
                      "dropped_full": 0, "dropped_claimed": 0, "discarded": 0,
                      "acks_sent": 0, "acks_piggybacked": 0, "refused": 0,
                      "rails_restored": 0}
        self._peers: dict[int, _Peer] = {}
        self._failed: dict[int, str] = {}
        self._left: dict[int, _Peer] = {}  # failed peers' early messages, until taken
        self._dead_rails: set[int] = set()  # rails failed towards every peer
        self._events: list[Event] = []

    # ------------------------------------------------------------------ public API

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
        view = _byte_view(data)
        if view.nbytes > self.max_message_bytes:
            raise ValueError(f"message of {view.nbytes} bytes exceeds max_message_bytes "
                             f"{self.max_message_bytes}")
        seq = state.tag_seq.get(tag, 0)
        state.tag_seq[tag] = seq + 1
        # Cut into at least one segment per rail (when segments stay >= MIN_SPRAY_BYTES),
        # so a mid-sized message is sprayed over every rail instead of riding one.
        seg_bytes = min(self.segment_bytes,
                        max(MIN_SPRAY_BYTES, -(-view.nbytes // self.nrails)))
        msg = _OutMessage(state.next_msg_id, tag, seq, view, seg_bytes,
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
        msg = _OutMessage(msg_id, tag, seq, memoryview(data), n or 1, 1, 1, 1, notify)
        state.open[msg_id] = msg
        rail = self._pick_rail(state)
        cost = n + F.HEADER_SIZE  # (_Segment.cost)
        state.rail_bytes[rail] += cost
        state.inflight += cost
        deadline = now + self.rto  # (_transmit's, for a first send: max_rto >= rto)
        state.unacked[(msg_id, 0)] = _Segment(msg, 0, n, rail, deadline)
        if deadline < state.scan_at:
            state.scan_at = deadline
        trailer = self._take_acks(state) if state.acks_out else b""
        self.stats["sent"] += 1
        return msg_id, rail, F.HEADER.pack(F.MAGIC, F.VERSION, F.DATA, 0, rail,
                                           len(trailer) >> 4, self.rank, peer, msg_id, tag,
                                           seq, n, 0, n, 0), data, trailer

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
                and not stream.early and not state.oversized
                and type(buffer) is memoryview and buffer.ndim == 1 and buffer.format == "B"
                and buffer.c_contiguous and not buffer.readonly):
            # the commonest case, in one step: a byte view for a stream with nothing early
            position = stream.next_post
            if position < stream.next_deliver:
                position = stream.next_deliver
            stream.bound[position] = buffer
            stream.next_post = position + 1
            return position
        view = _byte_view(buffer, writable=True)
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

    def has_events(self) -> bool:
        """Are there events ``events()`` would return?"""
        return bool(self._events)

    def take_early(self, src: int, tag: int) -> bytearray | None:
        """The oldest early message of ``(src, tag)`` (a ``bytearray``), or None."""
        state = self._peers.get(src) or self._left.get(src)
        if state is None or (stream := state.streams.get(tag)) is None or not stream.early:
            return None
        return self._take(state, stream)

    def take_early_any(self, tag: int) -> tuple[int, bytearray] | None:
        """``(src, message)`` of the earliest-arrived early message of ``tag`` from any
        peer, or None."""
        best = self._earliest(tag)
        if best is None:
            return None
        return best[0], self._take(best[1], best[2])

    def peek_early_any(self, tag: int) -> int | None:
        """The source of the message ``take_early_any(tag)`` would take, or None."""
        best = self._earliest(tag)
        return None if best is None else best[0]

    def _earliest(self, tag: int) -> tuple[int, _Peer, _Stream] | None:
        best: tuple[int, _Peer, _Stream] | None = None
        for src, state in [*self._peers.items(), *self._left.items()]:
            stream = state.streams.get(tag)
            if stream is not None and stream.early and (
                    best is None or stream.early[0][0] < best[2].early[0][0]):
                best = (src, state, stream)
        return best

    def _take(self, state: _Peer, stream: _Stream) -> bytearray:
        data = stream.early.popleft()[1]
        state.held -= len(data)
        state.held_messages -= 1
        self.reassembly_bytes -= len(data)
        return data

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

    def _forget(self, state: _Peer, msg: _OutMessage) -> None:
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

    def release_claims(self, peer: int, rail: int) -> None:
        """The reader of ``rail`` from ``peer`` stopped: its claims end unlanded (the
        segments are resent, to other rails if this one failed)."""
        state = self._peers.get(peer)
        if state is None:
            return
        for r in state.partial.values():
            for offset in [o for o, (_, rl) in r.claims.items() if rl == rail]:
                del r.claims[offset]

    def rail_failed(self, rail: int, peer: int | None = None) -> None:
        """Stop using ``rail`` (to ``peer``, or to every peer) and resend what it carried.

        The rail's unacked segments move to the peer's remaining rails at the next
        ``poll_transmit``. A peer left without a live rail fails (``PeerFailed``).
        """
        if not 0 <= rail < self.nrails:
            raise ValueError(f"no rail {rail} (rails 0..{self.nrails - 1})")
        if peer is None:
            self._dead_rails.add(rail)
            peers = list(self._peers)
        else:
            peers = [peer]
        for p in peers:
            if p in self._failed:
                continue
            state = self._peer(p)
            if not state.rails[rail]:
                continue
            state.rails[rail] = False
            self.has_work = True
            if not state.live_rails():
                self._fail(p, f"all {self.nrails} rails to rank {p} failed")
                continue
            for key, seg in state.unacked.items():
                if seg.rail == rail:
                    state.urgent.append(key)

    def rail_restored(self, rail: int, peer: int) -> None:
        """``rail`` to ``peer``, failed before, is usable again (the driver reopened its
        connection): new and resent segments may go on it. A failed peer stays failed."""
        if not 0 <= rail < self.nrails:
            raise ValueError(f"no rail {rail} (rails 0..{self.nrails - 1})")
        state = self._peers.get(peer)
        if state is None or peer in self._failed or state.rails[rail]:
            return
        state.rails[rail] = True
        self.stats["rails_restored"] += 1
        self.has_work = True

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

    def data_target(self, rail: int, header: F.Header) -> memoryview | None:
        """Where a DATA segment announced by ``header`` may be read straight into, or None.

        For stream drivers (TCP rails): after reading a frame's header (``F.decode_header``),
        the driver asks for the segment's place in its message (the posted receive buffer
        or the reassembly buffer) and reads the payload there, then calls ``data_landed``
        (or ``release_claims`` if the read fails). The range is claimed by ``rail`` until
        then: nobody else gets it (see "Buffer ownership"). None means "read the payload
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
    def _overlaps(r: _Reassembly, start: int, length: int) -> bool:
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
            done.low = low + 1  # (_IdWindow.add, in order)
        else:
            done.add(msg_id)
        self._ack(state, rail, msg_id, 0, total, now)
        stream.next_deliver = seq + 1
        if posted is None:  # (data is the private copy, a bytearray)
            self._arrivals += 1
            stream.early.append((self._arrivals, data))  # type: ignore[arg-type]
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
        self._events.append(MessageReceived(header.src, tag, msg_id, data, posted))
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

    def release_acks(self) -> None:
        """Make every held ack due now (before closing: peers wait for them)."""
        for state in self._peers.values():
            if state.acks_out:
                state.acks_due = -math.inf
                self.has_work = True

    def take_ack_hint(self) -> float:
        """The earliest ack deadline set since the last call (inf: none): a driver that
        sleeps until ``next_deadline`` must wake by then."""
        hint, self._ack_hint = self._ack_hint, math.inf
        return hint

    def events(self) -> list[Event]:
        """Events since the last call (``MessageReceived``, ``SendCompleted``, ...), oldest first."""
        events, self._events = self._events, []
        return events

    def next_deadline(self) -> float | None:
        """When to call ``poll_transmit`` next (None: nothing unacknowledged).

        Never later than the earliest retransmission deadline, and possibly earlier (the
        segment that set it may have been acknowledged since): a ``poll_transmit`` at that
        time may find nothing due, and the next call then gives the true deadline.
        """
        due = math.inf
        for s in self._peers.values():
            if s.unacked and s.scan_at < due:
                due = s.scan_at
            if s.acks_out and s.acks_due < due:
                due = s.acks_due
        return None if due == math.inf else due

    def mid_transfer(self) -> bool:
        """Is a message part way: segments not yet sent (waiting for the window to open, or
        to be resent off a failed rail), or a message partly received? Only reading the
        rails moves them on (acknowledgements, the rest of the segments)."""
        return any(s.queue or s.urgent or s.partial for s in list(self._peers.values()))

    def backlog_bytes(self, peer: int) -> int:
        """Bytes of messages to ``peer`` queued and not yet sent: what waits for the window
        to open. A driver that completes small sends at once (copying them) stops doing so
        while this is a window's worth or more, so a sender that runs ahead of its peer
        holds at most that much in copies, and a close has at most that much to deliver."""
        state = self._peers.get(peer)
        return 0 if state is None else state.backlog

    def inflight_bytes(self, peer: int, rail: int | None = None) -> int:
        """Unacked bytes to ``peer`` as counted against ``window_bytes`` (on ``rail``
        only, if given)."""
        state = self._peers.get(peer)
        if state is None:
            return 0
        return state.inflight if rail is None else state.rail_bytes[rail]

    # ------------------------------------------------------------------ peers

    def _peer(self, peer: int) -> _Peer:
        if not isinstance(peer, int) or not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"bad peer {peer!r} for rank {self.rank} of {self.world_size}")
        if peer in self._failed:
            raise ProtocolError(f"rank {peer} failed: {self._failed[peer]}")
        state = self._peers.get(peer)
        if state is None:
            rails = [r not in self._dead_rails for r in range(self.nrails)]
            state = self._peers[peer] = _Peer(rails=rails, rail_bytes=[0] * self.nrails)
            if not any(rails):
                self._fail(peer, f"all {self.nrails} rails failed")
                raise ProtocolError(f"rank {peer} failed: {self._failed[peer]}")
        return state

    def _fail(self, peer: int, reason: str) -> None:
        state = self._peers.pop(peer)
        self._failed[peer] = reason
        kept = kept_messages = 0
        for stream in state.streams.values():
            kept += sum(len(data) for _, data in stream.early)
            kept_messages += len(stream.early)
        self.reassembly_bytes -= state.held - kept
        state.held, state.held_messages, state.partial = kept, kept_messages, {}
        if kept:
            self._left[peer] = state  # its whole messages stay until taken
        self._events.append(PeerFailed(peer, reason, tuple(sorted(state.open))))

    def _reject(self, rail: int, reason: str) -> None:
        self.stats["rejected"] += 1
        self._events.append(FrameRejected(rail, reason))

    @staticmethod
    def _stream(state: _Peer, tag: int) -> _Stream:
        stream = state.streams.get(tag)
        if stream is None:
            stream = state.streams[tag] = _Stream()
        return stream

    # ------------------------------------------------------------------ sending

    def _pick_rail(self, state: _Peer, avoid: int | None = None) -> int:
        """The first live rail with less than FILL_BYTES unacked, else the one with the
        fewest unacked bytes (ties go round-robin from ``rr``)."""
        n, rails, load, rr = self.nrails, state.rails, state.rail_bytes, state.rr
        if avoid is not None and sum(rails) < 2:
            avoid = None
        for r in range(n):
            if rails[r] and r != avoid and load[r] < FILL_BYTES:
                return r
        best, best_key = -1, None
        for i in range(n):
            r = (rr + i) % n  # visiting from rr makes the first of equal loads the next in turn
            if rails[r] and r != avoid and (best_key is None or load[r] < best_key):
                best, best_key = r, load[r]
        if best < 0:
            raise ValueError("no live rail")  # (a peer without one has failed already)
        state.rr = (best + 1) % n
        return best

    def _transmit(self, peer: int, seg: _Segment, now: float) -> Transmit:
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

    def _take_acks(self, state: _Peer) -> bytes:
        """Every ack waiting for this peer (up to a frame's worth), packed to ride behind a
        DATA frame's payload."""
        if state.acks_held == 1:  # (the commonest: the ack of the message being answered)
            for entries in state.acks_out.values():
                if entries:
                    state.acks_out, state.acks_due, state.acks_held = {}, math.inf, 0
                    state.acks_bytes = 0
                    self.stats["acks_piggybacked"] += 1
                    return F.ACK_ENTRY.pack(*entries[0])
        entries = [e for es in state.acks_out.values() for e in es]
        take = entries[:F.MAX_ACKS_PER_FRAME]
        rest = entries[F.MAX_ACKS_PER_FRAME:]
        if rest:
            state.acks_out = {self._pick_rail(state): rest}
            state.acks_held = len(rest)
        else:
            state.acks_out, state.acks_due, state.acks_held = {}, math.inf, 0
            state.acks_bytes = 0
        self.stats["acks_piggybacked"] += len(take)
        return F.pack_acks(take)

    def _move(self, state: _Peer, seg: _Segment, rail: int) -> None:
        state.rail_bytes[seg.rail] -= seg.cost
        seg.rail = rail
        state.rail_bytes[rail] += seg.cost

    def _resend_due(self, peer: int, state: _Peer, now: float, out: list[Transmit]) -> bool:
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

    def _send_new(self, peer: int, state: _Peer, now: float, out: list[Transmit]) -> None:
        while state.queue:
            msg = state.queue[0]
            if msg.next_seg == 0 and msg.msg_id >= state.sent_done.low + self.max_open_messages:
                return
            offset = msg.next_seg * msg.seg_bytes
            length = min(msg.seg_bytes, msg.data.nbytes - offset)
            cost = length + F.HEADER_SIZE  # (_Segment.cost)
            if state.inflight and state.inflight + cost > self.window_bytes:
                return  # the window is full (one segment may always be outstanding)
            seg = _Segment(msg, offset, length, rail=self._pick_rail(state))
            state.rail_bytes[seg.rail] += cost
            state.inflight += cost
            state.unacked[(msg.msg_id, offset)] = seg
            state.backlog -= length
            msg.unacked += 1
            msg.next_seg += 1
            if msg.next_seg == msg.nsegs:
                state.queue.popleft()
            out.append(self._transmit(peer, seg, now))

    def _on_ack(self, peer: int, state: _Peer, entries: Iterable[tuple[int, int]]) -> None:
        if state.queue:
            self.has_work = True  # the window may open
        unacked = state.unacked
        for key in entries:
            seg = unacked.pop(key, None)
            if seg is None:
                continue  # a duplicate ack, or for a segment long done
            cost = seg.length + F.HEADER_SIZE  # (_Segment.cost)
            state.inflight -= cost
            state.rail_bytes[seg.rail] -= cost
            msg = seg.msg
            msg.unacked -= 1
            if msg.unacked == 0 and msg.next_seg == msg.nsegs:
                msg_id = msg.msg_id
                del state.open[msg_id]
                done = state.sent_done
                if msg_id == done.low and not done.above:
                    done.low = msg_id + 1  # (_IdWindow.add, in order)
                else:
                    done.add(msg_id)
                if msg.notify:
                    self._events.append(SendCompleted(peer, msg_id))

    def _ack(self, state: _Peer, rail: int, msg_id: int, offset: int, total: int, now: float,
             urgent: bool = False) -> None:
        """Queue the ack of one segment; see "Delayed acks" for when it goes."""
        entries = state.acks_out.get(rail)
        if entries is None:
            entries = state.acks_out[rail] = []
        entries.append((msg_id, offset))
        state.acks_held += 1
        state.acks_bytes += total
        if (urgent or total > DELAYED_ACK_BYTES or self.ack_delay <= 0
                or state.acks_held >= F.MAX_ACKS_PER_FRAME
                or state.acks_bytes >= DELAYED_ACK_HELD_BYTES):
            state.acks_due = min(state.acks_due, now)
            self.has_work = True
        elif state.acks_due == math.inf:
            state.acks_due = due = now + self.ack_delay
            if due < self._ack_hint:
                self._ack_hint = due

    def _flush_acks(self, peer: int, state: _Peer, out: list[Transmit]) -> None:
        pending, state.acks_out = state.acks_out, {}
        state.acks_due, state.acks_held, state.acks_bytes = math.inf, 0, 0
        for rail, entries in sorted(pending.items()):
            if not state.rails[rail]:
                rail = self._pick_rail(state)
            for i in range(0, len(entries), F.MAX_ACKS_PER_FRAME):
                self._send_ack(peer, rail, entries[i:i + F.MAX_ACKS_PER_FRAME], out)

    def _send_ack(self, peer: int, rail: int, chunk: list[tuple[int, int]],
                  out: list[Transmit]) -> None:
        frame = (F.encode_ack(self.rank, peer, chunk, rail=rail, crc=True) if self.crc
                 else F.pack_ack(self.rank, peer, chunk, rail))
        out.append(Transmit(peer, rail, frame))
        self.stats["acks_sent"] += 1

    # ------------------------------------------------------------------ receiving

    def _on_data(self, rail: int, state: _Peer, frame: F.Frame, now: float) -> None:
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

    def _over_budget(self, state: _Peer, stream: _Stream | None, header: F.Header | F.Frame,
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

    # ------------------------------------------------------------------ refusal (cold)

    def _too_large(self, rail: int, src: int, state: _Peer, stream: _Stream | None,
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

    def _refuse_remembered(self, src: int, state: _Peer, stream: _Stream, tag: int,
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

    def _refuse(self, rail: int, src: int, state: _Peer, stream: _Stream, msg_id: int,
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
        stream.ready[seq] = _Reassembly(msg_id, tag, seq, total, None, refused=expected)
        self._deliver_ready(src, state, stream)

    def _send_refusals(self, peer: int, state: _Peer, out: list[Transmit]) -> None:
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

    def _on_refuse(self, rail: int, src: int, state: _Peer, frame: F.Frame) -> None:
        """``src`` refuses message ``frame.msg_id`` (see "Refusal")."""
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
        self._events.append(SendRefused(src, msg.msg_id, msg.tag, msg.data.nbytes,
                                        frame.offset))

    def _start(self, rail: int, state: _Peer, frame: F.Header | F.Frame) -> _Reassembly | None:
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
        r = _Reassembly(frame.msg_id, frame.tag, frame.seq, frame.total, buf, owner,
                        discard=discard)
        state.partial[frame.msg_id] = r
        stream.owner[frame.seq] = frame.msg_id
        return r

    def _place(self, rail: int, r: _Reassembly, frame: F.Frame) -> bool:
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

    def _finish(self, src: int, state: _Peer, r: _Reassembly) -> None:
        del state.partial[r.msg_id]
        state.recv_done.add(r.msg_id)
        stream = self._stream(state, r.tag)
        stream.ready[r.seq] = r
        self._deliver_ready(src, state, stream)

    def _deliver_ready(self, src: int, state: _Peer, stream: _Stream) -> None:
        """Deliver the complete messages that are next in ``stream``'s order."""
        while stream.next_deliver in stream.ready:
            self._deliver(src, state, stream, stream.ready.pop(stream.next_deliver))
            stream.next_deliver += 1

    def _deliver(self, src: int, state: _Peer, stream: _Stream, r: _Reassembly) -> None:
        stream.owner.pop(r.seq, None)
        posted = stream.bound.pop(r.seq, None)
        if r.refused >= 0:  # (it never held memory, and no byte of it was placed)
            if r.seq in stream.cancelled:
                stream.cancelled.discard(r.seq)
                self.stats["discarded"] += 1
            else:
                self._events.append(MessageRefused(src, r.tag, r.msg_id, r.total, r.refused))
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
            self._events.append(MessageReceived(src, r.tag, r.msg_id,
                                                r.buf, True))  # type: ignore[arg-type]
            return
        if posted is not None and posted.nbytes >= r.total:
            state.held -= r.total
            state.held_messages -= 1
            self.reassembly_bytes -= r.total
            posted[:r.total] = r.buf  # type: ignore[assignment]
            self._events.append(MessageReceived(src, r.tag, r.msg_id, posted[:r.total], True))
            return
        # (a private buffer: a view of its bytearray)
        data: bytearray = r.buf.obj  # type: ignore[union-attr, assignment]
        if posted is not None:  # too small for it: the receive gets the message to refuse
            state.held -= r.total
            state.held_messages -= 1
            self.reassembly_bytes -= r.total
        else:  # nobody asked for it yet: kept (and counted) until taken
            self._arrivals += 1
            stream.early.append((self._arrivals, data))
        self._events.append(MessageReceived(src, r.tag, r.msg_id, data, False))


__all__ = ["Endpoint", "MessageReceived", "MessageRefused", "SendCompleted", "SendRefused",
           "PeerFailed", "FrameRejected", "Transmit", "ProtocolError"]
