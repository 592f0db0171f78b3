"""Reduce-scatter (also uneven) over a step channel.

The slot is cut into N equal blocks, one per destination rank. Each step, every rank
stages the next piece of its input for destination k into block k; after the step rank r
reduces block r of all N slots (in rank order) into its output. Each input element is
read once by its owner, so the work is spread evenly, and there is one synchronisation per
step (compare gloo, which runs a full all-reduce per call).
"""

from __future__ import annotations

from . import single_copy
from .context import ALIGN_BYTES, Context, steps_for
from .reduce_ops import reduce_into, stage



def reduce_scatter(ctx: Context, out, inputs: list, spec) -> None:
    """``out`` (rank r's result) = reduction over ranks of their ``inputs[r]``; typed, flat."""
    dtype = out.dtype
    es = out.element_size()
    n = ctx.size
    per = (ctx.channel.slot_bytes // n) // ALIGN_BYTES * ALIGN_BYTES // es
    sizes = [t.numel() for t in inputs]
    if single_copy.worth_it(ctx, max(sizes) * es, len(inputs)):
        single_copy.reduce_scatter(ctx, out, inputs, spec)
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
