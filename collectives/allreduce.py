"""All-reduce over a step channel. Which algorithm runs: the ``all_reduce`` table of
selection.py (by default one step up to a slot while a rank reads at most 3 MiB of its
peers' slots, single copy from 1 MiB blocks when the node's ranks can read each other's
memory, else one step per chunk for two ranks and two steps for more).

``one_step``: every rank stages its input in its slot, then reduces all N slots itself (in
rank order, so results are identical everywhere; in an in-place call ranks 0 and 1 read
their own part from the tensor instead of their slot: the same bits, and a reduction over
two buffers instead of three). One synchronisation, no second pass: the lowest latency.
A message that fits one slot takes a plan (``OneSlot``: every rank's slot viewed like the
tensor, both parities) made once per dtype and shape; a larger one goes one
slot-sized chunk per step.

``two_step``: reduce-scatter then all-gather, pipelined chunk by chunk (a chunk is one
slot). Step 1 of a chunk: every rank stages the chunk; rank r reduces slice r of it from
all N slots straight into its next slot. Step 2: every rank copies every slice out of its
owner's slot. In shared memory each rank reads every peer's slot directly, so both phases
take one step each instead of a ring's N-1: the data volume per rank is the ring's
(each byte is reduced once, by its owner), with 2 synchronisations per chunk instead of
2(N-1). Double-buffered slots let a rank stage chunk i+1 while peers still read chunk i.

``single_copy``: single_copy.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import single_copy
from .context import ALIGN_BYTES, Context, SlotViews, flat, partition
from .reduce_ops import PREMUL_SUM, reduce_into, stage

if TYPE_CHECKING:
    import torch

    from ..transport.base import StepChannel
    from .reduce_ops import ReduceSpec
    from .selection import Selection


def choose(selection: Selection, channel: StepChannel, numel: int, element_size: int) -> str:
    """The ``all_reduce`` table's algorithm for ``numel`` elements on ``channel`` (the same
    in any phase of a call: single copy publishes its addresses with whichever step comes
    first, single_copy.py)."""
    size = channel.size
    return selection.select("all_reduce", numel * element_size, size, numel=numel,
                            block=-(-numel // size) * element_size,  # each rank's block
                            cma=channel.cma)


def all_reduce(ctx: Context, out: torch.Tensor, inp: torch.Tensor, spec: ReduceSpec) -> None:
    """Reduce the contiguous tensor ``inp`` across ranks into ``out`` (same shape; may alias)."""
    n, es = inp.numel(), inp.element_size()
    algo = choose(ctx.selection, ctx.channel, n, es)
    ctx.chose(algo)
    ALGORITHMS[algo](ctx, out, inp, spec, n * es)


def single_step(selection: Selection, channel: StepChannel, t: torch.Tensor
                ) -> type[OneSlot] | None:
    """The single-step plan class (``OneSlot``) the ``all_reduce`` table's algorithm runs
    ``t``'s all_reduce with, or None if it runs it otherwise (express.py serves a call with
    the plan the algorithm itself would run)."""
    numel, es = t.numel(), t.element_size()
    if numel * es > channel.slot_bytes:  # (a plan holds one slot)
        return None
    return PLANS.get(choose(selection, channel, numel, es))


def _one_step(ctx: Context, out: torch.Tensor, inp: torch.Tensor, spec: ReduceSpec,
              nbytes: int) -> None:
    if nbytes <= ctx.channel.slot_bytes:  # one slot: the plan
        OneSlot.prepared(ctx.plans, ctx.channel, inp).run(ctx, out, inp, spec)
        return
    out, inp = flat(out), flat(inp)
    _one_step_chunks(ctx, out, inp, spec, ctx.channel.slot_bytes // inp.element_size())
    ctx.finish()


def _two_step(ctx: Context, out: torch.Tensor, inp: torch.Tensor, spec: ReduceSpec,
              nbytes: int) -> None:
    out, inp = flat(out), flat(inp)
    _two_step_chunks(ctx, out, inp, spec, ctx.channel.slot_bytes // inp.element_size())
    ctx.finish()


def _single_copy(ctx: Context, out: torch.Tensor, inp: torch.Tensor, spec: ReduceSpec,
                 nbytes: int) -> None:
    single_copy.all_reduce(ctx, flat(out), flat(inp), spec)


class OneSlot(SlotViews):
    """The one-step all-reduce of tensors with ``like``'s dtype and shape: ``views[p]`` is
    every rank's slot of step parity ``p``, viewed like the tensor."""

    __slots__ = ()
    NAME = "all_reduce"
    ALGORITHM = "one_step"

    def run(self, ctx: Context, out: torch.Tensor, inp: torch.Tensor, spec: ReduceSpec
            ) -> None:
        """``out`` = the reduction of every rank's ``inp`` (detached; ``out`` may be ``inp``)."""
        views = self.views[(ctx.channel.epoch + 1) & 1]
        if not ctx.channel.staged():
            stage(views[ctx.rank], inp, spec)
        ctx.one_step = True
        ctx.step()
        if out is inp:  # (both callers pass the tensor twice for an in-place call)
            views = _own_in_place(views, out, ctx.rank, spec)
        reduce_into(out, views, spec, ctx.size, ctx.scratch)


