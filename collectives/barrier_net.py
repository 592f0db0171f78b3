"""Barrier in a group that spans nodes: shared memory inside a node, network between.

How it works
------------
A local step (every rank of the node has arrived; it is also the call's descriptor check)
-> the node leaders (local index 0) run a barrier over the network (the
``barrier/network`` table: recursive doubling among a power of two of nodes,
net_recursive_doubling.py, else dissemination, net_dissemination.py: ceil(log2 N) rounds
of one message) -> every node has arrived -> a second local step releases the node's
ranks.
"""

from __future__ import annotations

from . import net_dissemination, net_mpi, net_recursive_doubling
from .context import Context

_NETWORK = {"dissemination": net_dissemination.barrier,
            "recursive_doubling": net_recursive_doubling.barrier}


def barrier(ctx: Context) -> None:
    """Nobody leaves before everybody arrived."""
    net_call = ctx.net_call
    topo = net_call.topo
    ctx.finish()
    if ctx.rank == 0:
        leaders = [topo.leader(b) for b in range(len(topo.nodes))]
        algo = ctx.selection.select("barrier/network", 0, len(topo.nodes),
                                    native=net_mpi.serves(net_call.net, leaders))
        ctx.chose(algo)
        if algo == "mpi":
            net_mpi.barrier(net_call)
        else:
            net_call.run(_NETWORK[algo](net_call, leaders, topo.my_node))
    ctx.step()
