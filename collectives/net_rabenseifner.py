"""All-reduce among ranks on different nodes: Rabenseifner's reduce-scatter + all-gather.

How it works
------------
The buffer is split into p regions (p the power of two of net_fold.py, starts aligned to
cache lines); a reduce-scatter by recursive halving leaves virtual rank ``v`` with region
``v`` reduced over every rank, and an all-gather by recursive doubling (the same rounds in
reverse) hands every region to every rank (net_halving.py: ``halve``, ``gather_back``).
Any number of ranks by the fold-in of net_fold.py: an ``extra`` rank sends its buffer to
its partner first and gets the result back last. A rank sends 2 log2 p messages (+1) of
2 (p-1)/p of the buffer in all (+1 buffer), in 2 log2 p dependent rounds (+2): fewer bytes
than recursive doubling and fewer messages than a ring, for medium buffers. Each region is
reduced by one rank only, so every rank gets the same bits; the order of the additions is a
tree, and float16/bfloat16 round once per level.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

from .context import ALIGN_BYTES, partition
from .net_fold import Fold, fold_in, fold_out
from .net_halving import gather_back, halve

if TYPE_CHECKING:
    import torch

    from .net import Exchange
    from .reduce_ops import ReduceSpec


def all_reduce(net: Exchange, buf: torch.Tensor, peers: Sequence[int], me: int,
               spec: ReduceSpec) -> Iterator[None]:
    """Reduce typed ``buf`` in place over ``peers`` (group ranks; ``peers[me]`` is this rank)."""
    fold = Fold(len(peers), me)
    if (yield from fold_in(net, buf, peers, fold, spec)):
        return
    regions = partition(buf.numel(), fold.pof2, max(1, ALIGN_BYTES // buf.element_size()))
    n = buf.numel()

    def bounds(v: int) -> int:
        return regions[v][0] if v < fold.pof2 else n

    rounds = yield from halve(net, buf, peers, fold, bounds, spec, "rb")
    yield from gather_back(net, buf, rounds)
    yield from fold_out(net, buf, peers, fold)
