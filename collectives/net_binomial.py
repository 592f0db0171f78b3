"""Broadcast and reduce among ranks on different nodes along a binomial tree.

How it works
------------
Ranks are numbered relative to the root: ``rel = index ^ root`` when P is a power of two
(so a rank's tree partners are ``index ^ 2^j``, the peers of recursive doubling: no rails
of their own), else ``rel = (index - root) mod P``. The parent of
``rel`` is ``rel`` with its lowest set bit cleared; its children are ``rel + 2^j`` for every
2^j below that bit. Broadcast: a rank receives from its parent, then sends to all its
children at once (largest subtree first). Reduce: the mirror image: a rank receives from
its children one level at a time, smallest subtree first, reduces each into its partial
(its own data first, so the order is a fixed tree), then sends to its parent. Depth
ceil(log2 P); the root sends (or receives) ceil(log2 P) messages where a flat tree has it
send P - 1.

Written as generators over a ``NetCall`` (net.py: each ``yield`` waits for everything
posted), so the simulator (bench/netsim.py) runs the same code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

if TYPE_CHECKING:
    import torch

    from .net import Exchange
    from .reduce_ops import ReduceSpec


def children(rel: int, size: int) -> list[int]:
    """Relative ranks of ``rel``'s children, largest subtree first."""
    low = rel & -rel if rel else 1 << size.bit_length()
    out, mask = [], low >> 1
    while mask:
        if rel + mask < size:
            out.append(rel + mask)
        mask >>= 1
    return out


def parent(rel: int) -> int:
    """Relative rank of ``rel``'s parent (``rel`` > 0): ``rel`` without its lowest set bit."""
    return rel - (rel & -rel)


class _Renumbered:
    """``peers`` by relative rank in a tree rooted at index ``root`` (not 0)."""

    __slots__ = ("_peers", "_root", "_xor")

    def __init__(self, peers: Sequence[int], root: int):
        self._peers, self._root = peers, root
        self._xor = len(peers) & (len(peers) - 1) == 0

    def relative(self, i: int) -> int:
        """The relative rank of index ``i``."""
        return i ^ self._root if self._xor else (i - self._root) % len(self._peers)

    def __getitem__(self, r: int) -> int:
        """The peer at relative rank ``r``."""
        peers = self._peers
        return peers[r ^ self._root if self._xor else (r + self._root) % len(peers)]


def _tree_order(peers: Sequence[int], me: int, root: int
                ) -> tuple[int, Sequence[int] | _Renumbered]:
    """This rank's relative rank in the tree rooted at ``peers[root]``, and the peers by
    relative rank: ``peers`` themselves when the root is index 0 (the tree all_reduce and
    the barrier: nothing to renumber)."""
    if not root:
        return me, peers
    order = _Renumbered(peers, root)
    return order.relative(me), order


def broadcast(net: Exchange, buf: torch.Tensor, peers: Sequence[int], me: int, root: int
              ) -> Iterator[None]:
    """Make ``buf`` equal to ``peers[root]``'s on every rank of ``peers``."""
    rel, order = _tree_order(peers, me, root)
    if rel:
        net.recv(order[parent(rel)], buf)
        yield
    sent = False
    for child in children(rel, len(peers)):
        net.send(order[child], buf)
        sent = True
    if sent:
        yield


def reduce(net: Exchange, buf: torch.Tensor, peers: Sequence[int], me: int, root: int,
           spec: ReduceSpec) -> Iterator[None]:
    """Reduce typed ``buf`` over ``peers`` into ``peers[root]``'s ``buf`` (the others' ``buf``
    is used as scratch: it ends holding their subtree's partial)."""
    rel, order = _tree_order(peers, me, root)
    below = children(rel, len(peers))
    if below:
        tmp = net.buffer("binomial", buf.numel(), buf.dtype)
    for child in reversed(below):  # smallest subtree first: it is ready first
        net.recv(order[child], tmp)
        yield
        net.reduce(buf, [buf, tmp], spec)
    if rel:
        net.send(order[parent(rel)], buf)
        yield
