"""The express lane: a small synchronous all_reduce of a one-node group, start to finish in
the caller's thread, with nothing on the way that a repeated call does not need.

The general path builds, per call, a closure, a ``Context``, a call descriptor lookup and the
engine's task bookkeeping; at 8 bytes that Python work is most of the latency (the data
movement is one copy in, one step and one add). Training loops repeat the same few small
calls (loss scalars, grad-norm pieces, metrics), so the express lane prepares everything that
depends only on (dtype, shape, reduce op) once: the call descriptor words, the slot views of
every rank for both step parities, the reduction. A call then does: claim the engine (it
must be idle: issue order is kept), record the call in the flight recorder, stage the input
in this rank's slot, one channel step carrying the descriptor, compare the peers'
descriptors, reduce the slots into the tensor.

It is the same algorithm as ``allreduce._fits_one_slot``, so both paths interoperate step for
step (a rank may take either). Anything unusual takes the general path: async_op, the
profiler on, PREMUL_SUM (its factor changes per call), a non-contiguous or large tensor, a
group that spans nodes, or an engine with work queued. Failures go through the engine's
error handling, so they are reported exactly as on the general path.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch.autograd import profiler as _profiler

from . import stats
from .collectives.descriptor import DTYPE_CODES, NWORDS, Call, check_all_match
from .collectives.reduce_ops import ReduceSpec, check_supported, reduce_into
from .flight_recorder import recorder
from .work import NeuronWork

_MAX_PLANS = 256
_PREMUL_SUM = dist.ReduceOp.RedOpType.PREMUL_SUM


class _Plan:
    """What one (dtype, shape, reduce op) needs, computed on its first call."""

    __slots__ = ("call", "words", "spec", "slots", "nbytes", "work")

    def __init__(self, channel, t: torch.Tensor, spec: ReduceSpec):
        self.call = Call("all_reduce", t.dtype, t.numel(), reduce=spec.kind)
        self.words = self.call.words(0)[1:]  # everything but the sequence number
        self.spec = spec
        self.nbytes = t.numel() * t.element_size()
        self.work = None  # the last call's Work, recycled once nobody else holds it
        # slots[parity] = every rank's slot of that parity, viewed with t's dtype and shape
        self.slots = [[channel._shaped(k, parity, t) for k in range(channel.size)]
                      for parity in (0, 1)]


class ExpressLane:
    """Small synchronous all_reduce for the group ``pg`` (see the module docstring)."""

    def __init__(self, pg, reduce_spec):
        self._pg = pg
        self._channel = pg._channel
        self._engine = pg._engine
        self._reduce_spec = reduce_spec
        self._plans: dict = {}
        self._limit = min(pg.settings.small_bytes, self._channel.slot_bytes)
        self._enabled = pg._net is None  # not for groups that span nodes

    def _plan(self, key, t: torch.Tensor, op):
        """The plan for ``key``, or None if such calls must take the general path."""
        plan = None
        if (self._enabled and op.op != _PREMUL_SUM and t.layout is torch.strided
                and t.dtype in DTYPE_CODES and t.numel() * t.element_size() <= self._limit):
            spec = self._reduce_spec(op)
            try:
                check_supported(spec, t.dtype)
            except ValueError:
                return None  # the general path raises it
            plan = _Plan(self._channel, t, spec)
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def all_reduce(self, t, opts, seconds: float):
        """Run the all-reduce of ``t`` now and return its completed Work, or None if this
        call must take the general path (nothing has been done then)."""
        if type(t) is not torch.Tensor or not t.is_cpu or not t.is_contiguous():
            return None
        op = opts.reduceOp
        key = (t.dtype, t.shape, op.op)
        plan = self._plans.get(key, _MISSING)
        if plan is _MISSING:
            plan = self._plan(key, t, op)
        if plan is None or _profiler._is_profiler_enabled:
            return None
        engine = self._engine
        seq = engine.claim_inline()
        if not seq:
            return None
        what = f"all_reduce #{seq} in group {engine.label}"
        # A Work costs ~8 µs to make and free, a fifth of this path. c10d waits on a
        # synchronous call's Work and drops it, so the previous one is usually free: reuse it
        # unless something still refers to it (or to its future).
        if plan.work is not None and sys.getrefcount(plan.work) == 2 and plan.work._future is None:
            work = plan.work
            work._outputs, work.what, work._finished, work._exception = [t], what, False, None
        else:
            work = plan.work = NeuronWork([t], what)
        rec = recorder.issue(engine.group_name, engine.rank, engine.size, seq, "all_reduce",
                             plan.call)
        started = time.monotonic()
        stats.add_call(plan.nbytes)
        try:
            if rec is not None:
                rec.start()
            channel = self._channel
            epoch = channel.epoch + 1
            views = plan.slots[epoch & 1]
            x = t.detach() if t.requires_grad else t
            views[channel.rank].copy_(x)
            descriptor = (seq,) + plan.words + (epoch,)
            channel.step(started + seconds, descriptor)
            for k in range(channel.size):
                if k != channel.rank and channel.peer_descriptor(k, seq, NWORDS + 1) != descriptor:
                    check_all_match(channel, plan.call, seq, epoch)  # raises, naming the calls
            reduce_into(x, views, plan.spec, channel.size, self._pg._scratch)
        except BaseException as exc:  # noqa: BLE001 - reported like the general path's
            engine.fail(exc, work, rec)
        else:
            if rec is not None:
                rec.finish()
            work._finished = True  # nobody else has seen this Work yet: no lock needed
        finally:
            engine.release_inline()
            stats.add_blocked(time.monotonic() - started)
        return work


_MISSING = object()
