"""All-gather (also uneven, "all-gather-v") over a step channel, on raw bytes.

Each step moves up to one slot of every rank's contribution: a rank stages the next piece
of its input in its slot; after the step every rank copies piece k of peer k's slot into
output k. The number of steps follows the largest contribution, which every rank knows
(the output sizes are part of the checked call), so all ranks step together.
"""

from __future__ import annotations

from . import single_copy
from .context import Context, steps_for


def all_gather(ctx: Context, outs: list, inp) -> None:
    """Copy every rank's uint8 ``inp`` into ``outs[rank]`` on every rank."""
    cap = ctx.channel.slot_bytes
    sizes = [o.numel() for o in outs]
    if single_copy.worth_it(ctx, max(sizes)):
        single_copy.all_gather(ctx, outs, inp)
        return
    for i in range(steps_for(max(sizes), cap)):
        o = i * cap
        mine = max(0, min(cap, inp.numel() - o))
        if mine:
            ctx.my_slot()[:mine].copy_(inp[o:o + mine])
        ctx.step()
        for k, out in enumerate(outs):
            m = max(0, min(cap, sizes[k] - o))
            if m:
                out[o:o + m].copy_(ctx.peer_slot(k)[:m])
    ctx.finish()
