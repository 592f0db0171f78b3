"""A single-producer single-consumer byte ring in shared memory (one per ordered rank pair).

``head`` counts bytes ever written (only the producer stores it), ``tail`` bytes ever
consumed (only the consumer stores it); ``head - tail`` bytes are readable and
``capacity - (head - tail)`` writable. Data is copied before the counter moves, so a reader
that sees a counter also sees the bytes it covers. Framing (headers, tags) is the caller's:
see collectives/p2p.py.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from ..base import Mailbox


class ShmMailbox(Mailbox):
    """A ``Mailbox`` in the group's shared-memory segment: head and tail counters in
    ``words``, the ring's bytes in ``data``."""

    __slots__ = ("_w", "_head", "_tail", "_data", "_data_word", "capacity", "_base")

    def __init__(self, words: memoryview[int], head_off: int, tail_off: int, data: torch.Tensor,
                 data_off: int):
        self._w = words
        self._head = head_off // 8
        self._tail = tail_off // 8
        self._data = data  # uint8 tensor view of the ring bytes
        self._data_word = data_off // 8
        self.capacity = data.numel()
        self._base = data.data_ptr()

    def free(self) -> int:
        return self.capacity - (self._w[self._head] - self._w[self._tail])

    def available(self) -> int:
        return self._w[self._head] - self._w[self._tail]

    def write(self, address: int, nbytes: int) -> None:
        """Append ``nbytes`` from memory at ``address`` (memmove: cheaper than torch calls
        for small pieces, as fast for large ones, and it releases the GIL)."""
        head = self._w[self._head]
        self._copy_in(head % self.capacity, address, nbytes)
        self._w[self._head] = head + nbytes

    def _copy_in(self, pos: int, address: int, nbytes: int) -> None:
        first = min(nbytes, self.capacity - pos)
        ctypes.memmove(self._base + pos, address, first)
        if nbytes > first:
            ctypes.memmove(self._base, address + first, nbytes - first)

    def write_frame(self, words: Sequence[int], address: int, nbytes: int, padded: int) -> None:
        """Append a whole frame at once: header ``words``, ``nbytes`` copied from memory at
        ``address`` (memmove: no torch call, which costs more than a small payload), then
        padding up to ``padded`` payload bytes. The caller checked ``free()``; the head
        moves once, so the reader sees the frame complete or not at all."""
        head = self._w[self._head]
        pos = head % self.capacity
        base = self._data_word + pos // 8
        for i, v in enumerate(words):
            self._w[base + i] = v
        self._copy_in((pos + 8 * len(words)) % self.capacity, address, nbytes)
        self._w[self._head] = head + 8 * len(words) + padded

    def read_into(self, address: int, nbytes: int) -> None:
        """Consume ``nbytes`` into memory at ``address``."""
        self.take(0, address, nbytes, nbytes)

    def pad(self, nbytes: int) -> None:
        """Producer side: advance past ``nbytes`` without writing them (frame padding)."""
        self._w[self._head] = self._w[self._head] + nbytes

    def skip(self, nbytes: int) -> None:
        """Consume ``nbytes`` without copying them anywhere."""
        self._w[self._tail] = self._w[self._tail] + nbytes

    def write_words(self, values: Sequence[int]) -> None:
        """Append 8-byte words; the caller keeps frames aligned so they never wrap."""
        head = self._w[self._head]
        base = self._data_word + (head % self.capacity) // 8
        for i, v in enumerate(values):
            self._w[base + i] = v
        self._w[self._head] = head + 8 * len(values)

    def take(self, skip: int, address: int, nbytes: int, frame: int) -> None:
        """Consume a whole ``frame`` bytes at once: copy the ``nbytes`` that start ``skip``
        bytes in (past a header) to memory at ``address``; the tail moves once."""
        w, cap = self._w, self.capacity
        tail = w[self._tail]
        if nbytes:
            pos = (tail + skip) % cap
            first = min(nbytes, cap - pos)
            ctypes.memmove(address, self._base + pos, first)
            if nbytes > first:
                ctypes.memmove(address + first, self._base, nbytes - first)
        w[self._tail] = tail + frame

    def peek_words(self, count: int) -> list[int]:
        """The first ``count`` words at the tail (a frame's header: it never wraps)."""
        base = self._data_word + (self._w[self._tail] % self.capacity) // 8
        return self._w[base:base + count].tolist()
