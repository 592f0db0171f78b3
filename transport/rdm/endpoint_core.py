"""The rdm endpoint's base: its settings, its peers, and their rails.

How it works
------------
``EndpointCore`` holds what every layer of the endpoint (protocol.py, "Layout") works on:
the settings (``Endpoint`` documents them), one ``PeerState`` per peer, made on first
contact (``_peer``), the events not yet taken (``pending_events``, ``events()``) and the
counters (``stats``). A peer fails (``_fail``) when its last rail fails or a segment of it
is never acknowledged: its state is dropped, except whole messages nobody took yet, which
stay in ``early`` until taken (their memory counted in the state kept in ``_left``), and
``PeerFailed`` names its unfinished sends.
``rail_failed`` and ``rail_restored`` take a rail out of use and back, towards one peer or
all; ``_pick_rail`` chooses the rail of a segment (protocol.py, "Sending").
"""

from __future__ import annotations

import math
from typing import Iterable

from ..matching import Unexpected
from . import frames as F
from .events import Event, FrameRejected, PeerFailed, ProtocolError
from .peer_state import PeerState, Stream

# A segment goes to the first rail with less than FILL_BYTES unacknowledged, else to the
# least loaded (protocol.py, "Sending"): small and mid-sized traffic keeps to one rail,
# large transfers fill the rails in turn (docs/design.md, "Thresholds and why").
FILL_BYTES = 4 << 20
MAX_HELD_MESSAGES = 1 << 16  # messages held privately per peer (max_held_messages)


class EndpointCore:
    """State and peers of an ``Endpoint`` (see the module docstring)."""

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
        # The earliest ack deadline set since take_ack_hint() (inf: none).
        self.ack_hint = math.inf
        self.reassembly_bytes = 0  # held by every peer together (see PeerState.held)
        # Early messages (delivered whole before any receive asked for them), until taken
        self.early: Unexpected[bytearray] = Unexpected()
        self.stats = {"sent": 0, "retransmits": 0, "duplicates": 0, "rejected": 0,
                      "dropped_full": 0, "dropped_claimed": 0, "discarded": 0,
                      "acks_sent": 0, "acks_piggybacked": 0, "refused": 0,
                      "rails_restored": 0}
        self._peers: dict[int, PeerState] = {}
        self._failed: dict[int, str] = {}
        self._left: dict[int, PeerState] = {}  # failed peers with early messages still kept
        self._dead_rails: set[int] = set()  # rails failed towards every peer
        # The events not yet taken by events(): a driver may test this list's truth
        # to skip the call.
        self.pending_events: list[Event] = []

    def _peer(self, peer: int) -> PeerState:
        if not isinstance(peer, int) or not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"bad peer {peer!r} for rank {self.rank} of {self.world_size}")
        if peer in self._failed:
            raise ProtocolError(f"rank {peer} failed: {self._failed[peer]}")
        state = self._peers.get(peer)
        if state is None:
            rails = [r not in self._dead_rails for r in range(self.nrails)]
            state = self._peers[peer] = PeerState(rails=rails, rail_bytes=[0] * self.nrails)
            if not any(rails):
                self._fail(peer, f"all {self.nrails} rails failed")
                raise ProtocolError(f"rank {peer} failed: {self._failed[peer]}")
        return state

    def _fail(self, peer: int, reason: str) -> None:
        state = self._peers.pop(peer)
        self._failed[peer] = reason
        early = self.early.of(peer)
        kept, kept_messages = sum(len(data) for data in early), len(early)
        self.reassembly_bytes -= state.held - kept
        state.held, state.held_messages, state.partial = kept, kept_messages, {}
        if kept:
            self._left[peer] = state  # its whole messages stay until taken
        self.pending_events.append(PeerFailed(peer, reason, tuple(sorted(state.open))))

    def _reject(self, rail: int, reason: str) -> None:
        self.stats["rejected"] += 1
        self.pending_events.append(FrameRejected(rail, reason))

    @staticmethod
    def _stream(state: PeerState, tag: int) -> Stream:
        stream = state.streams.get(tag)
        if stream is None:
            stream = state.streams[tag] = Stream()
        return stream

    def _pick_rail(self, state: PeerState, avoid: int | None = None) -> int:
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

    def events(self) -> list[Event]:
        """Events since the last call (``MessageReceived``, ``SendCompleted``, ...), oldest first."""
        events, self.pending_events = self.pending_events, []
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


__all__ = ["EndpointCore", "FILL_BYTES", "MAX_HELD_MESSAGES"]