def _own_in_place(views: list[torch.Tensor], out: torch.Tensor, rank: int, spec: ReduceSpec
                  ) -> list[torch.Tensor]:
    """The inputs of the reduction: every rank's staged slot, except that rank 0 or 1 of an
    in-place call reads its own contribution from ``out`` itself (the same bits as its slot,
    still in rank order), so the reduction reads and writes two buffers instead of three,
    which keeps them in cache (docs/design.md, "Thresholds and why")."""
    if rank > 1 or spec.kind == PREMUL_SUM:
        return views  # (reduce_into's output may alias only its first two inputs)
    mine = list(views)
    mine[rank] = out
    return mine


def _one_step_chunks(ctx: Context, out: torch.Tensor, inp: torch.Tensor, spec: ReduceSpec,
                     cap: int) -> None:
    dtype = inp.dtype
    in_place = out.data_ptr() == inp.data_ptr()  # (flat views of one tensor)
    for o in range(0, inp.numel(), cap):
        m = min(cap, inp.numel() - o)
        stage(ctx.my_slot(dtype)[:m], inp[o:o + m], spec)
        ctx.step()
        views = [ctx.peer_slot(k, dtype)[:m] for k in range(ctx.size)]
        part = out[o:o + m]
        if in_place:
            views = _own_in_place(views, part, ctx.rank, spec)
        reduce_into(part, views, spec, ctx.size, ctx.scratch)


def _two_step_chunks(ctx: Context, out: torch.Tensor, inp: torch.Tensor, spec: ReduceSpec,
                     cap: int) -> None:
    dtype = inp.dtype
    align = max(1, ALIGN_BYTES // inp.element_size())
    r = ctx.rank
    # My own slice is reduced by me, straight from my input: only the slices that peers
    # reduce need to go through shared memory (PREMUL_SUM must scale mine first, so it
    # stages everything).
    own_from_input = spec.kind != PREMUL_SUM
    for o in range(0, inp.numel(), cap):
        m = min(cap, inp.numel() - o)
        slices = partition(m, ctx.size, align)
        slot = ctx.my_slot(dtype)
        for k, (s, length) in enumerate(slices):
            if length and not (k == r and own_from_input):
                stage(slot[s:s + length], inp[o + s:o + s + length], spec)
        ctx.step()
        s, length = slices[r]
        views = [ctx.peer_slot(k, dtype)[s:s + length] for k in range(ctx.size)]
        if own_from_input:
            views[r] = inp[o + s:o + s + length]
        reduce_into(ctx.my_slot(dtype)[s:s + length], views, spec, ctx.size, ctx.scratch)
        ctx.step()
        for k, (s, length) in enumerate(slices):
            if length:
                out[o + s:o + s + length].copy_(ctx.peer_slot(k, dtype)[s:s + length])


# the ``all_reduce`` table's algorithms (selection.py): name -> what runs it, as
# ``f(ctx, out, inp, spec, nbytes)`` (``nbytes``: the message's)
ALGORITHMS = {"one_step": _one_step, "two_step": _two_step, "single_copy": _single_copy}
# algorithm -> its single-step plan, for a message that fits one slot
PLANS = {"one_step": OneSlot}
