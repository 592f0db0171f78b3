"""Folding any number of ranks onto a power of two, for the log-depth algorithms between nodes.

How it works
------------
Recursive doubling and halving pair rank ``v`` with ``v ^ mask``: they need a power of two.
With P ranks, p the largest power of two <= P and ``rem = P - p`` (the standard fold-in of
Thakur, Rabenseifner and Gropp, as MPICH does it):

* the first ``2 rem`` ranks form pairs (0, 1), (2, 3), ...: the even rank of a pair is
  ``extra``: it hands its data to its odd partner at the start and gets the result back
  at the end, and takes no part in between;
* every other rank has a *virtual rank* ``v`` in 0..p-1: the odd rank 2k+1 of a pair is
  ``k``, a rank ``i >= 2 rem`` is ``i - rem``.

Virtual rank ``v`` speaks for real ranks ``first(v) .. first(v + 1) - 1`` (two for a pair,
one otherwise), so a contiguous range of virtual ranks speaks for a contiguous range of
real ones: the reduce-scatter by halving (net_halving.py) uses that to hand each rank its
own block. ``fold_in`` and ``fold_out`` are an all-reduce's two fold steps, shared by
recursive doubling and Rabenseifner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generator, Iterator, Sequence

if TYPE_CHECKING:
    import torch

    from .net import Exchange
    from .reduce_ops import ReduceSpec


class Fold:
    """Rank ``index`` of ``size`` ranks, folded onto the largest power of two (see above).

    Attributes
    ----------
    pof2, rem : int
        The power of two and the ranks beyond it.
    vrank : int or None
        This rank's virtual rank; None for an ``extra`` rank.
    extra, folded : bool
        This rank hands its data to ``index + 1`` (extra) / takes the data of ``index - 1``
        (folded: the odd rank of a pair).
    """

    __slots__ = ("size", "index", "pof2", "rem", "vrank", "extra", "folded")

    def __init__(self, size: int, index: int):
        if not 0 <= index < size:
            raise ValueError(f"rank {index} out of range for {size} ranks")
        self.size, self.index = size, index
        self.pof2 = 1 << (size.bit_length() - 1)
        self.rem = size - self.pof2
        paired = index < 2 * self.rem
        self.extra = paired and index % 2 == 0
        self.folded = paired and index % 2 == 1
        if self.extra:
            self.vrank: int | None = None
        else:
            self.vrank = index // 2 if paired else index - self.rem

    def real(self, v: int) -> int:
        """The real rank that plays virtual rank ``v``."""
        return 2 * v + 1 if v < self.rem else v + self.rem

    def first(self, v: int) -> int:
        """The first real rank virtual rank ``v`` speaks for (``first(pof2) == size``)."""
        return 2 * v if v < self.rem else v + self.rem

    def levels(self) -> int:
        """Rounds of recursive doubling among the virtual ranks (log2 of ``pof2``)."""
        return self.pof2.bit_length() - 1


def fold_in(net: Exchange, buf: torch.Tensor, peers: Sequence[int], fold: Fold,
            spec: ReduceSpec) -> Generator[None, None, bool]:
    """The fold-in of an all-reduce of typed ``buf`` (a generator over a ``NetCall``, like
    the algorithms): an extra rank sends its buffer to its partner and then receives the
    result into it; the partner adds it to its own, the extra rank's data first. Returns
    True for the extra rank (its ``buf`` holds the result: it is done)."""
    me = fold.index
    if fold.extra:
        partner = peers[me + 1]
        net.send(partner, buf)
        yield  # (the send completes before the result lands in the same memory)
        net.recv(partner, buf)
        yield
        return True
    if fold.folded:
        tmp = net.buffer("fold", buf.numel(), buf.dtype)
        net.recv(peers[me - 1], tmp)
        yield
        net.reduce(buf, [tmp, buf], spec)
    return False


def fold_out(net: Exchange, buf: torch.Tensor, peers: Sequence[int], fold: Fold
             ) -> Iterator[None]:
    """The fold-out of an all-reduce: the partner of an extra rank sends it the result."""
    if fold.folded:
        net.send(peers[fold.index - 1], buf)
        yield
