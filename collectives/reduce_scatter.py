"""Reduce-scatter (also uneven) over a step channel. Which algorithm runs: the
``reduce_scatter`` table of selection.py (single copy, single_copy.py, for blocks from 1 MiB
when the node's ranks can read each other's memory, else slots).

``slots``: the slot is cut into N equal blocks, one per destination rank. Each step, every rank
stages the next piece of its input for destination k into block k; after the step rank r
reduces block r of all N slots (in rank order) into its output. Each input element is
read once by its owner, so the work is spread evenly, and there is one synchronisation per
step (compare gloo, which runs a full all-reduce per call).

Equal blocks that fit one slot's block take one step, with a plan (``OneStep``: where this
rank stages each block, and views of block r of every rank's slot, both parities) made once
per dtype and block length; it stages by memmove from the inputs' addresses.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Sequence

from . import single_copy
from .context import ALIGN_BYTES, Context, steps_for
from .reduce_ops import PREMUL_SUM, reduce_into, stage

if TYPE_CHECKING:
    import torch

    from ..transport.base import StepChannel
    from .context import Plans
    from .reduce_ops import ReduceSpec
    from .selection import Selection


def block_elements(channel: StepChannel, element_size: int) -> int:
    """Elements of one destination's block in a slot (blocks start cache-line aligned)."""
    return (channel.slot_bytes // channel.size) // ALIGN_BYTES * ALIGN_BYTES // element_size


def choose(selection: Selection, channel: StepChannel, nbytes: int, inputs: int) -> str:
    """The ``reduce_scatter`` table's algorithm for blocks of at most ``nbytes`` (the same
    in any phase of a call)."""
    return selection.select("reduce_scatter", nbytes, channel.size, cma=channel.cma,
                            addresses=inputs)


def reduce_scatter(ctx: Context, out: torch.Tensor, inputs: Sequence[torch.Tensor],
                   spec: ReduceSpec) -> None:
    """``out`` (rank r's result) = reduction over ranks of their ``inputs[r]``; typed, flat."""
    nbytes = max(t.numel() for t in inputs) * out.element_size()
    algo = choose(ctx.selection, ctx.channel, nbytes, len(inputs))
    ctx.chose(algo)
    ALGORITHMS[algo](ctx, out, inputs, spec)


def single_step(selection: Selection, channel: StepChannel, count: int, element_size: int
                ) -> type[OneStep] | None:
    """The single-step plan class (``OneStep``) the ``reduce_scatter`` table's algorithm
    runs an even reduce_scatter of ``count`` elements per rank with, or None if it runs it
    otherwise (express.py serves a call with the plan the algorithm itself would run)."""
    if count > block_elements(channel, element_size):  # (a plan holds one slot's block)
        return None
    return PLANS.get(choose(selection, channel, count * element_size, channel.size))


def _slots(ctx: Context, out: torch.Tensor, inputs: Sequence[torch.Tensor], spec: ReduceSpec
           ) -> None:
    dtype = out.dtype
    n = ctx.size
    per = block_elements(ctx.channel, out.element_size())
    sizes = [t.numel() for t in inputs]
    count = out.numel()
    if spec.kind != PREMUL_SUM and count <= per and all(m == count for m in sizes):
        plan = OneStep.prepared(ctx.plans, ctx.channel, dtype, count)
        plan.run(ctx, out, [t.data_ptr() for t in inputs], spec)
        return
    r = ctx.rank
    for i in range(steps_for(max(sizes), per)):
        o = i * per
        slot = ctx.my_slot(dtype)
        for k, t in enumerate(inputs):
            m = max(0, min(per, sizes[k] - o))
            if m:
                stage(slot[k * per:k * per + m], t[o:o + m], spec)
        ctx.step()
        m = max(0, min(per, sizes[r] - o))
        if m:
            views = [ctx.peer_slot(k, dtype)[r * per:r * per + m] for k in range(n)]
            reduce_into(out[o:o + m], views, spec, n, ctx.scratch)
    ctx.finish()


class OneStep:
    """The one-step reduce-scatter of ``count`` elements of ``dtype`` per rank (at most
    ``block_elements``): ``mine[p]`` is the address of this rank's slot of step parity
    ``p``, ``views[p]`` block r (ours) of every rank's slot of that parity."""

    __slots__ = ("mine", "views", "stride", "nbytes")
    ALGORITHM = "slots"

    def __init__(self, channel: StepChannel, dtype: torch.dtype, count: int):
        es = dtype.itemsize
        per, r = block_elements(channel, es), channel.rank
        self.stride, self.nbytes = per * es, count * es
        self.mine = [channel.slot(r, p).data_ptr() for p in (0, 1)]
        self.views = [[channel.slot(k, p, dtype)[r * per:r * per + count]
                       for k in range(channel.size)] for p in (0, 1)]

    @classmethod
    def prepared(cls, plans: Plans, channel: StepChannel, dtype: torch.dtype, count: int
                 ) -> OneStep:
        """The group's plan for ``count`` elements of ``dtype`` per rank (made on first use)."""
        key = ("reduce_scatter", dtype, count)
        return plans.get(key) or plans.add(key, cls(channel, dtype, count))

    def run(self, ctx: Context, out: torch.Tensor, srcs: Sequence[int], spec: ReduceSpec
            ) -> None:
        """``out`` (1-D, detached) = reduction over ranks of the block each stages for us;
        ``srcs[k]`` is the address of our block for rank k. Not for PREMUL_SUM."""
        p = (ctx.channel.epoch + 1) & 1
        mine, stride, nbytes = self.mine[p], self.stride, self.nbytes
        if not ctx.channel.staged():
            for k, src in enumerate(srcs):
                ctypes.memmove(mine + k * stride, src, nbytes)
        ctx.one_step = True
        ctx.step()
        reduce_into(out, self.views[p], spec, ctx.size, ctx.scratch)


# the ``reduce_scatter`` table's algorithms (selection.py): name -> what runs it
ALGORITHMS = {"slots": _slots, "single_copy": single_copy.reduce_scatter}
# algorithm -> its single-step plan, for equal blocks that fit one slot's block
PLANS = {"slots": OneStep}
