"""All-reduce in a group that spans nodes: shared memory inside a node, network between.

How it works
------------
Local phases run allreduce.py's, reduce_scatter.py's and allgather.py's algorithms over the
node's step channel (``ctx``: ranks are local indices); network phases go through
``ctx.net_call`` (net.py, addressed by group rank). Which algorithms run: the
``all_reduce/nodes`` and ``all_reduce/network`` tables of selection.py.

Nodes of equal size (hierarchical), by default from 64 elements per local rank
    local reduce-scatter (local rank j owns slice j) -> each local rank all-reduces its
    slice with the ranks of the same local index on the other nodes -> local all-gather.
    Every local rank drives its own share of the network traffic, in parallel.
Uneven nodes, small buffers, or ``NEURON_DIST_ALGO=all_reduce=leader`` (leader)
    local all-reduce -> node leaders (local index 0) exchange and reduce -> local broadcast.
A rank alone on its node
    straight to the network exchange (both algorithms come to that).

The network exchange among P ranks (``_exchange_reduce``) is chosen by the
``all_reduce/network`` table: between two nodes ``direct`` (each sends its buffer to the
other; every message posted before one wait, so a first run may be deferred) or, from
HALVES_BYTES, ``halves`` (each reduces one half and sends it back); among more, the
algorithm the cost model (net_cost.py) predicts fastest for P and the bytes:
``recursive_doubling`` (net_recursive_doubling.py: log2 P rounds of whole buffers),
``rabenseifner`` (net_rabenseifner.py: reduce-scatter by halving, all-gather by doubling),
``ring`` (net_ring.py: 2 (P-1) steps of 1/P of the buffer), ``direct`` (P - 1 messages in one
round: few nodes), or, where ranks share cores, ``tree`` (net_tree.py: a binomial reduce and
broadcast, 2 (P - 1) messages in all). Under mpiexec with the MPI transport, ``mpi``: the cluster's MPI
(net_mpi.py).
Every algorithm gives every rank bit-identical results: the direct exchange reduces in
node order on every rank; the others compute each value once, or on both sides of a pair
from the same operands in the same order (their additions follow a tree, and float16 /
bfloat16 round once per level). AVG and PREMUL_SUM follow reduce_ops.phase_specs.

The choices depend only on the size, the dtype and the group, so they are made once per
size and dtype (``Plan``, kept in the group's ``Plans``): the general path and the express
lane run the same plan, and a repeated call goes straight to its algorithm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch

from . import allgather, allreduce, broadcast as bcast, reduce_scatter as rs
from . import net_mpi, net_rabenseifner, net_recursive_doubling, net_ring, net_tree
from .context import ALIGN_BYTES, Context, flat, partition
from .reduce_ops import PREMUL_SUM, ReduceSpec, finish_phases, phase_specs, reduce_into

if TYPE_CHECKING:
    from .net import Exchange

    # an exchange that waits for what it posted: ``f(ctx, buf, peers, spec)``
    _Exchange = Callable[[Context, torch.Tensor, Sequence[int], ReduceSpec], None]
    # an ``all_reduce/network`` algorithm: ``f(ctx, buf, peers, spec, rest)``
    _Network = Callable[[Context, torch.Tensor, Sequence[int], ReduceSpec,
                         Callable[[], None] | None], None]
    # an algorithm of one file, a generator over the call's NetCall:
    # ``f(net, buf, peers, me, spec)``
    _Algorithm = Callable[[Exchange, torch.Tensor, Sequence[int], int, ReduceSpec],
                          Iterator[None]]


def all_reduce(ctx: Context, out: torch.Tensor, inp: torch.Tensor, spec: ReduceSpec) -> None:
    """Reduce contiguous typed ``inp`` over the whole group into ``out`` (may alias)."""
    prepared(ctx, inp.numel(), inp.dtype).run(ctx, out, inp, spec)


def prepared(ctx: Context, numel: int, dtype: torch.dtype) -> Plan:
    """The group's ``Plan`` for an all_reduce of ``numel`` elements of ``dtype`` (made on
    first use, kept in the group's ``Plans``)."""
    key = ("all_reduce/net", numel, dtype)
    return ctx.plans.get(key) or ctx.plans.add(key, Plan(ctx, numel, dtype))


