"""Socket driver of the rdm transport: N authenticated TCP rails per pair of ranks.

How it works
------------
Every rank listens on one TCP socket bound to the chosen interface's address (port 0)
and publishes ``host:port``. For each pair of ranks that must talk, the higher rank dials
the lower one ``rails`` times; each connection is authenticated (handshake.py) and
becomes rail ``i`` of that pair at both ends. All protocol logic lives in the sans-I/O
``protocol.Endpoint``; this module only moves its frames, under one lock:

* one **writer** thread per rail drains that rail's queue of ``Transmit``s with one
  scatter-gather ``sendmsg`` (header + a view of the user's buffer: no copy);
* one **reader** thread per rail reads a 64-byte header (validated before anything else
  is read: ``frames.decode_header``), asks the endpoint where the segment belongs
  (``data_target``: the posted receive buffer or the message's reassembly buffer) and
  reads the payload straight there with ``recv_into``, so large messages are copied once,
  by the kernel (then the acks riding behind it, if any). ACKs, duplicates and odd frames
  are read aside and go through
  ``Endpoint.receive``. A header that fails validation means the byte stream cannot be
  trusted any more: the rail is closed (and logged); its unacknowledged segments are
  resent on the other rails;
* a **timer** thread calls ``poll_transmit`` at the endpoint's next deadline: a
  retransmission, or acks held for ``ack_delay`` that found no DATA frame to ride on.

Threads block in system calls with the GIL released, one syscall per segment, so the
Python cost is per segment (<= ``segment_bytes``), not per byte. A rail whose connection
breaks is reported to the endpoint (``rail_failed``): nothing is lost while one rail to the
peer is left; when the last one goes, every request to or from that peer fails with
``PeerUnreachable`` naming it.

Requests: ``isend``/``irecv`` return a ``Request``; ``wait(deadline)`` raises
``PeerTimeout`` naming the peer when the deadline passes. Receives match sends per
``(peer, tag)`` in order; a message that arrives before its receive is posted is kept
until it is. Nothing here imports torch.
"""

from __future__ import annotations

import logging
import math
import queue
import socket
import threading
import time
from collections import deque

from ..errors import (ABORTED, ABORTED_TIMEOUT, ChannelClosed, MessageSizeMismatch, PeerAborted,
                      PeerTimeout, PeerUnreachable)
from ..requests import Request, run_callbacks
from . import frames as F
from . import handshake
from .protocol import (DELAYED_ACK_BYTES, Endpoint, FrameRejected, MessageReceived, PeerFailed,
                       SendCompleted)

log = logging.getLogger("neuron_dist.rdm")

_IOV_MAX = 512
EAGER_BYTES = 64 << 10
_SMALL_COPY = 512  # eager copies up to this size come from Python's small-object allocator
ABORT_TAG = (1 << 62) + 1  # a rank failed the group: [kind byte | reason] (see abort())
_CLEAN_EOF = "connection closed by the peer (0 of"
_HANDSHAKE_TIMEOUT = 10.0
CANCEL_GRACE = 1.0  # a rail still inside a withdrawn request's buffer after this is cut
MAX_HANDSHAKES = 32  # unfinished incoming handshakes at once (then the oldest is dropped)


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


class _CopyPool:
    """Buffers for the copies of eager sends, reused once their message is acknowledged.

    A fresh 64 KiB copy costs ~40 µs here when the allocator has handed freed memory back
    to the kernel in between (page faults), a reused one ~7. A copy comes back when its
    message is acknowledged, and is reused only if no frame refers to it any more (a
    resend still queued on a rail holds a view of it: a bytearray with live views cannot
    change size, which is how that is checked). Holds at most ``limit`` bytes.
    """

    def __init__(self, limit: int = 8 << 20):
        self._free: dict = {}  # size class -> [bytearray]
        self._bytes, self._limit = 0, limit

    def take(self, n: int) -> bytearray:
        size = 1 << max(10, (n - 1).bit_length())
        free = self._free.get(size)
        if free:
            self._bytes -= size
            return free.pop()
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        size = len(buf)
        if self._bytes + size > self._limit:
            return
        try:
            buf.append(0)
        except BufferError:
            return  # still referred to: let it go
        buf.pop()
        self._free.setdefault(size, []).append(buf)
        self._bytes += size


