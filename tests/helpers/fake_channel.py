"""A step channel over plain memory: one-node algorithms run by threads of one process.

``FakeGroup(size, slot_bytes)`` holds what a group's shared-memory segment holds: two
slots per rank (double buffering), two descriptor buffers per rank (by sequence parity)
and every rank's step counter. ``group.run(fn)`` runs ``fn(channel)`` for every rank in a
thread of its own and returns the ranks' results in rank order. A ``FakeChannel`` keeps the
``StepChannel`` contract of transport/base.py as transport/shm/channel.py does (step ``e``
publishes slot ``e % 2``, then waits until every rank has published ``e``; ``my_slot`` is
the slot of the next step, ``peer_slot`` that of the step just completed), and is stricter
where a real channel would let a bug pass unseen:

* The slot a rank fills for its next step is first overwritten with 0xFF bytes (NaN as a
  float, -1 as an integer): bytes not staged in this step read as garbage, never as the
  right values left over from an earlier one.
* A published slot must not change until its owner has completed the next step (then
  every rank has published that step, so nobody reads it any more). A write into it
  (through a view kept from before the step, or into a peer's slot) fails the run,
  naming the slot's rank and the step.
* A rank that returns or raises leaves the group: a peer waiting for a step it will never
  publish fails at once, naming it, instead of hanging; ranks that return after different
  numbers of steps fail the run.
* A descriptor longer than the segment's (``layout.HEAD_WORDS + layout.DESC_WORDS``), or
  a read of more words than were posted, fails.
* A deferred step (``defer_once``) must be taken again with the slot exactly as it was
  published: the call, run again, stages the same bytes.

With ``cma=True`` the ranks may read each other's memory (``read_peer``: one process, so
a plain memmove), and the single-copy algorithms run too; ``group.reads`` counts them.
"""

from __future__ import annotations

import ctypes
import threading
import time
import traceback
import zlib

import torch

from neuron_dist.collectives.selection import Selection
from neuron_dist.collectives.context import Context, Plans
from neuron_dist.collectives.reduce_ops import Scratch
from neuron_dist.transport.errors import ChannelClosed, PeerAborted, PeerTimeout, StepDeferred
from neuron_dist.transport.shm.layout import DESC_WORDS, HEAD_WORDS

POISON = 0xFF


class FakeChannelError(AssertionError):
    """An algorithm broke the step channel's contract (see the module docstring)."""


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.numpy())


class FakeGroup:
    """The shared state of ``size`` ranks' fake channels (``channels[r]`` is rank r's)."""

    def __init__(self, size: int, slot_bytes: int, cma: bool = False, small_bytes: int = 0,
                 overrides: tuple = ()):
        self.size, self.slot_bytes, self.cma, self.small_bytes = size, slot_bytes, cma, small_bytes
        self.selection = Selection(small_bytes, slot_bytes, overrides)
        self.slots = [[torch.full((slot_bytes,), POISON, dtype=torch.uint8) for _ in (0, 1)]
                      for _ in range(size)]
        self.published = [[None, None] for _ in range(size)]  # (step, crc) per slot parity
        self.steps = [0] * size
        self.descriptors = [[(), ()] for _ in range(size)]
        self.gone: dict[int, str] = {}  # rank -> why it left the run
        self.aborted: dict[int, tuple[str, int]] = {}
        self.closed = False
        self.reads = 0
        self.cond = threading.Condition()
        self.channels = [FakeChannel(self, r) for r in range(size)]

    def run(self, fn, timeout: float = 60.0) -> list:
        """``fn(channel)`` on every rank, each in its thread; their results in rank order.

        Raises the lowest failing rank's exception (with every failing rank's traceback
        attached as a note), or ``FakeChannelError`` if the ranks ended at different steps
        or a published slot changed.
        """
        results, errors = [None] * self.size, {}
        with self.cond:
            self.gone.clear()

        def body(r: int) -> None:
            why = "returned"
            try:
                results[r] = fn(self.channels[r])
            except BaseException as exc:  # noqa: BLE001
                errors[r] = exc
                why = f"raised {type(exc).__name__}: {exc}"
                exc.add_note(f"rank {r}:\n{traceback.format_exc()}")
            finally:
                with self.cond:
                    self.gone[r] = why
                    self.cond.notify_all()

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, t in enumerate(threads) if t.is_alive()]
        if hung:
            with self.cond:
                self.closed = True  # their waits raise ChannelClosed
                self.cond.notify_all()
            for t in threads:
                t.join(5)
            raise TimeoutError(f"ranks {hung} did not finish within {timeout} s "
                               f"(steps: {self.steps})")
        if errors:
            r = min(errors)
            raise errors[r]
        if len(set(self.steps)) > 1:
            raise FakeChannelError(f"the ranks ended at different steps: {self.steps}")
        for ch in self.channels:
            ch.check_published(ch.epoch)
        return results


