"""Reduce, gather and scatter in a group that spans nodes: shared memory inside, network between.

How it works
------------
Local phases run rooted.py's algorithms over the node's step channel (``ctx``: ranks are
local indices); network phases go through ``ctx.net_call`` (net.py, addressed by group
rank). In a rooted collective, each node has one rank that speaks for it (``node_root``):
the root itself on the root's node, the leader (local index 0) elsewhere.

reduce
    local reduce to the node's speaker -> the speakers reduce their nodes' partials to the
    root along a binomial tree (net_binomial.py, the ``reduce/network`` table: ceil(log2 N)
    rounds; AVG and PREMUL_SUM follow reduce_ops.phase_specs).
gather, scatter
    direct: ranks on other nodes send their block to / receive it from the root over the
    network; the root's node uses the local algorithm among its ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch

from . import net_binomial, rooted
from .context import Context
from .reduce_ops import finish_phases, phase_specs

if TYPE_CHECKING:
    from .net import NetCall, Topo
    from .reduce_ops import ReduceSpec


def node_root(topo: Topo, root: int) -> int:
    """Local index of the rank that speaks for this node in a collective rooted at ``root``."""
    if topo.node_of(root) == topo.my_node:
        return topo.local.index(root)
    return 0


def reduce(ctx: Context, out: torch.Tensor, inp: torch.Tensor, spec: ReduceSpec, root: int
           ) -> None:
    """Reduce flat typed ``inp`` into ``out`` on ``root`` only (others' ``out`` untouched)."""
    net_call = ctx.net_call
    topo = net_call.topo
    first, later = phase_specs(spec)
    here = node_root(topo, root)
    part = torch.empty_like(inp) if ctx.rank == here else inp
    rooted.reduce(ctx, part, inp, first, here)
    if ctx.rank == here:
        algo = ctx.selection.select("reduce/network", part.numel() * part.element_size(),
                                    len(topo.nodes))
        ctx.chose(algo)
        REDUCE_NETWORK[algo](net_call, part, root, later)
    if topo.rank == root:
        out.copy_(part)
        finish_phases(out, spec, topo.size)


def _binomial_reduce(net_call: NetCall, part: torch.Tensor, root: int, spec: ReduceSpec
                     ) -> None:
    topo = net_call.topo
    net_call.run(net_binomial.reduce(net_call, part, topo.speakers(root), topo.my_node,
                                     topo.node_of(root), spec))


# the ``reduce/network`` table's algorithms (selection.py): name -> what runs it among the
# speakers
REDUCE_NETWORK = {"binomial": _binomial_reduce}


def gather(ctx: Context, outs: Sequence[torch.Tensor], inp: torch.Tensor, root: int) -> None:
    """The root gets every rank's uint8 ``inp`` in ``outs[rank]``."""
    net_call = ctx.net_call
    if _direct(ctx, root, net_call.send, inp, net_call.recv, outs):
        topo = net_call.topo
        rooted.gather(ctx, [outs[g] for g in topo.local] if topo.rank == root else [], inp,
                      topo.local.index(root))
        net_call.wait()


def scatter(ctx: Context, out: torch.Tensor, ins: Sequence[torch.Tensor], root: int) -> None:
    """Rank k gets the root's uint8 ``ins[k]`` in ``out``."""
    net_call = ctx.net_call
    if _direct(ctx, root, net_call.recv, out, net_call.send, ins):
        topo = net_call.topo
        rooted.scatter(ctx, out, [ins[g] for g in topo.local] if topo.rank == root else [],
                       topo.local.index(root))
        net_call.wait()


def _direct(ctx: Context, root: int, post_mine: Callable[[int, torch.Tensor], object],
            mine: torch.Tensor, post_root: Callable[[int, torch.Tensor], object],
            blocks: Sequence[torch.Tensor]) -> bool:
    """The network part of a gather or scatter. A rank on another node than the root posts
    its block (``post_mine(root, mine)``), takes the call's local step and waits: it is
    done (False). The root posts one message per rank on another node (``post_root(g,
    blocks[g])``); the ranks of the root's node go on with the local phase (True)."""
    topo = ctx.net_call.topo
    if topo.node_of(root) != topo.my_node:
        post_mine(root, mine)
        ctx.finish()
        ctx.net_call.wait()
        return False
    if topo.rank == root:
        for g in range(topo.size):
            if topo.node_of(g) != topo.my_node:
                post_root(g, blocks[g])
    return True
