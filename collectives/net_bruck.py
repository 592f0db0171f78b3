"""All-gather among ranks on different nodes by Bruck's algorithm.

How it works
------------
Rank i keeps the blocks it has in rotated order (position j holds rank (i + j) mod P's
block), starting with its own. In round k (distance d = 2^k) it receives the first
min(d, P - d) blocks rank i + d holds and appends them, and sends its own first ones to
rank i - d. After ceil(log2 P) rounds it has every block and puts each in its place.
Any P, no fold needed: a rank sends ceil(log2 P) messages, P - 1 blocks in all (as many
bytes as a direct exchange or a ring, in far fewer messages), plus one copy of the whole
result. Blocks are copied, never combined: every rank gets the same bits.

Written as a generator over a ``NetCall`` (net.py: each ``yield`` waits for everything
posted), so the simulator (bench/netsim.py) runs the same code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

import torch

if TYPE_CHECKING:
    from .net import Exchange


def all_gather(net: Exchange, outs: Sequence[torch.Tensor], mine: torch.Tensor,
               peers: Sequence[int], me: int) -> Iterator[None]:
    """``outs[k]`` (uint8, all of ``mine``'s size) = rank ``peers[k]``'s ``mine``; ``mine``
    may be ``outs[me]``."""
    size, b = len(peers), mine.numel()
    held = net.buffer("bruck", size * b, torch.uint8)
    held[:b].copy_(mine)
    d = 1
    while d < size:
        count = min(d, size - d)
        net.recv(peers[(me + d) % size], held[d * b:(d + count) * b])
        net.send(peers[(me - d) % size], held[:count * b])
        yield
        d <<= 1
    for j in range(size):
        k = (me + j) % size
        if k != me:
            outs[k].copy_(held[j * b:(j + 1) * b])
    if outs[me].data_ptr() != mine.data_ptr():
        outs[me].copy_(mine)
