"""The network phase as MPI's own collectives (jobs under mpiexec, ``NEURON_DIST_TRANSPORT=mpi``).

How it works
------------
With the MPI transport every rank also holds a communicator of its *column*: the ranks of
its local index on every node, in node order (``Topology.column``; for one rank per node,
every rank). The network phases of all_reduce, all_gather, reduce_scatter, broadcast and
barrier run among exactly such a column, so there they can be MPI's nonblocking
collectives (``MpiTransport.iallgather`` ...) and a tuned MPI (its fabric providers, its
own algorithms) carries them. The ``*/network`` tables pick ``mpi`` whenever the phase's
ranks are the transport's column (``serves``); ``NEURON_DIST_ALGO`` can still force
neuron's own algorithms over MPI's point-to-point messages.

* **The call is checked first.** MPI requires every member to start the same collectives
  in the same order with matching sizes, and gives no error otherwise. So every call
  starts with one ``MPI_Iallgather`` of a fixed ``SLOT`` bytes per member, the same size
  whatever the call: this rank's call descriptor (net.py) followed by up to ``SLOT_DATA``
  bytes of data. Each member compares every descriptor with its own and raises
  ``CollectiveMismatch`` naming the other call before any other collective is started.
* **Small data rides in the slot**, one collective per call: an all_reduce reduces the
  members' slots locally in column order (the same operands in the same order on every
  rank, so the same bits); a reduce_scatter does the same for its own block; all_gather
  and broadcast copy the slots out; a barrier is the gather alone.
* **Larger data takes a second collective**: ``Iallreduce`` (float16 and bfloat16 reduced
  in float32 and rounded once at the end; bool as 0/1 bytes, OR as MAX and AND as MIN;
  complex SUM as pairs of reals; what MPI cannot reduce, such as a complex PRODUCT, is
  gathered whole and reduced locally in column order), ``Iallgather``,
  ``Ireduce_scatter_block`` (else ``Ialltoall`` and a local reduction), ``Ibcast`` (the
  ``broadcast/network`` table sends larger broadcasts down the binomial tree over MPI's
  messages instead: measured faster than two collectives here). MPI's algorithms give every
  member the same result for these commutative operations.
* **MPI never holds a user's tensor.** MPI works on staging buffers of the call, copied in
  before and out after. A collective that fails or passes its deadline cannot be
  withdrawn from MPI: its buffers leave the group's scratch pool and stay with the
  transport until MPI completes them, so nothing lands in a tensor after its call failed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from .net import as_bytes
from .reduce_ops import _BOOL_KIND, AVG, BAND, BOR, BXOR, MAX, MIN, PREMUL_SUM, SUM, ReduceSpec

if TYPE_CHECKING:
    from ..transport.base import ColumnCollectives, NetTransport
    from .net import NetCall

HEAD = 64  # a call descriptor (net.py's _DESC), padded to a multiple of 16
SLOT_DATA = 256  # data bytes that ride with the descriptor
SLOT = HEAD + SLOT_DATA
_LOW = (torch.float16, torch.bfloat16)
_BOOL_AS_BYTES = {BOR: MAX, BAND: MIN, BXOR: BXOR}


def serves(net: NetTransport, peers: Sequence[int]) -> bool:
    """Can the network phase among ``peers`` (group ranks, node order) be MPI's?"""
    column = net.column
    return column is not None and column == list(peers)


# What follows runs only where ``serves`` chose it: the transport is then a
# ``transport.base.ColumnCollectives`` with its column set, which the type checker is told
# where ``net_call.net`` is read (the ignores marked "serves").


# ------------------------------------------------------------------------ the collectives

def all_reduce(net_call: NetCall, buf: torch.Tensor, peers: Sequence[int],
               spec: ReduceSpec) -> None:
    """Reduce typed flat ``buf`` in place over the column (``spec``: a later phase's, so
    not AVG or PREMUL_SUM)."""
    n = buf.numel() * buf.element_size()
    P = len(peers)
    if n <= SLOT_DATA:
        gathered = _gather_slots(net_call, "ar", buf)
        net_call.reduce(buf, list(_slots(gathered, P, n).view(buf.dtype).unbind()), spec)
        return
    _gather_slots(net_call, "ar", None)
    net: ColumnCollectives = net_call.net  # type: ignore[assignment]  # (serves)
    plan = _plan(net, buf.dtype, spec.kind)
    if plan is None:  # MPI cannot reduce it: gather everything, reduce in column order
        whole = _collective(net_call, "arwhole", P * n, lambda mine, out: (
            mine.copy_(_bytes(buf)), net.iallgather(as_bytes(mine), as_bytes(out))), n)
        net_call.reduce(buf, [whole[b * n:(b + 1) * n].view(buf.dtype) for b in range(P)],
                        spec)
        return
    dtype, op = plan
    staged = buf.numel() * (2 if buf.dtype.is_complex else 1)
    # (the ignores on the lambdas' tuples: the first item runs a step, the last is the request)
    result = _collective(net_call, "arstage", staged * dtype.itemsize, lambda _, out: (
        _stage(out.view(dtype), buf),  # type: ignore[func-returns-value]
        net.iallreduce(as_bytes(out), _name(dtype), op)))
    _unstage(buf, result.view(dtype))