class FakeChannel:
    """Rank ``rank``'s step channel of a ``FakeGroup`` (transport/base.py: StepChannel)."""

    def __init__(self, group: FakeGroup, rank: int):
        self.group = group
        self.rank = rank
        self.size = group.size
        self.slot_bytes = group.slot_bytes
        self.cma = group.cma
        self.scratch = Scratch()
        self.plans = Plans()  # kept across calls, as a process group keeps its plans
        self._epoch = 0
        self._seq = 0
        self.defer_once = False  # (StepChannel contract: see transport/base.py)
        self._published = 0

    @property
    def epoch(self) -> int:
        """Steps this rank has completed."""
        return self._epoch

    def context(self, call, timeout: float = 30.0) -> Context:
        """The ``Context`` of this rank's next collective (sequence numbers 1, 2, ... as a
        process group gives them), with its scratch and the group's selection (its
        ``small_bytes`` and ``overrides``)."""
        self._seq += 1
        return Context(self, call, self._seq, time.monotonic() + timeout, self.scratch,
                       self.group.selection, self.plans)

    # ----------------------------------------------------------------- slots
    def slot(self, rank: int, parity: int, dtype=None):
        s = self.group.slots[rank][parity]
        return s if dtype is None else s.view(dtype)

    def slot_like(self, rank: int, parity: int, like):
        return self.slot(rank, parity, like.dtype)[:like.numel()].view(like.shape)

    def my_slot(self, dtype=None):
        return self.slot(self.rank, (self._epoch + 1) & 1, dtype)

    def peer_slot(self, rank: int, dtype=None):
        return self.slot(rank, self._epoch & 1, dtype)

    # ----------------------------------------------------------------- steps
    def step(self, deadline: float, descriptor=None) -> None:
        g, r = self.group, self.rank
        e = self._epoch + 1
        defer, self.defer_once = self.defer_once, False
        if self._published == e:  # deferred: published already, and the slot unchanged
            self.check_published(e)
        else:
            if descriptor is not None:
                if len(descriptor) > HEAD_WORDS + DESC_WORDS:
                    raise FakeChannelError(f"rank {r} posted {len(descriptor)} descriptor "
                                           f"words; a segment holds {HEAD_WORDS + DESC_WORDS}")
                g.descriptors[r][descriptor[0] & 1] = tuple(int(w) for w in descriptor)
        with g.cond:
            if self._published != e:
                g.published[r][e & 1] = (e, _crc(g.slots[r][e & 1]))
                g.steps[r] = e
                g.cond.notify_all()
            if defer and any(g.steps[k] < e for k in range(g.size)):
                self._published = e
                raise StepDeferred(e)
            while True:
                if g.closed:
                    raise ChannelClosed("the fake group was closed while waiting")
                pending = [k for k in range(g.size) if g.steps[k] < e]
                if not pending:
                    break
                left = [k for k in pending if k in g.gone]
                if left:
                    k = left[0]
                    raise FakeChannelError(
                        f"rank {r} waits for step {e}, but rank {k} {g.gone[k]} "
                        f"after step {g.steps[k]}")
                now = time.monotonic()
                if now >= deadline:
                    raise PeerTimeout(pending, 0.0)
                g.cond.wait(min(deadline - now, 0.05))
            for k, (reason, kind) in g.aborted.items():
                if k != r:
                    raise PeerAborted(k, reason, kind)
        self._epoch = e
        # Every rank has published e, so nobody reads my slot of step e-1 any more: it must
        # be as I published it, and it is the one I fill next.
        self.check_published(e - 1)
        g.slots[r][(e + 1) & 1].fill_(POISON)

    def staged(self) -> bool:
        return self._published == self._epoch + 1

    def peers_published(self) -> bool:
        with self.group.cond:
            return all(s > self._epoch for s in self.group.steps)

    def check_published(self, e: int) -> None:
        """Fail if my slot of step ``e`` changed since I published it."""
        if e < 1:
            return
        step, crc = self.group.published[self.rank][e & 1]
        if step == e and _crc(self.group.slots[self.rank][e & 1]) != crc:
            raise FakeChannelError(f"rank {self.rank}'s slot of step {e} was written while "
                                   "peers could read it")

    def all_posted(self, seq: int, head) -> bool:
        return all(self.peer_descriptor(k, seq, len(head)) == tuple(head)
                   for k in range(self.size) if k != self.rank)

    def peer_descriptor(self, rank: int, seq: int, nwords: int) -> tuple[int, ...]:
        words = self.group.descriptors[rank][seq & 1]
        if nwords > len(words):
            raise FakeChannelError(f"rank {self.rank} reads {nwords} descriptor words of rank "
                                   f"{rank}, which posted {len(words)}")
        return words[:nwords]

    def read_peer(self, k: int, local: int, remote: int, nbytes: int) -> None:
        """Copy ``nbytes`` at address ``remote`` of rank ``k`` to ``local`` (``cma`` only)."""
        if not self.cma:
            raise FakeChannelError(f"rank {self.rank} read rank {k}'s memory without cma")
        if k in self.group.gone:
            raise FakeChannelError(f"rank {self.rank} read rank {k}'s memory after it returned")
        ctypes.memmove(local, remote, nbytes)
        with self.group.cond:
            self.group.reads += 1

    # --------------------------------------------------------------- failure
    def abort(self, reason: str, kind: int = 1) -> None:
        with self.group.cond:
            self.group.aborted[self.rank] = (reason, kind)
            self.group.cond.notify_all()

    def close(self) -> None:
        pass
