"""Collectives of a group that spans several nodes: shared memory inside, network between.

The group's ranks are split into nodes (``Topology``). Every algorithm here is a schedule
of *local* phases, run by the single-node algorithms over the node's step channel (the
``Context`` passed in, whose ranks are the node's local indices), and *network* phases over
the rdm transport (``ctx.net``, a ``Net``, addressed by group rank):

all_reduce, nodes of equal size (hierarchical)
    local reduce-scatter (local rank j owns slice j) -> each local rank all-reduces its
    slice with the ranks of the same local index on the other nodes -> local all-gather.
    Every local rank drives its own share of the network traffic, in parallel.
    Among 3+ nodes, slices of RING_BYTES and more go around a ring of those ranks instead
    of straight to every other node (see bench/costmodel.py). Between two nodes, slices of
    HALVES_BYTES and more are exchanged in halves: each rank reduces one half and sends it
    back (half the additions of the full exchange, the same bytes on the link).
all_reduce, uneven nodes (leader)
    local all-reduce -> node leaders (local index 0) exchange and reduce -> local broadcast.
broadcast
    the root sends to every other node's leader -> local broadcast from root / leader.
reduce
    local reduce to the node's root (the root itself, or the leader) -> node roots send to
    the root, which reduces in node order.
all_gather, nodes of equal size (columns)
    each rank swaps its block with the ranks of its column on the other nodes -> per
    node, a local all-gather of the blocks the node's ranks hold. Uneven nodes: local
    phase -> leaders exchange whole node blocks -> local broadcast of what came in.
reduce_scatter, nodes of equal size (columns)
    local rank j of every node owns the blocks of the ranks (b, j): per node b, a local
    reduce-scatter of the contributions to node b's blocks -> each rank sends node b's
    partial of block (b, j) to rank (b, j) and reduces the partials of its own block, in
    node order. Each block's share crosses the network once per other node (gloo runs
    a whole all-reduce). Uneven nodes: local reduce to the leader -> leaders exchange
    each node's share -> local broadcast.
gather, scatter, all_to_all
    direct: ranks on other nodes send to / receive from each other over the network, ranks
    of one node use the local algorithm among themselves.
barrier
    local step -> leaders exchange empty messages -> local step.

Network phases between two nodes exchange full buffers and every receiver reduces in node
order, so all ranks compute bit-identical results. AVG runs as SUM and divides by the group
size once at the end; PREMUL_SUM scales in the first (local) phase and sums afterwards.
The first message between two ranks within one collective carries the sender's call
descriptor (see ``Net``), so ranks on different nodes that call different collectives fail
with ``CollectiveMismatch`` naming both calls; the failing rank's abort notice tells the rest.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import torch

from . import allgather, allreduce, broadcast as bcast, reduce_scatter as rs, rooted
from . import alltoall
from .context import ALIGN_BYTES, Context, flat, partition
from .descriptor import NWORDS, Call, CollectiveMismatch
from ..transport.errors import MessageSizeMismatch
from .reduce_ops import AVG, PREMUL_SUM, SUM, ReduceSpec, _finish_avg, reduce_into

COLLECTIVE_TAG = 1
PIGGYBACK_BYTES = 64 << 10  # data up to this size travels in one message with the descriptor
RING_BYTES = 4 << 20  # network all-reduce among 3+ peers: a ring from here, else direct
HALVES_BYTES = 2 << 20  # network all-reduce between two peers: halves from here, else direct
_DESC = struct.Struct(f"!{NWORDS + 1}q")
_SUM = ReduceSpec(SUM)


@dataclass(frozen=True)
class Topology:
    """How a group's ranks sit on nodes.

    Attributes
    ----------
    rank : int
        This process's group rank.
    nodes : tuple of tuple of int
        Group ranks of each node, nodes ordered by their lowest rank.
    """

    rank: int
    nodes: tuple

    @classmethod
    def from_names(cls, rank: int, names: list) -> "Topology":
        order: dict = {}
        for k, name in enumerate(names):
            order.setdefault(name, []).append(k)
        return cls(rank, tuple(tuple(v) for v in order.values()))

    @property
    def size(self) -> int:
        return sum(len(n) for n in self.nodes)

    def node_of(self, rank: int) -> int:
        for i, ranks in enumerate(self.nodes):
            if rank in ranks:
                return i
        raise ValueError(f"rank {rank} is in no node")

    @property
    def my_node(self) -> int:
        return self.node_of(self.rank)

    @property
    def local(self) -> tuple:
        """Group ranks of this node, in local-index order."""
        return self.nodes[self.my_node]

    @property
    def even(self) -> bool:
        return len({len(n) for n in self.nodes}) == 1

    def leader(self, node: int) -> int:
        return self.nodes[node][0]

    def describe(self) -> str:
        return " | ".join(f"node {i}: ranks {list(r)}" for i, r in enumerate(self.nodes))


class Net:
    """The network half of one collective call: descriptor-checked sends and receives.

    The first message of a call from one rank to another carries the sender's call
    descriptor: in front of the data in the same message when the data is small (one
    message, one acknowledgement: the latency path), as a message of its own before large
    data (which then travels without a copy). Both sides make the same choice from the
    message size, which they agree on when they made the same call; when they did not,
    the receiver still reads the descriptor (sizes differ, so the transport hands over
    the message it refused) and raises ``CollectiveMismatch`` naming both calls.
    """

    def __init__(self, transport, topo: Topology, call: Call, seq: int, deadline: float,
                 algo: str = "auto", scratch: dict | None = None):
        self.transport, self.topo, self.call, self.seq = transport, topo, call, seq
        self._scratch = {} if scratch is None else scratch  # the group's, across calls
        self.algo = algo
        self.deadline = deadline
        self._told: set = set()  # peers that got our descriptor in this call
        self._heard: dict = {}  # peer -> (descriptor box, request, data dest or None)
        self._pending: list = []

    def _words(self) -> bytes:
        return _DESC.pack(*self.call.words(self.seq), 0)

    def send(self, peer: int, buf):
        """Post a send of ``buf`` to ``peer``; returns its request (done: ``buf`` is free)."""
        data = as_bytes(buf)
        if peer not in self._told:
            self._told.add(peer)
            if _nbytes(data) <= PIGGYBACK_BYTES:
                req = self.transport.isend(
                    peer, COLLECTIVE_TAG, self._words() + bytes(memoryview(data).cast("B")))
                self._pending.append(req)
                return req
            self._pending.append(self.transport.isend(peer, COLLECTIVE_TAG, self._words()))
        req = self.transport.isend(peer, COLLECTIVE_TAG, data)
        self._pending.append(req)
        return req

    def recv(self, peer: int, buf):
        """Post a receive from ``peer`` into ``buf``. Returns its request, or None for the
        call's first message from ``peer`` when it is small (it travels with the
        descriptor and is copied into ``buf`` by ``check``)."""
        data = as_bytes(buf)
        if peer not in self._heard:
            n = _nbytes(data)
            if n <= PIGGYBACK_BYTES:
                box = bytearray(_DESC.size + n)
                self._heard[peer] = (box, self.transport.irecv(peer, COLLECTIVE_TAG, box), data)
                return None
            box = bytearray(_DESC.size)
            self._heard[peer] = (box, self.transport.irecv(peer, COLLECTIVE_TAG, box), None)
        req = self.transport.irecv(peer, COLLECTIVE_TAG, data)
        self._pending.append(req)
        return req

    def buffer(self, key: str, numel: int, dtype) -> torch.Tensor:
        """A scratch tensor kept across calls (allocating fresh pages every call costs more
        than the network: the kernel zero-fills each one)."""
        pool = self._scratch
        nbytes = numel * dtype.itemsize
        entry = pool.get(key)
        if entry is None or entry[0].numel() < nbytes:
            entry = pool[key] = (torch.empty(max(nbytes, 64), dtype=torch.uint8), {})
        base, views = entry  # typed views of it, kept: torch view ops cost µs each
        view = views.get((numel, dtype))
        if view is None:
            if len(views) >= 64:
                views.clear()
            view = views[(numel, dtype)] = base[:nbytes].view(dtype)
        return view

    def wait(self) -> None:
        """Wait for everything posted; check the peers' descriptors first."""
        self.check()
        pending, self._pending = self._pending, []
        for req in pending:
            req.wait(self.deadline)

    def check(self) -> None:
        """Wait for the descriptors of the peers heard from so far and check them: a peer
        that made another call raises ``CollectiveMismatch`` here, naming both calls."""
        for peer, (box, req, dest) in sorted(self._heard.items()):
            if box is None:
                continue
            try:
                req.wait(self.deadline)
                words = bytes(box[:_DESC.size])
            except MessageSizeMismatch as e:  # a message of another size: another call?
                words = bytes(e.message)[:_DESC.size]
                if len(words) < _DESC.size:
                    raise
                self._check(peer, words)
                raise
            self._check(peer, words)
            if dest is not None:
                memoryview(dest).cast("B")[:] = memoryview(box)[_DESC.size:]
            self._heard[peer] = (None, req, None)

    def _check(self, peer: int, words: bytes) -> None:
        theirs = _DESC.unpack(words)[:NWORDS]
        if theirs != self.call.words(self.seq):
            their_seq, their_call = Call.from_words(theirs)
            raise CollectiveMismatch(
                f"collective mismatch: rank {self.topo.rank} called #{self.seq} "
                f"{self.call.describe()}; rank {peer} called #{their_seq} "
                f"{their_call.describe()}", self.call, {peer: their_call})