def all_gather(net_call: NetCall, blocks: Sequence[torch.Tensor], mine: int) -> None:
    """``blocks[b]`` (one per column member, equal sizes) from member ``b``; this rank's
    is ``blocks[mine]``."""
    n = blocks[0].numel() * blocks[0].element_size()
    src = _bytes(blocks[mine])
    if n <= SLOT_DATA:
        gathered = _gather_slots(net_call, "ag", blocks[mine])
        for b, blk in enumerate(blocks):
            if b != mine:
                _bytes(blk).copy_(_slot(gathered, b, n))
        return
    _gather_slots(net_call, "ag", None)
    net: ColumnCollectives = net_call.net  # type: ignore[assignment]  # (serves)
    P = len(blocks)
    whole = _collective(net_call, "agwhole", P * n, lambda m, out: (
        m.copy_(src), net.iallgather(as_bytes(m), as_bytes(out))), n)
    for b, blk in enumerate(blocks):
        if b != mine:
            _bytes(blk).copy_(whole[b * n:(b + 1) * n])


def reduce_scatter(net_call: NetCall, out: torch.Tensor, partials: Sequence[torch.Tensor],
                   mine: int, spec: ReduceSpec) -> None:
    """``out`` = the reduction over the column of every member's ``partials[mine]``
    (``partials[b]``: this rank's contribution to member ``b``'s block, in column order)."""
    m = out.numel() * out.element_size()
    P = len(partials)
    if P * m <= SLOT_DATA:
        gathered = _gather_slots(net_call, "rs", torch.cat([_bytes(p) for p in partials]))
        views = [_slot(gathered, b, P * m)[mine * m:(mine + 1) * m].view(out.dtype)
                 for b in range(P)]
        net_call.reduce(out, views, spec)
        return
    _gather_slots(net_call, "rs", None)
    net: ColumnCollectives = net_call.net  # type: ignore[assignment]  # (serves)

    def fill(send: torch.Tensor) -> None:
        for b, p in enumerate(partials):
            send[b * m:(b + 1) * m].copy_(_bytes(p))

    plan = _plan(net, out.dtype, spec.kind)
    if plan is not None:
        dtype, op = plan
        k = out.numel() * (2 if out.dtype.is_complex else 1)  # staged elements per block

        def fill_staged(send: torch.Tensor) -> None:
            typed = send.view(dtype)
            for b, p in enumerate(partials):
                _stage(typed[b * k:(b + 1) * k], p)

        got = _collective(net_call, "rsblock", k * dtype.itemsize, lambda send, recv: (
            fill_staged(send),  # type: ignore[func-returns-value]
            net.ireduce_scatter(as_bytes(send), as_bytes(recv), _name(dtype), op)),
            P * k * dtype.itemsize)
        _unstage(out, got.view(dtype))
        return
    got = _collective(net_call, "rsall", P * m, lambda send, recv: (
        fill(send),  # type: ignore[func-returns-value]
        net.ialltoall(as_bytes(send), as_bytes(recv))), P * m)
    net_call.reduce(out, [got[b * m:(b + 1) * m].view(out.dtype) for b in range(P)], spec)


def broadcast(net_call: NetCall, buf: torch.Tensor, root: int) -> None:
    """Column member ``root``'s uint8 ``buf`` into every member's."""
    n = buf.numel()
    me = net_call.net.column.index(net_call.topo.rank)  # type: ignore[union-attr]  # (serves)
    if n <= SLOT_DATA:
        gathered = _gather_slots(net_call, "bc", buf if me == root else None)
        if me != root:
            buf.copy_(_slot(gathered, root, n))
        return
    _gather_slots(net_call, "bc", None)
    net: ColumnCollectives = net_call.net  # type: ignore[assignment]  # (serves)
    got = _collective(net_call, "bcast", n, lambda _, b: (
        b.copy_(buf) if me == root else None, net.ibcast(as_bytes(b), root)))
    if me != root:
        buf.copy_(got)


