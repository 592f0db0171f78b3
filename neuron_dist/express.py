"""The express lane: a small synchronous all_reduce, broadcast, all_gather_into_tensor,
reduce_scatter_tensor or evenly split all_to_all_single of a one-node group, start to finish
in the caller's thread, with nothing on the way that a repeated call does not need.

The general path builds, per call, a closure, a ``Context``, a call descriptor lookup and the
engine's task bookkeeping; at 8 bytes that Python work is most of the latency (the data
movement is one copy in, one step and one add). Training loops repeat the same few small
calls (loss scalars, grad-norm pieces, metrics), so the express lane prepares everything that
depends only on (dtype, shape, reduce op or root) once: the call descriptor words, the slot
views of every rank for both step parities, the reduction. A call then does: claim the
engine (it must be idle: issue order is kept), record the call in the flight recorder, stage
the input in this rank's slot (all_reduce, all_gather: every rank; broadcast: the root), one
channel step carrying the descriptor, compare the peers' descriptors, then reduce the slots
into the tensor (all_reduce), copy the root's slot into it (broadcast, the other ranks),
concatenate every rank's slot into the output (all_gather), reduce block r of every slot
into the output (reduce_scatter: each rank staged its whole input, block k for rank k), or,
for all_to_all, stage the split-size header and one block per peer, check every rank's
header after the step and copy each peer's block for us out of its slot.

These are the algorithms of ``allreduce._fits_one_slot``, ``broadcast.broadcast``,
``allgather.all_gather``, ``reduce_scatter.reduce_scatter`` and ``alltoall.all_to_all``
for one slot's worth, so both paths interoperate step for step (a rank may take either).
Anything unusual takes the general path: async_op, the profiler on, PREMUL_SUM (its factor
changes per call), a non-contiguous or large tensor, uneven splits, a group that spans
nodes, or an engine with work queued. Failures go through the engine's error handling, so
they are reported exactly as on the general path.
"""

from __future__ import annotations

import ctypes
import sys
import time

import torch
import torch.distributed as dist
from torch.autograd import profiler as _profiler

from . import stats
from .collectives import alltoall, reduce_scatter, single_copy
from .collectives.descriptor import DTYPE_CODES, NWORDS, Call, check_all_match
from .collectives.reduce_ops import ReduceSpec, check_supported, reduce_into
from .flight_recorder import recorder
from .work import NeuronWork

_MAX_PLANS = 256
_PREMUL_SUM = dist.ReduceOp.RedOpType.PREMUL_SUM


class _Plan:
    """What one (op, dtype, shape, reduce op or root) needs, computed on its first call."""

    __slots__ = ("call", "words", "spec", "root", "slots", "nbytes", "work", "blocks", "scatter")

    def __init__(self, channel, t: torch.Tensor, call: Call, spec: ReduceSpec | None = None,
                 root: int | None = None, flat: bool = False, views: bool = True):
        self.call = call
        self.words = self.call.words(0)[1:]  # everything but the sequence number
        self.spec, self.root = spec, root
        self.nbytes = t.numel() * t.element_size()
        self.work = None  # the last call's Work, recycled once nobody else holds it
        self.blocks = None  # all_to_all: _Blocks
        self.scatter = None  # reduce_scatter: _Scatter
        # slots[parity] = every rank's slot of that parity, viewed with t's dtype and shape
        # (flat: as a vector of t's elements); not made for plans that address slots by
        # pointer (all_to_all, reduce_scatter)
        like = t.reshape(-1) if flat else t
        self.slots = [[channel._shaped(k, parity, like) for k in range(channel.size)]
                      for parity in (0, 1)] if views else None


