"""All-reduce among ranks on different nodes by recursive doubling (small buffers).

How it works
------------
In round k (k = 0 .. log2 p - 1) virtual rank ``v`` swaps its whole buffer with ``v ^ 2^k``
and both reduce the two, the lower virtual rank's data first: after round k every block of
2^(k+1) virtual ranks holds the same partial result, bit for bit (both partners computed
the same operation on the same operands in the same order). Any number of ranks: the
fold-in of net_fold.py (an ``extra`` rank sends its buffer to its partner first and gets
the result back last). A rank sends log2 p messages (+1 with the fold) of the whole buffer,
in log2 p dependent rounds (+2): the latency algorithm, for buffers where the number of
messages decides. The order of the additions is a tree, not rank order; float16/bfloat16
round once per level.

Written as a generator over a ``NetCall`` (net.py: ``send``, ``recv``, ``reduce``,
``buffer``; each ``yield`` waits for everything posted), so the simulator
(neuron_dist/bench/netsim.py) runs the same code for thousands of ranks in one process.
"""

from __future__ import annotations

from .net_fold import Fold


def all_reduce(net, buf, peers: list, me: int, spec):
    """Reduce typed ``buf`` in place over ``peers`` (group ranks; ``peers[me]`` is this rank)."""
    fold = Fold(len(peers), me)
    if fold.extra:
        partner = peers[me + 1]
        net.send(partner, buf)
        yield  # (the send completes before the result lands in the same memory)
        net.recv(partner, buf)
        yield
        return
    tmp = net.buffer("rd", buf.numel(), buf.dtype)
    if fold.folded:
        net.recv(peers[me - 1], tmp)
        yield
        net.reduce(buf, [tmp, buf], spec)
    v, mask = fold.vrank, 1
    while mask < fold.pof2:
        pv = v ^ mask
        partner = peers[fold.real(pv)]
        net.recv(partner, tmp)
        net.send(partner, buf)
        yield
        net.reduce(buf, [tmp, buf] if pv < v else [buf, tmp], spec)
        mask <<= 1
    if fold.folded:
        net.send(peers[me - 1], buf)
        yield
