"""Barrier among ranks on different nodes by dissemination (Hensgen, Finkel and Manber).

How it works
------------
In round k (distance d = 2^k) rank i sends an empty message to rank i + d and waits for
the one from rank i - d (mod P). After ceil(log2 P) rounds every rank has heard, through
some chain, from every other: no rank leaves before all have arrived. Any P; one message
per rank and round, where an exchange among all sends P - 1.

Written as a generator over a ``NetCall`` (net.py: each ``yield`` waits for everything
posted), so the simulator (bench/netsim.py) runs the same code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

if TYPE_CHECKING:
    from .net import Exchange


def barrier(net: Exchange, peers: Sequence[int], me: int) -> Iterator[None]:
    """Return only once every rank of ``peers`` has called it."""
    size, d = len(peers), 1
    empty = bytearray(0)
    while d < size:
        net.recv(peers[(me - d) % size], empty)
        net.send(peers[(me + d) % size], b"")
        yield
        d <<= 1
