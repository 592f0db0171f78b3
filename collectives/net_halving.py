"""Reduce-scatter among ranks on different nodes by recursive halving.

How it works
------------
Every rank holds a buffer of P blocks, block r destined to rank r. The p virtual ranks of
net_fold.py start with the whole buffer as their window. In each round the window's
virtual ranks split in two halves; virtual rank ``v`` pairs with the rank at the same place
in the other half, sends it the half of the window that half speaks for, receives the
partner's data of its own half, and reduces (the lower virtual rank's data first). After
log2 p rounds ``v`` holds the reduced blocks of the real ranks it speaks for: an
``extra`` rank (which handed its whole buffer to its partner first) gets its block back
from that partner. A rank sends log2 p messages (+1 with the fold) and about (p-1)/p of
the buffer in all, where a direct exchange sends P - 1 messages.

``halve`` (the rounds alone, over any split of a buffer into p regions) and ``gather_back``
(its mirror image, an all-gather by recursive doubling) are the two halves of the
all-reduce in net_rabenseifner.py. Each region's final value is computed by one rank only,
so every rank that receives it gets the same bits. The order of the additions is a tree,
not rank order; float16/bfloat16 round once per level.

Written as generators over a ``NetCall`` (net.py: each ``yield`` waits for everything
posted), so the simulator (bench/netsim.py) runs the same code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Generator, Iterator, Sequence

from .net_fold import Fold

if TYPE_CHECKING:
    import torch
    from typing_extensions import TypeAlias

    from .net import Exchange
    from .reduce_ops import ReduceSpec

    # a round: (own half, other half) as (start, end), the partner, is it first
    Round: TypeAlias = tuple[tuple[int, int], tuple[int, int], int, bool]


def windows(fold: Fold, peers: Sequence[int], bounds: Callable[[int], int]) -> list[Round]:
    """The rounds of recursive halving for this (non-extra) rank, computed without any
    message: (own half, other half, partner) per round, halves as (start, end) of the
    buffer, region ``v`` being ``bounds(v) .. bounds(v + 1)``. Round j pairs virtual rank
    ``v`` with ``v ^ 2^(log2 p - 1 - j)``."""
    v: int = fold.vrank  # type: ignore[assignment]  # (not an extra rank)
    lo, hi = 0, fold.pof2
    rounds = []
    while hi - lo > 1:
        half = (hi - lo) // 2
        mid = lo + half
        if v < mid:
            keep, give, pv = (lo, mid), (mid, hi), v + half
        else:
            keep, give, pv = (mid, hi), (lo, mid), v - half
        rounds.append(((bounds(keep[0]), bounds(keep[1])), (bounds(give[0]), bounds(give[1])),
                       peers[fold.real(pv)], pv < v))
        lo, hi = keep
    return rounds


def halve(net: Exchange, buf: torch.Tensor, peers: Sequence[int], fold: Fold,
          bounds: Callable[[int], int], spec: ReduceSpec, key: str
          ) -> Generator[None, None, list[Round]]:
    """Recursive halving over the virtual ranks: region ``v`` of ``buf`` is
    ``buf[bounds(v):bounds(v + 1)]``; afterwards this rank's region holds the reduction over
    every virtual rank's ``buf``. Returns the rounds (``windows``) for ``gather_back``."""
    rounds = windows(fold, peers, bounds)
    tmp = net.buffer(key, rounds[0][0][1] - rounds[0][0][0], buf.dtype) if rounds else None
    for (ks, ke), (gs, ge), partner, partner_first in rounds:
        # (later rounds keep part of the first round's half; tmp is there: rounds are)
        got = tmp[:ke - ks]  # type: ignore[index]
        net.recv(partner, got)
        net.send(partner, buf[gs:ge])
        yield
        mine = buf[ks:ke]
        net.reduce(mine, [got, mine] if partner_first else [mine, got], spec)
    return rounds


def gather_back(net: Exchange, buf: torch.Tensor, rounds: list[Round]) -> Iterator[None]:
    """All-gather by recursive doubling, the rounds of ``halve`` in reverse: each round this
    rank sends everything it holds to the partner of that round and receives the rest of
    the window."""
    for (ks, ke), (gs, ge), partner, _ in reversed(rounds):
        net.recv(partner, buf[gs:ge])
        net.send(partner, buf[ks:ke])
        yield


def reduce_scatter(net: Exchange, out: torch.Tensor, work: torch.Tensor, peers: Sequence[int],
                   me: int, spec: ReduceSpec) -> Iterator[None]:
    """``out`` (m elements) = the reduction over ``peers`` of block ``me`` of their ``work``
    (P blocks of m elements, in the order of ``peers``; ``work`` is scratch: it is
    overwritten)."""
    fold = Fold(len(peers), me)
    m = out.numel()
    if fold.extra:
        partner = peers[me + 1]
        net.send(partner, work)
        net.recv(partner, out)
        yield
        return
    if fold.folded:
        tmp = net.buffer("rhfold", work.numel(), work.dtype)
        net.recv(peers[me - 1], tmp)
        yield
        net.reduce(work, [tmp, work], spec)
    yield from halve(net, work, peers, fold, lambda v: fold.first(v) * m, spec, "rh")
    if fold.folded:  # this rank holds blocks me - 1 and me: the first is its partner's
        net.send(peers[me - 1], work[(me - 1) * m:me * m])
    out.copy_(work[me * m:(me + 1) * m])
    yield
