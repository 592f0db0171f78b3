"""One progress engine per process, shared by every rdm transport (every group).

How it works
------------
Rails are non-blocking sockets registered here (``register``), each with the link (the
rails to one peer process, shared by the groups that have both processes: links.py) it
belongs to. ``poll(timeout)`` waits in ``epoll`` until a rail is readable or writable, or a
transport's timer (a retransmission, held acks) is due, and lets the link or transport
handle it (``on_ready``; ``Wire.on_tick`` once the transport's ``wire.due`` has passed) under
the process's one network lock (``NET_LOCK``: a rail carries several groups' frames, so
their transports share it). The engine also keeps the links other groups may join
(``publish``, ``find_link``).

Whoever needs progress drives it. A thread waiting for a request polls for itself
(``drive``), so the bytes that complete its request are read by the thread that wants
them: no hand-off to another thread on a message's path. One thread polls at a time (the
*leader*, holding ``_poll``); another thread that waits meanwhile sleeps on its own
request's completion and checks every millisecond whether it may lead. The engine's one
background thread polls only when no thread has waited for a while, so that a thread that
waits back to back, one operation after another, keeps driving it, and asynchronous work,
acks and retransmissions still move when nobody is blocked. A thread that starts waiting
while the background thread polls wakes it (``wake``) and takes over at once; that hand-over
costs two thread wake-ups, so the background thread holds back as long as it can:

* ``_LINGER_BULK`` (2 ms) when a transport has work that only progress moves on and that
  someone waits for without driving it: bytes queued behind a full socket, a message part
  way (held back by the window, or partly received), a posted receive larger than an eager message (its sender waits for the
  acknowledgement), a request with a completion callback (``Wire.bulk_pending``).
  The transport calls ``kick`` when such work appears.
* ``_LINGER_IDLE`` (100 ms) otherwise: what is left then (held acks, small messages that
  arrive before their receive, the ack of a send that will be waited for) waits in socket
  buffers at no cost to anyone: whoever waits next drives it at once. So a caller that
  posts a few sends between two waits does not hand the engine back and forth each time.
  While the background thread leads, every frame that arrives wakes it, and it needs the
  GIL the user's thread computes with: the longer it lingers, the less it takes from the
  user's thread (docs/design.md, "Thresholds and why").

**Fairness.** Each visit to a rail reads a bounded number of bytes (links.py's
``_VISIT_BYTES``), visits for bulk bytes come after the others in a poll, and a leader
whose own condition holds leaves the rails not visited yet to the next poll: a bulk stream
on one rail does not hold up small messages on the others (design.md, "Rails").

**Waiting.** The leader does not sleep in ``epoll`` at once: it polls without sleeping
(``spin`` polls, at most ``backoff.SPIN_SECONDS``), then polls with a ``sched_yield``
between polls for up to ``_YIELD_SECONDS``, and only then sleeps in ``epoll``, like a
shared-memory wait (transport/backoff.py). Waking a thread that sleeps in the kernel costs
more than a small message's whole trip, in time and in CPU, since every sleep and wake-up is
CPU of its own (docs/design.md, "Thresholds and why"). ``spin`` is 0 when more ranks than
cores share the machine (``rendezvous._spin``, which counts the ranks of other nodes on the
same kernel too), and then a waiter sleeps in ``epoll`` at once: each yield would hand the
core to another rank and be scheduled back, a poll's CPU each turn, long before a peer
that needs the same cores has answered. A background thread never polls ahead: it would
keep the GIL from the user's thread.

The engine also keeps the process's listeners, one per interface address, shared by every
group (``listen``, listener.py; the handshake names the group and rank dialled, and
``join_group`` says which transport that is).

Completion callbacks run on the engine's callback thread (never under a transport's lock;
see ``requests.py``). Both threads and the listeners start with the first transport and
end with the last, so nothing is left behind once every transport is closed.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import threading
import time
from typing import TYPE_CHECKING, Callable, Sequence

from ..errors import TransportError
from ..requests import Completion, Request, run_callbacks
from ..backoff import Backoff
from .listener import Listener

if TYPE_CHECKING:
    from .driver import RdmTransport
    from .opening import RailOpening
    from .links import Link, LinkKey, Rail

log = logging.getLogger("neuron_dist.rdm")

_BG_POLL = 0.05  # longest sleep of the background thread in epoll (a safety net)
_FOLLOW = 0.001  # a waiter that cannot lead checks this often whether it may
_LINGER_BULK = 0.002  # the background thread leads after this long without a waiter when
_LINGER_IDLE = 0.100  # a transport has bulk work waiting for progress, else after this long
_YIELD_SECONDS = 5e-4  # a waiter polls, yielding the CPU in between, this long before it sleeps


class Progress:
    """The process's progress engine (``engine()``); see the module docstring."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._handlers: dict[int, tuple[Link, Rail]] = {}  # fd -> (link, rail)
        self._transports: list[RdmTransport] = []
        self._lock = threading.Lock()  # registry and waiter count
        self._idle = threading.Condition(self._lock)  # the background thread parks here
        self._poll = threading.Lock()  # held by the thread that polls (the leader)
        self._waiters = 0
        self._last_wait = 0.0  # when the last waiter left
        self._bg_leads = False
        self._polling: int | None = None  # the thread in epoll, and until when it sleeps there
        self._poll_until = 0.0
        self._stop = False
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._listeners: dict[str, Listener] = {}  # host -> Listener, shared by every group
        # (group id, rank) -> the transport of that group's rank
        self._groups: dict[tuple[bytes, int], RdmTransport] = {}
        # (group context, rank) -> the same (links.py)
        self._contexts: dict[tuple[int, int], RdmTransport] = {}
        self._links: dict[LinkKey, list[Link]] = {}  # link key -> links other groups may join
        self.lock = NET_LOCK
        self.callbacks: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._background, daemon=True,
                                          name="neuron-rdm-progress"),
                         threading.Thread(target=run_callbacks, args=(self.callbacks,),
                                          daemon=True, name="neuron-rdm-callbacks")]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ registry

    def listen(self, host: str, port_range: tuple[int, int] | None = None) -> str:
        """The address of the process's listener on ``host``, started on first use on a
        free port of ``port_range`` (``(first, last)``, both included; None: any free
        port). Later groups share it, wherever its port is."""
        with self._lock:
            listener = self._listeners.get(host)
            if listener is None:
                listener = self._listeners[host] = Listener(host, self._resolve, port_range)
            return listener.address

    def join_group(self, gid: bytes, rank: int, transport: RdmTransport, context: int) -> None:
        """Connections that name group ``gid`` and ``rank``, and JOINs on a link that name
        its ``context`` and ``rank`` (links.py), go to ``transport``."""
        with self._lock:
            self._groups[(gid, rank)] = transport
            self._contexts[(context, rank)] = transport

    def leave_group(self, gid: bytes, rank: int, transport: RdmTransport) -> None:
        with self._lock:
            if self._groups.get((gid, rank)) is transport:
                del self._groups[(gid, rank)]
            for k in [k for k, t in self._contexts.items() if t is transport]:
                del self._contexts[k]

    def resolve_context(self, context: int, rank: int) -> RdmTransport | None:
        """The transport of rank ``rank`` of the group whose context is ``context``."""
        with self._lock:
            return self._contexts.get((context, rank))

    # Links (links.py): under NET_LOCK, like everything that touches rails.

    def publish(self, link: Link) -> None:
        """Other groups may join ``link`` (its ``key`` says to which process it goes)."""
        if link.key is not None and link not in self._links.get(link.key, ()):
            self._links.setdefault(link.key, []).append(link)

    def unpublish(self, link: Link) -> None:
        if link.key is None:
            return  # (never published)
        found = self._links.get(link.key)
        if found and link in found:
            found.remove(link)
            if not found:
                del self._links[link.key]

    def find_link(self, key: LinkKey, context: int) -> Link | None:
        """A published link with ``key`` that group ``context`` may join now, or None."""
        for link in self._links.get(key, ()):
            if link.joinable(context):
                return link
        return None

    def _resolve(self, gid: bytes, rank: int) -> tuple[RailOpening, bytes, bytes, Callable[
            [int, int], bool | bytes], Callable[[int, int], None]] | None:
        with self._lock:
            t = self._groups.get((gid, rank))
        if t is None:
            return None
        o = t.opening
        return o, o.key, o.group, o.may_dial, o.release

    def register(self, fd: int, handler: Link, rail: Rail, events: int) -> None:
        """Tell ``handler`` (a link) when ``rail`` is ready (``in_bulk``, ``on_ready``)."""
        self._handlers[fd] = (handler, rail)
        self._epoll.register(fd, events)

    def modify(self, fd: int, events: int) -> None:
        try:
            self._epoll.modify(fd, events)
        except (OSError, ValueError):
            pass  # unregistered meanwhile

    def unregister(self, fd: int) -> None:
        if self._handlers.pop(fd, None) is not None:
            try:
                self._epoll.unregister(fd)
            except (OSError, ValueError):
                pass

    def due_changed(self, due: float) -> None:
        """A transport's next deadline moved to ``due``: wake the thread in epoll if it
        would sleep past it (the thread that polls computes it afresh anyway)."""
        polling = self._polling
        if polling is not None and due < self._poll_until and polling != threading.get_ident():
            self.wake()

    def kick(self) -> None:
        """A transport has new bulk work (see the module docstring): the background thread
        looks again whether it should lead soon (a thread that waits drives it anyway)."""
        if not self._waiters:
            with self._lock:
                self._idle.notify()

    def _bulk_waiting(self) -> bool:
        """Under ``_lock``: does a transport have bulk work that only progress moves on?"""
        return any(t.wire.bulk_pending() for t in self._transports)

    def wake(self) -> None:
        """Make the thread in ``epoll`` (if any) return now."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # full: it will wake anyway

    # ------------------------------------------------------------------ polling

    def poll(self, timeout: float, done: Callable[[], bool] | None = None) -> None:
        """Under ``_poll``: wait up to ``timeout`` for rails or timers, and handle them
        (nothing once the engine has shut down).

        Visits for bulk bytes (a payload being read in place, a queue being written) come
        after the others, and each visit reads a bounded number of bytes (links.py's
        ``_VISIT_BYTES``); once ``done()`` (the leader's own condition), the rails not
        handled yet are left for the next poll (epoll reports them again). So a small
        message that completes a waiter's request is not read after other rails' bulk."""
        if self._stop:
            return
        if timeout > 0:  # (a poll that does not sleep needs no deadline and no waking)
            now = time.monotonic()
            for t in self._transports:
                due = t.wire.due
                if due is not None and due - now < timeout:
                    timeout = max(0.0, due - now)
            self._poll_until = now + timeout
            self._polling = threading.get_ident()
        events: Sequence[tuple[int, int]]
        try:
            events = self._epoll.poll(timeout)
        except InterruptedError:
            events = []
        finally:
            self._polling = None
        if len(events) == 1:  # (nothing to order: see below)
            fd, mask = events[0]
            handler = self._handlers.get(fd)
            if handler is not None:
                handler[0].on_ready(handler[1], mask)
            elif fd == self._wake_r:
                self._drain_wake()
            events = ()
        bulk: list[tuple[tuple[Link, Rail], int]] = []
        for fd, mask in events:
            if fd == self._wake_r:
                self._drain_wake()
                continue
            handler = self._handlers.get(fd)
            if handler is not None:
                if handler[0].in_bulk(handler[1], mask):
                    bulk.append((handler, mask))
                    continue
                handler[0].on_ready(handler[1], mask)
                if done is not None and done():
                    bulk = ()  # type: ignore[assignment]  # (none left: an empty tuple)
                    break
        for handler, mask in bulk:
            if done is not None and done():
                break
            handler[0].on_ready(handler[1], mask)
        now = time.monotonic()
        for t in list(self._transports):
            due = t.wire.due
            if due is not None and now >= due:
                t.wire.on_tick(now)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def drive(self, done: Callable[[], bool], deadline: float, event: Completion | None = None,
              spin: int = 0) -> bool:
        """Make progress from the calling thread until ``done()`` or ``deadline``; the
        result of ``done()``. ``done`` is checked between polls; ``event`` (a
        ``Completion``), if given, wakes the thread while another one leads.

        The leader first polls without sleeping (``spin`` polls, at most ``SPIN_SECONDS``),
        then yields the CPU between polls for up to ``_YIELD_SECONDS``, and only then sleeps
        in ``epoll``: see "Waiting" in the module docstring. A background thread
        (``backoff.set_background_thread``) sleeps at once. A waiter counts as one from its
        first poll on: polled uncounted, a wait's first visits kick the background thread
        to lead (``kick``), and a large transfer then loses a sixth of its speed to the
        threads handing the lead back and forth (docs/design.md, "Tried and dropped")."""
        with self._lock:
            self._waiters += 1
            bg = self._bg_leads
        if bg:
            self.wake()  # the background thread leaves epoll and parks
        backoff = Backoff(spin, _YIELD_SECONDS, 0.0, True)
        sleep = backoff.background or not spin  # (crowded cores: see "Waiting")
        try:
            while not done():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return done()
                if self._bg_leads:  # (it leads no more once it sees us: wake it)
                    self.wake()
                    got = self._poll.acquire(True, min(remaining, 0.05))
                else:
                    got = self._poll.acquire(False)
                if got:
                    try:
                        if not done():
                            self.poll(min(remaining, _BG_POLL) if sleep else 0.0, done)
                    finally:
                        self._poll.release()
                    if not sleep and not done():
                        sleep = backoff.pause()
                elif event is not None:
                    event.wait(min(remaining, _FOLLOW))
                else:
                    time.sleep(min(remaining, _FOLLOW))
            return True
        finally:
            with self._lock:
                self._waiters -= 1
                self._last_wait = time.monotonic()  # (the background thread looks later)

    def _background(self) -> None:
        while True:
            with self._lock:
                while not self._stop:  # threads that wait back to back drive it themselves
                    quiet = time.monotonic() - self._last_wait
                    linger = _LINGER_BULK if self._bulk_waiting() else _LINGER_IDLE
                    if not self._waiters and quiet >= linger:
                        break
                    self._idle.wait(linger if self._waiters else linger - quiet)
                if self._stop:
                    return
            if not self._poll.acquire(True, _BG_POLL):
                continue
            failure = None
            try:
                with self._lock:
                    if self._waiters or self._stop:
                        continue
                    self._bg_leads = True
                self.poll(_BG_POLL)
            except Exception as e:  # noqa: BLE001 - never die silently: see _failed
                failure = e
            finally:
                self._bg_leads = False
                self._poll.release()
            if failure is not None:
                self._failed(failure)

    def _failed(self, error: Exception) -> None:
        """The background thread's poll raised (a bug): without it nothing moves what nobody
        waits for, so every transport closes with that cause, which their pending requests
        and their groups' next calls raise (instead of a stall reported as a timeout)."""
        log.error("neuron: the network progress engine failed", exc_info=error)
        retire(self)  # a transport made from now on gets an engine of its own
        cause = TransportError(f"the network progress engine failed: {error!r}")
        for t in list(self._transports):
            try:
                t.close(cause)
            except Exception:  # noqa: BLE001 - close the others anyway
                log.exception("neuron: closing a transport after the engine failed")

    # ------------------------------------------------------------------ lifetime

    def _add(self, transport: RdmTransport) -> None:
        self._transports.append(transport)

    def _remove(self, transport: RdmTransport) -> bool:
        """Forget ``transport``; True if it was the last one (the engine then stops)."""
        kept = [t for t in self._transports if t is not transport]
        was_user, self._transports = len(kept) < len(self._transports), kept
        return was_user and not kept

    def _shutdown(self) -> None:
        with self._lock:
            self._stop = True
            self._idle.notify_all()
        self.wake()
        self.callbacks.put(None)
        for listener in self._listeners.values():
            listener.close()
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(timeout=2.0)
        # Not while a thread polls: a leader in ``epoll`` would find it closed under it.
        # (A leader polls at most _BG_POLL at a time and, once it holds ``_poll``, sees
        # ``_stop``.)
        got = self._poll.acquire(timeout=2.0)
        try:
            self._epoll.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
        finally:
            if got:
                self._poll.release()


# Every rdm transport of the process, and the links they share, work under this one lock
# (links.py: a rail carries the frames of several groups).
NET_LOCK = threading.RLock()
_ENGINE: Progress | None = None
_ENGINE_LOCK = threading.RLock()  # (detach retires under it)


def attach(transport: RdmTransport) -> Progress:
    """The process's engine (started if needed), with ``transport`` counted as a user."""
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is None:
            _ENGINE = Progress()
        _ENGINE._add(transport)
        return _ENGINE


def detach(transport: RdmTransport) -> None:
    """``transport`` is closed; its engine stops with its last user."""
    engine = transport.engine
    with _ENGINE_LOCK:
        if not engine._remove(transport):
            return
        retire(engine)
    engine._shutdown()


def retire(engine: Progress) -> None:
    """``engine`` takes no new users: the next ``attach`` starts another."""
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is engine:
            _ENGINE = None