class Plan:
    """What an all_reduce of one size and dtype runs in a group, chosen once.

    The selection tables are pure functions of the bytes, the ranks and the group's
    topology, so the choices (the layout across nodes and, for a rank alone on its node,
    the network exchange, its peers and this rank's place among them) are made when the
    plan is made, and a repeated call goes straight to its algorithm. The general path
    (``all_reduce``) and the express lane (neuron_dist/express_net.py) run the same plan.
    """

    __slots__ = ("name", "layout", "alone", "peers", "me", "exchange", "generator", "size")
    ALGORITHM = None  # (the express lane's entries: the plan names itself as it runs)

    def __init__(self, ctx: Context, numel: int, dtype: torch.dtype):
        net_call = ctx.net_call
        topo = net_call.topo
        nbytes = numel * dtype.itemsize
        self.size = topo.size
        self.layout = ctx.selection.select("all_reduce/nodes", nbytes, ctx.size, numel=numel,
                                           even=topo.even)
        self.alone = len(topo.local) == 1
        self.name = self.layout
        self.peers = [node[0] for node in topo.nodes]
        self.me = self.peers.index(topo.rank) if self.alone else -1
        self.exchange: _Network | None = None
        self.generator: _Algorithm | None = None
        if self.alone and len(self.peers) > 1:
            algo = ctx.selection.select("all_reduce/network", nbytes, len(self.peers),
                                        numel=numel,
                                        native=(net_call.net.column is not None
                                                and net_mpi.serves(net_call.net, self.peers)))
            self.name = f"{self.layout}+{algo}"
            self.generator = GENERATORS.get(algo)
            self.exchange = NETWORK[algo]

    def run(self, ctx: Context, out: torch.Tensor, inp: torch.Tensor, spec: ReduceSpec) -> None:
        """Reduce contiguous typed ``inp`` (of the plan's size and dtype) over the whole
        group into ``out`` (may alias)."""
        ctx.chose(self.name)
        out, inp = flat(out), flat(inp)
        first, later = phase_specs(spec)
        if not self.alone:
            LAYOUTS[self.layout](ctx, out, inp, first, later)
            finish_phases(out, spec, self.size)
            return
        # alone on this node: straight to the network
        if first.kind == PREMUL_SUM:
            if out.data_ptr() == inp.data_ptr():
                # (scaling in place must not be done twice: a call that may be run again
                # from the start must not begin with it)
                ctx.net_call.not_deferrable()
            torch.mul(inp, first.factor, out=out)  # type: ignore[arg-type]  # (PREMUL_SUM has one)
        elif out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        generator = self.generator
        if generator is not None:  # (the usual case, without the wrappers of NETWORK)
            net_call = ctx.net_call
            net_call.run(generator(net_call, out, self.peers, self.me, later))
            ctx.finish()
            finish_phases(out, spec, self.size)
            return

        def rest() -> None:
            ctx.finish()
            finish_phases(out, spec, self.size)

        if self.exchange is None:  # (only this rank)
            rest()
        else:
            self.exchange(ctx, out, self.peers, later, rest)


def _leader(ctx: Context, out: torch.Tensor, inp: torch.Tensor, first: ReduceSpec,
            later: ReduceSpec) -> None:
    topo = ctx.net_call.topo
    allreduce.all_reduce(ctx, out, inp, first)
    if ctx.rank == 0:
        _exchange_reduce(ctx, out, [topo.leader(b) for b in range(len(topo.nodes))], later)
    bcast.broadcast(ctx, out.view(torch.uint8), 0)


