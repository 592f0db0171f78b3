"""All-reduce and barrier among ranks on different nodes along one binomial tree.

How it works
------------
all_reduce: net_binomial.reduce brings the sum to the first rank of ``peers`` (each rank
adds its children's partials, smallest subtree first, into its own buffer, then sends it
to its parent), and net_binomial.broadcast sends the result back down the same tree. Every
rank ends with the root's bytes, so the ranks agree bit for bit; the additions follow the
tree (float16 / bfloat16 round once per level).

barrier: empty messages up the tree (a rank waits once, for all its children together,
then tells its parent and waits for its answer) and back down (the root has heard,
through its children, from every rank; its answer releases them).

Why a tree: it sends 2 (P - 1) messages in all where recursive doubling sends P log2 P.
Its critical path is twice as long (2 ceil(log2 P) rounds, the root handling ceil(log2 P)
messages each way), so with a core for every rank recursive doubling is faster; but
where ranks share cores the call takes the CPU all ranks spend, and the average rank of
the tree handles two messages where recursive doubling's handles 2 log2 P. The
``all_reduce/network`` and ``barrier/network`` tables choose it by the cost model's
``crowd`` term (net_cost.py). With a power of two of ranks the tree's partners are
``index ^ 2^j``, recursive doubling's: no rails of its own.

Written as generators over a ``NetCall`` (net.py: each ``yield`` waits for everything
posted), so the simulator (bench/netsim.py) runs the same code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

from .net_binomial import broadcast, children, parent, reduce

if TYPE_CHECKING:
    import torch

    from .net import Exchange
    from .reduce_ops import ReduceSpec


def all_reduce(net: Exchange, buf: torch.Tensor, peers: Sequence[int], me: int,
               spec: ReduceSpec) -> Iterator[None]:
    """Reduce typed ``buf`` in place over ``peers`` (group ranks; ``peers[me]`` is this rank)."""
    yield from reduce(net, buf, peers, me, 0, spec)
    yield from broadcast(net, buf, peers, me, 0)


def barrier(net: Exchange, peers: Sequence[int], me: int) -> Iterator[None]:
    """Return only once every rank of ``peers`` has called it."""
    below = [peers[c] for c in children(me, len(peers))]
    for child in below:  # (each into a buffer of its own: nothing is shared while posted)
        net.recv(child, bytearray(0))
    if below:
        yield
    if me:  # (rooted at index 0: a rank's index is its place in the tree)
        up = peers[parent(me)]
        net.send(up, b"")
        net.recv(up, bytearray(0))
        yield
    for child in below:
        net.send(child, b"")
    if below:
        yield
