"""Barrier in a group that spans nodes: shared memory inside a node, network between.

How it works
------------
A local step (every rank of the node has arrived; it is also the call's descriptor check)
-> the node leaders (local index 0) run a barrier over the network (the
``barrier/network`` table: recursive doubling among a power of two of nodes,
net_recursive_doubling.py, else dissemination, net_dissemination.py: ceil(log2 N) rounds
of one message; where ranks share cores, up and down a binomial tree, net_tree.py) ->
every node has arrived -> a second local step releases the node's ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from . import net_dissemination, net_mpi, net_recursive_doubling, net_tree
from .context import Context

if TYPE_CHECKING:
    from .net import Exchange, NetCall

    # a barrier among the node leaders: ``f(net_call, leaders, mine)`` (``mine``: the index
    # of this rank's node in ``leaders``)
    _Network = Callable[[NetCall, Sequence[int], int], None]


def barrier(ctx: Context) -> None:
    """Nobody leaves before everybody arrived."""
    net_call = ctx.net_call
    topo = net_call.topo
    ctx.finish()
    if ctx.rank == 0:
        leaders = [topo.leader(b) for b in range(len(topo.nodes))]
        algo = ctx.selection.select("barrier/network", 0, len(topo.nodes),
                                    native=(net_call.net.column is not None
                                            and net_mpi.serves(net_call.net, leaders)))
        ctx.chose(algo)
        NETWORK[algo](net_call, leaders, topo.my_node)
    ctx.step()


def _generator(algorithm: Callable[[Exchange, Sequence[int], int], Iterator[None]]
               ) -> _Network:
    """An algorithm of one file (a generator over the call's NetCall)."""
    def run(net_call: NetCall, leaders: Sequence[int], mine: int) -> None:
        net_call.run(algorithm(net_call, leaders, mine))
    return run


def _mpi(net_call: NetCall, leaders: Sequence[int], mine: int) -> None:
    net_mpi.barrier(net_call)


# the ``barrier/network`` table's algorithms (selection.py): name -> what runs it among
# the node leaders
NETWORK = {"mpi": _mpi, "dissemination": _generator(net_dissemination.barrier),
           "recursive_doubling": _generator(net_recursive_doubling.barrier),
           "tree": _generator(net_tree.barrier)}
