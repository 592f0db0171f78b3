"""The collective core's step channel over one shared-memory segment per group.

Protocol (see transport/base.py for the interface):

* Each rank has a monotonically increasing ``step`` counter. Step ``e`` is: write my slot
  ``e % 2`` (and, on a collective's first step, my descriptor ``seq % 2``: its first
  ``HEAD_WORDS`` words into the step counter's cache line, which peers poll anyway, the
  rest, if any, into the descriptor buffer), store ``step = e``, then poll until every
  peer's counter is >= e. Afterwards peers' slots ``e % 2`` are read directly, with no
  further copy.
* Reuse is safe without extra flags: I write slot parity ``p`` again only at step e + 2,
  and I only get there after waiting for every peer to publish e + 1, which each peer does
  only after it has finished reading everybody's step-e slots. The same argument covers
  the two descriptor buffers, because every collective has at least one step.
* Failures end a wait early and by name: a peer's abort flag (with its message), a peer pid
  that no longer runs, the local endpoint being closed, or the deadline. Waiting follows
  ``backoff.Backoff`` (spin, yield), then sleeps on the awaited peer's step word with a
  futex; a publisher wakes the word's sleepers when a peer has raised its sleep flag.
"""

from __future__ import annotations

import errno
import os
import struct
import time
from typing import Callable, Sequence

import torch

from ..errors import ChannelClosed, PeerAborted, PeerDied, PeerTimeout, StepDeferred
from . import cma, futex
from .segment import ShmSetupError
from . import layout as L
from ..backoff import Backoff
from ..base import StepChannel
from .mailbox import ShmMailbox
from . import procid
from .segment import Segment

class _Words(dict[int, struct.Struct]):
    """Number of descriptor words -> its ``struct.Struct`` (each format parsed once; a
    lookup is a plain dict lookup, not a Python call)."""

    def __missing__(self, n: int) -> struct.Struct:
        s = self[n] = struct.Struct(f"{n}q")
        return s


_WORDS = _Words()
assert L.HEAD_WORDS == 3  # (step and peer_descriptor move a head as three words)


LIVENESS_PERIOD = 0.2  # seconds between checks that waited-for peers still run
SLEEP_SLICE = 2e-3  # longest futex sleep before looking again (bounds a missed wake-up)