class _Blocks:
    """The slot layout of ``alltoall.all_to_all`` for blocks of ``block`` bytes: addresses
    of every rank's slot of both parities, the header words this rank posts, and the table
    of split sizes every rank must post for the call to be consistent."""

    __slots__ = ("block", "header", "per", "addr", "words", "expect")

    def __init__(self, channel, block: int):
        n = channel.size
        self.block = block
        self.header = -(-16 * n // alltoall.ALIGN_BYTES) * alltoall.ALIGN_BYTES
        self.per = ((channel.slot_bytes - self.header) // n) // alltoall.ALIGN_BYTES \
            * alltoall.ALIGN_BYTES
        self.addr = [[channel._typed(k, parity, None).data_ptr() for k in range(n)]
                     for parity in (0, 1)]
        self.words = (ctypes.c_int64 * (2 * n))(*([block] * (2 * n)))
        self.expect = list(self.words)


class _Scatter:
    """``reduce_scatter.reduce_scatter``'s slot layout for one step: this rank stages block
    k of its input at ``k * per`` elements of its slot (addresses of both parities), and
    reduces every rank's block r into the (1-D) output."""

    __slots__ = ("block", "per", "addr", "views")

    def __init__(self, channel, out: torch.Tensor, per: int):
        es, r = out.element_size(), channel.rank
        self.block, self.per = out.numel() * es, per * es
        self.addr = [channel._typed(r, parity, None).data_ptr() for parity in (0, 1)]
        self.views = [[channel._typed(k, parity, out.dtype)[r * per:r * per + out.numel()]
                       for k in range(channel.size)] for parity in (0, 1)]


class ExpressLane:
    """Small synchronous all_reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor
    and evenly split all_to_all_single for the group ``pg`` (see the module docstring)."""

    def __init__(self, pg, reduce_spec):
        self._pg = pg
        self._channel = pg._channel
        self._engine = pg._engine
        self._reduce_spec = reduce_spec
        self._plans: dict = {}
        self._limit = min(pg.settings.small_bytes, self._channel.slot_bytes)
        self._enabled = pg._net is None  # not for groups that span nodes

    def _eligible(self, t, limit: int | None = None) -> bool:
        return (self._enabled and t.layout is torch.strided and t.dtype in DTYPE_CODES
                and t.numel() * t.element_size() <= (self._limit if limit is None else limit))

    def _remember(self, key, plan):
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

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

    def _all_reduce_plan(self, key, t: torch.Tensor, op):
        """The plan for ``key``, or None if such calls must take the general path."""
        plan = None
        spec = self._spec(op, t.dtype) if self._eligible(t) else None
        if spec is not None:
            plan = _Plan(self._channel, t, Call("all_reduce", t.dtype, t.numel(),
                                                reduce=spec.kind), spec=spec)
        return self._remember(key, plan)

    def _broadcast_plan(self, key, t: torch.Tensor, root):
        plan = None
        if type(root) is int and 0 <= root < self._channel.size and self._eligible(t):
            plan = _Plan(self._channel, t, Call("broadcast", t.dtype, t.numel(), root=root),
                         root=root)
        return self._remember(key, plan)

    def _all_gather_plan(self, key, out: torch.Tensor, inp: torch.Tensor):
        plan = None
        if (out.dtype == inp.dtype and out.numel() == inp.numel() * self._channel.size
                and self._eligible(inp)):
            plan = _Plan(self._channel, inp, Call("all_gather", inp.dtype, out.numel()),
                         flat=True)
        return self._remember(key, plan)

    def _all_to_all_plan(self, key, out: torch.Tensor, inp: torch.Tensor):
        plan = None
        n = self._channel.size
        nbytes = inp.numel() * inp.element_size()
        # Any size the general path moves in its one step (not just NEURON_DIST_SMALL_BYTES,
        # a threshold between all_reduce algorithms): blocks up to a slot's share.
        if (out.dtype == inp.dtype and out.numel() == inp.numel()
                and self._eligible(inp, self._channel.slot_bytes)
                and nbytes % n == 0 and inp.dim() and out.dim()
                and inp.shape[0] % n == 0 and out.shape[0] % n == 0):
            blocks = _Blocks(self._channel, nbytes // n)
            # One step on the general path too (larger blocks may take a second one there).
            if blocks.block <= blocks.per and blocks.block < single_copy.MIN_BYTES:
                plan = _Plan(self._channel, inp, Call("all_to_all", inp.dtype, 0),
                             views=False)
                plan.blocks = blocks
        return self._remember(key, plan)

    def _reduce_scatter_plan(self, key, out: torch.Tensor, inp: torch.Tensor, op):
        plan = None
        n = self._channel.size
        es = out.element_size()
        per = (self._channel.slot_bytes // n) // reduce_scatter.ALIGN_BYTES \
            * reduce_scatter.ALIGN_BYTES // es
        spec = None
        if (out.dtype == inp.dtype and out.dim() == 1
                and inp.numel() == out.numel() * n and 0 < out.numel() <= per
                and out.numel() * es < single_copy.MIN_BYTES  # one step on the general path
                and self._eligible(inp, self._channel.slot_bytes)):
            spec = self._spec(op, out.dtype)
        if spec is not None:
            plan = _Plan(self._channel, out, Call("reduce_scatter", out.dtype, inp.numel(),
                                                  reduce=spec.kind), spec=spec, views=False)
            plan.scatter = _Scatter(self._channel, out, per)
            plan.nbytes = inp.numel() * inp.element_size()  # (as the general path counts it)
        return self._remember(key, plan)

    @staticmethod
    def _usable(t) -> bool:
        return (type(t) is torch.Tensor and t.is_cpu and t.is_contiguous()
                and not _profiler._is_profiler_enabled)

    def all_reduce(self, t, opts, seconds: float):
        """Run the all-reduce of ``t`` now and return its completed Work, or None if this
        call must take the general path (nothing has been done then)."""
        if not self._usable(t):
            return None
        op = opts.reduceOp
        key = ("all_reduce", t.dtype, t.shape, op.op)
        plan = self._plans.get(key, _MISSING)
        if plan is _MISSING:
            plan = self._all_reduce_plan(key, t, op)
        return None if plan is None else self._run(plan, t, t, seconds)

    def broadcast(self, t, opts, seconds: float):
        """Run the broadcast of ``t`` now and return its completed Work, or None if this
        call must take the general path (nothing has been done then)."""
        if not self._usable(t):
            return None
        root = opts.rootRank
        key = ("broadcast", t.dtype, t.shape, root)
        plan = self._plans.get(key, _MISSING)
        if plan is _MISSING:
            plan = self._broadcast_plan(key, t, root)
        return None if plan is None else self._run(plan, t, t, seconds)

    def all_gather(self, out, inp, seconds: float):
        """Run all_gather_into_tensor(``out``, ``inp``) now and return its completed Work, or
        None if this call must take the general path (nothing has been done then)."""
        if not (self._usable(inp) and self._usable(out)):
            return None
        key = ("all_gather", inp.dtype, inp.shape, out.numel())
        plan = self._plans.get(key, _MISSING)
        if plan is _MISSING:
            plan = self._all_gather_plan(key, out, inp)
        return None if plan is None else self._run(plan, inp, out, seconds)

    def all_to_all(self, out, inp, seconds: float):
        """Run an evenly split all_to_all_single(``out``, ``inp``) now and return its
        completed Work, or None if this call must take the general path."""
        if not (self._usable(inp) and self._usable(out)):
            return None
        key = ("all_to_all", inp.dtype, inp.shape, out.shape)
        plan = self._plans.get(key, _MISSING)
        if plan is _MISSING:
            plan = self._all_to_all_plan(key, out, inp)
        return None if plan is None else self._run(plan, inp, out, seconds)

    def reduce_scatter(self, out, inp, opts, seconds: float):
        """Run reduce_scatter_tensor(``out``, ``inp``) now and return its completed Work, or
        None if this call must take the general path."""
        if not (self._usable(inp) and self._usable(out)):
            return None
        op = opts.reduceOp
        key = ("reduce_scatter", inp.dtype, inp.shape, out.shape, op.op)
        plan = self._plans.get(key, _MISSING)
        if plan is _MISSING:
            plan = self._reduce_scatter_plan(key, out, inp, op)
        return None if plan is None else self._run(plan, inp, out, seconds)

    def _run(self, plan: _Plan, t, out, seconds: float):
        """Run ``plan`` with input ``t`` and output ``out`` (the same tensor but for
        all_gather)."""
        engine = self._engine
        seq = engine.claim_inline()
        if not seq:
            return None
        name = plan.call.op
        what = f"{name} #{seq} in group {engine.label}"
        # A Work costs ~8 µs to make and free, a fifth of this path. c10d waits on a
        # synchronous call's Work and drops it, so the previous one is usually free: reuse it
        # unless something still refers to it (or to its future).
        if plan.work is not None and sys.getrefcount(plan.work) == 2 and plan.work._future is None:
            work = plan.work
            work._outputs, work.what, work._finished, work._exception = [out], what, False, None
        else:
            work = plan.work = NeuronWork([out], what)
        rec = recorder.issue(engine.group_name, engine.rank, engine.size, seq, name, plan.call)
        started = time.monotonic()
        stats.add_call(plan.nbytes)
        try:
            if rec is not None:
                rec.start()
            channel = self._channel
            epoch = channel.epoch + 1
            views = plan.slots[epoch & 1] if plan.slots is not None else None
            x = t.detach() if t.requires_grad else t
            gather = plan.call.op == "all_gather"
            root = plan.root
            if plan.blocks is not None:
                _stage_blocks(channel, plan.blocks, epoch, t)
            elif plan.scatter is not None:
                sc = plan.scatter
                src, mine = t.data_ptr(), sc.addr[epoch & 1]
                for k in range(channel.size):
                    ctypes.memmove(mine + k * sc.per, src + k * sc.block, sc.block)
            elif gather:
                views[channel.rank].copy_(x.reshape(-1))
            elif root is None or root == channel.rank:
                views[channel.rank].copy_(x)
            descriptor = (seq,) + plan.words + (epoch,)
            channel.step(started + seconds, descriptor)
            for k in range(channel.size):
                if k != channel.rank and channel.peer_descriptor(k, seq, NWORDS + 1) != descriptor:
                    check_all_match(channel, plan.call, seq, epoch)  # raises, naming the calls
            if gather:
                torch.cat(views, out=(out.detach() if out.requires_grad else out).view(-1))
            elif plan.blocks is not None:
                _take_blocks(channel, plan, seq, epoch, t, out)
            elif plan.scatter is not None:
                reduce_into(out.detach() if out.requires_grad else out,
                            plan.scatter.views[epoch & 1], plan.spec, channel.size,
                            self._pg._scratch)
            elif root is None:
                reduce_into(x, views, plan.spec, channel.size, self._pg._scratch)
            elif root != channel.rank:
                x.copy_(views[root])
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


def _stage_blocks(channel, b: _Blocks, epoch: int, inp) -> None:
    """Before ``alltoall.all_to_all``'s single step: the split-size header and a block for
    every peer in this rank's slot (memmove from prepared addresses)."""
    n, r, size = channel.size, channel.rank, b.block
    mine, src = b.addr[epoch & 1][r], inp.data_ptr()
    ctypes.memmove(mine, b.words, 16 * n)
    for k in range(n):
        if k != r:
            ctypes.memmove(mine + b.header + k * b.per, src + k * size, size)


def _take_blocks(channel, plan: _Plan, seq: int, epoch: int, inp, out) -> None:
    """After the step: every rank must have posted the even split we expect (else the same
    error as the general path), then our own block and each peer's block for us."""
    b = plan.blocks
    n, r, size = channel.size, channel.rank, b.block
    src, dst = inp.data_ptr(), out.data_ptr()
    slots = b.addr[epoch & 1]
    table = [list((ctypes.c_int64 * (2 * n)).from_address(slots[k])) for k in range(n)]
    if any(row != b.expect for row in table):
        alltoall._check_splits(table, n, inp.element_size(), _Named(plan.call, seq))
    ctypes.memmove(dst + r * size, src + r * size, size)
    for k in range(n):
        if k != r:
            ctypes.memmove(dst + k * size, slots[k] + b.header + r * b.per, size)


class _Named:
    """What ``alltoall._check_splits`` reads from a Context: the call and its number."""

    __slots__ = ("call", "seq")

    def __init__(self, call, seq):
        self.call, self.seq = call, seq


_MISSING = object()
