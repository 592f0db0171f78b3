"""The express lane: a small synchronous all_reduce, broadcast, all_gather_into_tensor,
reduce_scatter_tensor or evenly split all_to_all_single of a one-node group, run by the
caller's thread with nothing on the way that a repeated call does not need.

The general path (process_group.py) validates and flattens the arguments and describes the
call every time; at 8 bytes that Python work is most of the latency. Training loops repeat
the same few small calls (loss scalars, grad-norm pieces, metrics), so the express lane
keeps, per (collective, dtype, shapes, reduce op or root), what they need: the checked
call descriptor, the reduction, the bytes counted, and the algorithm's single-step plan
(``allreduce.OneSlot``, ``broadcast.OneSlot``, ``allgather.OneSlot``,
``reduce_scatter.OneStep``, ``alltoall.EvenSplit``). The plan is the one the algorithm
itself uses for such a call, taken from the group's ``Plans``: the engine thread and the
caller's thread run the same code, so ranks may take either path for the same call.

A call goes to ``CollectiveEngine.run_now``, which runs it in the caller's thread if the
engine is idle (issue order is kept), with the same flight-recorder, stats and error
handling as every collective; the record names the plan's algorithm (its constant
``ALGORITHM``). The lane serves a call only where the selection tables
(collectives/selection.py) pick the algorithm whose plan it holds. Anything unusual takes
the general path: async_op, the profiler on, PREMUL_SUM (its factor changes per call), a
non-contiguous or large tensor, uneven splits, or an engine with work queued. A group that
spans nodes has its own lane (express_net.py), built on this one.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.autograd import profiler as _profiler

from .collectives import allgather, allreduce, alltoall, broadcast, reduce_scatter
from .collectives.context import Context
from .collectives.descriptor import DTYPE_CODES, Call
from .collectives.reduce_ops import check_supported
from .work import NeuronWork

_MAX_ENTRIES = 256
_PREMUL_SUM = dist.ReduceOp.RedOpType.PREMUL_SUM
_SUM = dist.ReduceOp.SUM
_MISSING = object()


class _Entry:
    """What a repeated call needs: its name, checked descriptor, reduction, byte count for
    the stats, and the algorithm's plan (whose ``ALGORITHM`` the flight recorder names)."""

    __slots__ = ("name", "call", "spec", "nbytes", "plan", "algo", "work")

    def __init__(self, name: str, call: Call, nbytes: int, plan, spec=None):
        self.name, self.call, self.nbytes, self.plan, self.spec = name, call, nbytes, plan, spec
        self.algo = plan.ALGORITHM
        # The last call's Work, reused by the next call if nothing else can reach it: c10d
        # waits on a synchronous call's Work and drops it, so unless the caller kept it
        # (``work = dist.all_reduce(...)``) or made a future from it, this attribute is its
        # only reference, which ``sys.getrefcount`` tells exactly (a Work that C++ keeps
        # is referenced too). Saves making and freeing one (a c10d object) per call.
        self.work = None


