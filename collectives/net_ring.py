"""All-reduce among ranks on different nodes around a ring (large buffers, any number of ranks).

How it works
------------
The buffer is split into P chunks (starts aligned to cache lines). Reduce-scatter: in step
k each rank sends chunk (i - k) to the next rank and adds the chunk (i - k - 1) the previous
one sent it; after P - 1 steps chunk (i + 1) holds every rank's contribution. All-gather:
P - 1 more steps pass the finished chunks around. Each rank's link carries 2 (P-1)/P of the
buffer whatever P is (a direct exchange carries P - 1 times it), in 2 (P-1) dependent
steps: what gloo runs. Each chunk is reduced along the ring once and then copied
everywhere, so every rank gets the same bits.

Written as a generator over a ``NetCall`` (net.py: each ``yield`` waits for everything
posted), so the simulator (bench/netsim.py) runs the same code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

from .context import ALIGN_BYTES, partition

if TYPE_CHECKING:
    import torch

    from .net import Exchange
    from .reduce_ops import ReduceSpec


def all_reduce(net: Exchange, buf: torch.Tensor, peers: Sequence[int], me: int,
               spec: ReduceSpec) -> Iterator[None]:
    """Reduce typed ``buf`` in place over ``peers`` (group ranks; ``peers[me]`` is this rank)."""
    n = len(peers)
    nxt, prv = peers[(me + 1) % n], peers[(me - 1) % n]
    chunks = partition(buf.numel(), n, max(1, ALIGN_BYTES // buf.element_size()))
    tmp = net.buffer("ring", max(m for _, m in chunks), buf.dtype)
    for k in range(n - 1):  # after step k, chunk (i-k-1) holds k+2 ranks' contributions
        (so, sm), (ro, rm) = chunks[(me - k) % n], chunks[(me - k - 1) % n]
        net.recv(prv, tmp[:rm])
        net.send(nxt, buf[so:so + sm])
        yield
        net.reduce(buf[ro:ro + rm], [tmp[:rm], buf[ro:ro + rm]], spec)
    for k in range(n - 1):  # chunk (i+1) is complete here: pass the results around
        (so, sm), (ro, rm) = chunks[(me + 1 - k) % n], chunks[(me - k) % n]
        net.recv(prv, buf[ro:ro + rm])
        net.send(nxt, buf[so:so + sm])
        yield
