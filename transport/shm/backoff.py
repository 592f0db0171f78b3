"""How a rank waits for a shared-memory flag: spin briefly, then yield, then sleep.

A peer's store becomes visible to a spinning reader in well under a microsecond, while
waking a sleeping process costs 25-55 µs here; so we poll first. With more ranks than
cores, pure spinning starves the very peer we wait for, so after ``spin`` polls we call
sched_yield (which also releases the GIL, letting the caller's other threads run), and after
``yield_seconds`` we sleep in growing steps up to ``max_sleep`` so an idle wait costs no CPU.
"""

from __future__ import annotations

import os
import threading
import time

_thread = threading.local()


def set_background_thread() -> None:
    """Mark the calling thread as a progress thread: its waits never spin.

    A spinning Python thread holds the GIL, so a progress thread that spun would stall
    the user's own thread (the one doing compute) for whole GIL switch intervals.
    """
    _thread.background = True


class Backoff:
    __slots__ = ("spin", "yield_seconds", "max_sleep", "polls", "started", "sleep")

    def __init__(self, spin: int, yield_seconds: float, max_sleep: float):
        self.spin = 0 if getattr(_thread, "background", False) else spin
        self.yield_seconds = yield_seconds
        self.max_sleep = max_sleep
        self.polls = 0
        self.started = 0.0
        self.sleep = 0.0

    def pause(self) -> None:
        """Called after each unsuccessful poll."""
        self.polls += 1
        if self.polls <= self.spin:
            return
        now = time.monotonic()
        if not self.started:
            self.started = now
        if now - self.started < self.yield_seconds:
            os.sched_yield()
            return
        self.sleep = min(self.max_sleep, max(2e-5, self.sleep * 2))
        time.sleep(self.sleep)


def default_spin(local_ranks: int) -> int:
    """Polls before yielding: none when ranks outnumber the cores we may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cores = os.cpu_count() or 1
    return 0 if local_ranks > cores else 2000