class ShmChannel(StepChannel):
    """Step channel and mailboxes of one group, over a mapped ``Segment``.

    Parameters
    ----------
    segment : Segment
        The group's mapped segment (created by group rank 0, attached by the others).
    layout : Layout
        Offsets inside it.
    rank : int
        This process's rank in the group.
    spin : int
        Polls before a wait starts yielding the CPU.
    """

    def __init__(self, segment: Segment, layout: L.Layout, rank: int, spin: int,
                 yield_seconds: float = 5e-4, max_sleep: float = 1e-3):
        if rank != 0:  # (read before any view of the map exists: a refused map can close)
            magic = struct.unpack_from("q", segment.map, 0)[0]
            if magic != L.MAGIC:
                raise ShmSetupError(
                    f"shared-memory segment {segment.name!r} is not a neuron node segment "
                    f"(magic word {magic & (2**64 - 1):#x}, expected {L.MAGIC:#x}): another "
                    f"program's file, or one its creator has not set up")
        self.segment = segment
        self.layout = layout
        self.rank = rank
        self.size = layout.size
        self.slot_bytes = layout.slot_bytes
        self.spin = spin
        self._yield_seconds = yield_seconds
        self._max_sleep = max_sleep
        self._closed = False
        self.epoch = 0  # steps this rank has completed on this channel (read often: no property)
        # Set by the engine before a collective it may defer: the next step, if a peer is
        # behind, publishes and raises StepDeferred instead of waiting; ``_published`` is
        # that step, which a repeated ``step`` (the call run again) does not publish twice.
        self.defer_once = False
        self._published = 0
        self._w = memoryview(segment.map).cast("q")
        self._bytes = torch.frombuffer(segment.map, dtype=torch.uint8)
        n = self.size
        self._step_word = [layout.region(k) // 8 for k in range(n)]
        self._abort_word = [(layout.region(k) + L.ABORT_OFF) // 8 for k in range(n)]
        self._pid_word = [(layout.region(k) + L.PID_OFF) // 8 for k in range(n)]
        # word index of every rank's two descriptor heads, byte offsets of the rest of its
        # two descriptors (parity = seq & 1)
        self._head_word = [[(layout.region(k) + L.HEAD_OFF) // 8 + p * L.HEAD_WORDS
                            for p in (0, 1)] for k in range(n)]
        self._desc_off = [[layout.region(k) + L.DESC_OFF + p * L.DESC_WORDS * 8 for p in (0, 1)]
                          for k in range(n)]
        self._sleep_word = [(layout.region(k) + L.SLEEP_OFF) // 8 for k in range(n)]
        base = self._bytes.data_ptr()
        self._step_addr = [base + layout.region(k) for k in range(n)]
        self._bell_word = [(layout.region(k) + L.DOORBELL_OFF) // 8 for k in range(n)]
        self._bell_sleep_word = [(layout.region(k) + L.DOORBELL_SLEEP_OFF) // 8 for k in range(n)]
        self._bell_addr = [base + layout.region(k) + L.DOORBELL_OFF for k in range(n)]
        self._slots = [[self._view(layout.slot(k, p), layout.slot_bytes) for p in (0, 1)]
                       for k in range(n)]
        self._typed_views: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self._others = [k for k in range(n) if k != rank]
        self._pids: dict[int, int] = {}
        self._starts: dict[int, int] = {}  # rank -> its process's start time (procid.start_time)
        self._next_liveness = 0.0
        self.cma = False  # may ranks read each other's memory (cma.py)? set by rendezvous
        if rank == 0:
            self._w[0] = L.MAGIC  # (the creator's, before it publishes the segment's name)
        self._w[self._pid_word[rank]] = os.getpid()

    def _view(self, off: int, nbytes: int) -> torch.Tensor:
        return self._bytes[off:off + nbytes]

    # ----------------------------------------------------------------- steps
    def my_slot(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """My slot for the next step, as uint8 or (cached view) as ``dtype``."""
        return self.slot(self.rank, (self.epoch + 1) & 1, dtype)

    def peer_slot(self, rank: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``rank``'s slot of the step just completed, as uint8 or ``dtype``."""
        return self.slot(rank, self.epoch & 1, dtype)

    def slot(self, rank: int, parity: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``rank``'s slot of step parity ``parity`` (``epoch & 1`` of the step that fills
        it), as uint8 or (cached view) as ``dtype``."""
        if dtype is None:
            return self._slots[rank][parity]
        key = (rank, parity, dtype)
        view = self._typed_views.get(key)
        if view is None:
            view = self._typed_views[key] = self._slots[rank][parity].view(dtype)
        return view

    def slot_like(self, rank: int, parity: int, like: torch.Tensor) -> torch.Tensor:
        """``slot(rank, parity)`` viewed with the dtype and shape of ``like`` (which fits)."""
        return self.slot(rank, parity, like.dtype)[:like.numel()].view(like.shape)

    def step(self, deadline: float, descriptor: Sequence[int] | None = None) -> None:
        e = self.epoch + 1
        w, others = self._w, self._others
        if self._published != e:  # (a deferred step is published already: see defer_once)
            if descriptor is not None:  # (its head: three stores beat a struct call)
                p = descriptor[0] & 1
                i = self._head_word[self.rank][p]
                w[i], w[i + 1], w[i + 2] = descriptor[:3]
                if len(descriptor) > 3:
                    _WORDS[len(descriptor) - 3].pack_into(
                        self.segment.map, self._desc_off[self.rank][p], *descriptor[3:])
            w[self._step_word[self.rank]] = e
            for k in others:
                if w[self._sleep_word[k]]:
                    futex.wake(self._step_addr[self.rank])
                    break
        sw = self._step_word
        for k in others:
            if w[sw[k]] < e:  # someone is behind: wait (no list built when nobody is)
                if self.defer_once:
                    self.defer_once = False
                    self._published = e
                    raise StepDeferred(e)
                self._poll([k for k in others if w[sw[k]] < e], e, deadline)
                break
        if self.defer_once:  # only a call's first step may be deferred
            self.defer_once = False
        # A peer that gave up (timeout, error) may have published this step before it did:
        # its counter alone does not prove it is still with us.
        aw = self._abort_word
        for k in others:
            if w[aw[k]]:
                raise PeerAborted(k, self.abort_reason(k), w[aw[k]])
        self.epoch = e

    def staged(self) -> bool:
        """Is the next step published already (a deferred call run again: this rank's slot
        holds what the call staged, so a one-step plan need not stage it again)?"""
        return self._published == self.epoch + 1

    def peers_published(self) -> bool:
        """Has every peer published the next step (would ``step`` find nobody behind)?"""
        e, w, sw = self.epoch + 1, self._w, self._step_word
        for k in self._others:
            if w[sw[k]] < e:
                return False
        return True

    def withdraw(self, error: Exception) -> None:
        """Nothing to take back: a published step writes into nobody's buffer."""

    def all_posted(self, seq: int, head: Sequence[int]) -> bool:
        """Did every peer post ``head`` as the head of its descriptor of collective ``seq``?"""
        w, p = self._w, seq & 1
        a, b, c = head
        for k in self._others:
            j = self._head_word[k][p]
            if w[j] != a or w[j + 1] != b or w[j + 2] != c:
                return False
        return True

    def peer_descriptor(self, rank: int, seq: int, nwords: int) -> tuple[int, ...]:
        w, j = self._w, self._head_word[rank][seq & 1]
        if nwords <= 3:
            return (w[j], w[j + 1], w[j + 2])[:nwords]  # (the slow paths: all_posted is quick)
        return (w[j], w[j + 1], w[j + 2]) + _WORDS[nwords - 3].unpack_from(
            self.segment.map, self._desc_off[rank][seq & 1])

    def _poll(self, pending: list[int], e: int, deadline: float) -> None:
        w = self._w
        sw = self._step_word
        backoff = Backoff(self.spin, self._yield_seconds, self._max_sleep, futex.available)
        polls = 0
        while True:
            pending = [k for k in pending if w[sw[k]] < e]
            if not pending:
                return
            polls += 1
            if backoff.pause():
                self._sleep_on(pending[0], e, deadline)
            elif polls & 63:
                continue
            # Judge only peers still missing *now*: one that published and then exited
            # while we slept has done its part.
            pending = [k for k in pending if w[sw[k]] < e]
            if pending:
                try:
                    # Liveness is looked up at most every LIVENESS_PERIOD per channel, not
                    # once per wait: small collectives wait often and briefly.
                    self._next_liveness = self.check_peers(pending, deadline, self._next_liveness)
                except PeerDied:
                    # Look once more after a moment before declaring the step lost: a peer
                    # that published and exited between our read and its reaping is fine.
                    time.sleep(0.01)
                    if any(w[sw[k]] < e for k in pending):
                        raise

    def _sleep_on(self, k: int, e: int, deadline: float) -> None:
        """Block until peer ``k``'s step counter moves (or a short timeout passes)."""
        w = self._w
        seen = w[self._step_word[k]]
        if seen >= e:
            return
        me = self._sleep_word[self.rank]
        w[me] = 1
        try:
            # Re-read after raising the flag: a publisher that stored before seeing the flag
            # has already changed the word, and the futex then returns at once.
            seen = w[self._step_word[k]]
            if seen < e:
                futex.wait(self._step_addr[k], seen, max(1e-4, min(SLEEP_SLICE, deadline - time.monotonic())))
        finally:
            w[me] = 0

    def check_peers(self, pending: list[int], deadline: float, next_liveness: float = 0.0,
                    any_suffices: bool = False) -> float:
        """Raise if the wait for ``pending`` peers cannot succeed; returns next liveness time.

        With ``any_suffices`` (a receive from any source) a dead peer only matters once
        every pending peer is dead.
        """
        if self._closed:
            raise ChannelClosed("the process group was destroyed or aborted while waiting")
        for k in self._others:
            kind = self._w[self._abort_word[k]]
            if kind:
                raise PeerAborted(k, self.abort_reason(k), kind)
        now = time.monotonic()
        if now >= next_liveness:
            dead = [(k, pid) for k in pending
                    if (pid := self._peer_pid(k)) and not procid.alive(pid, self._starts[k])]
            if dead and (not any_suffices or len(dead) == len(pending)):
                raise PeerDied(*dead[0])
            next_liveness = now + LIVENESS_PERIOD
        if now > deadline:
            raise PeerTimeout(pending, 0.0)
        return next_liveness

    def pid_word_address(self) -> int:
        """Address, in this process, of the word holding this rank's pid."""
        return self._bytes.data_ptr() + self.layout.region(self.rank) + L.PID_OFF

    def read_peer(self, k: int, local: int, remote: int, nbytes: int) -> None:
        """Copy ``nbytes`` at address ``remote`` of rank ``k``'s memory to our ``local``
        (cross-memory attach; only when ``self.cma``)."""
        pid = self._peer_pid(k)
        try:
            cma.read(pid, local, remote, nbytes)
        except OSError as e:
            if e.errno == errno.ESRCH:
                raise PeerDied(k, pid, "it exited while its tensor was being read") from None
            raise

    def _peer_pid(self, k: int) -> int:
        """Rank ``k``'s pid (0 until it has published it). Its start time is read with it,
        so that a later process given the same pid is not taken for it (ranks of a node
        share a PID namespace: it is part of the node identity, topology.node_identity)."""
        pid = self._pids.get(k)
        if not pid:
            pid = self._w[self._pid_word[k]]
            if pid:
                self._pids[k] = pid
                self._starts[k] = procid.start_time(pid)
        return pid

    # ---------------------------------------------------------------- failure
    def abort(self, reason: str, kind: int = 1) -> None:
        """Mark this rank's side of the group failed; peers' waits raise PeerAborted.

        ``kind`` (one of ``transport.errors.ABORTED*``) tells peers the class of
        the original failure, so every rank can raise the same exception type.
        """
        if self._closed:
            return
        msg = reason.encode("utf-8", "replace")[: L.ABORT_MSG_BYTES - 1] + b"\0"
        off = self.layout.region(self.rank) + L.ABORT_MSG_OFF
        self._bytes[off:off + len(msg)].copy_(torch.frombuffer(bytearray(msg), dtype=torch.uint8))
        self._w[self._abort_word[self.rank]] = kind

    def abort_reason(self, rank: int) -> str:
        off = self.layout.region(rank) + L.ABORT_MSG_OFF
        raw = bytes(self.segment.map[off:off + L.ABORT_MSG_BYTES])
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace")

    # -------------------------------------------------------------- mailboxes
    def mailbox(self, src: int, dst: int) -> ShmMailbox:
        """The src -> dst mailbox; its pages are reserved here when this rank is the sender
        (the only writer of its bytes), so unused pairs cost no memory."""
        head, tail = self.layout.mailbox_counters(src, dst)
        off = self.layout.mailbox_data(src, dst)
        if src == self.rank:
            self.segment.reserve(off, self.layout.mailbox_bytes)
        return ShmMailbox(self._w, head, tail, self._view(off, self.layout.mailbox_bytes), off)

    def backoff(self) -> Backoff:
        """A fresh waiting policy; ``pause()`` returning True means: call ``sleep_on_doorbell``."""
        return Backoff(self.spin, self._yield_seconds, self._max_sleep, futex.available)

    # -------------------------------------------------------------- doorbells
    # Send/recv progress can wait on many words at once (any source, full mailboxes), so
    # instead of sleeping on one of them a rank sleeps on its own doorbell, which every peer
    # rings after moving bytes into or out of a mailbox this rank uses.
    def ring(self, rank: int) -> None:
        """Tell ``rank`` that a mailbox it uses changed."""
        w = self._w
        w[self._bell_word[rank]] = w[self._bell_word[rank]] + 1
        if w[self._bell_sleep_word[rank]]:
            futex.wake(self._bell_addr[rank])

    def doorbell(self) -> int:
        return self._w[self._bell_word[self.rank]]

    def sleep_on_doorbell(self, seen: int, ready: Callable[[], bool]) -> None:
        """Sleep until the doorbell moves past ``seen`` unless ``ready()`` (checked after
        raising the sleep flag, so a ring between the two is never lost for long)."""
        w = self._w
        me = self._bell_sleep_word[self.rank]
        w[me] = 1
        try:
            if not ready():
                futex.wait(self._bell_addr[self.rank], seen, SLEEP_SLICE)
        finally:
            w[me] = 0

    # ---------------------------------------------------------------- closing
    @property
    def closed(self) -> bool:
        return self._closed

    def interrupt(self) -> None:
        """Make every wait on this channel raise ChannelClosed soon (from any thread)."""
        self._closed = True

    def close(self) -> None:
        """Unmap. Call after the threads that wait on this channel have stopped."""
        if self._bytes is None:
            return
        self._closed = True
        # (released for the unmap below; nothing reads them once closed)
        self._slots = None  # type: ignore[assignment]
        self._typed_views = None  # type: ignore[assignment]
        self._bytes = None  # type: ignore[assignment]
        try:
            self._w.release()
        except BufferError:
            pass
        self.segment.close()