class _Rail:
    __slots__ = ("sock", "peer", "index", "out", "cond", "alive", "busy", "reading",
                 "writing")

    def __init__(self, sock, peer, index):
        self.sock, self.peer, self.index = sock, peer, index
        self.out = deque()
        self.cond = threading.Condition(threading.Lock())
        self.alive = True
        self.busy = False  # the writer is sending a batch
        self.reading = None  # the buffer object the reader is writing a payload into
        self.writing = ()  # the batch the writer is sending (views), while busy

    @property
    def idle(self) -> bool:
        return not self.alive or (not self.out and not self.busy)

    def push(self, tx) -> None:
        """Queue a frame; when the rail is idle, write what the socket takes right away.

        The immediate, non-blocking write saves a hand-off to the writer thread on the
        latency path (small messages, acks); whatever does not fit waits for the writer.
        """
        bufs = [memoryview(tx.header)]
        if len(tx.payload):
            bufs.append(memoryview(tx.payload).cast("B"))
        if tx.trailer:
            bufs.append(memoryview(tx.trailer))
        with self.cond:
            if not self.alive:
                return
            if not self.out and not self.busy:
                try:
                    bufs = _trim(bufs, self.sock.sendmsg(bufs, [], socket.MSG_DONTWAIT))
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    pass  # the writer meets the error and reports the rail
                if not bufs:
                    return
            self.out.extend(bufs)
            self.cond.notify()