class ExpressLane:
    """Small synchronous collectives of a one-node group (see the module docstring).

    Each method runs its collective now and returns the completed Work, or returns None,
    having done nothing, if the call must take the general path.
    """

    def __init__(self, channel, engine, scratch, plans, selection, reduce_spec):
        self._channel = channel
        self._engine = engine
        self._scratch = scratch
        self._plans = plans
        self._selection = selection
        self._reduce_spec = reduce_spec
        self._entries: dict = {}
        # One Context for every call of the lane: the engine runs one call at a time
        self._ctx = Context(channel, None, 0, 0.0, scratch, selection, plans)

    # ------------------------------------------------------------ entries
    def _remember(self, key, entry):
        if len(self._entries) >= _MAX_ENTRIES:
            self._entries.clear()
        self._entries[key] = entry
        return entry

    def _fits(self, t, limit: int) -> bool:
        return (t.layout is torch.strided and t.dtype in DTYPE_CODES
                and t.numel() * t.element_size() <= limit)

    def _spec(self, op, dtype):
        """The reduction of ``op`` on ``dtype``, or None: PREMUL_SUM (its factor changes per
        call) and unsupported pairs (the general path raises the error) are not served."""
        if op.op == _PREMUL_SUM:
            return None
        spec = self._reduce_spec(op)
        try:
            check_supported(spec, dtype)
        except ValueError:
            return None
        return spec

    def _all_reduce_entry(self, t, op):
        channel, n = self._channel, t.numel() * t.element_size()
        # the general path's choice (selection.py), served when it runs a single-step plan
        plan = (allreduce.single_step(self._selection, channel, t)
                if self._fits(t, channel.slot_bytes) else None)
        if plan is None:
            return None
        spec = self._spec(op, t.dtype)
        if spec is None:
            return None
        return _Entry("all_reduce", Call("all_reduce", t.dtype, t.numel(), reduce=spec.kind), n,
                      plan.prepared(self._plans, channel, t), spec)

    def _broadcast_entry(self, t, root):
        channel = self._channel
        if not (type(root) is int and 0 <= root < channel.size
                and self._fits(t, channel.slot_bytes)):
            return None
        return _Entry("broadcast", Call("broadcast", t.dtype, t.numel(), root=root),
                      t.numel() * t.element_size(),
                      broadcast.OneSlot.prepared(self._plans, channel, t, root))

    def _all_gather_entry(self, out, inp):
        channel = self._channel
        if not (out.dtype == inp.dtype and out.numel() == inp.numel() * channel.size
                and self._fits(inp, channel.slot_bytes)):
            return None
        flat = inp.reshape(-1)
        plan = allgather.single_step(self._selection, channel, flat)
        if plan is None:
            return None
        return _Entry("all_gather_into_tensor", Call("all_gather", inp.dtype, out.numel()),
                      inp.numel() * inp.element_size(),
                      plan.prepared(self._plans, channel, flat))

    def _reduce_scatter_entry(self, out, inp, op):
        channel, n = self._channel, self._channel.size
        es = out.element_size()
        if not (out.dtype == inp.dtype and out.dim() == 1 and inp.numel() == out.numel() * n
                and self._fits(inp, channel.slot_bytes)):
            return None
        plan = reduce_scatter.single_step(self._selection, channel, out.numel(), es)
        if plan is None:
            return None
        spec = self._spec(op, out.dtype)
        if spec is None:
            return None
        return _Entry("reduce_scatter_tensor",
                      Call("reduce_scatter", out.dtype, inp.numel(), reduce=spec.kind),
                      inp.numel() * inp.element_size(),
                      plan.prepared(self._plans, channel, out.dtype, out.numel()), spec)

    def _all_to_all_entry(self, out, inp):
        channel, n = self._channel, self._channel.size
        nbytes = inp.numel() * inp.element_size()
        # Any size the general path moves in one step with the same plan, not only
        # NEURON_DIST_SMALL_BYTES (a threshold between all_reduce algorithms).
        if not (out.dtype == inp.dtype and out.numel() == inp.numel()
                and self._fits(inp, channel.slot_bytes) and nbytes % n == 0
                and inp.dim() and out.dim() and inp.shape[0] % n == 0
                and out.shape[0] % n == 0):
            return None
        plan = alltoall.single_step(self._selection, channel, nbytes // n)
        if plan is None:
            return None
        return _Entry("all_to_all_single", Call("all_to_all", inp.dtype, 0), nbytes,
                      plan.prepared(self._plans, channel, nbytes // n))

    # ------------------------------------------------------------ calls
    @staticmethod
    def _usable(t) -> bool:
        return (type(t) is torch.Tensor and t.is_cpu and t.is_contiguous()
                and not _profiler._is_profiler_enabled)

    def all_reduce(self, t, opts, seconds: float):
        """``dist.all_reduce(t)``: the completed Work, or None (take the general path)."""
        # (_usable, written out: this is the most frequent small call)
        if not (type(t) is torch.Tensor and t.is_cpu and t.is_contiguous()
                and not _profiler._is_profiler_enabled):
            return None
        op = opts.reduceOp
        # SUM, the usual op, is told by one comparison: reading the op's enum (``op.op``),
        # hashing it and comparing it in the key are pybind calls (callgrind: about 3k,
        # 2k and 5k instructions; the comparison about 2k).
        key = (("all_reduce", t.dtype, t.shape) if op == _SUM
               else ("all_reduce", t.dtype, t.shape, op.op))
        entry = self._entries.get(key, _MISSING)
        if entry is _MISSING:
            entry = self._remember(key, self._all_reduce_entry(t, op))
        if entry is None:
            return None
        x = t.detach() if t.requires_grad else t
        return self._run(entry, [t], seconds, x, x, entry.spec)

    def broadcast(self, t, opts, seconds: float):
        """``dist.broadcast(t)``: the completed Work, or None (take the general path)."""
        if not self._usable(t):
            return None
        root = opts.rootRank
        key = ("broadcast", t.dtype, t.shape, root)
        entry = self._entries.get(key, _MISSING)
        if entry is _MISSING:
            entry = self._remember(key, self._broadcast_entry(t, root))
        if entry is None:
            return None
        return self._run(entry, [t], seconds, t.detach() if t.requires_grad else t)

    def all_gather(self, out, inp, seconds: float):
        """``all_gather_into_tensor(out, inp)``: the completed Work, or None."""
        if not (self._usable(inp) and self._usable(out)):
            return None
        key = ("all_gather", inp.dtype, inp.shape, out.shape)
        entry = self._entries.get(key, _MISSING)
        if entry is _MISSING:
            entry = self._remember(key, self._all_gather_entry(out, inp))
        if entry is None:
            return None
        return self._run(entry, [out], seconds, *self._all_gather_args(out, inp))

    def _all_gather_args(self, out, inp):
        """What the all_gather plan's ``run`` takes after the context."""
        return _flat(out), _flat(inp)

    def reduce_scatter(self, out, inp, opts, seconds: float):
        """``reduce_scatter_tensor(out, inp)``: the completed Work, or None."""
        if not (self._usable(inp) and self._usable(out)):
            return None
        op = opts.reduceOp
        key = ("reduce_scatter", inp.dtype, inp.shape, out.shape, op.op)
        entry = self._entries.get(key, _MISSING)
        if entry is _MISSING:
            entry = self._remember(key, self._reduce_scatter_entry(out, inp, op))
        if entry is None:
            return None
        return self._run(entry, [out], seconds, *self._reduce_scatter_args(out, inp, entry.spec))

    def _reduce_scatter_args(self, out, inp, spec):
        """What the reduce_scatter plan's ``run`` takes after the context."""
        y = out.detach() if out.requires_grad else out
        base, block = inp.data_ptr(), out.numel() * out.element_size()
        return y, [base + k * block for k in range(self._channel.size)], spec

    def all_to_all(self, out, inp, seconds: float):
        """Evenly split ``all_to_all_single(out, inp)``: the completed Work, or None."""
        if not (self._usable(inp) and self._usable(out)):
            return None
        key = ("all_to_all", inp.dtype, inp.shape, out.shape)
        entry = self._entries.get(key, _MISSING)
        if entry is _MISSING:
            entry = self._remember(key, self._all_to_all_entry(out, inp))
        if entry is None:
            return None
        n = self._channel.size
        block = entry.plan.block
        src, dst = inp.data_ptr(), out.data_ptr()
        srcs = [src + k * block for k in range(n)]
        dsts = [dst + k * block for k in range(n)]
        return self._run(entry, [out], seconds, dsts, srcs, inp.element_size())

    def planned(self, op: str, t) -> tuple:
        """A hook for the lab's layer-by-layer timing (bench/layers.py): ``(entry, args)``,
        the lane's prepared entry for ``dist.all_reduce(t)`` (SUM) or ``dist.broadcast(t,
        0)`` (``op``: "all_reduce" or "broadcast") and the arguments its plan's ``run``
        takes after the context, as ``all_reduce`` / ``broadcast`` would hand them over.
        Nothing runs. Raises LookupError when the lane does not serve that call."""
        try:
            key, make, args = _PLANNED[op]
        except KeyError:
            raise ValueError(f"planned: no {op!r} (all_reduce, broadcast)") from None
        key = key(t)
        entry = self._entries.get(key, _MISSING)
        if entry is _MISSING:
            entry = self._remember(key, make(self, t))
        if entry is None or not self._usable(t):
            raise LookupError(f"the express lane does not serve this {op}")
        return entry, args(t, entry)

    def _run(self, entry: _Entry, outputs: list, seconds: float, *args):
        """Run ``entry.plan.run(ctx, *args)`` as the group's next collective now, or
        return None."""
        # Reuse the last call's Work when nothing else can reach it (see _Entry.work).
        if entry.work is None or not entry.work.restart(outputs):
            entry.work = NeuronWork(outputs, entry.name)
        work = entry.work
        ctx, call, plan_run = self._ctx, entry.call, entry.plan.run

        def run(seq: int, rec) -> None:
            ctx.begin(call, seq, time.monotonic() + seconds, rec)
            plan_run(ctx, *args)

        return (work if self._engine.run_now(run, work, entry.name, call, entry.nbytes, entry.algo)
                else None)


# ``planned``'s collectives: op -> (the entry's key, how to make the entry, the plan's
# arguments after the context), as ``all_reduce`` (SUM) and ``broadcast`` (root 0) do them
_PLANNED = {
    "all_reduce": (lambda t: ("all_reduce", t.dtype, t.shape),
                   lambda lane, t: lane._all_reduce_entry(t, _SUM),
                   lambda t, entry: (t, t, entry.spec)),
    "broadcast": (lambda t: ("broadcast", t.dtype, t.shape, 0),
                  lambda lane, t: lane._broadcast_entry(t, 0),
                  lambda t, entry: (t,)),
}


def _flat(t):
    """``t`` detached and 1-D (a torch view op costs µs: only when needed)."""
    if t.requires_grad:
        t = t.detach()
    return t if t.dim() == 1 else t.view(-1)
