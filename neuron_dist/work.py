"""``NeuronWork``: the handle c10d returns for every operation.

A Work completes exactly once, with its output tensors or an exception. ``wait`` blocks
(with an optional timeout) and re-raises the exception; ``get_future`` gives a
``torch.futures.Future`` completed with the list of output tensors, which DDP comm hooks
and funcol rely on. Who makes progress while a caller waits depends on the operation:
collectives are executed by their group's engine (or inline), send/recv are driven by the
caller's own ``wait`` through ``driver`` so no thread hand-off sits on the critical path.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import stats
from .errors import PeerTimeoutError


class NeuronWork(dist.Work):
    """Completion handle of one neuron operation.

    Parameters
    ----------
    outputs : list[torch.Tensor]
        What the future is completed with.
    what : str
        Human-readable description (e.g. ``"all_reduce #12 in group 'default_pg'"``).
    """

    def __init__(self, outputs, what: str):
        super().__init__()
        self._outputs = outputs
        self.what = what
        self._done = threading.Event()
        self._exception = None
        self._future = torch.futures.Future()
        self._source = -1
        self.driver = None  # callable(deadline) that makes progress until done (send/recv)
        self.engine = None  # the CollectiveEngine that runs this work, if queued
        self._hooks = []
        self._finished = False
        self._hooks_lock = threading.Lock()

    # ------------------------------------------------------------- completion
    def add_done_hook(self, hook) -> None:
        """Call ``hook()`` once this work is complete (now, if it already is)."""
        with self._hooks_lock:
            if not self._finished:
                self._hooks.append(hook)
                return
        hook()

    def _complete(self, exception=None, source: int = -1) -> None:
        # Order matters: the state is final first (so a future callback that waits on this
        # work returns at once), then the future runs its callbacks, then waiters wake up
        # (so they always find the future completed).
        with self._hooks_lock:
            if self._finished:
                return
            self._exception = exception
            self._source = source
            self._finished = True
            hooks, self._hooks = self._hooks, []
        try:
            if exception is None:
                self._future.set_result(self._outputs)
            else:
                self._future.set_exception(exception)
        finally:
            self._done.set()
            for hook in hooks:
                hook()

    # ------------------------------------------------------------------ c10d API
    def wait(self, timeout=None) -> bool:
        """Block until done; raise the operation's error. ``timeout``: timedelta or seconds."""
        if not self._finished:
            started = time.monotonic()
            seconds = _seconds(timeout)
            deadline = started + seconds if seconds else float("inf")
            try:
                if self.driver is not None:
                    self.driver(deadline)
                elif self.engine is not None and self.engine.is_engine_thread():
                    self.engine.run_until(self)
                elif not self._done.wait(None if deadline == float("inf") else seconds):
                    raise PeerTimeoutError(f"{self.what}: Work.wait timed out after {seconds:.3f} s")
            finally:
                stats.add_blocked(time.monotonic() - started)
        if self._exception is not None:
            raise self._exception
        return True

    def is_completed(self) -> bool:
        return self._finished

    def is_success(self) -> bool:
        return self._finished and self._exception is None

    def exception(self):
        return self._exception

    def result(self):
        self.wait()
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        return self._future

    def source_rank(self) -> int:
        return self._source

    def _source_rank(self) -> int:
        return self._source

    def synchronize(self) -> None:
        """CPU tensors: nothing to synchronise with."""

    def __repr__(self):
        state = "done" if self._finished else "pending"
        return f"<NeuronWork {self.what} {state}>"


def _seconds(timeout) -> float:
    if timeout is None:
        return 0.0
    if isinstance(timeout, timedelta):
        return max(0.0, timeout.total_seconds())
    return max(0.0, float(timeout))