def _hierarchical(ctx: Context, out: torch.Tensor, inp: torch.Tensor, first: ReduceSpec,
                  later: ReduceSpec) -> None:
    net_call = ctx.net_call
    align = max(1, ALIGN_BYTES // inp.element_size())
    slices = partition(inp.numel(), ctx.size, align)
    rs.reduce_scatter(ctx, out[slices[ctx.rank][0]:sum(slices[ctx.rank])],
                      [inp[s:s + m] for s, m in slices], first)
    s, m = slices[ctx.rank]
    column = [node[ctx.rank] for node in net_call.topo.nodes]
    if m:
        _exchange_reduce(ctx, out[s:s + m], column, later)
    else:
        net_call.wait()
    b = out.view(torch.uint8)
    es = out.element_size()
    mine = net_call.buffer("mine", m * es, torch.uint8)
    mine.copy_(b[s * es:(s + m) * es])
    allgather.all_gather(ctx, [b[s * es:(s + m) * es] for s, m in slices], mine)


def _exchange_reduce(ctx: Context, buf: torch.Tensor, peers: Sequence[int], spec: ReduceSpec,
                     rest: Callable[[], None] | None = None) -> None:
    """All-reduce typed ``buf`` among ``peers`` (group ranks, node order) over the network;
    then ``rest()``, if given: the rest of a call alone on its node (local work only), which
    the direct exchange may defer with its wait (net.py, ``wait_then``)."""
    net_call = ctx.net_call
    if len(peers) == 1:  # (only this rank: ``peers`` holds it)
        if rest is not None:
            rest()
        return
    algo = ctx.selection.select("all_reduce/network", buf.numel() * buf.element_size(),
                                len(peers), numel=buf.numel(),
                                native=(net_call.net.column is not None
                                        and net_mpi.serves(net_call.net, peers)))
    ctx.chose(algo)
    NETWORK[algo](ctx, buf, peers, spec, rest)


def _direct(ctx: Context, buf: torch.Tensor, peers: Sequence[int], spec: ReduceSpec,
            rest: Callable[[], None] | None) -> None:
    """Each rank sends its buffer to every other and reduces what came, in node order."""
    net_call = ctx.net_call
    me = net_call.topo.rank
    others = [p for p in peers if p != me]
    if rest is not None:
        net_call.deferrable()  # every message posted before the one wait
    got = {p: net_call.buffer(f"got{i}", buf.numel(), buf.dtype) for i, p in enumerate(others)}
    for p in others:
        net_call.recv(p, got[p])
    for p in others:
        net_call.send(p, buf)

    def reduce() -> None:
        views = [buf if p == me else got[p] for p in peers]
        if len(views) == 2:  # elementwise, so buf may be the output while being an input
            reduce_into(buf, views, spec, 2, ctx.scratch)
        else:
            acc = net_call.buffer("acc", buf.numel(), buf.dtype)
            reduce_into(acc, views, spec, len(peers), ctx.scratch)
            buf.copy_(acc)
        if rest is not None:
            rest()

    net_call.wait_then(reduce)


def _halves(ctx: Context, buf: torch.Tensor, peers: Sequence[int], spec: ReduceSpec) -> None:
    """All-reduce of a large ``buf`` between two ranks: each rank reduces one half and
    sends it back (a two-rank ring). The same bytes cross the link as in the direct
    exchange, but each rank adds half as much.

    The other half comes back into the memory its send read from, so that receive is
    posted only once the send has completed (been acknowledged): a resend can never
    read the answer."""
    net_call = ctx.net_call
    i = peers.index(net_call.topo.rank)
    peer = peers[1 - i]
    halves = partition(buf.numel(), 2, max(1, ALIGN_BYTES // buf.element_size()))
    (ms, mm), (ts, tm) = halves[i], halves[1 - i]
    got = net_call.buffer("half", mm, buf.dtype)
    arrived = net_call.recv(peer, got)
    sent = net_call.send(peer, buf[ts:ts + tm])
    net_call.check()  # (a small half travels inside the descriptor: check copies it)
    sent.wait(net_call.deadline)
    net_call.recv(peer, buf[ts:ts + tm])
    if arrived is not None:
        arrived.wait(net_call.deadline)
    ours = buf[ms:ms + mm]
    reduce_into(ours, [ours, got] if i == 0 else [got, ours], spec, 2, ctx.scratch)
    net_call.send(peer, ours)
    net_call.wait()


def _generator(algorithm: _Algorithm) -> _Exchange:
    """An algorithm of one file (a generator over the call's NetCall) as an exchange."""
    def run(ctx: Context, buf: torch.Tensor, peers: Sequence[int], spec: ReduceSpec) -> None:
        net_call = ctx.net_call
        net_call.run(algorithm(net_call, buf, peers, peers.index(net_call.topo.rank), spec))
    return run


def _mpi(ctx: Context, buf: torch.Tensor, peers: Sequence[int], spec: ReduceSpec) -> None:
    net_mpi.all_reduce(ctx.net_call, buf, peers, spec)


def _then_rest(exchange: _Exchange) -> _Network:
    """``exchange`` (which waits for what it posted), then the rest of the call, if any."""
    def run(ctx: Context, buf: torch.Tensor, peers: Sequence[int], spec: ReduceSpec,
            rest: Callable[[], None] | None) -> None:
        exchange(ctx, buf, peers, spec)
        if rest is not None:
            rest()
    return run


# the ``all_reduce/nodes`` table's algorithms (selection.py): name -> what runs it
LAYOUTS = {"hierarchical": _hierarchical, "leader": _leader}
# the ``all_reduce/network`` table's algorithms written as generators (net.py, ``run``)
GENERATORS: dict[str, _Algorithm] = {
    "ring": net_ring.all_reduce,
    "recursive_doubling": net_recursive_doubling.all_reduce,
    "rabenseifner": net_rabenseifner.all_reduce,
    "tree": net_tree.all_reduce,
}
# the ``all_reduce/network`` table's algorithms: name -> what runs the exchange and then
# the rest of a call alone on its node (the direct exchange may defer it with its wait)
NETWORK: dict[str, _Network] = {
    "direct": _direct,
    "mpi": _then_rest(_mpi),
    "halves": _then_rest(_halves),
    **{name: _then_rest(_generator(g)) for name, g in GENERATORS.items()},
}
