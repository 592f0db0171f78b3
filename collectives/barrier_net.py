"""Barrier in a group that spans nodes: shared memory inside a node, network between.

How it works
------------
A local step (every rank of the node has arrived; it is also the call's descriptor check)
-> the node leaders (local index 0) exchange empty messages with every other leader over
the network (``ctx.net_call``, net.py): every node has arrived -> a second local step
releases the node's ranks.
"""

from __future__ import annotations

from .context import Context


def barrier(ctx: Context) -> None:
    """Nobody leaves before everybody arrived."""
    net_call = ctx.net_call
    topo = net_call.topo
    ctx.finish()
    if ctx.rank == 0:
        empty = bytearray(0)
        for b in range(len(topo.nodes)):
            if b != topo.my_node:
                net_call.recv(topo.leader(b), empty)
                net_call.send(topo.leader(b), b"")
        net_call.wait()
    ctx.step()
