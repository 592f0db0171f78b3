"""Rooted collectives over a step channel: reduce, gather, scatter.

reduce  every rank stages a slot-sized piece; the root reduces all N slots into its output.
gather  every rank stages a piece of its input; the root copies each into output k.
scatter the root stages piece i of input k in block k of its slot; rank k copies block k.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .context import ALIGN_BYTES, Context, steps_for
from .reduce_ops import ReduceSpec, reduce_into, stage

if TYPE_CHECKING:
    import torch



def reduce(ctx: Context, out: torch.Tensor, inp: torch.Tensor, spec: ReduceSpec,
           root: int) -> None:
    """Reduce typed flat ``inp`` of every rank into ``out`` on ``root`` only."""
    dtype = inp.dtype
    cap = ctx.channel.slot_bytes // inp.element_size()
    n = inp.numel()
    for i in range(steps_for(n, cap)):
        o = i * cap
        m = max(0, min(cap, n - o))
        if m:
            stage(ctx.my_slot(dtype)[:m], inp[o:o + m], spec)
        ctx.step()
        if ctx.rank == root and m:
            views = [ctx.peer_slot(k, dtype)[:m] for k in range(ctx.size)]
            reduce_into(out[o:o + m], views, spec, ctx.size, ctx.scratch)
    ctx.finish()


def gather(ctx: Context, outs: Sequence[torch.Tensor], inp: torch.Tensor, root: int) -> None:
    """Copy each rank's uint8 ``inp`` into ``outs[k]`` on the root (``outs`` unused elsewhere)."""
    cap = ctx.channel.slot_bytes
    n = inp.numel()
    for i in range(steps_for(n, cap)):
        o = i * cap
        m = max(0, min(cap, n - o))
        if m:
            ctx.my_slot()[:m].copy_(inp[o:o + m])
        ctx.step()
        if ctx.rank == root and m:
            for k, out in enumerate(outs):
                out[o:o + m].copy_(ctx.peer_slot(k)[:m])
    ctx.finish()


def scatter(ctx: Context, out: torch.Tensor, ins: Sequence[torch.Tensor], root: int) -> None:
    """Rank k receives the root's uint8 ``ins[k]`` into ``out`` (all the same size)."""
    per = (ctx.channel.slot_bytes // ctx.size) // ALIGN_BYTES * ALIGN_BYTES
    n = out.numel()
    r = ctx.rank
    for i in range(steps_for(n, per)):
        o = i * per
        m = max(0, min(per, n - o))
        if ctx.rank == root and m:
            slot = ctx.my_slot()
            for k, src in enumerate(ins):
                slot[k * per:k * per + m].copy_(src[o:o + m])
        ctx.step()
        if m:
            out[o:o + m].copy_(ctx.peer_slot(root)[r * per:r * per + m])
    ctx.finish()
