"""Byte layout of a group's shared-memory segment.

    [header page][region of rank 0][region of rank 1]...[region of rank N-1]

Each region (page aligned) belongs to one rank and holds

    control   step counter, heads of 2 call descriptors | pid, abort flag, sleep flag |
              rest of 2 call descriptors | doorbell | abort message |
              per-source mailbox head/tail counters (each on its own 64-byte line)
    slots     2 x slot_bytes            double-buffered step slots (collectives)
    mailboxes N x mailbox_bytes         inbound byte rings, one per source rank (send/recv)

Counters are 8-byte aligned int64 words: on x86-64 an aligned 8-byte store is atomic and
stores become visible in program order (TSO), which is all the protocol relies on: data is
written before the counter that publishes it, and read after the counter is seen.
"""

from __future__ import annotations

from dataclasses import dataclass

PAGE = 4096
LINE = 64
HEADER_BYTES = PAGE
MAGIC = 0x4E4555524F4E3031  # "NEURON01"

# Byte offsets inside a region's control block.
STEP_OFF = 0
# A call descriptor's first HEAD_WORDS words (descriptor.py: sequence number, the call's code,
# the step it starts at) sit in the step counter's cache line, one head per parity of the
# sequence number: a peer that has seen the step has them without another cache miss (the
# descriptor's own lines cost 0.4-0.6 µs of an 8-byte all_reduce or broadcast here).
HEAD_OFF = 8
HEAD_WORDS = 3
PID_OFF = LINE
ABORT_OFF = LINE + 8
SLEEP_OFF = LINE + 16  # nonzero while this rank sleeps on a futex waiting for a peer
DESC_OFF = 2 * LINE  # the rest of each descriptor (past its head), by parity
DESC_WORDS = 16
DOORBELL_OFF = 6 * LINE  # bumped by peers whose send/recv progress this rank may wait for
DOORBELL_SLEEP_OFF = 6 * LINE + 8  # nonzero while this rank sleeps on its doorbell
ABORT_MSG_OFF = 512
ABORT_MSG_BYTES = 512
MAILBOX_CTR_OFF = 1024
MAILBOX_CTR_STRIDE = 2 * LINE  # head on one line, tail on the next
MAILBOX_ALIGN = 32  # mailbox frames are multiples of this, so headers never wrap


def round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


@dataclass(frozen=True)
class Layout:
    size: int  # ranks in the group
    slot_bytes: int
    mailbox_bytes: int

    def __post_init__(self) -> None:
        if self.slot_bytes % PAGE or self.slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be a positive multiple of {PAGE}")
        if self.mailbox_bytes % PAGE or self.mailbox_bytes <= 0:
            raise ValueError(f"mailbox_bytes must be a positive multiple of {PAGE}")

    @property
    def control_bytes(self) -> int:
        return round_up(MAILBOX_CTR_OFF + self.size * MAILBOX_CTR_STRIDE, PAGE)

    @property
    def region_bytes(self) -> int:
        return self.control_bytes + 2 * self.slot_bytes + self.size * self.mailbox_bytes

    @property
    def total_bytes(self) -> int:
        return HEADER_BYTES + self.size * self.region_bytes

    def region(self, rank: int) -> int:
        return HEADER_BYTES + rank * self.region_bytes

    def slot(self, rank: int, parity: int) -> int:
        return self.region(rank) + self.control_bytes + parity * self.slot_bytes

    def mailbox_counters(self, src: int, dst: int) -> tuple[int, int]:
        """Byte offsets of the head (written by src) and tail (written by dst) counters."""
        base = self.region(dst) + MAILBOX_CTR_OFF + src * MAILBOX_CTR_STRIDE
        return base, base + LINE

    def eager_ranges(self) -> list[tuple[int, int]]:
        """(offset, length) of what is used from the start: header, control and slots.
        Mailboxes are reserved when their sender first uses them."""
        first = [(0, HEADER_BYTES)]
        return first + [(self.region(k), self.control_bytes + 2 * self.slot_bytes)
                        for k in range(self.size)]

    @property
    def eager_bytes(self) -> int:
        return sum(length for _, length in self.eager_ranges())

    def mailbox_data(self, src: int, dst: int) -> int:
        return self.region(dst) + self.control_bytes + 2 * self.slot_bytes + src * self.mailbox_bytes
