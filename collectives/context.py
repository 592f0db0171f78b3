"""What an algorithm needs for one collective call: the channel, a deadline, scratch space.

``Context.step()`` performs one channel step; the first step of a call also posts the call
descriptor and checks that every rank called the same thing (see descriptor.py).
"""

from __future__ import annotations

import math

from .descriptor import NWORDS, Call, check_all_match
from .reduce_ops import Scratch


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
    small_bytes : int
        Messages up to this size take single-step algorithms.

    In a group that spans nodes, ``channel`` joins this node's ranks only (``rank`` and
    ``size`` are local) and ``net_call`` carries the network part (net.py, used by the
    ``*_net.py`` algorithms).
    """

    __slots__ = ("channel", "call", "seq", "deadline", "scratch", "small_bytes", "_checked",
                 "rank", "size", "net_call")

    def __init__(self, channel, call: Call, seq: int, deadline: float, scratch: Scratch,
                 small_bytes: int):
        self.channel = channel
        self.call = call
        self.seq = seq
        self.deadline = deadline
        self.scratch = scratch
        self.small_bytes = small_bytes
        self.rank = channel.rank
        self.size = channel.size
        self._checked = False
        self.net_call = None  # net.NetCall when the group spans nodes (channel: this node)

    def step(self, extra: tuple = ()) -> None:
        """One channel step. The call's first also posts its descriptor, followed by
        ``extra`` words (peers read them with ``peer_extra``), and checks the peers'."""
        if self._checked:
            self.channel.step(self.deadline)
            return
        epoch = self.channel.epoch + 1
        self.channel.step(self.deadline, self.call.words(self.seq) + (epoch,) + extra)
        self._checked = True
        check_all_match(self.channel, self.call, self.seq, epoch)

    @property
    def checked(self) -> bool:
        """Has the call made its first (descriptor-checking) step?"""
        return self._checked

    def peer_extra(self, rank: int, count: int) -> tuple:
        """The ``count`` extra words ``rank`` posted with this call's first step."""
        return self.channel.peer_descriptor(rank, self.seq, NWORDS + 1 + count)[NWORDS + 1:]

    def finish(self) -> None:
        """Guarantee the call made at least one (checked) step."""
        if not self._checked:
            self.step()

    def my_slot(self, dtype=None):
        return self.channel.my_slot(dtype)

    def peer_slot(self, rank: int, dtype=None):
        return self.channel.peer_slot(rank, dtype)

    def my_slot_like(self, like):
        return self.channel.my_slot_like(like)

    def peer_slot_like(self, rank: int, like):
        return self.channel.peer_slot_like(rank, like)


def steps_for(nbytes: int, per_step: int) -> int:
    """Number of steps to move ``nbytes`` at ``per_step`` bytes a step (at least one)."""
    return max(1, math.ceil(nbytes / per_step)) if per_step > 0 else 1


ALIGN_BYTES = 64  # slices and blocks start on cache-line boundaries


def flat(t):
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
