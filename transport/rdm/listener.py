"""The process's listener on one interface address, shared by every group (every rdm
transport) of the process.

A rank publishes this address for each of its groups; peers dial it and name, in the
handshake, the group and rank they want (handshake.py). ``resolve(group_id, rank)`` finds
that group's transport, whose key checks the proof; the authenticated connection becomes
a rail of that transport (``RailOpening.accepted``). Each connection gets a thread for its
handshake, with one deadline for the whole of it; at most ``MAX_HANDSHAKES`` may be
unfinished at once, and an error from ``accept`` (out of descriptors, a connection reset
before it was taken) is retried with a growing pause, never the end of the loop.
Strangers are logged a few times a minute.

Rails open on first use, at any time of a job, so a flood of strangers must not shed the
handshakes of the job's own dialers. A handshake's progress is 0 until the dialer's proof
starts with the protocol's magic, 1 until the proof checks out (the dialer holds the job
key), 2 after. When a new connection finds ``MAX_HANDSHAKES`` unfinished, the one dropped
is, among those not past 1 and open for ``SILENT_GRACE`` or longer, the least advanced,
then the oldest: idle and stalled connections go, a dialer whose proof is on its way does
not. A connection younger than that which has sent nothing looks like an idle stranger,
yet may be a dialer one round trip from sending its proof: so when every unfinished
handshake is that young (or proven), the new connection is closed at once instead. A
dialer whose connection is closed before an answer dials again (dialing.py), a refused
one is told why (handshake.py). Garbage ends a connection at once, and the handshake
deadline still bounds every connection.
"""

from __future__ import annotations

import errno
import logging
import math
import random
import socket
import threading
import time

from typing import TYPE_CHECKING, Any

from . import handshake

if TYPE_CHECKING:
    from .handshake import Resolve

log = logging.getLogger("neuron_dist.rdm")

HANDSHAKE_TIMEOUT = 10.0
MAX_HANDSHAKES = 32  # unfinished incoming handshakes at once (then one is dropped)
# A connection is not dropped for a new one before it had this long to show it is a
# dialer: a few round trips, and the time a loaded dialer takes to answer.
SILENT_GRACE = 0.2


class _RateLimitedLog:
    """Warnings about strangers at the listener: the first few per minute, then a count."""

    def __init__(self, label: str, burst: int = 5, period: float = 60.0):
        self._label, self._burst, self._period = label, burst, period
        self._start, self._count, self._lock = -math.inf, 0, threading.Lock()

    def note(self, what: str, level: int = logging.WARNING) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._start > self._period:
                if self._count > self._burst:
                    log.warning("neuron %s: %d more such events at the listener in the last "
                                "%.0f s", self._label, self._count - self._burst, self._period)
                self._start, self._count = now, 0
            self._count += 1
            loud = self._count <= self._burst
        if loud:
            log.log(level, "neuron %s: %s", self._label, what)



