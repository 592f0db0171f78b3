"""The express lane of a group that spans nodes: a small synchronous all_reduce or
broadcast, run by the caller's thread with the group's own algorithm, without the set-up
a repeated call does not need.

How it works
------------
The general path (process_group.py) checks and flattens the arguments, and makes a Work,
a ``Context`` and a ``NetCall`` for every call. This lane keeps, per (collective, dtype,
shape, reduce op or root), the checked call descriptor and the reduction, holds one
``Context`` with one ``NetCall`` that describe each call in turn (``Context.begin``), and
reuses the last call's Work when nothing else holds it (express.py's ``_run``). What runs
is the general path's algorithm itself (``allreduce_net.all_reduce``,
``broadcast_net.broadcast``, with the same selection tables), so ranks may take either
path for the same call, and the flight recorder names the algorithm as the algorithm
chooses it. Served: contiguous CPU tensors up to ``PIGGYBACK_BYTES`` (their data travels
with the call's descriptor, in one message per peer); anything else (async_op, the
profiler on, PREMUL_SUM, larger tensors, an engine with work queued) takes the general
path.
"""

from __future__ import annotations

import torch

from .collectives.descriptor import Call
from .collectives.net import PIGGYBACK_BYTES
from .express import ExpressLane, _Entry


class _Algorithm:
    """An across-nodes algorithm as an express entry's plan (it names itself as it runs:
    ``Context.chose``)."""

    ALGORITHM = None

    def __init__(self, run):
        self.run = run


class NetExpressLane(ExpressLane):
    """Small synchronous all_reduce and broadcast of a group that spans nodes (see the
    module docstring); the other collectives always take the general path."""

    def __init__(self, channel, engine, scratch, plans, selection, reduce_spec, net_call,
                 algos):
        super().__init__(channel, engine, scratch, plans, selection, reduce_spec)
        self._ctx.net_call = net_call
        self._algos = algos
        self._all_reduce = _Algorithm(algos.all_reduce)
        self._size = net_call.topo.size

    def _all_reduce_entry(self, t, op):
        if not self._fits(t, PIGGYBACK_BYTES):
            return None
        spec = self._spec(op, t.dtype)
        if spec is None:
            return None
        return _Entry("all_reduce", Call("all_reduce", t.dtype, t.numel(), reduce=spec.kind),
                      t.numel() * t.element_size(), self._all_reduce, spec)

    def _broadcast_entry(self, t, root):
        if not (type(root) is int and 0 <= root < self._size
                and self._fits(t, PIGGYBACK_BYTES)):
            return None
        broadcast = self._algos.broadcast
        return _Entry("broadcast", Call("broadcast", t.dtype, t.numel(), root=root),
                      t.numel() * t.element_size(),
                      _Algorithm(lambda ctx, x: broadcast(ctx, x.view(-1).view(torch.uint8),
                                                          root)))

    def all_gather(self, out, inp, seconds: float):
        return None

    def reduce_scatter(self, out, inp, opts, seconds: float):
        return None

    def all_to_all(self, out, inp, seconds: float):
        return None
