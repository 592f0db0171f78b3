"""Barrier in a group that spans nodes: shared memory inside a node, network between.

How it works
------------
A local step (every rank of the node has arrived; it is also the call's descriptor check)
-> the node leaders (local index 0) run a dissemination barrier over the network
(net_dissemination.py, the ``barrier/network`` table: ceil(log2 N) rounds of one message):
every node has arrived -> a second local step releases the node's ranks.
"""

from __future__ import annotations

from . import net_dissemination
from .context import Context


def barrier(ctx: Context) -> None:
    """Nobody leaves before everybody arrived."""
    net_call = ctx.net_call
    topo = net_call.topo
    ctx.finish()
    if ctx.rank == 0:
        ctx.chose(ctx.selection.select("barrier/network", 0, len(topo.nodes)))
        net_call.run(net_dissemination.barrier(
            net_call, [topo.leader(b) for b in range(len(topo.nodes))], topo.my_node))
    ctx.step()
