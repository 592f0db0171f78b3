"""Reduce-scatter in a group that spans nodes: shared memory inside a node, network between.

How it works
------------
Local phases run reduce_scatter.py's, rooted.py's and broadcast.py's algorithms over the
node's step channel (``ctx``: ranks are local indices); network phases go through
``ctx.net_call`` (net.py, addressed by group rank). Which algorithm runs: the ``reduce_scatter/nodes`` table of
selection.py.

Nodes of equal size (``columns``)
    local rank j of every node forms column j, which owns the blocks of the ranks (b, j)
    on every node b. Per node b, a local reduce-scatter of this node's contributions to
    node b's blocks (local rank j gets the node's partial sum of block (b, j)) -> each
    rank reduce-scatters those partials with the ranks of its column on the other nodes.
    Only each block's share crosses the network (gloo runs a whole all-reduce), and every
    local rank drives its own part of it. The column's reduce-scatter is the
    ``reduce_scatter/network`` table's choice: ``direct`` (each rank sends every other
    its partial and reduces the partials of its own block, in node order, in one round)
    or ``halving`` (net_halving.py: recursive halving, log2 P rounds, for many nodes).
Uneven nodes, or ``NEURON_DIST_ALGO=reduce_scatter=leader`` (``leader``)
    local reduce to the leader -> leaders exchange each node's share -> local broadcast.

Each block is reduced by one rank (its owner) only. AVG and PREMUL_SUM follow
reduce_ops.phase_specs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch

from . import broadcast as bcast, net_halving, net_mpi, reduce_scatter as rs, rooted
from .context import Context
from .reduce_ops import PREMUL_SUM, finish_phases, phase_specs, reduce_into

if TYPE_CHECKING:
    from .reduce_ops import ReduceSpec

    # a ``reduce_scatter/network`` algorithm: ``f(ctx, out, partials, column, later, spec)``
    _Run = Callable[[Context, torch.Tensor, Mapping[int, torch.Tensor], Sequence[int],
                     ReduceSpec, ReduceSpec], None]


def reduce_scatter(ctx: Context, out: torch.Tensor, inputs: Sequence[torch.Tensor],
                   spec: ReduceSpec) -> None:
    """``out`` = reduction over all ranks of their ``inputs[rank]`` (flat typed)."""
    topo = ctx.net_call.topo
    layout = ctx.selection.select("reduce_scatter/nodes",
                                  max(t.numel() for t in inputs) * out.element_size(), ctx.size,
                                  even=topo.even)
    ctx.chose(layout)
    LAYOUTS[layout](ctx, out, inputs, spec)


def _leader_reduce_scatter(ctx: Context, out: torch.Tensor, inputs: Sequence[torch.Tensor],
                           spec: ReduceSpec) -> None:
    """Uneven nodes (see the module docstring)."""
    net_call = ctx.net_call
    topo = net_call.topo
    first, later = phase_specs(spec)
    order = [g for node in topo.nodes for g in node]  # node-major
    full = torch.cat([inputs[g] for g in order]) if order else out[:0]
    part = torch.empty_like(full) if ctx.rank == 0 else full
    rooted.reduce(ctx, part, full, first, 0)
    sizes = [inputs[g].numel() for g in range(topo.size)]
    starts, o = {}, 0
    for b, node in enumerate(topo.nodes):
        starts[b] = o
        o += sum(sizes[g] for g in node)
    mine_n = sum(sizes[g] for g in topo.local)
    mine = part[starts[topo.my_node]:starts[topo.my_node] + mine_n]
    if ctx.rank == 0:
        got = {}
        for b in range(len(topo.nodes)):
            if b != topo.my_node:
                n_b = sum(sizes[g] for g in topo.nodes[b])
                net_call.send(topo.leader(b), part[starts[b]:starts[b] + n_b])
                got[b] = torch.empty(mine_n, dtype=out.dtype)
                net_call.recv(topo.leader(b), got[b])
        net_call.wait()
        result = torch.empty(mine_n, dtype=out.dtype)
        views = [mine if b == topo.my_node else got[b] for b in range(len(topo.nodes))]
        reduce_into(result, views, later, len(views), ctx.scratch)
    else:
        result = torch.empty(mine_n, dtype=out.dtype)
    bcast.broadcast(ctx, result.view(torch.uint8), 0)
    o = sum(sizes[g] for g in topo.local[:ctx.rank])
    out.copy_(result[o:o + out.numel()])
    finish_phases(out, spec, topo.size)


def _columns_reduce_scatter(ctx: Context, out: torch.Tensor, inputs: Sequence[torch.Tensor],
                            spec: ReduceSpec) -> None:
    """Nodes of equal size (see the module docstring)."""
    net_call = ctx.net_call
    topo = net_call.topo
    first, later = phase_specs(spec)
    j = ctx.rank
    alone = len(topo.local) == 1
    column = [node[j] for node in topo.nodes]
    sizes = {inputs[g].numel() for g in column}  # (every rank knows every block's size)
    algo = ctx.selection.select("reduce_scatter/network", max(sizes) * out.element_size(),
                                len(column), uniform=len(sizes) == 1,
                                native=(net_call.net.column is not None
                                        and net_mpi.serves(net_call.net, column)))
    ctx.chose(algo)
    exchange = NETWORK[algo]
    if alone and exchange.deferrable:  # every message posted before the one wait
        net_call.deferrable()
    # ``out`` is written only once every input has been read and sent: it may alias one of
    # the inputs (an in-place reduce_scatter).
    partial = {}
    for b, node in enumerate(topo.nodes):
        blocks = [inputs[g] for g in node]
        if len(node) > 1:
            dest = net_call.buffer(f"rs{b}", blocks[j].numel(), out.dtype)
            rs.reduce_scatter(ctx, dest, blocks, first)
        elif first.kind == PREMUL_SUM:
            dest = net_call.buffer(f"rs{b}", blocks[0].numel(), out.dtype)
            torch.mul(blocks[0], first.factor, out=dest)  # type: ignore[arg-type]  # (has one)
        else:
            dest = blocks[0]  # alone on the node: the input itself is the partial
        partial[b] = dest
    if len(topo.local) == 1:
        ctx.finish()
    exchange.run(ctx, out, partial, column, later, spec)


class _Exchange:
    """A ``reduce_scatter/network`` algorithm: ``run(ctx, out, partials, column, later,
    spec)`` reduce-scatters the node partials (``partials[b]``: this node's partial of
    node b's block) among the column with ``later`` (reduce_ops.phase_specs) and finishes
    the call's ``spec``; ``deferrable``: a call alone on its node may defer its one wait
    (every message is posted before it)."""

    __slots__ = ("run", "deferrable")

    def __init__(self, run: _Run, deferrable: bool = False):
        self.run, self.deferrable = run, deferrable


def _mpi(ctx: Context, out: torch.Tensor, partials: Mapping[int, torch.Tensor],
         column: Sequence[int], later: ReduceSpec, spec: ReduceSpec) -> None:
    net_call = ctx.net_call
    net_mpi.reduce_scatter(net_call, out, [partials[b] for b in range(len(column))],
                           net_call.topo.my_node, later)
    finish_phases(out, spec, net_call.topo.size)


def _halving(ctx: Context, out: torch.Tensor, partials: Mapping[int, torch.Tensor],
             column: Sequence[int], later: ReduceSpec, spec: ReduceSpec) -> None:
    net_call = ctx.net_call
    m = out.numel()
    work = net_call.buffer("rhwork", m * len(column), out.dtype)
    for b in range(len(column)):
        work[b * m:(b + 1) * m].copy_(partials[b])
    net_call.run(net_halving.reduce_scatter(net_call, out, work, column,
                                            net_call.topo.my_node, later))
    finish_phases(out, spec, net_call.topo.size)


def _direct(ctx: Context, out: torch.Tensor, partials: Mapping[int, torch.Tensor],
            column: Sequence[int], later: ReduceSpec, spec: ReduceSpec) -> None:
    """Each rank sends every other its partial and reduces its own block's, in node order."""
    net_call = ctx.net_call
    topo = net_call.topo
    mine = topo.my_node
    got = {}
    for b in range(len(topo.nodes)):
        if b != mine:
            got[b] = net_call.buffer(f"rsgot{b}", out.numel(), out.dtype)
            net_call.recv(column[b], got[b])
    for b in range(len(topo.nodes)):
        if b != mine:
            net_call.send(column[b], partials[b])

    def rest() -> None:
        views = [partials[mine] if b == mine else got[b] for b in range(len(topo.nodes))]
        if len(views) == 2:  # elementwise, so out may alias views[0] (an in-place call)
            reduce_into(out, views, later, 2, ctx.scratch)
        else:
            acc = net_call.buffer("rsacc", out.numel(), out.dtype)
            reduce_into(acc, views, later, len(views), ctx.scratch)
            out.copy_(acc)
        finish_phases(out, spec, topo.size)

    net_call.wait_then(rest)


# the ``reduce_scatter/nodes`` table's algorithms (selection.py): name -> what runs it
LAYOUTS = {"columns": _columns_reduce_scatter, "leader": _leader_reduce_scatter}
# the ``reduce_scatter/network`` table's algorithms: name -> the column's exchange
NETWORK = {"direct": _Exchange(_direct, deferrable=True), "mpi": _Exchange(_mpi),
           "halving": _Exchange(_halving)}
