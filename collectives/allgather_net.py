"""All-gather in a group that spans nodes: shared memory inside a node, network between.

How it works
------------
Local phases run allgather.py's and broadcast.py's algorithms over the node's step channel
(``ctx``: ranks are local indices); network phases go through ``ctx.net_call`` (net.py,
addressed by group rank). Which algorithm runs: the ``all_gather/nodes`` table of
selection.py.

Nodes of equal size (``columns``)
    each node all-gathers its own ranks' blocks -> each rank all-gathers its block with the
    ranks of its column (the same local index) on the other nodes -> per other node, a
    local all-gather of the blocks that node's ranks sent to this node's ranks. Every block
    crosses the network once per other node, each local rank driving its own share. The
    column's all-gather is the ``all_gather/network`` table's choice: ``direct`` (each
    rank sends its block to every other, in one round), ``recursive_doubling``
    (net_recursive_doubling.py: log2 P rounds with the peers of the other log-depth
    algorithms) or ``bruck`` (net_bruck.py: ceil(log2 P) rounds for any P).
Uneven nodes, or ``NEURON_DIST_ALGO=all_gather=leader`` (``leader``)
    local all-gather -> node leaders exchange whole node blocks -> local broadcast of
    what came in, packed into one buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch

from . import allgather, broadcast as bcast, net_bruck, net_mpi, net_recursive_doubling
from .context import Context

if TYPE_CHECKING:
    from .net import Exchange, NetCall

    # an ``all_gather/network`` algorithm: ``f(ctx, outs, column, alone)``
    _Network = Callable[[Context, Sequence[torch.Tensor], Sequence[int], bool], None]
    # an exchange among the column: ``run(net_call, blocks, column)``
    _Run = Callable[[NetCall, Sequence[torch.Tensor], Sequence[int]], None]


def all_gather(ctx: Context, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
    """Every rank gets every rank's uint8 ``inp`` in ``outs[rank]``."""
    topo = ctx.net_call.topo
    layout = ctx.selection.select("all_gather/nodes", max(o.numel() for o in outs), ctx.size,
                                  even=topo.even)
    ctx.chose(layout)
    LAYOUTS[layout](ctx, outs, inp)


def _leader_all_gather(ctx: Context, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
    """Uneven nodes (see the module docstring)."""
    net_call = ctx.net_call
    topo = net_call.topo
    allgather.all_gather(ctx, [outs[g] for g in topo.local], inp)
    remote = [g for b, node in enumerate(topo.nodes) if b != topo.my_node for g in node]
    if ctx.rank == 0:
        for b in range(len(topo.nodes)):
            if b != topo.my_node:
                for g in topo.local:
                    net_call.send(topo.leader(b), outs[g])
                for g in topo.nodes[b]:
                    net_call.recv(topo.leader(b), outs[g])
        net_call.wait()
        packed = _pack([outs[g] for g in remote])
    else:
        packed = torch.empty(sum(outs[g].numel() for g in remote), dtype=torch.uint8)
    bcast.broadcast(ctx, packed, 0)
    if ctx.rank != 0:
        _unpack(packed, [outs[g] for g in remote])


def _columns_all_gather(ctx: Context, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
    """Nodes of equal size (see the module docstring). ``inp`` is read only in the first
    phase (it may be one of the outputs)."""
    net_call = ctx.net_call
    topo = net_call.topo
    j = ctx.rank
    me = topo.rank
    alone = len(topo.local) == 1
    column = [node[j] for node in topo.nodes]
    sizes = {outs[g].numel() for g in column}  # (every rank knows every block's size)
    algo = ctx.selection.select("all_gather/network", max(sizes), len(column),
                                uniform=len(sizes) == 1,
                                native=(net_call.net.column is not None
                                        and net_mpi.serves(net_call.net, column)))
    ctx.chose(algo)
    if not alone:
        allgather.all_gather(ctx, [outs[g] for g in topo.local], inp)
    elif outs[me].data_ptr() != inp.data_ptr():
        outs[me].copy_(inp)
    NETWORK[algo](ctx, outs, column, alone)


def _direct(ctx: Context, outs: Sequence[torch.Tensor], column: Sequence[int], alone: bool
            ) -> None:
    """Each rank of the column sends its block to every other, in one round."""
    net_call = ctx.net_call
    topo = net_call.topo
    mine, me = topo.my_node, topo.rank
    if alone:
        net_call.deferrable()  # every message posted before the one wait
    for b, g in enumerate(column):
        if b != mine:
            net_call.recv(g, outs[g])
    for b, g in enumerate(column):
        if b != mine:
            net_call.send(g, outs[me])
    if alone:
        net_call.wait_then(ctx.finish)
        return
    net_call.wait()
    _gather_columns(ctx, outs)


def _exchange(run: _Run) -> _Network:
    """An exchange among the column that waits for what it posted (``run(net_call,
    blocks, column)``, ``blocks``: the column's outputs), then the local rest."""
    def exchange(ctx: Context, outs: Sequence[torch.Tensor], column: Sequence[int],
                 alone: bool) -> None:
        run(ctx.net_call, [outs[g] for g in column], column)
        if alone:
            ctx.finish()
        else:
            _gather_columns(ctx, outs)
    return exchange


def _generator(algorithm: Callable[[Exchange, Sequence[torch.Tensor], torch.Tensor,
                                    Sequence[int], int], Iterator[None]]) -> _Run:
    """An algorithm of one file (a generator over the call's NetCall)."""
    def run(net_call: NetCall, blocks: Sequence[torch.Tensor], column: Sequence[int]) -> None:
        mine = net_call.topo.my_node
        net_call.run(algorithm(net_call, blocks, blocks[mine], column, mine))
    return run


def _mpi(net_call: NetCall, blocks: Sequence[torch.Tensor], column: Sequence[int]) -> None:
    net_mpi.all_gather(net_call, blocks, net_call.topo.my_node)


def _gather_columns(ctx: Context, outs: Sequence[torch.Tensor]) -> None:
    """Per other node, a local all-gather of the blocks its ranks sent this node's ranks."""
    topo = ctx.net_call.topo
    for b, node in enumerate(topo.nodes):
        if b != topo.my_node:
            allgather.all_gather(ctx, [outs[g] for g in node], outs[node[ctx.rank]])


# the ``all_gather/nodes`` table's algorithms (selection.py): name -> what runs it
LAYOUTS = {"columns": _columns_all_gather, "leader": _leader_all_gather}
# the ``all_gather/network`` table's algorithms: name -> the column's exchange and the rest
NETWORK = {
    "direct": _direct,
    "mpi": _exchange(_mpi),
    "bruck": _exchange(_generator(net_bruck.all_gather)),
    "recursive_doubling": _exchange(_generator(net_recursive_doubling.all_gather)),
}


def _pack(blocks: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([b.view(-1) for b in blocks]) if blocks else torch.empty(0, dtype=torch.uint8)


def _unpack(flat: torch.Tensor, blocks: Sequence[torch.Tensor]) -> None:
    o = 0
    for b in blocks:
        b.copy_(flat[o:o + b.numel()])
        o += b.numel()
