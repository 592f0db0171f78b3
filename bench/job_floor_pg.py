"""The floor of a Python backend for the main job: every group's bytes moved, nothing else.

How it works
------------
``floor`` (``launch/train.py --backend floor``, a row of ``bench.mainjob``) is a
``torch.distributed`` backend for benchmarks only. It runs the collectives the main job
calls (FSDP2 and tensor parallel on a 2-D mesh) the plainest way a Python process group can
move their bytes, so its row says how much of the distance between ``null`` (nothing moved)
and neuron any Python backend pays on the machine, and how much is neuron's own.

Each group picks its path when it is made: the ranks write their node's name
(``NEURON_DIST_NODE_NAME``, else the host's identity, as neuron
itself tells nodes apart) into the group's store, and

* a group whose ranks are all on one node is a shared-memory floor group
  (``shm_floor_pg.py``: slots, or one cross-memory read per peer beyond a slot);
* any other group is a TCP floor group: one connection per pair of ranks, made as
  ``floor_pg.py`` makes them (on ``NEURON_DIST_SOCKET_IFNAME``), then switched to
  non-blocking. A call lists what goes to and comes from each peer and moves it all from
  the caller's thread: ``send``/``recv_into`` on every socket in turn, sleeping in
  ``select`` whenever none of them moved a byte (no spinning: with more ranks than cores
  a spinning waiter takes the core from the rank it waits for). The bytes go from the
  tensor to the socket and from the socket to the output (or, where they must be added,
  to a buffer kept across calls) once each. Sums are made in rank order, so every rank
  gets the same bits.

Two halves say where neuron's own cost lies: ``floor_inside`` is the floor for the groups
inside a node and neuron for the others, ``floor_between`` neuron inside a node and the floor
between nodes (rows of ``bench.mainjob`` too). Each one's distance to neuron is what
neuron's groups of that kind cost the job, measured in the same run.

Collectives: all_reduce (SUM), all_gather_into_tensor, reduce_scatter_tensor (SUM), their
coalesced forms, all_gather of tensor lists, broadcast, scatter, barrier, send/recv. Every
call completes before it returns (a completed Work: no overlap of communication and
compute, which a saturated machine has no spare core for anyway). No descriptors, tags,
checks beyond refusing what it cannot do, timeouts, or failure detection: not for
training anything that matters.
"""

from __future__ import annotations

import select

import torch
import torch.distributed as dist

from neuron_dist import backend as neuron_backend
from neuron_dist.config import Settings
from neuron_dist.topology import node_identity
from . import floor_pg, shm_floor_pg
from .null_pg import Named
from .shm_floor_pg import ShmFloorProcessGroup

BACKEND_NAME = "floor"
INSIDE = "floor_inside"  # the floor inside a node, neuron between nodes
BETWEEN = "floor_between"  # neuron inside a node, the floor between nodes
WAIT_SECONDS = 120.0  # a peer that moves nothing for this long fails the call


def _flat(t: torch.Tensor) -> torch.Tensor:
    return shm_floor_pg._flat(t, BACKEND_NAME)


def _bytes(t: torch.Tensor) -> memoryview:
    return floor_pg._bytes_of(_flat(t))


def _sum_only(opts, what: str) -> None:
    shm_floor_pg.sum_only(opts, what, BACKEND_NAME)


class _Coalesced:
    """The coalesced forms and tensor lists as loops over the single-tensor calls."""

    def allreduce_coalesced(self, tensors, opts=None):
        for t in tensors:
            self.allreduce([t], opts)
        return self._done

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for out, inp in zip(outputs, inputs):
            self.all_gather_single(out, inp, opts)
        return self._done

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for out, inp in zip(outputs, inputs):
            self.reduce_scatter_single(out, inp, opts)
        return self._done

    def allgather(self, output_tensors, input_tensors, opts=None):
        inp, outs = input_tensors[0], output_tensors[0]
        whole = torch.empty(len(outs) * inp.numel(), dtype=inp.dtype)
        self.all_gather_single(whole, inp)
        for k, out in enumerate(outs):
            out.copy_(whole[k * inp.numel():(k + 1) * inp.numel()].view_as(out))
        return self._done


class ShmJobFloor(_Coalesced, ShmFloorProcessGroup):
    """A group inside one node: shm_floor_pg.py, plus what the main job calls besides."""

    BACKEND = BACKEND_NAME

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        out = output_tensors[0]
        if self._rank == root:
            for k, t in enumerate(input_tensors[0]):
                if k == root:
                    out.copy_(t)
                else:
                    self.send([t.contiguous()], k)
        else:
            self.recv([out], root)
        return self._done


