"""All-to-all in a group that spans nodes: shared memory inside a node, network between.

How it works
------------
Direct: every rank posts a receive from and a send to each rank on another node over the
network (``ctx.net_call``, net.py), then exchanges the blocks of its own node's ranks with
alltoall.py's algorithm over the node's step channel while those messages travel, then
waits for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from . import alltoall
from .context import Context

if TYPE_CHECKING:
    import torch


def all_to_all(ctx: Context, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor],
               element_size: int) -> None:
    """Send uint8 ``ins[k]`` to rank k and receive rank k's block into ``outs[k]``."""
    net_call = ctx.net_call
    topo = net_call.topo
    remote = [g for g in range(topo.size) if topo.node_of(g) != topo.my_node]
    for g in remote:
        net_call.recv(g, outs[g])
    for g in remote:
        net_call.send(g, ins[g])
    alltoall.all_to_all(ctx, [outs[g] for g in topo.local], [ins[g] for g in topo.local],
                        element_size)
    net_call.wait()
