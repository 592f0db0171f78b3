"""The floor of a Python backend between nodes: a process group with no protocol at all.

How it works
------------
``neuron_floor`` is a ``torch.distributed`` backend for benchmarks only. Every pair of
ranks shares ``streams`` blocking TCP connections (``TCP_NODELAY``) on the address neuron
itself would use (``NEURON_DIST_SOCKET_IFNAME``), and nothing else: no headers, tags, acks,
timeouts, checks or progress engine, and every call returns a Work that is already complete.

* A message of up to ``SMALL_BYTES`` (1 MiB) goes whole over the first connection, from
  the caller's thread: ``send`` writes the tensor's bytes, ``recv`` reads exactly as many.
  For small ones that is what torch's dispatch to a Python ``ProcessGroup`` plus two
  socket calls cost; up to 1 MiB one stream is faster here than cutting a message up.
* A larger one is cut into ``streams`` contiguous pieces, piece ``i`` on connection ``i``,
  each written (or read) by a thread of its own at the same time: raw TCP over as many
  streams as neuron has rails, through the same c10d face, with the bytes going from the
  tensor to the socket and from the socket to the tensor once each.
* ``all_reduce`` (SUM) between two ranks sends the buffer to the other and reads its
  buffer at the same time (threads, so two ranks that both write large buffers cannot fill
  each other's socket buffers and stop), then adds: the simplest exchange. Among more ranks
  it runs a binomial tree (the children's partials up to rank 0, added smallest subtree
  first, then the sum back down), as neuron does where ranks share cores (its
  ``all_reduce/network`` table): 2 (P - 1) messages in all where the exchange sends
  P (P - 1), so the floor is the cost of the same algorithm with nothing but the bytes.
  Every rank gets rank 0's bits.
* ``broadcast`` runs the same binomial tree down from the root (relative ranks), and
  ``barrier`` is a 1-byte tree all_reduce.

``bench.internode`` runs it beside neuron and gloo in the same run and prints ratios to it:
for small messages it bounds what any backend written in Python can reach on the machine
with these algorithms;
for large ones it is the link itself (the target for neuron's large send/recv is a share of
raw TCP over several streams). It is not a backend anyone should train with: it never
notices a dead peer and it has no barrier semantics beyond a tiny all_reduce.
"""

from __future__ import annotations

import ctypes
import socket
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from neuron_dist.collectives.net_binomial import children, parent
from neuron_dist.config import Settings
from neuron_dist.topology import choose_addresses
from .null_pg import CompletedWork

BACKEND_NAME = "neuron_floor"
# Up to this size a message is one write on one connection: over veth between two network
# namespaces that beat cutting it over 4 connections and threads (256 KiB: 154 against 279
# us per message, 1 MiB: 675 against 741; 4 MiB: 2190 against 1899), so the floor is the
# faster of the two at every size.
SMALL_BYTES = 1 << 20
EXCHANGE_BYTES = 64 << 10  # all_reduce: up to this, written whole first (socket buffers hold
# it both ways); above, cut over the connections and moved by threads, reads beside writes