class TcpJobFloor(_Coalesced, Named, floor_pg.FloorProcessGroup):
    """A group across nodes: one non-blocking TCP connection per pair, no protocol."""

    BACKEND = BACKEND_NAME

    def __init__(self, store, rank: int, size: int):
        super().__init__(store, rank, size, streams=1)
        for socks in self._socks.values():
            socks[0].setblocking(False)
        self._sock = {peer: socks[0] for peer, socks in self._socks.items()}
        self._peers = sorted(self._sock)
        self._kept: dict = {}

    def _move(self, sends, recvs) -> None:
        """Write each ``(peer, view)`` of ``sends`` and fill each of ``recvs``, all at once."""
        out = [[self._sock[p], v] for p, v in sends if v.nbytes]
        into = [[self._sock[p], v] for p, v in recvs if v.nbytes]
        while out or into:
            moved = False
            for item in out:
                try:
                    n = item[0].send(item[1])
                except BlockingIOError:
                    continue
                item[1], moved = item[1][n:], True
            for item in into:
                try:
                    n = item[0].recv_into(item[1])
                except BlockingIOError:
                    continue
                if not n:
                    raise ConnectionError(f"{BACKEND_NAME}: a peer closed its connection")
                item[1], moved = item[1][n:], True
            out = [item for item in out if item[1].nbytes]
            into = [item for item in into if item[1].nbytes]
            if not moved and (out or into):
                ready = select.select([s for s, _ in into], [s for s, _ in out], [],
                                      WAIT_SECONDS)
                if not any(ready):
                    raise TimeoutError(f"{BACKEND_NAME}: no byte moved in {WAIT_SECONDS:.0f} s")

    def _from_peers(self, like: torch.Tensor) -> dict:
        """A buffer per peer shaped like ``like``, kept across calls (one per shape: fresh
        pages cost more than the network here, the kernel zero-fills each one)."""
        key = (like.dtype, like.numel())
        bufs = self._kept.get(key)
        if bufs is None:
            bufs = self._kept[key] = {p: torch.empty_like(like) for p in self._peers}
        return bufs

    def _add_in_rank_order(self, out: torch.Tensor, mine: torch.Tensor, theirs: dict) -> None:
        parts = [mine if k == self._rank else theirs[k] for k in range(self._size)]
        if len(parts) == 1:
            out.copy_(parts[0])
            return
        torch.add(parts[0], parts[1], out=out)
        for p in parts[2:]:
            out.add_(p)

    def send(self, tensors, dst: int, tag: int = 0):
        self._move([(dst, _bytes(tensors[0]))], [])
        return self._done

    def recv(self, tensors, src: int, tag: int = 0):
        self._move([], [(src, _bytes(tensors[0]))])
        return self._done

    def allreduce(self, tensors, opts=None):
        _sum_only(opts, "all_reduce")
        t = _flat(tensors[0])
        theirs = self._from_peers(t)
        self._move([(p, _bytes(t)) for p in self._peers],
                   [(p, _bytes(theirs[p])) for p in self._peers])
        self._add_in_rank_order(t, t.clone() if self._size > 2 else t, theirs)
        return self._done

    def all_gather_single(self, output, input, opts=None):
        inp, out = _flat(input), _flat(output)
        n = inp.numel()
        self._move([(p, _bytes(inp)) for p in self._peers],
                   [(p, _bytes(out[p * n:(p + 1) * n])) for p in self._peers])
        out[self._rank * n:(self._rank + 1) * n].copy_(inp)
        return self._done

    def reduce_scatter_single(self, output, input, opts=None):
        _sum_only(opts, "reduce_scatter")
        inp, out = _flat(input), _flat(output)
        n, r = out.numel(), self._rank
        theirs = self._from_peers(out)
        self._move([(p, _bytes(inp[p * n:(p + 1) * n])) for p in self._peers],
                   [(p, _bytes(theirs[p])) for p in self._peers])
        self._add_in_rank_order(out, inp[r * n:(r + 1) * n], theirs)
        return self._done

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        t = _bytes(tensors[0])
        if self._rank == root:
            self._move([(p, t) for p in self._peers], [])
        else:
            self._move([], [(root, t)])
        return self._done

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        out = output_tensors[0]
        if self._rank == root:
            ins = [t.contiguous() for t in input_tensors[0]]
            self._move([(p, _bytes(ins[p])) for p in self._peers], [])
            out.copy_(ins[root])
        else:
            self._move([], [(root, _bytes(out))])
        return self._done

    def barrier(self, opts=None):
        self.allreduce([torch.zeros(1, dtype=torch.uint8)])
        return self._done


def _node_name() -> str:
    """The node this process is on, as neuron tells nodes apart (topology.py)."""
    return node_identity(Settings.from_env())


def _creator(floor_inside: bool, floor_between: bool):
    """The creator of a backend that makes the floor's group, or else neuron's, for groups
    inside one node (``floor_inside``) and for the others (``floor_between``)."""

    def create(dist_opts, pg_options=None):
        store, rank, size = dist_opts.store, dist_opts.group_rank, dist_opts.group_size
        store.set(f"job_floor/node/{rank}", _node_name())
        nodes = {store.get(f"job_floor/node/{k}").decode() for k in range(size)}
        if len(nodes) == 1 and size > 1:
            return ShmJobFloor(store, rank, size) if floor_inside else neuron_backend._create(
                dist_opts, pg_options)
        return TcpJobFloor(store, rank, size) if floor_between else neuron_backend._create(
            dist_opts, pg_options)

    return create


_BACKENDS = {BACKEND_NAME: (True, True), INSIDE: (True, False), BETWEEN: (False, True)}


def register() -> None:
    """Register ``floor``, ``floor_inside`` and ``floor_between`` with torch.distributed
    (idempotent)."""
    for name, (inside, between) in _BACKENDS.items():
        if name not in dist.Backend.backend_list:
            dist.Backend.register_backend(name, _creator(inside, between), extended_api=True,
                                          devices=["cpu"])