def barrier(net_call: NetCall) -> None:
    """Every member of the column has arrived (and made the same call)."""
    _gather_slots(net_call, "ba", None)


# ------------------------------------------------------------------------ the pieces

def _gather_slots(net_call: NetCall, key: str, data: torch.Tensor | None) -> torch.Tensor:
    """The call's first collective: every member's descriptor and up to ``SLOT_DATA`` bytes
    of ``data`` (a tensor, or None), checked; the members' slots, one per ``SLOT`` bytes."""
    net_call.not_deferrable()
    words = net_call.descriptor()
    column: list[int] = net_call.net.column  # type: ignore[assignment]  # (serves: a column)
    P = len(column)

    def start(slot: torch.Tensor, out: torch.Tensor) -> object:
        as_bytes(slot)[:len(words)] = words
        if data is not None and data.numel():
            b = _bytes(data)
            slot[HEAD:HEAD + b.numel()].copy_(b)
        return net_call.net.iallgather(  # type: ignore[attr-defined]  # (serves: MPI's)
            as_bytes(slot), as_bytes(out))

    gathered = _collective(net_call, f"slots{key}", P * SLOT, start, SLOT)
    me = net_call.topo.rank
    raw = as_bytes(gathered)
    for b, peer in enumerate(column):
        theirs = raw[b * SLOT:b * SLOT + len(words)]
        if peer != me and theirs != words:
            net_call.check_descriptor(peer, bytes(theirs))
    return gathered


def _collective(net_call: NetCall, key: str, nbytes: int,
                start: Callable[[torch.Tensor, torch.Tensor], Any],
                in_bytes: int = 0) -> torch.Tensor:
    """Run one of MPI's collectives on staging buffers of the call: ``start(inbuf, outbuf)``
    fills ``inbuf`` (``in_bytes``, a uint8 tensor; None when 0) and starts the collective
    into ``outbuf`` (``nbytes``) and returns its request (or a tuple that ends with it);
    wait for it and return ``outbuf``. If the wait fails, both buffers leave the scratch
    pool for good (MPI may still write them)."""
    inbuf = net_call.buffer(f"mpi{key}in", in_bytes, torch.uint8) if in_bytes else None
    out = net_call.buffer(f"mpi{key}", nbytes, torch.uint8)
    req = start(inbuf, out)  # type: ignore[arg-type]  # (None: a start that takes no input)
    if isinstance(req, tuple):
        req = req[-1]
    try:
        req.wait(net_call.deadline)
    except BaseException:
        net_call.forget(f"mpi{key}")
        if in_bytes:
            net_call.forget(f"mpi{key}in")
        raise
    return out


def _slot(gathered: torch.Tensor, b: int, n: int) -> torch.Tensor:
    return gathered[b * SLOT + HEAD:b * SLOT + HEAD + n]


def _slots(gathered: torch.Tensor, P: int, n: int) -> torch.Tensor:
    """The data of every member's slot: a P x n view (rows in column order)."""
    return gathered[:P * SLOT].view(P, SLOT)[:, HEAD:HEAD + n]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a flat uint8 tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def _plan(net: ColumnCollectives, dtype: torch.dtype, kind: str
          ) -> tuple[torch.dtype, str] | None:
    """``(staged dtype, MPI op)`` for reducing ``dtype`` with ``kind`` through MPI, or None."""
    assert kind not in (AVG, PREMUL_SUM), "phase_specs turns them into SUM"
    if dtype is torch.bool:
        return torch.uint8, _BOOL_AS_BYTES[_BOOL_KIND[kind]]
    if dtype in _LOW:
        stage = torch.float32
    elif dtype.is_complex:
        if kind != SUM:
            return None
        stage = dtype.to_real()
    else:
        stage = dtype
    return (stage, kind) if net.reduces(_name(stage), kind) else None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).rsplit(".", 1)[1]


def _stage(stage: torch.Tensor, src: torch.Tensor) -> None:
    """``src`` (flat) into ``stage``, in the staged dtype."""
    stage.copy_(torch.view_as_real(src).reshape(-1) if src.dtype.is_complex else src.reshape(-1))


def _unstage(buf: torch.Tensor, result: torch.Tensor) -> None:
    """MPI's result (in the staged dtype) back into ``buf``."""
    if buf.dtype.is_complex:
        torch.view_as_real(buf).reshape(-1).copy_(result)
    else:
        buf.copy_(result)  # (bool: nonzero is True; float16/bfloat16: rounded once)
