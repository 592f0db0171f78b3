"""Broadcast over a step channel: the root stages a slot-sized piece, everyone copies it out.

Pipelined by double buffering: while the others copy piece i out of the root's slot, the
root already stages piece i+1 in its other slot. A buffer that fits one slot takes one step,
with a plan (``OneSlot``: the root's slot viewed like the buffer, both parities) made once
per dtype, shape and root.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .context import Context, Plans, steps_for

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

    from ..transport.base import StepChannel


def broadcast(ctx: Context, buf: torch.Tensor, root: int) -> None:
    """Make the uint8 tensor ``buf`` on every rank equal to the root's."""
    ctx.chose(OneSlot.ALGORITHM)
    cap = ctx.channel.slot_bytes
    n = buf.numel()
    if n <= cap:
        OneSlot.prepared(ctx.plans, ctx.channel, buf, root).run(ctx, buf)
        return
    for i in range(steps_for(n, cap)):
        o = i * cap
        m = max(0, min(cap, n - o))
        if ctx.rank == root and m:
            ctx.my_slot()[:m].copy_(buf[o:o + m])
        ctx.step()
        if ctx.rank != root and m:
            buf[o:o + m].copy_(ctx.peer_slot(root)[:m])
    ctx.finish()


class OneSlot:
    """The one-step broadcast from ``root`` of tensors with ``like``'s dtype and shape (at
    most one slot): ``views[p]`` is the root's slot of step parity ``p`` viewed like them."""

    __slots__ = ("views", "root")
    ALGORITHM = "slots"  # (the one algorithm inside a node: no selection table)

    def __init__(self, channel: StepChannel, like: torch.Tensor, root: int):
        self.root = root
        self.views = [channel.slot_like(root, p, like) for p in (0, 1)]

    @classmethod
    def prepared(cls, plans: Plans, channel: StepChannel, like: torch.Tensor, root: int) -> Self:
        """The group's plan for tensors like ``like`` from ``root`` (made on first use)."""
        key = ("broadcast", like.dtype, like.shape, root)
        return plans.get(key) or plans.add(key, cls(channel, like, root))

    def run(self, ctx: Context, buf: torch.Tensor) -> None:
        """Make ``buf`` (detached, contiguous) equal to the root's."""
        view = self.views[(ctx.channel.epoch + 1) & 1]
        ctx.one_step = True
        if ctx.rank == self.root:
            if not ctx.channel.staged():
                view.copy_(buf)
            ctx.step()
        else:
            ctx.step()
            buf.copy_(view)
