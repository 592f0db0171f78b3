"""How a group hands a checked collective call to its engine.

How it works
------------
``ProcessGroupNeuron`` checks a call's arguments and describes it (``Call``, for the
cross-rank check), then gives ``Submitter.submit`` a closure running the call's algorithm
on a ``Context``. ``submit`` makes the call's Work and:

* for a small async call that may be deferred (deferral.py, ``deferrable_for``) first
  tries to run it in the caller's thread (``engine.try_now``): its messages are posted
  (or its first step published) at once and its wait is deferred if a peer is behind, so
  a caller that waits soon after costs no thread hand-off;
* else queues it on the engine (``engine.submit``), which runs it in order, now in the
  caller's thread or on its own thread (engine.py).

Every run gets a fresh ``Context`` (the call's number and deadline, the group's channel,
scratch, selection and plans) and, across nodes, a ``NetCall``: the deferrable one kept
for the call, whose second run only finishes what the first posted. Calls are cached by
(op, dtype, count, reduce): a training loop repeats the same few.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Callable

from torch.autograd import profiler as _profiler

from .collectives.context import Context
from .collectives.descriptor import Call
from .collectives.net import NetCall
from .deferral import deferrable_for, finish_deferred
from .work import NeuronWork

_UNSET = timedelta(milliseconds=-1)
_NO_TIME = timedelta(0)
_CALLS_KEPT = 1024


class Submitter:
    """One group's way from a checked call to its engine (see the module docstring).

    ``timeout_s`` and ``label`` are read at each call: ``set_timeout`` and the group's name
    may change them.
    """

    def __init__(self, channel, topo, net, engine, selection, plans, scratch,
                 timeout_s: Callable[[], float], label: Callable[[], str]):
        self._channel, self._topo, self._net, self._engine = channel, topo, net, engine
        self._selection, self._plans, self._scratch = selection, plans, scratch
        self._timeout_s, self._label = timeout_s, label
        self.net_call_scratch: dict = {}  # NetCall's buffers, kept across calls
        self._calls: dict = {}

    def deadline_seconds(self, opts) -> float:
        """Seconds a call with c10d options ``opts`` may take: theirs, else the group's."""
        t = getattr(opts, "timeout", _UNSET)
        if t is None or t <= _NO_TIME:  # (unset: c10d's -1 ms; a comparison, not a call)
            return self._timeout_s()
        return t.total_seconds()

    def call(self, op, dtype, count, reduce=None) -> Call:
        """Call descriptors, cached: training loops repeat the same few calls."""
        key = (op, dtype, count, reduce)
        call = self._calls.get(key)
        if call is None:
            if len(self._calls) > _CALLS_KEPT:
                self._calls.clear()
            call = self._calls[key] = Call(op, dtype, count, reduce=reduce)
        return call

    def submit(self, name: str, call: Call, algo, outputs, opts, nbytes: int, flats=()):
        """Run ``algo(ctx)`` as collective ``name`` (described by ``call``; ``outputs`` are
        what its Work returns, ``flats`` copied back when it ends); returns its Work."""
        if _profiler._is_profiler_enabled:  # name the collective in torch.profiler traces
            with _profiler.record_function(f"neuron:{name}",
                                           f"group={self._label()} bytes={nbytes}"):
                return self._submit(name, call, algo, outputs, opts, nbytes, flats)
        return self._submit(name, call, algo, outputs, opts, nbytes, flats)

    def _submit(self, name: str, call: Call, algo, outputs, opts, nbytes: int, flats):
        seconds = self.deadline_seconds(opts)
        work = NeuronWork(outputs, name)
        channel, scratch, selection = self._channel, self._scratch, self._selection
        net, topo, plans = self._net, self._topo, self._plans
        net_call_scratch = self.net_call_scratch

        async_op = bool(getattr(opts, "asyncOp", False))
        deferrable = (deferrable_for(name, nbytes, channel, net, topo, call, net_call_scratch)
                      if async_op else None)

        def run(seq: int, rec) -> None:
            deadline = time.monotonic() + seconds
            if (deferrable is not None and net is not None  # (then it is the call's NetCall)
                    and finish_deferred(deferrable, seq, deadline)):  # type: ignore[arg-type]
                for f in flats:
                    f.finish()
                return
            ctx = Context(channel, call, seq, deadline, scratch, selection, plans, rec)
            if net is not None:
                if deferrable is not None:  # the same NetCall each time the call runs
                    ctx.net_call = deferrable
                else:
                    ctx.net_call = NetCall(net, topo, call, seq, deadline,
                                           scratch=net_call_scratch)
            algo(ctx)
            for f in flats:
                f.finish()

        if not (deferrable is not None
                and self._engine.try_now(run, work, name, deferrable, call, nbytes)):
            self._engine.submit(run, work, async_op, name, call, nbytes,
                                None if net is not None else channel.peers_published)
        return work
