"""The express lane of a group that spans nodes: a small synchronous all_reduce,
broadcast, all_gather_into_tensor or reduce_scatter_tensor, run by the caller's thread
with the group's own algorithm, without the set-up a repeated call does not need.

How it works
------------
The general path (process_group.py) checks and flattens the arguments, and makes a Work,
a ``Context`` and a ``NetCall`` for every call. This lane keeps, per (collective, dtype,
shape, reduce op or root), the checked call descriptor and the reduction, holds one
``Context`` with one ``NetCall`` that describe each call in turn (``Context.begin``), and
reuses the last call's Work when nothing else holds it (express.py's ``_run``). What runs
is what the general path runs: for all_reduce and broadcast the group's plan for the size
(``allreduce_net.Plan``, ``broadcast_net.Plan``: the selection tables' choices, made once
and kept in the group's ``Plans``, which both paths take them from), for all_gather and
reduce_scatter the algorithm itself (``allgather_net.all_gather``,
``reduce_scatter_net.reduce_scatter``), so ranks may take either path for the same call,
and the flight recorder names the algorithm as the algorithm chooses it. Served:
contiguous CPU tensors of the sizes the ``express/nodes`` lane table of
collectives/selection.py gives it (by default those whose data travels with the call's
descriptor, in one message per peer); anything else (async_op, the profiler on,
PREMUL_SUM, larger tensors, an engine with work queued) takes the general path.
"""

from __future__ import annotations

import torch

from .collectives import allreduce_net, broadcast_net
from .collectives.descriptor import DTYPE_CODES, Call
from .express import ExpressLane, _Entry, _flat


class _Algorithm:
    """An across-nodes algorithm as an express entry's plan (it names itself as it runs:
    ``Context.chose``)."""

    ALGORITHM = None

    def __init__(self, run):
        self.run = run


class NetExpressLane(ExpressLane):
    """Small synchronous all_reduce, broadcast, all_gather_into_tensor and
    reduce_scatter_tensor of a group that spans nodes (see the module docstring); the
    other collectives always take the general path."""

    def __init__(self, channel, engine, scratch, plans, selection, reduce_spec, net_call,
                 algos):
        super().__init__(channel, engine, scratch, plans, selection, reduce_spec)
        self._ctx.net_call = net_call
        self._algos = algos
        self._size = net_call.topo.size

    def _served(self, t) -> bool:
        """Does the lane serve a call on ``t`` (the ``express/nodes`` lane table)?"""
        return (t.layout is torch.strided and t.dtype in DTYPE_CODES
                and self._selection.serves("express/nodes", t.numel() * t.element_size(),
                                           self._size))

    def _all_reduce_entry(self, t, op):
        if not self._served(t):
            return None
        spec = self._spec(op, t.dtype)
        if spec is None:
            return None
        return _Entry("all_reduce", Call("all_reduce", t.dtype, t.numel(), reduce=spec.kind),
                      t.numel() * t.element_size(),
                      allreduce_net.prepared(self._ctx, t.numel(), t.dtype), spec)

    def _broadcast_entry(self, t, root):
        if not (type(root) is int and 0 <= root < self._size and self._served(t)):
            return None
        nbytes = t.numel() * t.element_size()
        return _Entry("broadcast", Call("broadcast", t.dtype, t.numel(), root=root), nbytes,
                      broadcast_net.prepared(self._ctx, nbytes, root))

    def _all_gather_entry(self, out, inp):
        size = self._size
        if not (out.dtype == inp.dtype and out.numel() == inp.numel() * size
                and self._served(inp)):
            return None
        n = inp.numel() * inp.element_size()
        all_gather = self._algos.all_gather
        return _Entry("all_gather_into_tensor", Call("all_gather", inp.dtype, out.numel()), n,
                      _Algorithm(lambda ctx, ob, ib: all_gather(
                          ctx, [ob[k * n:(k + 1) * n] for k in range(size)], ib)))

    def _reduce_scatter_entry(self, out, inp, op):
        size = self._size
        if not (out.dtype == inp.dtype and inp.numel() == out.numel() * size
                and self._served(inp)):
            return None
        spec = self._spec(op, out.dtype)
        if spec is None:
            return None
        n = out.numel()
        reduce_scatter = self._algos.reduce_scatter
        return _Entry("reduce_scatter_tensor",
                      Call("reduce_scatter", out.dtype, inp.numel(), reduce=spec.kind),
                      inp.numel() * inp.element_size(),
                      _Algorithm(lambda ctx, y, x, s: reduce_scatter(
                          ctx, y, [x[k * n:(k + 1) * n] for k in range(size)], s)), spec)

    def _all_gather_args(self, out, inp):
        return _flat(out).view(torch.uint8), _flat(inp).view(torch.uint8)

    def _reduce_scatter_args(self, out, inp, spec):
        return _flat(out), _flat(inp), spec

    def all_to_all(self, out, inp, seconds: float):
        return None
