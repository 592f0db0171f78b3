"""Broadcast over a step channel: the root stages a slot-sized piece, everyone copies it out.

Pipelined by double buffering: while the others copy piece i out of the root's slot, the
root already stages piece i+1 in its other slot.
"""

from __future__ import annotations

from .context import Context, steps_for


def broadcast(ctx: Context, buf, root: int) -> None:
    """Make the uint8 tensor ``buf`` on every rank equal to the root's."""
    cap = ctx.channel.slot_bytes
    n = buf.numel()
    for i in range(steps_for(n, cap)):
        o = i * cap
        m = max(0, min(cap, n - o))
        if ctx.rank == root and m:
            ctx.my_slot()[:m].copy_(buf[o:o + m])
        ctx.step()
        if ctx.rank != root and m:
            buf[o:o + m].copy_(ctx.peer_slot(root)[:m])
    ctx.finish()
