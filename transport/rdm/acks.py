"""Acknowledgements of the rdm endpoint, both ways (protocol.py: "Acknowledgement" and
"Delayed acks").

How it works
------------
Out: every DATA segment this rank accepts earns an ``(msg_id, offset)`` entry, queued per
rail it came on (``_ack``). Entries of small messages (up to DELAYED_ACK_BYTES) may wait up
to ``ack_delay``, or until DELAYED_ACK_HELD_BYTES of such messages wait, to ride behind the
next DATA frame to that peer (``_take_acks``, called by the send path); the others go at
the next ``poll_transmit``, as ACK frames of up to MAX_ACKS_PER_FRAME entries
(``_flush_acks``). ``ack_hint`` tells a driver that sleeps when held acks fall due.

In: ``_on_ack`` retires the acknowledged segments of this rank's sends, which frees their
share of the window, and reports ``SendCompleted`` once a message's last segment is
acknowledged.
"""

from __future__ import annotations

import math
from typing import Iterable

from . import frames as F
from .endpoint_core import EndpointCore
from .events import SendCompleted, Transmit
from .peer_state import PeerState

# Acks of messages up to this size may wait (ack_delay): the driver's eager sends
# (driver.EAGER_BYTES), which complete at once, so nobody waits for their acks.
DELAYED_ACK_BYTES = 256 << 10
# ... until this many bytes of such messages wait for their acks: then they go at once, so
# the copies a streaming sender keeps for its unacknowledged eager sends stay bounded
# whatever ``ack_delay`` is.
DELAYED_ACK_HELD_BYTES = 4 << 20


class Acks(EndpointCore):
    """The acks an ``Endpoint`` sends and the acks it receives."""

    def _ack(self, state: PeerState, rail: int, msg_id: int, offset: int, total: int, now: float,
             urgent: bool = False) -> None:
        """Queue the ack of one segment; see protocol.py, "Delayed acks", for when it goes."""
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
            if due < self.ack_hint:
                self.ack_hint = due

    def _take_acks(self, state: PeerState) -> bytes:
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

    def _flush_acks(self, peer: int, state: PeerState, out: list[Transmit]) -> None:
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

    def release_acks(self) -> None:
        """Make every held ack due now (before closing: peers wait for them)."""
        for state in self._peers.values():
            if state.acks_out:
                state.acks_due = -math.inf
                self.has_work = True

    def take_ack_hint(self) -> float:
        """The earliest ack deadline set since the last call (inf: none): a driver that
        sleeps until ``next_deadline`` must wake by then."""
        hint, self.ack_hint = self.ack_hint, math.inf
        return hint

    def _on_ack(self, peer: int, state: PeerState, entries: Iterable[tuple[int, int]]) -> None:
        if state.queue:
            self.has_work = True  # the window may open
        unacked = state.unacked
        for key in entries:
            seg = unacked.pop(key, None)
            if seg is None:
                continue  # a duplicate ack, or for a segment long done
            cost = seg.length + F.HEADER_SIZE  # (Segment.cost)
            state.inflight -= cost
            state.rail_bytes[seg.rail] -= cost
            msg = seg.msg
            msg.unacked -= 1
            if msg.unacked == 0 and msg.next_seg == msg.nsegs:
                msg_id = msg.msg_id
                del state.open[msg_id]
                done = state.sent_done
                if msg_id == done.low and not done.above:
                    done.low = msg_id + 1  # (IdWindow.add, in order)
                else:
                    done.add(msg_id)
                if msg.notify:
                    self.pending_events.append(SendCompleted(peer, msg_id))


__all__ = ["Acks", "DELAYED_ACK_BYTES", "DELAYED_ACK_HELD_BYTES"]
