"""Drives send/recv: the matching engine of collectives/p2p.py, a lock, and a helper thread.

Progress is made by whoever needs it: the caller's ``Work.wait`` (no thread hand-off on the
critical path), and a background thread while requests are pending and nobody waits (so an
``isend`` proceeds while the caller computes). Both call ``P2P.progress`` under one lock.

Waking the background thread costs more than a small message (it wants the GIL the caller
holds; docs/design.md, "Thresholds and why"). So only a send that did not fit
into the mailbox at once wakes the thread: its owner may go on computing (``isend``) while
the receiver waits for the rest. A receive does not: whoever posts one wants its data and
waits soon, and its sender needs no help until the mailbox is full (4 MiB by default).
While the group is exchanging messages the thread
lingers, looking every LAZY_PERIOD for requests nobody waits on (an irecv whose Work is
only polled, or a sender stuck on a full mailbox while this rank is in a collective), so
every request still progresses without its owner; after IDLE_AFTER without any, it looks
only every IDLE_PERIOD (a post wakes it at once). It starts with the group's first send or
receive and also drains inbound rings nobody asked for yet once they are half full, so a
sender that fills one is not stuck while this rank waits in a collective. Below that, whole
messages wait in the ring for their receive, which reads them straight into its tensor:
draining them early would cost a copy and an allocation each, and visits every
LAZY_PERIOD would take the GIL and the lock from the caller (docs/design.md, "Tried and
dropped").
Sends and receives of a group never queue behind its collectives, so the usual exchange
patterns (isend + irecv both ways, pipelining schedules) cannot deadlock.
Expired requests fail with PeerTimeoutError; requests on a dead peer with PeerDiedError.
"""

from __future__ import annotations

import threading
import time

from .collectives.p2p import P2P, Request
from .errors import GroupAbortedError, PeerTimeoutError
from .transport.backoff import set_background_thread

LIVENESS_PERIOD = 0.2
LAZY_PERIOD = 0.005  # a pending request nobody waits on is picked up within this
IDLE_AFTER = 1.0  # seconds without pending requests before the thread looks less often
IDLE_PERIOD = 0.1  # then it still looks this often for rings a sender filled