def _nbytes(data) -> int:
    return data.nbytes if hasattr(data, "nbytes") else len(data)


_BYTE_ARRAYS: dict = {}


def as_bytes(t):
    """A writable byte view of a contiguous tensor's memory, which the view keeps alive (or
    a bytes-like object as it is). Made with ctypes from the data pointer: torch's own view
    ops cost several µs each on small machines, and this is on every message's path."""
    if not isinstance(t, torch.Tensor):
        return t
    if not t.is_contiguous():
        raise ValueError("as_bytes needs a contiguous tensor")
    nbytes = t.numel() * t.element_size()
    if not nbytes:
        return memoryview(bytearray(0))
    kind = _BYTE_ARRAYS.get(nbytes)
    if kind is None:
        if len(_BYTE_ARRAYS) >= 256:
            _BYTE_ARRAYS.clear()
        kind = _BYTE_ARRAYS[nbytes] = ctypes.c_char * nbytes
    arr = kind.from_address(t.data_ptr())
    arr.tensor = t
    return memoryview(arr).cast("B")


def _split_spec(spec: ReduceSpec) -> tuple:
    """(spec of the first, local phase; spec of the later phases)."""
    if spec.kind == AVG:
        return _SUM, _SUM
    if spec.kind == PREMUL_SUM:
        return spec, _SUM
    return spec, spec


