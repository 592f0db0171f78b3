"""What an algorithm needs for one collective call: the channel, a deadline, scratch space,
and the group's prepared plans.

``Context.step()`` performs one channel step; the first step of a call also posts the call
descriptor and checks that every rank called the same thing (see descriptor.py).

A *plan* is what a collective's single-step case needs that depends only on (dtype, shapes,
op, root): slot views of every rank for both step parities, slot offsets, header words.
Each algorithm module defines its plan class and makes it on first use; ``Plans`` keeps them
per group, and the engine thread and the caller's thread (the express lane) both execute
them through a ``Context``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Hashable, Protocol, TypeVar

from ..transport.errors import StepDeferred
from .descriptor import HEAD, Call, check_all_match
from .reduce_ops import Scratch

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

    from ..transport.base import StepChannel
    from .net import NetCall
    from .selection import Selection

_P = TypeVar("_P")


class Record(Protocol):
    """What a call's flight-recorder record (neuron_dist/flight_recorder.py) shows here."""

    algo: str | None


class Context:
    """Per-call state handed to the algorithm functions.

    Parameters
    ----------
    channel : transport.base.StepChannel
    call : Call
        This rank's view of the call, checked against every peer's on the first step.
    seq : int
        The call's sequence number in its group (1, 2, ...).
    deadline : float
        ``time.monotonic()`` value after which waits raise PeerTimeout.
    scratch : Scratch
    selection : selection.Selection
        The group's selection tables (which algorithm runs: ``select``).
    plans : Plans
        The group's prepared single-step plans.
    record : flight_recorder.Record or None
        The call's flight-recorder record: ``chose`` names the algorithm in it.

    In a group that spans nodes, ``channel`` joins this node's ranks only (``rank`` and
    ``size`` are local) and ``net_call`` carries the network part (net.py, used by the
    ``*_net.py`` algorithms).
    """

    __slots__ = ("channel", "call", "seq", "deadline", "scratch", "selection", "plans",
                 "record", "_checked", "rank", "size", "net_call", "one_step")

    def __init__(self, channel: StepChannel, call: Call, seq: int, deadline: float,
                 scratch: Scratch, selection: Selection, plans: Plans,
                 record: Record | None = None):
        self.channel = channel
        self.call = call
        self.seq = seq
        self.deadline = deadline
        self.scratch = scratch
        self.selection = selection
        self.plans = plans
        self.record = record
        self.rank = channel.rank
        self.size = channel.size
        self._checked = False
        # net.NetCall when the group spans nodes (channel: this node); only the *_net.py
        # algorithms, which run only then, use it
        self.net_call: NetCall = None  # type: ignore[assignment]
        # Set by a one-step plan before its step: nothing the peers need follows it, so a
        # deferred first step (engine.py: try_now) may wait for whoever looks at the Work.
        self.one_step = False

    def step(self, extra: tuple[int, ...] = ()) -> None:
        """One channel step. The call's first also posts its descriptor, followed by
        ``extra`` words (peers read them with ``peer_extra``), and checks the peers'."""
        if self._checked:
            self.channel.step(self.deadline)
            return
        # The call's head (with the step it starts at; descriptor.py) is compared with every
        # peer's; only a difference takes the slow path, which names the calls.
        self._checked = True
        channel, seq, call = self.channel, self.seq, self.call
        epoch = channel.epoch + 1
        head, rest = (seq, call.code, epoch), call.rest
        mine = head + rest if rest else head
        try:
            channel.step(self.deadline, mine + extra if extra else mine)
        except StepDeferred as deferred:
            deferred.last = self.one_step
            raise
        if not channel.all_posted(seq, head) or rest and any(
                channel.peer_descriptor(k, seq, len(mine)) != mine
                for k in range(self.size) if k != self.rank):
            check_all_match(channel, call, seq, epoch)  # raises

    def chose(self, algorithm: str) -> None:
        """Name the algorithm chosen in the call's record (flight recorder, TRACE log); the
        phases of a call across nodes add theirs (``hierarchical+ring``)."""
        rec = self.record
        if rec is not None:
            rec.algo = algorithm if rec.algo is None else f"{rec.algo}+{algorithm}"

    def begin(self, call: Call, seq: int, deadline: float, record: Record | None = None) -> None:
        """Make this context (and its ``net_call``) describe a new call (a driver running
        one call at a time may keep one context for all of them)."""
        self.call, self.seq, self.deadline, self._checked = call, seq, deadline, False
        self.one_step = False
        self.record = record
        if self.net_call is not None:
            self.net_call.begin(call, seq, deadline)

    @property
    def checked(self) -> bool:
        """Has the call made its first (descriptor-checking) step?"""
        return self._checked

    def peer_extra(self, rank: int, count: int) -> tuple[int, ...]:
        """The ``count`` extra words ``rank`` posted with this call's first step."""
        start = HEAD + len(self.call.rest)  # (a peer's call matched ours: so did its length)
        return self.channel.peer_descriptor(rank, self.seq, start + count)[start:]

    def finish(self) -> None:
        """Guarantee the call made at least one (checked) step (a rank alone on its node
        has nobody to check against: nothing to do)."""
        if not self._checked:
            if self.size == 1:
                self._checked = True
                return
            self.step()

    def my_slot(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.channel.my_slot(dtype)

    def peer_slot(self, rank: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.channel.peer_slot(rank, dtype)


class Plans:
    """A group's prepared plans by key (the collective's name, dtype, shapes, op or root),
    made on first use. Bounded: training loops repeat a few calls, but a program that
    varies shapes without end must not grow it. A plan is read-only once made, and the
    group runs one collective at a time, so the engine thread and the caller share them."""

    LIMIT = 256

    def __init__(self) -> None:
        self._plans: dict[Hashable, Any] = {}  # (plans of every kind)

    def get(self, key: Hashable) -> Any:
        """The plan for ``key``, or None if not made yet."""
        return self._plans.get(key)

    def add(self, key: Hashable, plan: _P) -> _P:
        """Remember ``plan`` for ``key``; returns it."""
        if len(self._plans) >= self.LIMIT:
            self._plans.clear()
        self._plans[key] = plan
        return plan


class SlotViews:
    """Base of the plans that view every rank's slot like a tensor: ``views[p][k]`` is rank
    k's slot of step parity ``p`` with ``like``'s dtype and shape. A subclass names its
    collective (``NAME``) and defines ``run``."""

    __slots__ = ("views",)
    NAME = ""

    def __init__(self, channel: StepChannel, like: torch.Tensor):
        self.views = [[channel.slot_like(k, p, like) for k in range(channel.size)]
                      for p in (0, 1)]

    @classmethod
    def prepared(cls, plans: Plans, channel: StepChannel, like: torch.Tensor) -> Self:
        """The group's plan for tensors like ``like`` (made on first use)."""
        key = (cls.NAME, like.dtype, like.shape)
        return plans.get(key) or plans.add(key, cls(channel, like))


def steps_for(nbytes: int, per_step: int) -> int:
    """Number of steps to move ``nbytes`` at ``per_step`` bytes a step (at least one)."""
    return max(1, math.ceil(nbytes / per_step)) if per_step > 0 else 1


ALIGN_BYTES = 64  # slices and blocks start on cache-line boundaries


def flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 1-D view (``t`` itself if it is 1-D: a torch view op costs µs)."""
    return t if t.dim() == 1 else t.view(-1)


def partition(n: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous (start, length) pieces, starts aligned."""
    base = -(-n // parts)
    base = -(-base // align) * align if align > 1 else base
    out = []
    for i in range(parts):
        start = min(n, i * base)
        out.append((start, min(n, start + base) - start))
    return out
