"""Broadcast in a group that spans nodes: shared memory inside a node, network between.

How it works
------------
The root sends its buffer to the leader (local index 0) of every other node over the
network (``ctx.net_call``, net.py) -> each node broadcasts it locally with broadcast.py's
algorithm, from the root on the root's node and from the leader elsewhere
(``rooted_net.node_root``).
"""

from __future__ import annotations

from . import broadcast as bcast
from .context import Context
from .rooted_net import node_root


def broadcast(ctx: Context, buf, root: int) -> None:
    """Make uint8 ``buf`` equal to the root's everywhere."""
    net_call = ctx.net_call
    topo = net_call.topo
    ctx.chose("leaders")  # (the one layout across nodes: no selection table)
    root_node = topo.node_of(root)
    if topo.rank == root:
        for b in range(len(topo.nodes)):
            if b != root_node:
                net_call.send(topo.leader(b), buf)
    elif topo.my_node != root_node and ctx.rank == 0:
        net_call.recv(root, buf)
        net_call.wait()
    bcast.broadcast(ctx, buf, node_root(topo, root))
    net_call.wait()