class RdmTransport:
    """Reliable tagged messages to the other ranks of a group, over N TCP rails per peer.

    Parameters
    ----------
    rank, world_size : int
        This rank and the group size (ranks are group ranks).
    host : str
        Address to listen on (the chosen interface's; never a wildcard).
    rails : int
        Connections per peer.
    key, group : bytes
        Job secret and group nonce for the handshake.
    segment_bytes, window_bytes : int
        Largest DATA payload, unacknowledged bytes allowed per peer.
    crc : bool
        CRC-32 on every frame (end-to-end check on top of TCP's).
    max_unexpected_bytes : int
        Memory per peer for messages that arrive before their receive is posted
        (``Endpoint``'s ``max_reassembly_bytes``); beyond it the peer is held back.
    label : str
        Names the group in log messages.
    """

    def __init__(self, rank: int, world_size: int, *, host: str, rails: int, key: bytes,
                 group: bytes, segment_bytes: int = 1 << 20, window_bytes: int = 32 << 20,
                 crc: bool = False, rto: float = 5.0, ack_delay: float = 0.005,
                 max_unexpected_bytes: int = 512 << 20, label: str = ""):
        self.rank, self.world_size, self.nrails = rank, world_size, rails
        self.segment_bytes = segment_bytes
        self._key, self._group, self._label = key, group, label or f"rank {rank}"
        self.ep = Endpoint(rank, world_size, rails, segment_bytes, 1 << 48, rto=rto,
                           max_rto=max(rto, 30.0), max_retries=6, window_bytes=window_bytes,
                           max_reassembly_bytes=max_unexpected_bytes, crc=crc,
                           ack_delay=ack_delay, notice_tags=(ABORT_TAG,))
        self._lock = threading.Lock()
        self._rails: dict[int, list] = {}
        self._expected: set[int] = set()
        self._connected = threading.Condition(self._lock)
        self._sends: dict = {}
        self._copies: dict = {}  # (peer, msg_id) -> the copy of an eager send, until acked
        self._pool = _CopyPool()
        self._recvs: dict = {}  # (peer, tag) -> deque of posted Requests
        self._positions: dict = {}  # receive Request -> its stream position (cancel_recv)
        self._deferred: list = []  # (Request, error): failed while a reader wrote into it
        self._any: dict = {}  # tag -> deque of receives from any source
        self._failed: dict[int, Exception] = {}
        self._closed = False
        self._timer = threading.Condition(self._lock)
        self._timer_period = min(1.0, rto / 4)
        self._timer_at = -math.inf  # when the sleeping timer wakes (-inf: it is awake)
        # Completion callbacks run here, never under the lock: they may post new requests.
        self._callbacks = queue.SimpleQueue()
        self._outbox = deque()  # frames to write, queued under the lock (see _pump)
        self._handing: set = set()  # threads moving frames from the outbox to rails
        self._handshakes: dict = {}  # unfinished incoming connection -> address, oldest first
        self._strangers = _RateLimitedLog(self._label)
        self._listener = socket.create_server((host, 0), backlog=128,
                                              family=_family(host))
        self.address = f"{_bracket(host)}:{self._listener.getsockname()[1]}"
        self._threads = [threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"neuron-rdm-accept-{rank}"),
                         threading.Thread(target=self._timer_loop, daemon=True,
                                          name=f"neuron-rdm-timer-{rank}"),
                         threading.Thread(target=self._callback_loop, daemon=True,
                                          name=f"neuron-rdm-callbacks-{rank}")]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ set-up

    def connect(self, peers: dict, deadline: float) -> None:
        """Open ``rails`` authenticated connections to each of ``peers`` ({rank: "host:port"}).

        Ranks dial the lower-numbered peers and accept the higher-numbered ones; returns
        when every rail to every peer is up.

        Raises
        ------
        PeerTimeout
            Some peers were not connected by ``deadline``.
        """
        with self._lock:
            self._expected = set(peers) - {self.rank}
        for peer in sorted(p for p in self._expected if p < self.rank):
            host, port = _split(peers[peer])
            for rail in range(self.nrails):
                self._dial(peer, host, port, rail, deadline)
        with self._lock:
            while not self._closed:
                missing = [p for p in sorted(self._expected)
                           if None in self._rails.get(p, [None])]
                if not missing:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PeerTimeout(missing, 0.0, f"rank(s) {missing} did not open their "
                                                    f"{self.nrails} rail(s) to rank {self.rank} in time")
                self._connected.wait(min(remaining, 0.5))
        raise ChannelClosed("transport closed while connecting")

    def _dial(self, peer: int, host: str, port: int, rail: int, deadline: float) -> None:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerTimeout([peer], 0.0, f"could not connect rail {rail} to rank {peer} "
                                               f"at {host}:{port}")
            try:
                sock = socket.create_connection((host, port), timeout=min(remaining, _HANDSHAKE_TIMEOUT))
                break
            except ConnectionRefusedError:
                time.sleep(0.05)
        try:
            handshake.dial(sock, self._key, self._group, self.rank, rail, peer)
        except BaseException:
            sock.close()
            raise
        self._add_rail(sock, peer, rail)

    def _accept_loop(self) -> None:
        """Accept connections for as long as the transport is open.

        Each gets a thread for its handshake, with one deadline for the whole of it
        (``_HANDSHAKE_TIMEOUT``). At most ``MAX_HANDSHAKES`` may be unfinished at once: a
        new one closes the oldest (a flood of idle connections costs the job no more than
        that many descriptors and threads). An error from ``accept`` (out of descriptors,
        a connection reset before it was taken) is logged and retried with a growing pause,
        never the end of the loop.
        """
        pause = 0.0
        while not self._closed:
            try:
                conn, addr = self._listener.accept()
            except OSError as e:
                if self._closed:
                    return
                pause = min(1.0, max(0.01, pause * 2))
                self._strangers.note(f"accept() failed: {e}", level=logging.WARNING)
                with self._lock:  # free descriptors: drop the oldest unfinished handshake
                    if self._handshakes:
                        self._evict_oldest()
                time.sleep(pause)
                continue
            pause = 0.0
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                while len(self._handshakes) >= MAX_HANDSHAKES:
                    self._evict_oldest()
                self._handshakes[conn] = addr
            threading.Thread(target=self._accept_one, args=(conn, addr), daemon=True,
                             name=f"neuron-rdm-handshake-{self.rank}").start()

    def _evict_oldest(self) -> None:
        """Under the lock: end the oldest unfinished handshake (its thread sees an error)."""
        conn, addr = next(iter(self._handshakes.items()))
        del self._handshakes[conn]
        self._strangers.note(f"dropped an unfinished handshake from {addr} "
                             f"({MAX_HANDSHAKES} were open)")
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _accept_one(self, conn, addr) -> None:
        def may_dial(rank, rail):
            with self._lock:
                return (self.rank < rank < self.world_size and rail < self.nrails
                        and self._rails.get(rank, [None] * self.nrails)[rail] is None)
        try:
            peer, rail = handshake.accept(conn, self._key, self._group, self.rank, may_dial,
                                          deadline=time.monotonic() + _HANDSHAKE_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - a stranger must never hurt the job
            with self._lock:
                self._handshakes.pop(conn, None)
            self._strangers.note(f"refused a connection from {addr}: {e}")
            conn.close()
            return
        with self._lock:
            evicted = self._handshakes.pop(conn, None) is None
        if evicted:  # (it was closed under us: the dialer retries)
            conn.close()
            return
        self._add_rail(conn, peer, rail)

    def _add_rail(self, sock, peer: int, index: int) -> None:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rail = _Rail(sock, peer, index)
        with self._lock:
            if self._closed:
                sock.close()
                return
            rails = self._rails.setdefault(peer, [None] * self.nrails)
            rails[index] = rail
            self._rails[peer] = rails
            self._connected.notify_all()
        for target, name in ((self._write_loop, "w"), (self._read_loop, "r")):
            t = threading.Thread(target=target, args=(rail,), daemon=True,
                                 name=f"neuron-rdm-{name}{self.rank}-{peer}.{index}")
            t.start()
            self._threads.append(t)

    # ------------------------------------------------------------------ requests

    def isend(self, peer: int, tag: int, buf, callback=None) -> Request:
        """Send the bytes of ``buf`` (kept unchanged until the request completes).

        Messages up to ``EAGER_BYTES`` are copied and the request completes at once (like
        MPI's eager protocol): the copy stays with the protocol until the peer acknowledges
        it, so a small send costs no round trip. Larger ones complete when acknowledged.
        ``callback(request)``, if given, runs on the transport's callback thread when the
        request completes (successfully or not).
        """
        view = memoryview(buf).cast("B")
        req = Request(peer, tag, view, True, self._callbacks)
        req.callback = callback
        n = view.nbytes
        eager = n <= EAGER_BYTES
        with self._lock:
            self._check_usable(peer)
            if not eager:
                self._sends[(peer, self.ep.send(peer, tag, view))] = req
            elif n <= _SMALL_COPY:
                self.ep.send(peer, tag, bytes(view))
                req._finish()
            else:
                copy = self._pool.take(n)
                copy[:n] = view
                self._copies[(peer, self.ep.send(peer, tag, memoryview(copy)[:n]))] = copy
                req._finish()
            self._pump()
        self._send_out()
        return req

    def irecv(self, peer: int, tag: int, buf, callback=None) -> Request:
        """Receive the next message of ``(peer, tag)`` into ``buf`` (exactly its size)."""
        view = memoryview(buf).cast("B")
        req = Request(peer, tag, view, False, self._callbacks)
        req.callback = callback
        with self._lock:
            if self._closed:
                raise ChannelClosed(f"rdm transport of {self._label} is closed")
            # A message that arrived whole is delivered even if its sender has since closed
            # or failed: a peer that sends its last message and exits is normal.
            early = self.ep.take_early(peer, tag)
            if early is not None:
                self._complete_recv(req, early)
                return req
            self._check_usable(peer)
            self._positions[req] = self.ep.post_recv(peer, tag, view)
            self._recvs.setdefault((peer, tag), deque()).append(req)
        return req

    def irecv_any(self, tag: int, buf, callback=None) -> Request:
        """Receive the next message of ``tag`` from whichever rank sends one first.

        The source is in ``request.source`` once complete. Messages go to receives naming
        their source first; a receive from any source takes the earliest message that no
        such receive was waiting for.
        """
        view = memoryview(buf).cast("B")
        req = Request(None, tag, view, False, self._callbacks)
        req.callback = callback
        with self._lock:
            if self._closed:
                raise ChannelClosed(f"rdm transport of {self._label} is closed")
            early = self.ep.take_early_any(tag)
            if early is not None:
                req.source = early[0]
                self._complete_recv(req, early[1])
                return req
            alive = [p for p in self._rails if p not in self._failed]
            if not alive:
                raise next(iter(self._failed.values()), ValueError("no peer connected"))
            self._any.setdefault(tag, deque()).append(req)
        return req

    def cancel(self, req: Request, error: Exception) -> bool:
        """Withdraw ``req`` unless it has completed; True if it was withdrawn.

        On return the transport no longer touches the request's buffer: frames still
        queued with views of a send's data are copied, and a rail whose reader or writer
        is still inside the buffer after ``CANCEL_GRACE`` seconds is cut (its other
        traffic is resent on the remaining rails). The request fails with ``error``. A
        withdrawn message leaves its stream between the two ranks out of step, so the
        peer is failed on both sides: later requests with it raise ``error`` here, and it
        is told (its requests with this rank fail with ``PeerAborted``). A receive from
        any source binds no stream and is simply withdrawn.
        """
        obj, peer = req.buf.obj, req.peer
        with self._lock:
            if req._event.is_set():
                return False
            if not req.is_send:
                if peer is None:
                    self._any.get(req.tag, deque()).remove(req)
                    req._finish(error)
                    return True
                try:
                    self._recvs.get((peer, req.tag), deque()).remove(req)
                except ValueError:
                    pass
                position = self._positions.pop(req, None)
                if position is not None:
                    self.ep.cancel_recv(peer, req.tag, position)
                self._fail_recv(req, error)  # (finished once no reader is in its buffer)
            else:
                key = next((k for k, r in self._sends.items() if r is req), None)
                if key is not None:
                    del self._sends[key]
                    self.ep.cancel_send(*key)
            self._break_peer(peer, error)
            self._pump()
        self._send_out()
        end = time.monotonic() + CANCEL_GRACE
        while True:
            with self._lock:
                inside, handing = self._inside(obj, peer)
            if not inside and not handing:
                break
            if inside and time.monotonic() > end:
                for rail in inside:
                    self._rail_down(rail, f"still inside the buffer of a withdrawn request "
                                          f"after {CANCEL_GRACE:g} s (the peer stalls)")
                end = math.inf  # cut: its reader and writer leave at once
            time.sleep(0.0005)
        if req.is_send:
            req._finish(error)
        return True

    def _inside(self, obj, peer: int):
        """Under the lock: rails to ``peer`` whose threads still use buffer ``obj``, and
        whether a frame is being handed to a rail; queued frames that refer to ``obj``
        are replaced by copies."""
        def refers(tx):
            return getattr(tx.payload, "obj", None) is obj

        if any(refers(tx) for tx in self._outbox):
            # In place: another thread may be taking frames from it (a frame it took
            # meanwhile goes out twice, which the protocol treats as a duplicate).
            frames = [tx._replace(payload=bytes(tx.payload)) if refers(tx) else tx
                      for tx in self._outbox]
            self._outbox.clear()
            self._outbox.extend(frames)
        inside = []
        for rail in self._rails.get(peer, ()):
            if rail is None:
                continue
            with rail.cond:
                if any(v.obj is obj for v in rail.out):
                    rail.out = deque(memoryview(bytes(v)) if v.obj is obj else v
                                     for v in rail.out)
                writing = rail.busy and any(v.obj is obj for v in rail.writing)
            if writing or rail.reading is obj:
                inside.append(rail)
        return inside, bool(self._handing)  # (handing: a frame between outbox and a rail)

    def _break_peer(self, peer: int, error: Exception) -> None:
        """Under the lock: stop talking to ``peer`` after a withdrawn request, and tell it."""
        if peer in self._failed:
            return
        self._failed[peer] = error
        kind = ABORTED_TIMEOUT if isinstance(error, PeerTimeout) else ABORTED
        payload = bytes([kind]) + (f"rank {self.rank} withdrew a request with this rank: "
                                   f"{error}").encode("utf-8", "replace")[:4000]
        try:
            self.ep.send(peer, ABORT_TAG, payload)
        except Exception:  # noqa: BLE001 - the peer is gone already
            pass
        self._fail_peer_requests(peer, error)

    def _check_usable(self, peer: int) -> None:
        if self._closed:
            raise ChannelClosed(f"rdm transport of {self._label} is closed")
        if peer in self._failed:
            raise self._failed[peer]
        if peer not in self._rails:
            raise ValueError(f"rank {peer} is not connected to rank {self.rank}")

    def _complete_recv(self, req: Request, data) -> None:
        n = len(data) if not isinstance(data, memoryview) else data.nbytes
        if n != req.nbytes:
            req._finish(MessageSizeMismatch(req.source, req.tag, n, req.nbytes, data))
            return
        if not (isinstance(data, memoryview) and data.obj is req.buf.obj):
            req.buf[:n] = data
        req._finish()

    # ------------------------------------------------------------------ engine

    def _pump(self, deadline_passed: bool = False, hold: bool = False) -> None:
        """Under the lock: act on the endpoint's events (completing requests first, so
        their waiters run while frames go out), then queue the frames it wants sent. The
        caller writes them with ``_send_out`` once it has released the lock: a write may
        take a while (on loopback or veth the kernel delivers to the peer's socket in it),
        and the rdm protocol does not need frames in order, even on one rail. ``hold``:
        a reader has more frames to read right away; what is due goes after them."""
        self._handle_events()
        if self.ep.take_ack_hint() < self._timer_at:
            self._timer.notify()  # held acks are due before the timer would look
        if hold or not (self.ep.has_work or deadline_passed):
            return  # (say, a frame that only completed a receive: nothing to send)
        self._outbox.extend(self.ep.poll_transmit(time.monotonic()))
        self._handle_events()  # poll_transmit may have declared a peer failed

    def _send_out(self) -> None:
        """Outside the lock: hand the queued frames to their rails.

        A thread is listed in ``_handing`` from before it takes a frame until the frame is
        on its rail, so a draining close sees a frame that is in nobody's queue (see
        ``_drain``)."""
        out = self._outbox
        if not out:
            return
        me = threading.get_ident()
        self._handing.add(me)
        try:
            while out:
                try:
                    tx = out.popleft()
                except IndexError:  # another thread took the last one
                    return
                rails = self._rails.get(tx.peer)
                rail = rails[tx.rail] if rails else None
                if rail is not None and rail.alive:
                    rail.push(tx)
        finally:
            self._handing.discard(me)

    def _handle_events(self) -> None:
        for ev in self.ep.events():
            if isinstance(ev, SendCompleted):
                req = self._sends.pop((ev.peer, ev.msg_id), None)
                if req is not None:
                    req._finish()
                else:
                    copy = self._copies.pop((ev.peer, ev.msg_id), None)
                    if copy is not None:
                        self._pool.give(copy)
            elif isinstance(ev, MessageReceived):
                self._on_message(ev)
            elif isinstance(ev, PeerFailed):
                self._on_peer_failed(ev)
            elif isinstance(ev, FrameRejected):
                log.error("neuron %s: rejected a frame on rail %d: %s", self._label, ev.rail,
                          ev.reason)
        # The timer is not woken for new retransmission deadlines: they are at least one
        # rto away, and it looks at least every rto / 4 (a wake-up per frame cost a thread
        # switch). Held acks wake it only when due before it would look (see _pump).

    def _on_message(self, ev: MessageReceived) -> None:
        if ev.tag == ABORT_TAG:
            self._on_abort(ev.src, bytes(ev.data))
            return
        waiting = self._recvs.get((ev.src, ev.tag))
        if waiting:  # (its buffer was bound to this position: posted, or too small)
            req = waiting.popleft()
            self._positions.pop(req, None)
            if ev.posted:
                self._complete_recv(req, ev.data)
            else:
                req._finish(MessageSizeMismatch(ev.src, ev.tag, len(ev.data), req.nbytes,
                                                ev.data))
            return
        anyone = self._any.get(ev.tag)
        if anyone:  # an early message (kept by the endpoint): the oldest such receive takes it
            req = anyone.popleft()
            req.source = ev.src
            self._complete_recv(req, self.ep.take_early(ev.src, ev.tag))

    def _on_abort(self, peer: int, data: bytes) -> None:
        kind = data[0] if data else ABORTED
        error = PeerAborted(peer, data[1:].decode("utf-8", "replace"), kind)
        error.network = True
        self._failed[peer] = error
        log.info("neuron %s: %s", self._label, error)
        self._fail_peer_requests(peer, error)

    def _fail_peer_requests(self, peer: int, error: Exception) -> None:
        if all(p in self._failed for p in self._rails):  # nobody left to send to us
            for q in self._any.values():
                for req in q:
                    req._finish(error)
            self._any.clear()
        for key in [k for k in self._sends if k[0] == peer]:
            self._sends.pop(key)._finish(error)
        for key in [k for k in self._copies if k[0] == peer]:
            del self._copies[key]
        for key in [k for k in self._recvs if k[0] == peer]:
            for req in self._recvs.pop(key):
                self._fail_recv(req, error)

    def _fail_recv(self, req: Request, error: Exception) -> None:
        """Under the lock: fail a receive, once no reader writes into its buffer any more
        (until then it waits in ``_deferred``; readers finish it when they leave it)."""
        self._positions.pop(req, None)
        if self._reading(req.buf.obj):
            self._deferred.append((req, error))
        else:
            req._finish(error)

    def _reading(self, obj) -> bool:
        return any(r is not None and r.reading is obj
                   for rails in self._rails.values() for r in rails)

    def _done_reading(self, rail: _Rail) -> None:
        """Under the lock: ``rail``'s reader left the buffer it was writing into."""
        rail.reading = None
        if self._deferred:
            waiting, self._deferred = self._deferred, []
            for req, error in waiting:
                self._fail_recv(req, error)

    def abort(self, reason: str, kind: int = ABORTED, grace: float = 0.5) -> None:
        """Tell every connected peer that this rank failed the group, then close.

        Peers' pending and later requests to or from this rank fail with ``PeerAborted``
        carrying ``reason`` and ``kind`` (so every rank can raise the same error class).
        Waits at most ``grace`` seconds for the notices to be acknowledged.
        """
        payload = bytes([kind]) + reason.encode("utf-8", "replace")[:4000]
        reqs = []
        with self._lock:
            if self._closed:
                return
            for peer in list(self._rails):
                if peer not in self._failed:
                    try:
                        msg_id = self.ep.send(peer, ABORT_TAG, payload)
                    except Exception:  # noqa: BLE001 - the peer is gone already
                        continue
                    req = Request(peer, ABORT_TAG, memoryview(payload), True)
                    self._sends[(peer, msg_id)] = req
                    reqs.append(req)
            self._pump()
        self._send_out()
        deadline = time.monotonic() + grace
        for req in reqs:
            try:
                req.wait(deadline)
            except Exception:  # noqa: BLE001 - best effort
                pass
        self.close(PeerAborted(self.rank, reason, kind))

    def _on_peer_failed(self, ev: PeerFailed) -> None:
        error = PeerUnreachable(ev.peer, f"rank {ev.peer} is unreachable: {ev.reason}")
        if isinstance(self._failed.get(ev.peer), PeerAborted):
            return  # it told us why before its rails went
        self._failed[ev.peer] = error
        busy = any(k[0] == ev.peer for k in self._sends) or any(
            k[0] == ev.peer and q for k, q in self._recvs.items())
        # A peer that closes its end while nothing is pending is usually just done.
        (log.error if busy else log.info)("neuron %s: %s", self._label, error)
        self._fail_peer_requests(ev.peer, error)
        for rail in self._rails.get(ev.peer, ()):
            if rail is not None:
                self._drop(rail)

    def _drop(self, rail: _Rail) -> None:
        # Shut down first: that wakes the reader blocked in recv (closing the fd would not);
        # the reader closes the socket on its way out.
        try:
            rail.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        rail.alive = False
        with rail.cond:
            rail.out.clear()
            rail.cond.notify()

    def _rail_down(self, rail: _Rail, reason: str) -> None:
        with self._lock:
            if not rail.alive or self._closed:
                return
            log.log(logging.INFO if reason.startswith(_CLEAN_EOF) else logging.WARNING,
                    "neuron %s: rail %d to rank %d failed: %s", self._label, rail.index,
                    rail.peer, reason)
            self._drop(rail)
            if rail.peer not in self._failed:
                self.ep.rail_failed(rail.index, rail.peer)
                self._pump()
        self._send_out()

    def _write_loop(self, rail: _Rail) -> None:
        sock = rail.sock
        while True:
            with rail.cond:
                while not rail.out and rail.alive:
                    rail.cond.wait()
                if not rail.alive:
                    break
                buffers = list(rail.out)
                rail.out.clear()
                rail.busy, rail.writing = True, buffers
            try:
                _send_all(sock, buffers)
            except OSError as e:
                rail.busy, rail.writing = False, ()
                self._rail_down(rail, f"send failed: {e}")
                break
            rail.writing = ()
            del buffers  # (views of eager copies: see _CopyPool)
            rail.busy = False

    def _read_loop(self, rail: _Rail) -> None:
        sock, ep = rail.sock, self.ep
        hbuf = bytearray(F.HEADER_SIZE)
        hview = memoryview(hbuf)
        max_payload = max(self.segment_bytes, F.MAX_ACKS_PER_FRAME * F.ACK_ENTRY.size)
        try:
            while rail.alive:
                _recv_exact(sock, hview)
                try:
                    h = F.decode_header(hbuf, world_size=self.world_size,
                                        max_message_bytes=ep.max_message_bytes,
                                        max_payload=max_payload, require_crc=ep.crc)
                    if h.src != rail.peer or h.dst != self.rank:
                        raise F.FrameError(f"frame from rank {h.src} to {h.dst} on a rail "
                                           f"between ranks {rail.peer} and {self.rank}")
                except F.FrameError as e:
                    log.error("neuron %s: closing rail %d to rank %d after a malformed frame: %s",
                              self._label, rail.index, rail.peer, e)
                    self._rail_down(rail, f"malformed frame: {e}")
                    return
                with self._lock:
                    target = ep.data_target(rail.index, h)
                    if target is not None:  # claimed for this rail: see "Buffer ownership"
                        rail.reading = target.obj
                if target is not None:
                    _recv_exact(sock, target)
                    trailer = b""
                    if h.nacks:
                        trailer = bytearray(h.trailer_bytes)
                        _recv_exact(sock, memoryview(trailer))
                    # A segment of a large message is acked at once (its sender waits), but
                    # not while more of a burst is already here: one ack frame per burst.
                    burst = h.total > DELAYED_ACK_BYTES and _readable(sock)
                    with self._lock:
                        ep.data_landed(rail.index, hbuf, h, time.monotonic(), trailer)
                        self._done_reading(rail)
                        self._pump(hold=burst)
                    self._send_out()
                    continue
                frame = bytearray(F.HEADER_SIZE + h.length + h.trailer_bytes)
                frame[:F.HEADER_SIZE] = hbuf
                _recv_exact(sock, memoryview(frame)[F.HEADER_SIZE:])
                with self._lock:
                    rejected = ep.stats["rejected"]
                    ep.receive(rail.index, frame, time.monotonic())
                    corrupt = ep.stats["rejected"] > rejected
                    self._pump()
                self._send_out()
                if corrupt:  # a path that corrupts data (past TCP's checksum) is not used again
                    self._rail_down(rail, "corrupted frame (CRC mismatch)")
                    return
        except Exception as e:  # noqa: BLE001 - never a reader that dies unnoticed
            if not isinstance(e, OSError):
                log.exception("neuron %s: reader of rail %d to rank %d failed", self._label,
                              rail.index, rail.peer)
            # Out of whatever it was reading into before the segments are resent elsewhere.
            self._leave(rail)
            self._rail_down(rail, (str(e) or type(e).__name__) if isinstance(e, OSError)
                            else f"reader failed: {type(e).__name__}: {e}")
        finally:
            self._leave(rail)
            if not rail.alive or self._closed:
                rail.sock.close()

    def _leave(self, rail: _Rail) -> None:
        """The reader of ``rail`` stops: its claims end, buffers it was in are free."""
        with self._lock:
            self.ep.release_claims(rail.peer, rail.index)
            self._done_reading(rail)

    def _timer_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                deadline = self.ep.next_deadline()
                wait = self._timer_period if deadline is None else max(
                    0.0, min(self._timer_period, deadline - time.monotonic()))
                if wait > 0:
                    self._timer_at = time.monotonic() + wait
                    self._timer.wait(wait)
                    self._timer_at = -math.inf
                if self._closed:
                    return
                due = deadline is not None and time.monotonic() >= deadline
                if due:
                    self._pump(deadline_passed=True)
            if due:
                self._send_out()

    def _callback_loop(self) -> None:
        run_callbacks(self._callbacks)

    # ------------------------------------------------------------------ teardown

    def stats(self) -> dict:
        """Protocol counters (segments sent, retransmits, duplicates, rejected frames...)."""
        with self._lock:
            return dict(self.ep.stats)

    def close(self, error: Exception | None = None) -> None:
        """Close every rail and the listener; pending requests fail with ``error``.

        Without ``error`` (a normal shutdown) the close is graceful: frames already queued
        (acknowledgements of what we received, above all) are written first and each rail
        is half-closed, so a peer still waiting for those acks completes normally.
        """
        if error is None:
            self._drain(time.monotonic() + 5.0)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            error = error or ChannelClosed(f"rdm transport of {self._label} was closed")
            for req in self._sends.values():
                req._finish(error)
            for q in self._recvs.values():
                for req in q:
                    self._fail_recv(req, error)
            for q in self._any.values():
                for req in q:
                    req._finish(error)
            self._sends.clear()
            self._copies.clear()
            self._recvs.clear()
            self._any.clear()
            for rails in self._rails.values():
                for rail in rails:
                    if rail is not None:
                        self._drop(rail)
            self._timer.notify_all()
            self._connected.notify_all()
        self._callbacks.put(None)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked in it
        except OSError:
            pass
        self._listener.close()
        me = threading.current_thread()
        for t in list(self._threads):
            if t is not me:
                t.join(timeout=2.0)


    def _drain(self, deadline: float) -> None:
        """Before a normal close: every message sent (eager ones completed long ago) must be
        acknowledged, so a peer still reading gets it all; then half-close the rails."""
        with self._lock:
            rails = [r for rails in self._rails.values() for r in rails if r is not None]
            peers = [p for p in self._rails if p not in self._failed]
            self.ep.release_acks()  # the peers' drains wait for them
            self._pump()
        self._send_out()

        def settled():
            with self._lock:
                unacked = sum(self.ep.inflight_bytes(p) for p in peers if p not in self._failed)
            # In this order: a frame leaves the outbox only after its mover is listed.
            return (unacked == 0 and not self._outbox and not self._handing
                    and all(r.idle for r in rails))

        while time.monotonic() < deadline and not settled():
            time.sleep(0.001)
        for r in rails:
            try:
                r.sock.shutdown(socket.SHUT_WR)  # FIN after the queued bytes
            except OSError:
                pass
        # Let the peers see our FIN and answer theirs, so no socket closes with unread
        # bytes (which would send a reset that can destroy data the peer has not read yet).
        end = min(deadline, time.monotonic() + 0.2)
        readers = [t for t in self._threads if t.name.startswith(f"neuron-rdm-r{self.rank}-")]
        for t in readers:
            t.join(timeout=max(0.0, end - time.monotonic()))


def _trim(views: list, sent: int) -> list:
    """What is left of the byte views ``views`` after ``sent`` bytes went out."""
    for i, v in enumerate(views):
        if sent < v.nbytes:
            return [v[sent:]] + views[i + 1:]
        sent -= v.nbytes
    return []


def _send_all(sock: socket.socket, views: list) -> None:
    while views:
        chunk, rest = views[:_IOV_MAX], views[_IOV_MAX:]
        views = _trim(chunk, sock.sendmsg(chunk)) + rest


def _readable(sock: socket.socket) -> bool:
    """Are bytes waiting on ``sock`` (without reading them)?"""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return False  # the next read meets the error


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    n, got = view.nbytes, 0
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError(f"connection closed by the peer ({got} of {n} bytes read)")
        got += k


def _family(host: str):
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)
