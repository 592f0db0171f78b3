"""Broadcast in a group that spans nodes: shared memory inside a node, network between.

How it works
------------
One rank speaks for each node (``Topo.speakers``: the root on its node, the leader,
local index 0, elsewhere). The speakers broadcast over the network along a binomial tree
rooted at the root (net_binomial.py, the ``broadcast/network`` table: ceil(log2 N) rounds,
the root sends ceil(log2 N) messages) -> each node of more than one rank broadcasts
locally with broadcast.py's algorithm from its speaker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import broadcast as bcast, net_binomial, net_mpi
from .context import Context
from .rooted_net import node_root

if TYPE_CHECKING:
    import torch

    from .net import NetCall


def broadcast(ctx: Context, buf: torch.Tensor, root: int) -> None:
    """Make uint8 ``buf`` equal to the root's everywhere."""
    net_call = ctx.net_call
    topo = net_call.topo
    root_node = topo.node_of(root)
    # (MPI's: the speakers are the leaders, a column, when the root is its node's leader)
    algo = ctx.selection.select("broadcast/network", buf.numel(), len(topo.nodes),
                                native=(net_call.net.column is not None
                                        and root == topo.leader(root_node)))
    ctx.chose(algo)
    here = node_root(topo, root)
    if ctx.rank == here:
        NETWORK[algo](net_call, buf, root, root_node)
    if ctx.size == 1:  # (alone on this node: no local phase)
        ctx.finish()
        return
    bcast.broadcast(ctx, buf, here)


def _mpi(net_call: NetCall, buf: torch.Tensor, root: int, root_node: int) -> None:
    net_mpi.broadcast(net_call, buf, root_node)


def _binomial(net_call: NetCall, buf: torch.Tensor, root: int, root_node: int) -> None:
    topo = net_call.topo
    net_call.run(net_binomial.broadcast(net_call, buf, topo.speakers(root), topo.my_node,
                                        root_node))


# the ``broadcast/network`` table's algorithms (selection.py): name -> what runs it among
# the speakers
NETWORK = {"mpi": _mpi, "binomial": _binomial}