class P2PEngine:
    """Send/receive driver of one group.

    Parameters
    ----------
    p2p : P2P
    channel : ShmChannel
        For peer liveness and abort checks.
    label : str
    translate : callable
        ``translate(exc, what) -> exception`` for errors raised while progressing.
    """

    def __init__(self, p2p: P2P, channel, label: str, translate):
        self._p2p = p2p
        self._channel = channel
        self._label = label
        self._translate = translate
        self._lock = threading.RLock()  # completions may post new requests
        self._wake = threading.Condition(self._lock)
        self._waiters = 0
        self._thread = None
        self._stopped = False
        self._next_liveness = 0.0
        self._idle = False  # the thread sleeps until notified (not lingering)
        self._last_pending = 0.0

    def post(self, req: Request) -> None:
        with self._lock:
            if self._stopped:
                raise GroupAbortedError(f"{req.describe()} in group {self._label}: "
                                        "the group was destroyed")
            if req.is_send:
                self._p2p.post_send(req)
            else:
                self._p2p.post_recv(req)
            self._progress_locked()
            if self._thread is None:
                self._start()
            if not req.done and (self._idle or req.is_send):
                self._wake.notify()

    def _start(self) -> None:
        """Under the lock: from the first send/recv on, the thread looks after requests and
        rings nobody drives."""
        self._thread = threading.Thread(target=self._loop, name=f"neuron-p2p[{self._label}]",
                                        daemon=True)
        self._thread.start()

    def poll(self) -> None:
        """Move whatever can move now, from the calling thread, without waiting."""
        with self._lock:
            self._progress_locked()

    def withdraw(self, req: Request, error: BaseException) -> None:
        """Withdraw ``req`` unless it has completed; it then fails with ``error``."""
        with self._lock:
            if not req.done:
                self._p2p.fail(req, error)

    def send_now(self, dst: int, tag: int, address: int, nbytes: int) -> bool:
        """Send a small message at once if it fits (see ``P2P.send_now``); else False."""
        with self._lock:
            return not self._stopped and self._p2p.send_now(dst, tag, address, nbytes)

    def recv_now(self, src: int, tag: int, address: int, nbytes: int) -> bool:
        """Receive a message that is already whole in ``src``'s ring straight into memory
        at ``address``, if nothing else could take it first (see ``P2P.recv_now``); else
        False (nothing has changed: post a request)."""
        with self._lock:
            if self._stopped or not self._p2p.recv_now(src, tag, address, nbytes):
                return False
            if self._thread is None:  # (a rank whose receives all take this path still
                self._start()         # has its rings drained while it is elsewhere)
            return True

    def drive(self, req: Request, deadline: float) -> None:
        """Make progress from the calling thread until ``req`` is done or ``deadline``."""
        backoff = self._channel.backoff()
        with self._lock:
            self._waiters += 1
        try:
            while True:
                with self._lock:
                    moved = self._progress_locked()
                if req.done:
                    return
                if time.monotonic() > deadline:
                    raise PeerTimeoutError(f"{req.describe()} in group {self._label}: "
                                           "Timed out in Work.wait")
                if moved:
                    backoff = self._channel.backoff()
                elif backoff.pause():
                    self._sleep(lambda: req.done)
        finally:
            with self._lock:
                self._waiters -= 1

    def _loop(self) -> None:
        set_background_thread()
        backoff = self._channel.backoff()
        while True:
            with self._lock:
                while not self._stopped:
                    now = time.monotonic()
                    if self._p2p.pending():
                        self._last_pending = now
                        if not self._waiters:
                            break
                    if now - self._last_pending < IDLE_AFTER:
                        self._wake.wait(LAZY_PERIOD)
                    else:
                        self._idle = True
                        try:
                            self._wake.wait(IDLE_PERIOD)
                        finally:
                            self._idle = False
                if self._stopped:
                    return
                moved = self._progress_locked()
            if moved:
                backoff = self._channel.backoff()
            elif backoff.pause():
                self._sleep(lambda: self._waiters or self._stopped)

    def _sleep(self, stop) -> None:
        """Sleep on this rank's doorbell until a peer moves bytes (or a short slice ends)."""
        seen = self._channel.doorbell()

        def ready():
            if stop():
                return True
            with self._lock:
                return self._progress_locked()

        self._channel.sleep_on_doorbell(seen, ready)

    def _progress_locked(self) -> bool:
        try:
            moved = self._p2p.progress()
        except Exception as exc:  # a corrupt stream: fail everything pending
            self._fail_all(self._translate(exc, f"send/recv in group {self._label}"))
            return False
        now = time.monotonic()
        if not moved and now >= self._next_liveness:
            self._next_liveness = now + LIVENESS_PERIOD
            self._check_expired(now)
        return moved

    def _check_expired(self, now: float) -> None:
        for req in self._p2p.pending_requests():
            peers = list(range(self._channel.size)) if req.peer is None else [req.peer]
            peers = [k for k in peers if k != self._channel.rank]
            if req.claim is not None:
                # A receive from any rank that the network may satisfy too: that this
                # node's ranks are gone does not fail it (p2p_any.py decides), its
                # deadline and an abort do.
                peers = []
            try:
                # A peer that sent everything and exited has done its part: only data it
                # never wrote is lost.
                self._channel.check_peers(peers, req.deadline, any_suffices=req.peer is None)
            except Exception as exc:  # noqa: BLE001
                # Its mailbox was drained before this check, but it may have written its
                # last message and exited in between: drain once more before judging.
                try:
                    self._p2p.progress()
                except Exception:  # noqa: BLE001 - a corrupt stream: judged as it stands
                    pass
                if not req.done:
                    self._p2p.fail(req, self._translate(
                        exc, f"{req.describe()} in group {self._label}"))

    def _fail_all(self, error) -> None:
        for req in self._p2p.pending_requests():
            self._p2p.fail(req, error)

    def stop(self, error=None) -> None:
        with self._lock:
            self._stopped = True
            self._fail_all(error or GroupAbortedError(
                f"send/recv in group {self._label}: the group was destroyed"))
            self._wake.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
