"""``NeuronWork``: the handle c10d returns for every operation.

A Work completes exactly once, with its output tensors or an exception. ``wait`` blocks
(with an optional timeout) and re-raises the exception; ``get_future`` gives a
``torch.futures.Future`` completed with the list of output tensors, which DDP comm hooks
and funcol rely on. Who makes progress while a caller waits depends on the operation:
collectives are executed by their group's engine (or inline), send/recv are driven by the
caller's own ``wait`` through its ``op`` so no thread hand-off sits on the critical path;
a network send/recv completes when someone looks (``wait``, ``is_completed``, ...) or,
once a future or hook asks for it, by itself.

Small synchronous collectives complete before their Work is even returned, so a Work
allocates nothing it may not need: the future is made on first ``get_future`` and blocking
waiters share one process-wide condition variable.
"""

from __future__ import annotations

import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import stats
from .errors import PeerTimeoutError

# Guards completion state; blocking waiters sleep on ``_state``. Taken as ``_lock`` (the
# condition's own lock): entering a Condition is a Python-level call, the lock's is not.
_lock = threading.RLock()
_state = threading.Condition(_lock)


class NeuronWork(dist.Work):
    """Completion handle of one neuron operation.

    Parameters
    ----------
    outputs : list[torch.Tensor]
        What the future is completed with.
    what : str, tuple or callable
        Human-readable description (e.g. ``"all_reduce #12 in group 'default_pg'"``), or
        what makes it, formatted only if read: a function returning it, or a collective's
        ``(name, sequence number, group label)``.

    Attributes
    ----------
    finished : bool
        Complete (with or without an error). Users ask ``is_completed()``, which also
        completes a finished send/recv that nobody has looked at yet.
    description : str, tuple or callable
        ``what`` as given (``what`` formats it once read): its maker sets a collective's
        ``(name, sequence number, group label)`` when the call is issued.

    The backend's side of a Work (``complete``, ``complete_unseen``, ``restart``) is written
    here once: the engine, the express lanes and send/recv use only these.
    """

    def __init__(self, outputs, what):
        super().__init__()
        self._outputs = outputs
        self.description = what
        self.finished = False
        self._exception = None
        self._future = None
        self._source = -1
        self._hooks = None
        self._waiters = 0
        # A send/recv's progress (None for collectives): ``op.drive(deadline)`` makes
        # progress until done. A network send/recv completes lazily: ``op.poll()``
        # completes this work if its request has finished, ``op.arm()`` makes it complete
        # by itself when the request does (for futures and hooks, which must not wait for
        # a caller to look).
        self.op = None
        self.engine = None  # the CollectiveEngine that runs this work, if queued

    @property
    def what(self) -> str:
        """What this work is, e.g. ``"all_reduce #3 in group 'default_pg'"`` (given as a
        string, or as a function formatting it the first time it is read)."""
        what = self.description
        if type(what) is tuple:
            name, seq, label = what
            what = self.description = f"{name} #{seq} in group {label}"
        elif not isinstance(what, str):
            what = self.description = what()
        return what

    @what.setter
    def what(self, value) -> None:
        self.description = value

    # ------------------------------------------------------------- completion
    def complete_unseen(self, source: int = -1) -> None:
        """Complete successfully a work no other thread can have seen yet (a collective run
        by the caller before its work is returned): no future, hooks or waiters exist."""
        self.finished, self._source = True, source

    def restart(self, outputs, what=None, finished: bool = False, source: int = -1) -> bool:
        """Make this completed work the handle of a new call, if nobody else can reach it:
        call it as ``keeper.work.restart(...)`` (never through a local name), so that the
        keeper's attribute is its only reference. False, with nothing changed, when another
        exists (the caller kept the work, C++ holds it, a future or hook was made from
        it): then make a new one.

        c10d waits on a synchronous call's Work and drops it, so its maker (the express
        lane, send/recv's face) keeps the last one and restarts it for the next call
        instead of making and freeing a c10d object per call. ``outputs``, ``what`` (None:
        kept), ``finished`` (a send/recv that completed as it was posted) and its
        ``source`` describe the new call; its error is cleared."""
        # references: the keeper's attribute, this frame's ``self``, getrefcount's argument
        if sys.getrefcount(self) != 3 or self._future is not None or self._hooks is not None:
            return False
        self._outputs, self.finished, self._exception, self._source = (outputs, finished,
                                                                        None, source)
        if what is not None:
            self.description = what
        return True

    def _look(self) -> None:
        """Complete a lazily completed work whose operation has finished."""
        op = self.op
        if op is not None and not self.finished:
            op.poll()

    def _arm(self) -> None:
        op = self.op
        if op is not None and not self.finished:
            op.arm()

    def add_done_hook(self, hook, arm: bool = True) -> None:
        """Call ``hook()`` once this work is complete (now, if it already is). ``arm``:
        make a lazily completed work complete by itself; without it, the hook runs when
        someone looks at this work (or at one sharing its ``op``)."""
        if arm:
            self._arm()
        with _lock:
            if not self.finished:
                if self._hooks is None:
                    self._hooks = []
                self._hooks.append(hook)
                return
        hook()

    def complete(self, exception=None, source: int = -1) -> None:
        # The state is final first (so a future callback that waits on this work returns at
        # once), then the future runs its callbacks, then hooks and blocked waiters run.
        with _lock:
            if self.finished:
                return
            self._exception = exception
            self._source = source
            self.finished = True
            # The op refers back to this work: dropping it lets reference counting free
            # both (a cycle per message would wake the cyclic collector, whose full
            # passes over torch's objects cost tens of ms).
            self.op = None
            future, hooks = self._future, self._hooks
            self._hooks = None
        try:
            if future is not None:
                _settle(future, self._outputs, exception)
        finally:
            if self._waiters:
                with _lock:
                    _state.notify_all()
            for hook in hooks or ():
                hook()

    # ------------------------------------------------------------------ c10d API
    def wait(self, timeout=None) -> bool:
        """Block until done; raise the operation's error. ``timeout``: timedelta or seconds."""
        if not self.finished:
            started = time.monotonic()
            seconds = _seconds(timeout)
            deadline = started + seconds if seconds else float("inf")
            try:
                op = self.op  # (None once complete)
                if op is not None:
                    op.drive(deadline)
                    if not self.finished:  # another thread is completing it right now
                        self._block(deadline, seconds)
                elif self.engine is not None and self.engine.is_engine_thread():
                    self.engine.run_until(self)
                elif self.engine is None or seconds or not self.engine.run_for(self):
                    self._block(deadline, seconds)
            finally:
                stats.add_blocked(time.monotonic() - started)
        if self._exception is not None:
            raise self._exception
        return True

    def _block(self, deadline: float, seconds: float) -> None:
        with _lock:
            self._waiters += 1
            try:
                while not self.finished:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise PeerTimeoutError(
                            f"{self.what}: Timed out after {seconds:.3f} s in Work.wait")
                    _state.wait(None if left == float("inf") else left)
            finally:
                self._waiters -= 1

    def is_completed(self) -> bool:
        self._look()
        return self.finished

    def is_success(self) -> bool:
        self._look()
        return self.finished and self._exception is None

    def exception(self):
        self._look()
        return self._exception

    def result(self):
        self.wait()
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        self._arm()
        with _lock:
            if self._future is None:
                self._future = torch.futures.Future()
                if self.finished:
                    _settle(self._future, self._outputs, self._exception)
            return self._future

    def source_rank(self) -> int:
        self._look()
        return self._source

    def _source_rank(self) -> int:
        return self._source

    def synchronize(self) -> None:
        """CPU tensors: nothing to synchronise with."""

    def __repr__(self):
        return f"<NeuronWork {self.what} {'done' if self.finished else 'pending'}>"


def _settle(future, outputs, exception) -> None:
    if exception is None:
        future.set_result(outputs)
    else:
        future.set_exception(exception)


def _seconds(timeout) -> float:
    if timeout is None:
        return 0.0
    if isinstance(timeout, timedelta):
        return max(0.0, timeout.total_seconds())
    return max(0.0, float(timeout))