def bind(host: str, port_range: tuple[int, int] | None = None) -> socket.socket:
    """A socket listening on ``host``: on any free port, or on the first free one of
    ``port_range`` (``(first, last)``, both included, for clusters whose firewalls open only
    a range), tried from a random place in it so that the ranks of one machine do not all
    race for its first ports. Raises OSError naming the range when every port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if port_range is None:
        return socket.create_server((host, 0), backlog=128, family=family)
    first, last = port_range
    count = last - first + 1
    start = random.randrange(count)
    for k in range(count):
        port = first + (start + k) % count
        try:
            return socket.create_server((host, port), backlog=128, family=family)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
    raise OSError(errno.EADDRINUSE,
                  f"NEURON_DIST_PORT_RANGE={first}-{last}: all {count} ports are in use on "
                  f"{host}; each process listens on one port per interface: widen the range")


class Listener:
    """A listening socket on ``host`` (see ``bind``) and its accept thread."""

    def __init__(self, host: str, resolve: Resolve, port_range: tuple[int, int] | None = None):
        self.sock = bind(host, port_range)
        port = self.sock.getsockname()[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._resolve = resolve
        self._lock = threading.Lock()
        # unfinished incoming connection -> [address, progress (0..2), accepted at],
        # oldest first
        self._handshakes: dict[socket.socket, list[Any]] = {}  # (see above)
        # handshake threads not finished yet (close joins them)
        self._workers: set[threading.Thread] = set()
        self._strangers = _RateLimitedLog(f"listener {self.address}")
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"neuron-rdm-accept-{port}")
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, end the unfinished handshakes and wait (at most 2 s) for their
        threads and the accept thread, so nothing of the listener outlives it."""
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked in it
        except OSError:
            pass
        self.sock.close()
        with self._lock:
            for conn in list(self._handshakes):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        end = time.monotonic() + 2.0
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        with self._lock:
            workers = list(self._workers)
        for worker in workers:  # (their connections are shut down: they end at once)
            if worker is not threading.current_thread():
                worker.join(timeout=max(0.0, end - time.monotonic()))

    def _accept_loop(self) -> None:
        """Accept connections for as long as the transport is open.

        Each gets a thread for its handshake, with one deadline for the whole of it
        (``HANDSHAKE_TIMEOUT``). At most ``MAX_HANDSHAKES`` may be unfinished at once
        (``_make_room``: a flood of idle connections costs the job no more than that many
        descriptors and threads, and does not drop the handshakes of its dialers). An
        error from ``accept`` (out of descriptors,
        a connection reset before it was taken) is logged and retried with a growing pause,
        never the end of the loop; so is a thread that cannot be started (the process's
        thread limit): that connection is dropped.
        """
        pause = 0.0
        while not self._closed:
            try:
                conn, addr = self.sock.accept()
            except OSError as e:
                if self._closed:
                    return
                pause = min(1.0, max(0.01, pause * 2))
                self._strangers.note(f"accept() failed: {e}", level=logging.WARNING)
                with self._lock:  # free descriptors: drop an unfinished handshake
                    if self._handshakes and not self._make_room(time.monotonic()):
                        self._drop(next(iter(self._handshakes)), "out of descriptors")
                time.sleep(pause)
                continue
            pause = 0.0
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                now = time.monotonic()
                room = len(self._handshakes) < MAX_HANDSHAKES or self._make_room(now)
                if room:
                    self._handshakes[conn] = [addr, 0, now]
                    worker = threading.Thread(target=self._accept_one, args=(conn, addr),
                                              daemon=True, name="neuron-rdm-handshake")
                    self._workers.add(worker)
            if not room:  # every unfinished one may be a dialer: this one goes (it redials)
                self._strangers.note(f"closed a connection from {addr}: {MAX_HANDSHAKES} "
                                     f"handshakes under way")
                conn.close()
                continue
            try:
                worker.start()
            except RuntimeError as e:  # at the process's thread limit: drop this one, go on
                with self._lock:
                    self._handshakes.pop(conn, None)
                    self._workers.discard(worker)
                conn.close()
                pause = min(1.0, max(0.01, pause * 2))
                self._strangers.note(f"no thread for a handshake from {addr}: {e}",
                                     level=logging.WARNING)
                time.sleep(pause)

    def _make_room(self, now: float) -> bool:
        """Under the lock: drop the unfinished handshake that has shown least, longest (see
        the module docstring); False if every one is proven or younger than SILENT_GRACE."""
        victim, key = None, None
        for conn, (_, level, since) in self._handshakes.items():  # (oldest first)
            if level < 2 and now - since >= SILENT_GRACE and (key is None or level < key):
                victim, key = conn, level
                if level == 0:
                    break
        if victim is None:
            return False
        self._drop(victim, f"{MAX_HANDSHAKES} were open")
        return True

    def _drop(self, conn: socket.socket, why: str) -> None:
        """Under the lock: end the unfinished handshake on ``conn`` (its thread sees an
        error and closes it; a dialer dials again)."""
        addr = self._handshakes.pop(conn)[0]
        self._strangers.note(f"dropped an unfinished handshake from {addr} ({why})")
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _progress(self, conn: socket.socket, level: int) -> None:
        """The handshake on ``conn`` reached ``level`` (see ``handshake.accept``)."""
        with self._lock:
            entry = self._handshakes.get(conn)
            if entry is not None:
                entry[1] = level

    def _accept_one(self, conn: socket.socket, addr: object) -> None:
        try:
            self._handshake(conn, addr)
        finally:
            with self._lock:
                self._workers.discard(threading.current_thread())

    def _handshake(self, conn: socket.socket, addr: object) -> None:
        try:
            owner, peer, rail, session = handshake.accept(
                conn, self._resolve, deadline=time.monotonic() + HANDSHAKE_TIMEOUT,
                progress=lambda level: self._progress(conn, level))
        except Exception as e:  # noqa: BLE001 - a stranger must never hurt the job
            with self._lock:
                self._handshakes.pop(conn, None)
            if isinstance(e, handshake.Crossed):
                log.debug("neuron listener: %s", e)  # (normal: both ends sent at once)
            else:
                self._strangers.note(f"refused a connection from {addr}: {e}")
            conn.close()
            return
        with self._lock:
            evicted = self._handshakes.pop(conn, None) is None
        if evicted:  # (dropped just after its OK went out: the dialer's new rail breaks)
            conn.close()
            owner.release(peer, rail)
            return
        try:
            owner.accepted(conn, peer, rail, session)
        except Exception as e:  # noqa: BLE001 - never end this thread silently
            log.exception("neuron listener: taking rail %d of rank %d failed", rail, peer)
            conn.close()
            owner.release(peer, rail)
            self._strangers.note(f"could not take a rail from rank {peer}: {e!r}",
                                 level=logging.WARNING)
