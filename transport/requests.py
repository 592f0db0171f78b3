"""The request object both inter-node transports (rdm, mpi) hand out, and their callbacks.

A request completes once (``finish``, called by the transport that made it), with or without an error. ``wait(deadline)``
blocks until then; past the deadline it allows a short grace (a peer that timed out at the
same moment may be about to send its abort notice, which says why) and then raises
``PeerTimeout`` naming the peer (``network=True``: the ranks are group ranks). A
completion callback is not run by whoever completes the request (that
may hold the transport's lock). When a thread is blocked in ``wait`` it runs the callback
itself on its way out (no thread hand-off on the latency path); otherwise the request is
queued for the transport's callback thread (``run_callbacks``). Either way it runs once, and
it may post new requests.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable

from .base import NetRequest
from .errors import PeerTimeout

if TYPE_CHECKING:
    from typing_extensions import Self

TIMEOUT_GRACE = 0.5


class Completion:
    """A one-shot flag threads can wait on: ``threading.Event``'s interface, at the cost of
    one lock, made only when a thread blocks on it. Every request makes one, and an
    ``Event`` (a Condition, its lock and its waiter list) cost a tenth of a small message's
    time on this machine; most requests complete while their waiter polls, never
    blocking on the flag.

    The lock is made held by the first thread that blocks (under ``_MAKING``, so two
    blocking at once share it), and ``set`` releases it; a waiter acquires it and releases
    it at once, so every waiter passes. ``set`` raises the flag before it looks for the
    lock and a waiter publishes the lock before it looks at the flag again, so one of the
    two always sees the other (the GIL orders them).
    """

    __slots__ = ("_lock", "done")

    def __init__(self) -> None:
        self.done = False  # (is_set(); read directly where a call would cost)
        self._lock: threading.Lock | None = None

    def is_set(self) -> bool:
        return self.done

    def set(self) -> None:
        if not self.done:
            self.done = True
            lock = self._lock
            if lock is not None:
                try:
                    lock.release()
                except RuntimeError:  # two threads set it at once: one release is enough
                    pass

    def wait(self, timeout: float | None = None) -> bool:
        if self.done:
            return True
        lock = self._lock
        if lock is None:
            with _MAKING:
                lock = self._lock
                if lock is None:
                    lock = threading.Lock()
                    lock.acquire()
                    self._lock = lock
            if self.done:
                return True  # (set before the lock was there: nobody releases it)
        if timeout is None:
            got = lock.acquire()
        elif timeout <= 0:
            got = lock.acquire(False)
        else:
            got = lock.acquire(True, timeout)
        if got:
            try:
                lock.release()
            except RuntimeError:  # a racing second set() released it already
                pass
        return self.done


_MAKING = threading.Lock()  # (the lock of a Completion is made once, by one thread)
_DONE = Completion()
_DONE.set()


class Request(NetRequest):
    """A pending send or receive (``base.NetRequest``).

    Attributes
    ----------
    peer : int or None
        The rank named when posting (None: a receive from any rank).
    source : int or None
        The rank the message came from (set when a receive from any rank matches).
    error : Exception or None
        Why it failed, once complete.
    callback : callable or None
        ``callback(request)``, run on the transport's callback thread once complete.
    claim : callable or None
        For a receive from any rank that another path may satisfy instead: ``claim()``,
        called just before a message is bound to it, says whether it still may take one
        (transport/matching.py). None: it takes whatever comes.
    """

    __slots__ = ("peer", "tag", "buf", "is_send", "error", "nbytes", "callback", "source",
                 "claim", "completion", "_sink", "_waiting", "_token")
    VIA = "the network"  # how the timeout message names the path

    def __init__(self, peer: int | None, tag: int, buf: memoryview, is_send: bool,
                 sink: queue.SimpleQueue[Request | None] | None = None):
        self.peer, self.tag, self.buf, self.is_send = peer, tag, buf, is_send
        self.nbytes = buf.nbytes
        self.error: Exception | None = None
        self.callback: Callable[[Request], object] | None = None
        self.source = peer
        self.claim: Callable[[], bool] | None = None
        self.completion = Completion()
        self._sink = sink  # the queue of the transport's callback thread
        # one entry per thread in wait() (list append/pop are atomic)
        self._waiting: list[None] = []
        self._token = [True]  # whoever pops it runs the callback

    @classmethod
    def completed(cls, peer: int, tag: int, buf: memoryview) -> Self:
        """A send that completed as it was posted (an eager send), made without the
        machinery of one that waits."""
        req = cls.__new__(cls)
        req.peer = req.source = peer
        req.tag, req.buf, req.is_send, req.nbytes = tag, buf, True, buf.nbytes
        req.error = req.callback = req.claim = req._sink = None
        req.completion = _DONE
        req._waiting, req._token = [], [True]
        return req

    def finish(self, error: Exception | None = None) -> None:
        event = self.completion
        if not event.done:
            self.error = error
            event.set()
            if self.callback is not None and self._sink is not None and not self._waiting:
                self._sink.put(self)

    def on_complete(self, callback: Callable[[Request], object]) -> None:
        """Attach ``callback(request)`` after posting; it runs once, now if the request has
        already completed."""
        self.callback = callback
        if self.completion.is_set():
            self._run_callback()

    def _run_callback(self) -> None:
        """Run the callback unless another thread has claimed it (list.pop is atomic)."""
        try:
            self._token.pop()
        except IndexError:
            return
        try:
            # (set: only a request with a callback gets here)
            self.callback(self)  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - a callback's failure is its own business
            logging.getLogger("neuron_dist").exception("completion callback of %r failed", self)

    def done(self) -> bool:
        """True once complete, with or without an error (never raises)."""
        return self.completion.is_set()

    def test(self) -> bool:
        """True once complete (raises its error if it failed)."""
        if self.completion.is_set():
            if self.error is not None:
                raise self.error
            return True
        return False

    def _block(self, deadline: float) -> bool:
        """Wait for completion until ``deadline``; True if complete."""
        self._waiting.append(None)
        try:
            self.completion.wait(max(0.0, deadline - time.monotonic()))
        finally:
            self._waiting.pop()
        # Complete now (even if just after the wait gave up): finish may have left the
        # callback to us.
        done = self.completion.is_set()
        if done and self.callback is not None and self._sink is not None:
            self._run_callback()
        return done

    def wait(self, deadline: float) -> None:
        """Block until complete or ``deadline`` (``time.monotonic()``), raising on failure."""
        if not self.completion.done:
            start = time.monotonic()
            if not self._block(deadline) and not self._block(time.monotonic() + TIMEOUT_GRACE):
                raise self._timed_out(deadline, start)
        if self.error is not None:
            raise self.error

    def _timed_out(self, deadline: float, start: float) -> PeerTimeout:
        """The error of a wait from ``start`` that found it incomplete past ``deadline``
        and the grace after it."""
        what = "send to" if self.is_send else "receive from"
        who = f"rank {self.peer}" if self.peer is not None else "any rank"
        return PeerTimeout([self.peer] if self.peer is not None else [],
                           max(0.0, deadline - start),
                           f"{what} {who} ({self.nbytes} bytes, tag {self.tag}) over "
                           f"{self.VIA} did not complete in time", network=True)


def run_callbacks(callbacks: queue.SimpleQueue[Request | None]) -> None:
    """Body of a transport's callback thread: run queued requests' callbacks until None."""
    while True:
        req = callbacks.get()
        if req is None:
            return
        req._run_callback()
