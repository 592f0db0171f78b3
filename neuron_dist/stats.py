"""Process-wide communication counters, read with ``neuron_dist.comm_stats()``."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_stats = {"calls": 0, "bytes": 0, "blocked_seconds": 0.0}


# Updates are not locked: they come almost only from the caller's thread, and a lock
# would cost more than a small collective's bookkeeping is worth.
def add_call(nbytes: int, blocked: float = 0.0) -> None:
    """One operation of ``nbytes``; ``blocked``: seconds its caller spent running it."""
    _stats["calls"] += 1
    _stats["bytes"] += nbytes
    if blocked:
        _stats["blocked_seconds"] += blocked


def add_blocked(seconds: float) -> None:
    _stats["blocked_seconds"] += seconds


def comm_stats() -> dict:
    """Cumulative counters of this process.

    Returns
    -------
    dict
        ``calls`` collectives and p2p operations issued, ``bytes`` of their inputs, and
        ``blocked_seconds``: time callers spent blocked on communication (inline execution
        plus ``Work.wait``). Take differences between two reads to measure an interval.
    """
    with _lock:
        return dict(_stats)
