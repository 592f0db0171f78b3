"""Broadcast in a group that spans nodes: shared memory inside a node, network between.

How it works
------------
One rank speaks for each node (``Topo.speakers``: the root on its node, the leader,
local index 0, elsewhere). The speakers broadcast over the network along a binomial tree
rooted at the root (net_binomial.py, the ``broadcast/network`` table: ceil(log2 N) rounds,
the root sends ceil(log2 N) messages) -> each node of more than one rank broadcasts
locally with broadcast.py's algorithm from its speaker.

The choices depend only on the size, the root and the group, so they are made once per
size and root (``Plan``, kept in the group's ``Plans``), for the general path and the
express lane alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import broadcast as bcast, net_binomial, net_mpi
from .context import Context
from .rooted_net import node_root

if TYPE_CHECKING:
    from .net import NetCall


def broadcast(ctx: Context, buf: torch.Tensor, root: int) -> None:
    """Make contiguous ``buf`` equal to the root's everywhere."""
    prepared(ctx, buf.numel() * buf.element_size(), root).run(ctx, buf)


def prepared(ctx: Context, nbytes: int, root: int) -> Plan:
    """The group's ``Plan`` for a broadcast of ``nbytes`` from ``root`` (made on first use,
    kept in the group's ``Plans``)."""
    key = ("broadcast/net", nbytes, root)
    return ctx.plans.get(key) or ctx.plans.add(key, Plan(ctx, nbytes, root))


class Plan:
    """What a broadcast of one size from one root runs in a group, chosen once (the
    ``broadcast/network`` table is a pure function of the bytes, the nodes and where the
    root is): the general path and the express lane (neuron_dist/express_net.py) run it."""

    __slots__ = ("name", "root", "root_node", "here", "speaks", "network", "speakers", "me")
    ALGORITHM = None  # (the express lane's entries: the plan names itself as it runs)

    def __init__(self, ctx: Context, nbytes: int, root: int):
        net_call = ctx.net_call
        topo = net_call.topo
        self.root, self.root_node = root, topo.node_of(root)
        # (MPI's: the speakers are the leaders, a column, when the root is its node's leader)
        self.name = ctx.selection.select(
            "broadcast/network", nbytes, len(topo.nodes),
            native=(net_call.net.column is not None and root == topo.leader(self.root_node)))
        self.here = node_root(topo, root)  # (the local index that speaks for this node)
        self.speaks = ctx.rank == self.here
        self.network = NETWORK[self.name]
        self.speakers, self.me = topo.speakers(root), topo.my_node

    def run(self, ctx: Context, buf: torch.Tensor) -> None:
        """Make contiguous ``buf`` (of the plan's size in bytes, any dtype) equal to the
        root's everywhere."""
        ctx.chose(self.name)
        if self.speaks:
            net_call = ctx.net_call
            if self.network is _binomial:  # (the usual case: its messages carry buf's bytes)
                net_call.run(net_binomial.broadcast(net_call, buf, self.speakers, self.me,
                                                    self.root_node))
            else:
                self.network(net_call, _as_uint8(buf), self.root, self.root_node)
        if ctx.size == 1:  # (alone on this node: no local phase)
            ctx.finish()
            return
        bcast.broadcast(ctx, _as_uint8(buf), self.here)


def _as_uint8(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``t`` as a flat uint8 view (itself if it is one: a view op costs µs)."""
    return t if t.dtype is torch.uint8 and t.dim() == 1 else t.view(-1).view(torch.uint8)


def _mpi(net_call: NetCall, buf: torch.Tensor, root: int, root_node: int) -> None:
    net_mpi.broadcast(net_call, buf, root_node)


def _binomial(net_call: NetCall, buf: torch.Tensor, root: int, root_node: int) -> None:
    topo = net_call.topo
    net_call.run(net_binomial.broadcast(net_call, buf, topo.speakers(root), topo.my_node,
                                        root_node))


# the ``broadcast/network`` table's algorithms (selection.py): name -> what runs it among
# the speakers
NETWORK = {"mpi": _mpi, "binomial": _binomial}
