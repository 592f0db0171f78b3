"""How a rank waits for a peer: spin briefly, then yield, then sleep.

Both transports wait this way: shared memory for a peer's flag (shm/channel.py), rdm for
its sockets (rdm/progress.py, which sleeps in ``epoll`` where this says block). A peer's
store becomes visible to a spinning reader in well under a microsecond, while waking a
sleeping process costs 25-55 µs here; so we poll first. With more ranks than
cores, pure spinning starves the very peer we wait for, so after ``spin`` polls we call
sched_yield (which also releases the GIL, letting the caller's other threads run), and after
``yield_seconds`` we block: on a futex when the caller can (the step channel, see
shm/futex.py: woken the moment the peer publishes), else in growing sleeps up to ``max_sleep``
so an idle wait costs no CPU.
"""

from __future__ import annotations

import os
import threading
import time

class _Role(threading.local):
    background = False  # (set_background_thread)


role = _Role()  # the calling thread's: ``role.background``
SPIN_SECONDS = 50e-6


def set_background_thread() -> None:
    """Mark the calling thread as a progress thread: its waits never spin.

    A spinning Python thread holds the GIL, so a progress thread that spun would stall
    the user's own thread (the one doing compute) for whole GIL switch intervals.
    """
    role.background = True


class Backoff:
    __slots__ = ("spin", "yield_seconds", "max_sleep", "polls", "started", "sleep", "can_block",
                 "background")

    def __init__(self, spin: int, yield_seconds: float, max_sleep: float, can_block: bool = False):
        self.background = role.background
        self.spin = 0 if self.background else spin
        self.yield_seconds = yield_seconds
        self.max_sleep = max_sleep
        self.polls = 0
        self.started = 0.0
        self.sleep = 0.0
        self.can_block = can_block

    def pause(self) -> bool:
        """Called after each unsuccessful poll.

        Returns True when the caller should block on a futex instead (only with
        ``can_block``); otherwise it spins, yields or sleeps here and returns False.
        """
        self.polls += 1
        if self.polls <= self.spin:
            if self.polls & 15:
                return False
            # Spinning is bounded in time too: a poll that is itself expensive (send/recv
            # progress) must not turn 500 polls into milliseconds of a stolen core.
            now = time.monotonic()
            if not self.started:
                self.started = now
                return False
            if now - self.started < SPIN_SECONDS:
                return False
            self.polls = self.spin
        now = time.monotonic()
        if not self.started:
            self.started = now
        if now - self.started < self.yield_seconds + SPIN_SECONDS:
            os.sched_yield()
            return False
        if self.can_block:
            return True
        self.sleep = min(self.max_sleep, max(2e-5, self.sleep * 2))
        time.sleep(self.sleep)
        return False


SPIN_POLLS = 500  # polls before a waiting rank yields, unless ranks outnumber cores
