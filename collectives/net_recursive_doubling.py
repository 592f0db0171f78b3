"""All-reduce, all-gather and barrier among ranks on different nodes by recursive doubling.

How it works
------------
Virtual rank ``v`` (net_fold.py) talks to ``v ^ 2^k`` in round k: with a power of two of
ranks a rank has log2 P peers in all, the same ones for every collective of this file and
for net_halving.py's and net_rabenseifner.py's (and net_binomial.py's trees): few rails.

all_reduce: in round k (k = 0 .. log2 p - 1) virtual rank ``v`` swaps its whole buffer with ``v ^ 2^k``
and both reduce the two, the lower virtual rank's data first: after round k every block of
2^(k+1) virtual ranks holds the same partial result, bit for bit (both partners computed
the same operation on the same operands in the same order). Any number of ranks: the
fold-in of net_fold.py (an ``extra`` rank sends its buffer to its partner first and gets
the result back last). A rank sends log2 p messages (+1 with the fold) of the whole buffer,
in log2 p dependent rounds (+2): the latency algorithm, for buffers where the number of
messages decides. The order of the additions is a tree, not rank order; float16/bfloat16
round once per level.

all_gather: the blocks are laid out in rank order; in each round a rank sends every block
it holds to its partner and receives the partner's (net_halving.gather_back over the
halving windows of the blocks): log2 p rounds, P - 1 blocks received in all. With the
fold, an extra rank sends its block first and gets the whole result last.

barrier: empty messages in the same pattern; after the last round every rank has heard,
through some chain, from every other.

Written as generators over a ``NetCall`` (net.py: ``send``, ``recv``, ``reduce``,
``buffer``; each ``yield`` waits for everything posted), so the simulator
(bench/netsim.py) runs the same code for thousands of ranks in one process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from .net_fold import Fold, fold_in, fold_out
from .net_halving import gather_back, windows

if TYPE_CHECKING:
    from .net import Exchange
    from .reduce_ops import ReduceSpec


def all_reduce(net: Exchange, buf: torch.Tensor, peers: Sequence[int], me: int,
               spec: ReduceSpec) -> Iterator[None]:
    """Reduce typed ``buf`` in place over ``peers`` (group ranks; ``peers[me]`` is this rank)."""
    fold = Fold(len(peers), me)
    if (yield from fold_in(net, buf, peers, fold, spec)):
        return
    tmp = net.buffer("rd", buf.numel(), buf.dtype)
    v: int = fold.vrank  # type: ignore[assignment]  # (not an extra rank)
    mask = 1
    while mask < fold.pof2:
        pv = v ^ mask
        partner = peers[fold.real(pv)]
        net.recv(partner, tmp)
        net.send(partner, buf)
        yield
        net.reduce(buf, [tmp, buf] if pv < v else [buf, tmp], spec)
        mask <<= 1
    yield from fold_out(net, buf, peers, fold)


def all_gather(net: Exchange, outs: Sequence[torch.Tensor], mine: torch.Tensor,
               peers: Sequence[int], me: int) -> Iterator[None]:
    """``outs[k]`` (uint8, all of ``mine``'s size) = rank ``peers[k]``'s ``mine``; ``mine``
    may be ``outs[me]``."""
    size, b = len(peers), mine.numel()
    fold = Fold(size, me)
    # (blocks end to end in one tensor, as all_gather_into_tensor's are: gathered in place,
    # without a copy of the whole output in and out of a scratch buffer)
    span = spanned(outs)
    held = net.buffer("rdgather", size * b, torch.uint8) if span is None else span
    own = held[me * b:(me + 1) * b]
    if own.data_ptr() != mine.data_ptr():
        own.copy_(mine)
    if fold.extra:
        partner = peers[me + 1]
        net.send(partner, own)
        yield  # (the send completes before anything lands in the same memory)
        net.recv(partner, held)
        yield
    else:
        if fold.folded:
            net.recv(peers[me - 1], held[(me - 1) * b:me * b])
            yield
        yield from gather_back(net, held, windows(fold, peers, lambda v: fold.first(v) * b))
        if fold.folded:
            net.send(peers[me - 1], held)
            yield
    if span is not None:
        return
    for k in range(size):
        if k != me:
            outs[k].copy_(held[k * b:(k + 1) * b])
    if outs[me].data_ptr() != mine.data_ptr():
        outs[me].copy_(mine)


def spanned(blocks: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One uint8 tensor over ``blocks`` (uint8, of one size) when they lie end to end in
    order in one storage, each contiguous; else None."""
    first = blocks[0]
    b = first.numel()
    if not b or first.dtype != torch.uint8 or not all(t.is_contiguous() for t in blocks):
        return None
    base = first.data_ptr()
    storage = first.untyped_storage()
    for k, t in enumerate(blocks):
        if t.numel() != b or t.data_ptr() != base + k * b:
            return None
    if first.storage_offset() + len(blocks) * b > storage.nbytes():
        return None
    return first.as_strided((len(blocks) * b,), (1,))  # (from first's own offset)


def barrier(net: Exchange, peers: Sequence[int], me: int) -> Iterator[None]:
    """Return only once every rank of ``peers`` has called it."""
    fold = Fold(len(peers), me)
    empty = bytearray(0)
    if fold.extra:
        net.send(peers[me + 1], b"")
        net.recv(peers[me + 1], empty)
        yield
        return
    if fold.folded:
        net.recv(peers[me - 1], empty)
        yield
    v: int = fold.vrank  # type: ignore[assignment]  # (not an extra rank)
    mask = 1
    while mask < fold.pof2:
        partner = peers[fold.real(v ^ mask)]
        net.recv(partner, empty)
        net.send(partner, b"")
        yield
        mask <<= 1
    if fold.folded:
        net.send(peers[me - 1], b"")
        yield
