"""The floor of a Python backend between nodes: a process group with no protocol at all.

How it works
------------
``neuron_floor`` is a ``torch.distributed`` backend for benchmarks only. Every pair of
ranks shares one blocking TCP connection (``TCP_NODELAY``) on the address neuron itself
would use (``NEURON_DIST_SOCKET_IFNAME``); ``send`` writes the tensor's bytes, ``recv``
reads exactly as many, and ``all_reduce`` (SUM) sends the buffer to every other rank, reads
theirs and adds them up in rank order. There are no headers, tags, acks, timeouts,
checks or threads, and every call returns a Work that is already complete.

What it measures is what torch's dispatch to a Python ``ProcessGroup`` plus two socket
calls cost on the machine, in the same run as neuron and gloo: neither neuron nor any
other backend written in Python can be faster than this for a small message, so it
bounds the small-message rows of ``bench.internode``. It is not a backend anyone should
train with: it runs only small messages (both ranks of an exchange write before they
read, which only kernel socket buffers make safe) and it never notices a dead peer.
"""

from __future__ import annotations

import ctypes
import socket

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..config import Settings
from ..topology import choose_addresses
from .null_pg import CompletedWork

BACKEND_NAME = "neuron_floor"
MAX_BYTES = 64 << 10  # exchanges beyond this could fill both sockets and deadlock


def _bytes_of(t: torch.Tensor) -> memoryview:
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class FloorProcessGroup(ProcessGroup):
    """See the module docstring. ``store`` exchanges the listening addresses."""

    def __init__(self, store, rank: int, size: int):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._socks: dict[int, socket.socket] = {}
        self._done = CompletedWork()
        host = choose_addresses(Settings.from_env().socket_ifname, store)[0]
        listener = socket.create_server((host, 0))
        try:
            store.set(f"floor/addr/{rank}", f"{host}:{listener.getsockname()[1]}")
            for peer in range(rank):  # dial the lower ranks, accept the higher ones
                h, _, p = store.get(f"floor/addr/{peer}").decode().rpartition(":")
                sock = socket.create_connection((h, int(p)))
                sock.sendall(rank.to_bytes(4, "little"))
                self._add(peer, sock)
            for _ in range(rank + 1, size):
                sock, _ = listener.accept()
                self._add(int.from_bytes(_read(sock, 4), "little"), sock)
        finally:
            listener.close()

    def _add(self, peer: int, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socks[peer] = sock

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def send(self, tensors, dst: int, tag: int = 0):
        self._socks[dst].sendall(_bytes_of(tensors[0]))
        return self._done

    def recv(self, tensors, src: int, tag: int = 0):
        _read_into(self._socks[src], _bytes_of(tensors[0]))
        return self._done

    def allreduce(self, tensors, opts=None):
        t = tensors[0]
        if t.numel() * t.element_size() > MAX_BYTES:
            raise ValueError(f"{BACKEND_NAME} runs messages up to {MAX_BYTES} bytes only")
        mine = _bytes_of(t)
        theirs = {}
        for peer, sock in self._socks.items():
            sock.sendall(mine)
        for peer, sock in self._socks.items():
            theirs[peer] = torch.empty_like(t)
            _read_into(sock, _bytes_of(theirs[peer]))
        total = torch.zeros_like(t)
        for r in range(self._size):
            total += t if r == self._rank else theirs[r]
        t.copy_(total)
        return self._done

    def barrier(self, opts=None):
        one = torch.zeros(1, dtype=torch.uint8)
        self.allreduce([one])
        return self._done

    def shutdown(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()


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


def register() -> None:
    """Register ``neuron_floor`` with torch.distributed (idempotent)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, lambda o, pg_options=None: FloorProcessGroup(o.store, o.group_rank,
                                                                   o.group_size),
        extended_api=True, devices=["cpu"])
