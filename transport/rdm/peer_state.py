"""The rdm endpoint's records: what it keeps per peer, per message and per stream.

How it works
------------
One ``PeerState`` per peer holds both directions. Sending: messages are numbered by
``next_msg_id`` and open (``OutMessage``) until their last segment is acknowledged;
``queue`` holds those with segments not yet sent, ``unacked`` each sent ``Segment`` with
its retransmission deadline, ``sent_done`` the ids finished. Receiving: ``partial`` holds
the messages being reassembled (``InMessage``: its buffer, the byte ranges landed or
claimed by a rail's reader), ``recv_done`` the ids finished, ``streams`` one ``Stream`` per
tag (delivery order, the buffers posted for its positions), ``acks_out``
the acks to send. Both directions live in one record because one frame touches both: a
DATA frame carries acks of this rank's sends, and the ack it earns rides on the next DATA
frame back. The endpoint's layers (protocol.py, "Layout") all work on these records.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import frames as F

if TYPE_CHECKING:
    from .frames import Bytes


class IdWindow:
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
class OutMessage:
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
class Segment:
    msg: OutMessage
    offset: int
    length: int
    rail: int
    deadline: float = 0.0
    retries: int = 0

    @property
    def cost(self) -> int:
        return self.length + F.HEADER_SIZE


@dataclass(eq=False, slots=True)
class InMessage:
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
    refused: int = -1  # refused (protocol.py, "Refusal"): the size of the receive it was refused for

    @property
    def complete(self) -> bool:
        return self.received == self.total and bool(self.lengths)


@dataclass(eq=False, slots=True)
class Stream:
    next_deliver: int = 0
    next_post: int = 0
    bound: dict[int, memoryview] = field(default_factory=dict)  # seq -> posted buffer
    ready: dict[int, InMessage] = field(default_factory=dict)  # seq -> complete InMessage
    owner: dict[int, int] = field(default_factory=dict)  # seq -> msg_id, messages in progress
    cancelled: set[int] = field(default_factory=set)  # positions whose receive was withdrawn


@dataclass(eq=False, slots=True)
class PeerState:
    rails: list[bool]  # alive flag per rail
    # sending
    next_msg_id: int = 0
    tag_seq: dict[int, int] = field(default_factory=dict)
    queue: deque[OutMessage] = field(default_factory=deque)  # messages with segments not yet sent
    backlog: int = 0  # bytes of those segments (see backlog_bytes)
    # msg_id -> OutMessage, not yet completed
    open: dict[int, OutMessage] = field(default_factory=dict)
    sent_done: IdWindow = field(default_factory=IdWindow)
    unacked: dict[tuple[int, int], Segment] = field(default_factory=dict)  # (msg_id, offset)
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
    recv_done: IdWindow = field(default_factory=IdWindow)
    partial: dict[int, InMessage] = field(default_factory=dict)  # msg_id -> InMessage
    held: int = 0  # private reassembly + early bytes from this peer (max_reassembly_bytes)
    held_messages: int = 0  # the messages those bytes belong to (max_held_messages)
    streams: dict[int, Stream] = field(default_factory=dict)  # tag -> Stream
    # msg_id -> (tag, seq, total, buffer bytes)
    refused: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)
    refusals_out: dict[int, int] = field(default_factory=dict)  # msg_id -> rail: REFUSEs to send
    # first frames too large for private memory that met no receive yet:
    # msg_id -> (tag, seq, total, rail), at most MAX_OVERSIZED (protocol.py, "Refusal")
    oversized: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)

    def live_rails(self) -> list[int]:
        return [r for r, ok in enumerate(self.rails) if ok]


def byte_view(buffer: Bytes, writable: bool = False) -> memoryview:
    view = memoryview(buffer)
    if not view.contiguous:
        raise ValueError("buffer must be contiguous")
    view = view.cast("B")
    if writable and view.readonly:
        raise ValueError("buffer must be writable")
    return view


__all__ = ["IdWindow", "InMessage", "OutMessage", "PeerState", "Segment", "Stream", "byte_view"]