def _bytes_of(t: torch.Tensor) -> memoryview:
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class FloorProcessGroup(ProcessGroup):
    """See the module docstring. ``store`` exchanges the listening addresses; ``streams``
    connections join every pair of ranks."""

    def __init__(self, store, rank: int, size: int, streams: int = 1):
        super().__init__(rank, size)
        if streams < 1:
            raise ValueError(f"{BACKEND_NAME}: streams must be >= 1, not {streams}")
        self._rank, self._size, self._streams = rank, size, streams
        self._socks: dict[int, list] = {}  # peer -> its connections, in stream order
        self._done = CompletedWork()
        self._buffers: dict = {}  # peer (-1: the sum) -> buffer of the last all_reduce's shape
        self._pool = ThreadPoolExecutor(max_workers=max(1, 2 * streams * (size - 1)),
                                        thread_name_prefix="neuron-floor")
        settings = Settings.from_env()
        host = choose_addresses(settings.socket_ifname, store, settings.master_addr)[0]
        listener = socket.create_server((host, 0), backlog=max(8, streams * size))
        try:
            store.set(f"floor/addr/{rank}", f"{host}:{listener.getsockname()[1]}")
            for peer in range(rank):  # dial the lower ranks, accept the higher ones
                h, _, p = store.get(f"floor/addr/{peer}").decode().rpartition(":")
                for i in range(streams):
                    sock = socket.create_connection((h, int(p)))
                    sock.sendall(rank.to_bytes(4, "little") + i.to_bytes(4, "little"))
                    self._add(peer, i, sock)
            for _ in range(streams * (size - rank - 1)):
                sock, _ = listener.accept()
                who = _read(sock, 8)
                self._add(int.from_bytes(who[:4], "little"), int.from_bytes(who[4:], "little"),
                          sock)
        finally:
            listener.close()

    def _add(self, peer: int, index: int, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socks.setdefault(peer, [None] * self._streams)[index] = sock

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _pieces(self, view: memoryview, whole: int) -> list:
        """``view`` cut into one contiguous piece per stream (just one up to ``whole``)."""
        n = view.nbytes
        if n <= whole:
            return [view]
        step = -(-n // self._streams)
        return [view[i:i + step] for i in range(0, n, step)]

    def _start(self, peer: int, view: memoryview, send: bool, whole: int = SMALL_BYTES) -> list:
        """Start moving ``view`` to (or from) ``peer``, piece ``i`` on connection ``i``, each
        in a pool thread; the futures."""
        io = _write if send else _read_into
        socks = self._socks[peer]
        return [self._pool.submit(io, socks[i], piece)
                for i, piece in enumerate(self._pieces(view, whole))]

    def send(self, tensors, dst: int, tag: int = 0):
        view = _bytes_of(tensors[0])
        if view.nbytes <= SMALL_BYTES:
            self._socks[dst][0].sendall(view)
        else:
            _wait(self._start(dst, view, True))
        return self._done

    def recv(self, tensors, src: int, tag: int = 0):
        view = _bytes_of(tensors[0])
        if view.nbytes <= SMALL_BYTES:
            _read_into(self._socks[src][0], view)
        else:
            _wait(self._start(src, view, False))
        return self._done

    def allreduce(self, tensors, opts=None):
        t = tensors[0]
        if self._size > 2:
            self._tree_reduce(t)
            self._tree_broadcast(t, 0)
            return self._done
        mine = _bytes_of(t)
        theirs = {peer: self._buffer(peer, t) for peer in self._socks}
        if mine.nbytes <= EXCHANGE_BYTES:  # (both ranks may write first: buffers hold it)
            for sock in self._socks.values():
                sock[0].sendall(mine)
            for peer, sock in self._socks.items():
                _read_into(sock[0], _bytes_of(theirs[peer]))
        else:
            moving = []
            for peer in self._socks:
                moving += self._start(peer, mine, True, EXCHANGE_BYTES)
                moving += self._start(peer, _bytes_of(theirs[peer]), False, EXCHANGE_BYTES)
            _wait(moving)
        if self._size == 2:  # (a + b == b + a exactly: both ranks get the same bits)
            t.add_(theirs[1 - self._rank])
        return self._done

    def _tree_reduce(self, t: torch.Tensor) -> None:
        """Rank 0 ends with the sum: each rank adds its children's partials (smallest
        subtree first) into ``t`` and sends it to its parent."""
        me, theirs = self._rank, self._buffer(-1, t)
        for child in reversed(children(me, self._size)):
            self.recv([theirs], child)
            t += theirs
        if me:
            self.send([t], parent(me))

    def _tree_broadcast(self, t: torch.Tensor, root: int) -> None:
        """``t`` of ``root`` to every rank, down the binomial tree of relative ranks."""
        size = self._size
        rel = (self._rank - root) % size
        if rel:
            self.recv([t], (parent(rel) + root) % size)
        for child in children(rel, size):
            self.send([t], (child + root) % size)

    def broadcast(self, tensors, opts):
        self._tree_broadcast(tensors[0], opts.rootRank)
        return self._done

    def _buffer(self, key: int, like: torch.Tensor) -> torch.Tensor:
        """A buffer shaped like ``like``, kept across calls (fresh pages cost more than the
        network here: the kernel zero-fills each one)."""
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != like.numel() or buf.dtype != like.dtype:
            buf = self._buffers[key] = torch.empty_like(like)
        return buf

    def barrier(self, opts=None):
        one = torch.zeros(1, dtype=torch.uint8)
        self.allreduce([one])
        return self._done

    def shutdown(self) -> None:
        for socks in self._socks.values():
            for sock in socks:
                sock.close()
        self._socks.clear()
        self._pool.shutdown(wait=False)


def _wait(futures) -> None:
    for f in futures:
        f.result()


def _write(sock: socket.socket, view: memoryview) -> None:
    sock.sendall(view)


def _read(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _read_into(sock, memoryview(buf))
    return bytes(buf)


def _read_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError(f"{BACKEND_NAME}: a peer closed its connection")
        got += n


_STREAMS = [1]  # connections per pair of the groups made from now on (register())


def register(streams: int = 1) -> None:
    """Register ``neuron_floor`` with torch.distributed (idempotent); groups made after this
    join every pair of ranks with ``streams`` TCP connections."""
    _STREAMS[0] = streams
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, lambda o, pg_options=None: FloorProcessGroup(o.store, o.group_rank,
                                                                   o.group_size, _STREAMS[0]),
        extended_api=True, devices=["cpu"])