def _finish(out, spec: ReduceSpec, size: int) -> None:
    if spec.kind == AVG:
        _finish_avg(out, size)


def _exchange_reduce(ctx: Context, buf, peers: list, spec: ReduceSpec) -> None:
    """All-reduce typed ``buf`` among ``peers`` (group ranks, node order) over the network."""
    net, me = ctx.net, ctx.net.topo.rank
    others = [p for p in peers if p != me]
    if not others:
        return
    nbytes = buf.numel() * buf.element_size()
    if len(peers) >= 3 and nbytes >= RING_BYTES and buf.numel() >= len(peers):
        _ring_all_reduce(ctx, buf, peers, spec)
        return
    if len(peers) == 2 and nbytes >= HALVES_BYTES:
        _halves(ctx, buf, peers, spec)
        return
    got = {p: net.buffer(f"got{i}", buf.numel(), buf.dtype) for i, p in enumerate(others)}
    for p in others:
        net.recv(p, got[p])
    for p in others:
        net.send(p, buf)
    net.wait()
    views = [buf if p == me else got[p] for p in peers]
    if len(views) == 2:  # elementwise, so buf may be the output while being an input
        reduce_into(buf, views, spec, 2, ctx.scratch)
        return
    acc = net.buffer("acc", buf.numel(), buf.dtype)
    reduce_into(acc, views, spec, len(peers), ctx.scratch)
    buf.copy_(acc)


