"""Who drives MPI for a transport: the thread that waits, or the progress thread.

How it works
------------
A poll (``MpiTransport.poll``) reads the notes and abort notices that arrived, matches the
heads of the posted receives and tests the transport's active requests. A thread in
``Request.wait`` polls for itself (``drive``), so no thread hand-off sits on a message's
critical path: back to back with ``sched_yield`` in between for 1 ms after the last
progress, then with sleeps growing to 0.2 ms. A progress thread per transport completes
what nobody waits for (async work, callbacks): it polls with sleeps growing to 2 ms (every
2 ms while some thread polls for itself: two threads polling in turn only trade the GIL),
and after 50 ms with nothing pending it sleeps until a request is posted (no polling, no
MPI calls; waking it then, ``wake``, is the only notification a post ever makes: a
wake-up costs ~0.1 ms on a busy machine).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, ContextManager, Iterator

from ..errors import TransportError

if TYPE_CHECKING:
    from ..requests import Completion
    from .driver import MpiTransport

log = logging.getLogger("neuron_dist.mpi")

_SPIN_SECONDS = 1e-3                 # a waiting thread polls (yielding the CPU) this long,
_HOT_SLEEP = 2e-4                    # ... then sleeps up to this long between polls
_IDLE_POLLS = 4                      # the progress thread's back-to-back polls, then
_COLD_SLEEP = 2e-3                   # sleeps growing to this between polls
_PARK_AFTER = 0.05                   # idle this long: sleep until woken (no polling)


class Polling:
    """The polling of ``owner`` (an MPI transport) under ``lock``: ``drive`` for a waiting
    thread, and the progress thread (``start``, ``join``). ``cond`` (on ``lock``) is
    notified whenever something the transport's threads wait for may have happened."""

    def __init__(self, owner: MpiTransport, lock: ContextManager[object], rank: int):
        self._owner, self._lock = owner, lock
        self.cond = threading.Condition(lock)  # type: ignore[arg-type]  # (a lock)
        self.waiting_threads = 0     # threads that drive MPI for themselves
        self._parked = False         # the progress thread sleeps until woken
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"neuron-mpi-progress-{rank}")

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait for the progress thread to end (the transport has closed)."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)

    def drive(self, event: Completion, deadline: float) -> bool:
        """Wait for ``event`` until ``deadline``, polling MPI from this thread meanwhile.

        Polls back to back for 1 ms after the last progress, with ``sched_yield`` in between
        (~1 us when the CPU is free; runnable processes go first when it is not, where
        ``sleep(0)`` or a 25 us timed wait cost ~0.1 ms), then with sleeps growing to
        0.2 ms. False on timeout.
        """
        owner = self._owner
        with self.waiting():
            idle = 0
            spin_until = time.monotonic() + _SPIN_SECONDS
            while not event.is_set():
                with self._lock:
                    if owner.closed:
                        break
                    try:
                        progressed = owner.poll()
                    except Exception:  # noqa: BLE001 - the progress thread reports it
                        progressed = False
                if event.is_set():
                    break
                now = time.monotonic()
                if now >= deadline:
                    return False
                if progressed:
                    idle, spin_until = 0, now + _SPIN_SECONDS
                if now < spin_until:
                    os.sched_yield()
                else:
                    idle += 1
                    event.wait(min(deadline - now, _HOT_SLEEP, 2.5e-5 * (1 << min(idle, 4))))
            return event.wait(max(0.0, deadline - time.monotonic()))

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the calling thread as one that drives MPI for itself while inside (the
        progress thread then polls less often)."""
        with self._lock:
            self.waiting_threads += 1
        try:
            yield
        finally:
            with self._lock:
                self.waiting_threads -= 1

    def wake(self) -> None:
        """Under the lock: wake the progress thread if it sleeps until woken."""
        if self._parked:
            self.cond.notify_all()

    def _loop(self) -> None:
        idle, idle_since = 0, None
        owner = self._owner
        with self._lock:
            while not owner.closed:
                if not owner.busy():
                    idle = 0
                    now = time.monotonic()
                    if idle_since is None:
                        idle_since = now
                    if now - idle_since < _PARK_AFTER:
                        self.cond.wait(_COLD_SLEEP)
                    else:  # long idle: sleep until a request is posted (no polling)
                        self._parked = True
                        self.cond.wait()
                        self._parked = False
                    continue
                idle_since = None
                try:
                    progressed = owner.poll()
                except Exception as e:  # noqa: BLE001 - never die silently with work pending
                    if not owner.active.failing:  # (once: what MPI owns may still complete)
                        log.exception("neuron %s: MPI progress failed", owner.label)
                    owner.fail_all(TransportError(f"MPI progress of {owner.label} failed: {e!r}"))
                    if owner.active.failing:
                        owner.active.check_failing()
                        self.cond.wait(_COLD_SLEEP)
                    continue
                idle = 0 if progressed else idle + 1
                if self.waiting_threads > 0:   # a waiting thread polls for itself
                    self.cond.wait(_COLD_SLEEP)
                elif idle > _IDLE_POLLS:
                    self.cond.wait(min(_COLD_SLEEP, 2e-5 * (1 << min(idle - _IDLE_POLLS, 10))))
                else:
                    self.cond.wait(0)          # let posting threads take the lock
