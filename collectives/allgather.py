"""All-gather (also uneven, "all-gather-v") over a step channel, on raw bytes. Which
algorithm runs: the ``all_gather`` table of selection.py (single copy, single_copy.py, for
contributions from 1 MiB when the node's ranks can read each other's memory, else slots).

``slots``: each step moves up to one slot of every rank's contribution: a rank stages the
next piece of its input in its slot; after the step every rank copies piece k of peer k's
slot into output k. The number of steps follows the largest contribution, which every rank
knows (the output sizes are part of the checked call), so all ranks step together.

Into one tensor (``all_gather_into``: equal contributions, rank k's at block k) an input
that fits one slot takes one step, with a plan (``OneSlot``: every rank's slot viewed like
the input, both parities) made once per dtype and shape: one concatenation fills the output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from . import single_copy
from .context import Context, SlotViews, steps_for

if TYPE_CHECKING:
    from ..transport.base import StepChannel
    from .selection import Selection


def choose(selection: Selection, channel: StepChannel, nbytes: int) -> str:
    """The ``all_gather`` table's algorithm for contributions of at most ``nbytes`` (the
    same in any phase of a call: a two-level collective's later all_gather chooses for
    itself)."""
    return selection.select("all_gather", nbytes, channel.size, cma=channel.cma)


def all_gather(ctx: Context, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
    """Copy every rank's uint8 ``inp`` into ``outs[rank]`` on every rank."""
    algo = choose(ctx.selection, ctx.channel, max(o.numel() for o in outs))
    ctx.chose(algo)
    ALGORITHMS[algo](ctx, outs, inp)


def _slots(ctx: Context, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
    cap = ctx.channel.slot_bytes
    sizes = [o.numel() for o in outs]
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


def all_gather_into(ctx: Context, out: torch.Tensor, inp: torch.Tensor) -> None:
    """All-gather the 1-D ``inp`` of every rank into the 1-D ``out`` (rank k's at block k)."""
    nbytes = inp.numel() * inp.element_size()
    algo = choose(ctx.selection, ctx.channel, nbytes)
    ctx.chose(algo)
    INTO[algo](ctx, out, inp, nbytes)


def single_step(selection: Selection, channel: StepChannel, inp: torch.Tensor
                ) -> type[OneSlot] | None:
    """The single-step plan class (``OneSlot``) the ``all_gather`` table's algorithm runs
    ``all_gather_into`` of ``inp`` with, or None if it runs it otherwise (express.py)."""
    nbytes = inp.numel() * inp.element_size()
    if nbytes > channel.slot_bytes:  # (a plan holds one slot)
        return None
    return PLANS.get(choose(selection, channel, nbytes))


def _blocks(ctx: Context, out: torch.Tensor, inp: torch.Tensor) -> list[torch.Tensor]:
    """``out``'s block of every rank (``inp``'s length each)."""
    n = inp.numel()
    return [out[k * n:(k + 1) * n] for k in range(ctx.size)]


def _slots_into(ctx: Context, out: torch.Tensor, inp: torch.Tensor, nbytes: int) -> None:
    if nbytes <= ctx.channel.slot_bytes:  # one slot: the plan
        OneSlot.prepared(ctx.plans, ctx.channel, inp).run(ctx, out, inp)
        return
    _slots(ctx, _blocks(ctx, out, inp), inp)


def _single_copy_into(ctx: Context, out: torch.Tensor, inp: torch.Tensor, nbytes: int
                      ) -> None:
    single_copy.all_gather(ctx, _blocks(ctx, out, inp), inp)


class OneSlot(SlotViews):
    """The one-step all-gather of 1-D inputs with ``like``'s dtype and length (at most one
    slot): ``views[p]`` is every rank's slot of step parity ``p``, viewed like the input."""

    __slots__ = ()
    NAME = "all_gather"
    ALGORITHM = "slots"

    def run(self, ctx: Context, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``out`` (1-D, detached) = every rank's ``inp`` (1-D), in rank order."""
        views = self.views[(ctx.channel.epoch + 1) & 1]
        if not ctx.channel.staged():
            views[ctx.rank].copy_(inp)
        ctx.one_step = True
        ctx.step()
        torch.cat(views, out=out)


# the ``all_gather`` table's algorithms (selection.py): name -> what runs it, for a list of
# outputs (``all_gather``: ``f(ctx, outs, inp)``) and into one tensor (``all_gather_into``:
# ``f(ctx, out, inp, nbytes)``, ``nbytes`` the input's)
ALGORITHMS = {"slots": _slots, "single_copy": single_copy.all_gather}
INTO = {"slots": _slots_into, "single_copy": _single_copy_into}
# algorithm -> its single-step plan, for an input that fits one slot
PLANS = {"slots": OneSlot}