def _halves(ctx: Context, buf, peers: list, spec: ReduceSpec) -> None:
    """All-reduce of a large ``buf`` between two ranks: each rank reduces one half and
    sends it back (a two-rank ring). The same bytes cross the link as in the direct
    exchange, but each rank adds half as much.

    The other half comes back into the memory its send read from, so that receive is
    posted only once the send has completed (been acknowledged): a resend can never
    read the answer."""
    net, me = ctx.net, ctx.net.topo.rank
    i = peers.index(me)
    peer = peers[1 - i]
    halves = partition(buf.numel(), 2, max(1, ALIGN_BYTES // buf.element_size()))
    (ms, mm), (ts, tm) = halves[i], halves[1 - i]
    got = net.buffer("half", mm, buf.dtype)
    arrived = net.recv(peer, got)
    sent = net.send(peer, buf[ts:ts + tm])
    net.check()  # (halves are large: neither travels inside the descriptor)
    sent.wait(net.deadline)
    net.recv(peer, buf[ts:ts + tm])
    arrived.wait(net.deadline)
    ours = buf[ms:ms + mm]
    reduce_into(ours, [ours, got] if i == 0 else [got, ours], spec, 2, ctx.scratch)
    net.send(peer, ours)
    net.wait()


def _ring_all_reduce(ctx: Context, buf, peers: list, spec: ReduceSpec) -> None:
    """Ring reduce-scatter then ring all-gather among ``peers``: each rank's link carries
    2 (P-1)/P of the buffer whatever P is, where the direct exchange carries (P-1) times
    it (the cost model, bench/costmodel.py, puts the crossover near 4-8 MiB at 4+ nodes).
    Each chunk is reduced along the ring and then copied everywhere, so every rank gets
    the same bits."""
    net, me = ctx.net, ctx.net.topo.rank
    n, i = len(peers), peers.index(me)
    nxt, prv = peers[(i + 1) % n], peers[(i - 1) % n]
    chunks = partition(buf.numel(), n, max(1, ALIGN_BYTES // buf.element_size()))
    tmp = net.buffer("ring", max(m for _, m in chunks), buf.dtype)
    for k in range(n - 1):  # after step k, chunk (i-k-1) holds k+2 ranks' contributions
        (so, sm), (ro, rm) = chunks[(i - k) % n], chunks[(i - k - 1) % n]
        net.recv(prv, tmp[:rm])
        net.send(nxt, buf[so:so + sm])
        net.wait()
        reduce_into(buf[ro:ro + rm], [tmp[:rm], buf[ro:ro + rm]], spec, 2, ctx.scratch)
    for k in range(n - 1):  # chunk (i+1) is complete here: pass the results around
        (so, sm), (ro, rm) = chunks[(i + 1 - k) % n], chunks[(i - k) % n]
        net.recv(prv, buf[ro:ro + rm])
        net.send(nxt, buf[so:so + sm])
        net.wait()


# ---------------------------------------------------------------------- all-reduce

def all_reduce(ctx: Context, out, inp, spec) -> None:
    """Reduce flat typed ``inp`` over the whole group into ``out`` (may alias)."""
    topo = ctx.net.topo
    first, later = _split_spec(spec)
    n = inp.numel()
    out, inp = flat(out), flat(inp)
    if len(topo.local) == 1:  # alone on this node: straight to the network
        if first.kind == PREMUL_SUM:
            torch.mul(inp, first.factor, out=out)
        elif out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        _exchange_reduce(ctx, out, [node[0] for node in topo.nodes], later)
        ctx.finish()
    elif topo.even and ctx.net.algo != "leader" and n >= ctx.size * 64:
        _hierarchical(ctx, out, inp, first, later)
    else:
        allreduce.all_reduce(ctx, out, inp, first)
        if ctx.rank == 0:
            _exchange_reduce(ctx, out, [topo.leader(b) for b in range(len(topo.nodes))], later)
        bcast.broadcast(ctx, out.view(torch.uint8), 0)
    _finish(out, spec, topo.size)


def _hierarchical(ctx, out, inp, first, later) -> None:
    topo = ctx.net.topo
    align = max(1, ALIGN_BYTES // inp.element_size())
    slices = partition(inp.numel(), ctx.size, align)
    rs.reduce_scatter(ctx, out[slices[ctx.rank][0]:sum(slices[ctx.rank])],
                      [inp[s:s + m] for s, m in slices], first)
    s, m = slices[ctx.rank]
    column = [node[ctx.rank] for node in topo.nodes]
    if m:
        _exchange_reduce(ctx, out[s:s + m], column, later)
    else:
        ctx.net.wait()
    b = out.view(torch.uint8)
    es = out.element_size()
    mine = ctx.net.buffer("mine", m * es, torch.uint8)
    mine.copy_(b[s * es:(s + m) * es])
    allgather.all_gather(ctx, [b[s * es:(s + m) * es] for s, m in slices], mine)


# ---------------------------------------------------------------------- broadcast

def _node_root(topo: Topology, root: int) -> int:
    """Local index of the rank that speaks for this node in a rooted collective."""
    if topo.node_of(root) == topo.my_node:
        return topo.local.index(root)
    return 0


def broadcast(ctx: Context, buf, root: int) -> None:
    """Make uint8 ``buf`` equal to the root's everywhere."""
    topo, net = ctx.net.topo, ctx.net
    root_node = topo.node_of(root)
    if topo.rank == root:
        for b in range(len(topo.nodes)):
            if b != root_node:
                net.send(topo.leader(b), buf)
    elif topo.my_node != root_node and ctx.rank == 0:
        net.recv(root, buf)
        net.wait()
    bcast.broadcast(ctx, buf, _node_root(topo, root))
    net.wait()


def reduce(ctx: Context, out, inp, spec, root: int) -> None:
    """Reduce flat typed ``inp`` into ``out`` on ``root`` only (others' ``out`` untouched)."""
    topo, net = ctx.net.topo, ctx.net
    first, later = _split_spec(spec)
    here = _node_root(topo, root)
    part = torch.empty_like(inp) if ctx.rank == here else inp
    rooted.reduce(ctx, part, inp, first, here)
    root_node = topo.node_of(root)
    if ctx.rank == here and topo.rank != root:
        net.send(root, part)
        net.wait()
    elif topo.rank == root:
        senders = {b: topo.leader(b) for b in range(len(topo.nodes)) if b != root_node}
        got = {b: torch.empty_like(inp) for b in senders}
        for b, p in senders.items():
            net.recv(p, got[b])
        net.wait()
        views = [part if b == root_node else got[b] for b in range(len(topo.nodes))]
        reduce_into(out, views, later, len(views), ctx.scratch)
        _finish(out, spec, topo.size)


# ---------------------------------------------------------------------- gather family

def _pack(blocks) -> torch.Tensor:
    return torch.cat([b.view(-1) for b in blocks]) if blocks else torch.empty(0, dtype=torch.uint8)


def _unpack(flat, blocks) -> None:
    o = 0
    for b in blocks:
        b.copy_(flat[o:o + b.numel()])
        o += b.numel()


def all_gather(ctx: Context, outs: list, inp) -> None:
    """Every rank gets every rank's uint8 ``inp`` in ``outs[rank]``."""
    topo, net = ctx.net.topo, ctx.net
    if topo.even and net.algo != "leader":
        _columns_all_gather(ctx, outs, inp)
        return
    allgather.all_gather(ctx, [outs[g] for g in topo.local], inp)
    remote = [g for b, node in enumerate(topo.nodes) if b != topo.my_node for g in node]
    if ctx.rank == 0:
        for b in range(len(topo.nodes)):
            if b != topo.my_node:
                for g in topo.local:
                    net.send(topo.leader(b), outs[g])
                for g in topo.nodes[b]:
                    net.recv(topo.leader(b), outs[g])
        net.wait()
        packed = _pack([outs[g] for g in remote])
    else:
        packed = torch.empty(sum(outs[g].numel() for g in remote), dtype=torch.uint8)
    bcast.broadcast(ctx, packed, 0)
    if ctx.rank != 0:
        _unpack(packed, [outs[g] for g in remote])


def _columns_all_gather(ctx: Context, outs: list, inp) -> None:
    """Nodes of equal size: each node first all-gathers its own ranks' blocks; then each
    rank swaps its block with the ranks of its column (the same local index) on the other
    nodes, and each node all-gathers, node by node, the blocks its ranks received. Every
    block crosses the network once per other node, each local rank driving its own share,
    and ``inp`` is read only in the first phase (it may be one of the outputs)."""
    topo, net = ctx.net.topo, ctx.net
    j, mine = ctx.rank, topo.my_node
    me = topo.rank
    if len(topo.local) > 1:
        allgather.all_gather(ctx, [outs[g] for g in topo.local], inp)
    elif outs[me].data_ptr() != inp.data_ptr():
        outs[me].copy_(inp)
    column = [node[j] for node in topo.nodes]
    for b, g in enumerate(column):
        if b != mine:
            net.recv(g, outs[g])
    for b, g in enumerate(column):
        if b != mine:
            net.send(g, outs[me])
    net.wait()
    if len(topo.local) == 1:
        ctx.finish()
        return
    for b, node in enumerate(topo.nodes):
        if b != mine:
            allgather.all_gather(ctx, [outs[g] for g in node], outs[node[j]])


def reduce_scatter(ctx: Context, out, inputs: list, spec) -> None:
    """``out`` = reduction over all ranks of their ``inputs[rank]`` (flat typed)."""
    topo, net = ctx.net.topo, ctx.net
    if topo.even and net.algo != "leader":
        _columns_reduce_scatter(ctx, out, inputs, spec)
        return
    first, later = _split_spec(spec)
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
                net.send(topo.leader(b), part[starts[b]:starts[b] + n_b])
                got[b] = torch.empty(mine_n, dtype=out.dtype)
                net.recv(topo.leader(b), got[b])
        net.wait()
        result = torch.empty(mine_n, dtype=out.dtype)
        views = [mine if b == topo.my_node else got[b] for b in range(len(topo.nodes))]
        reduce_into(result, views, later, len(views), ctx.scratch)
    else:
        result = torch.empty(mine_n, dtype=out.dtype)
    bcast.broadcast(ctx, result.view(torch.uint8), 0)
    o = sum(sizes[g] for g in topo.local[:ctx.rank])
    out.copy_(result[o:o + out.numel()])
    _finish(out, spec, topo.size)


def _columns_reduce_scatter(ctx: Context, out, inputs: list, spec) -> None:
    """Nodes of equal size: local rank ``j`` of every node forms column ``j``, which owns
    the blocks of the ranks ``(b, j)`` on every node ``b``. For each node ``b`` the node
    reduce-scatters its ranks' contributions to node ``b``'s blocks (local rank ``j`` gets
    the node's partial sum of block ``(b, j)``); then each rank sends those partials to
    the ranks of its column on the other nodes and reduces the partials of its own block
    they send back, in node order. Only each block's share crosses the network, once per
    other node, and every local rank drives its own part of it."""
    topo, net = ctx.net.topo, ctx.net
    first, later = _split_spec(spec)
    j, mine = ctx.rank, topo.my_node
    # ``out`` is written only once every input has been read and sent: it may alias one of
    # the inputs (an in-place reduce_scatter).
    partial = {}
    for b, node in enumerate(topo.nodes):
        blocks = [inputs[g] for g in node]
        if len(node) > 1:
            dest = net.buffer(f"rs{b}", blocks[j].numel(), out.dtype)
            rs.reduce_scatter(ctx, dest, blocks, first)
        elif first.kind == PREMUL_SUM:
            dest = net.buffer(f"rs{b}", blocks[0].numel(), out.dtype)
            torch.mul(blocks[0], first.factor, out=dest)
        else:
            dest = blocks[0]  # alone on the node: the input itself is the partial
        partial[b] = dest
    if len(topo.local) == 1:
        ctx.finish()
    column = [node[j] for node in topo.nodes]
    got = {}
    for b in range(len(topo.nodes)):
        if b != mine:
            got[b] = net.buffer(f"rsgot{b}", out.numel(), out.dtype)
            net.recv(column[b], got[b])
    for b in range(len(topo.nodes)):
        if b != mine:
            net.send(column[b], partial[b])
    net.wait()
    views = [partial[mine] if b == mine else got[b] for b in range(len(topo.nodes))]
    if len(views) == 2:  # elementwise, so out may alias views[0] (an in-place call)
        reduce_into(out, views, later, 2, ctx.scratch)
    else:
        acc = net.buffer("rsacc", out.numel(), out.dtype)
        reduce_into(acc, views, later, len(views), ctx.scratch)
        out.copy_(acc)
    _finish(out, spec, topo.size)


def gather(ctx: Context, outs: list, inp, root: int) -> None:
    """The root gets every rank's uint8 ``inp`` in ``outs[rank]``."""
    topo, net = ctx.net.topo, ctx.net
    if topo.node_of(root) != topo.my_node:
        net.send(root, inp)
        ctx.finish()
        net.wait()
        return
    if topo.rank == root:
        for g in range(topo.size):
            if topo.node_of(g) != topo.my_node:
                net.recv(g, outs[g])
    rooted.gather(ctx, [outs[g] for g in topo.local] if topo.rank == root else [], inp,
                  topo.local.index(root))
    net.wait()


def scatter(ctx: Context, out, ins: list, root: int) -> None:
    """Rank k gets the root's uint8 ``ins[k]`` in ``out``."""
    topo, net = ctx.net.topo, ctx.net
    if topo.node_of(root) != topo.my_node:
        net.recv(root, out)
        ctx.finish()
        net.wait()
        return
    if topo.rank == root:
        for g in range(topo.size):
            if topo.node_of(g) != topo.my_node:
                net.send(g, ins[g])
    rooted.scatter(ctx, out, [ins[g] for g in topo.local] if topo.rank == root else [],
                   topo.local.index(root))
    net.wait()


def all_to_all(ctx: Context, outs: list, ins: list, element_size: int) -> None:
    """Send uint8 ``ins[k]`` to rank k and receive rank k's block into ``outs[k]``."""
    topo, net = ctx.net.topo, ctx.net
    remote = [g for g in range(topo.size) if topo.node_of(g) != topo.my_node]
    for g in remote:
        net.recv(g, outs[g])
    for g in remote:
        net.send(g, ins[g])
    alltoall.all_to_all(ctx, [outs[g] for g in topo.local], [ins[g] for g in topo.local],
                        element_size)
    net.wait()


def barrier(ctx: Context) -> None:
    """Nobody leaves before everybody arrived."""
    topo, net = ctx.net.topo, ctx.net
    ctx.finish()
    if ctx.rank == 0:
        empty = bytearray(0)
        for b in range(len(topo.nodes)):
            if b != topo.my_node:
                net.recv(topo.leader(b), empty)
                net.send(topo.leader(b), b"")
        net.wait()
    ctx.step()
