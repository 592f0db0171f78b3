"""The network half of one collective call in a group that spans nodes (``NetCall``).

How it works
------------
The between-nodes algorithms (the ``*_net.py`` modules) send and receive through a
``NetCall``, made per call over the group's ``NetTransport`` (transport/base.py), addressed
by group rank, on the stream ``COLLECTIVE_TAG``. It adds what the contract lacks:

* **Call descriptors.** The first message of a call from one rank to another carries the
  sender's call descriptor: in front of the data in the same message when the data is
  small (up to ``PIGGYBACK_BYTES``: one message, one acknowledgement, the latency path), as
  a message of its own before large data (which then travels without a copy). Both sides
  make the same choice from the message size, which they agree on when they made the same
  call; when they did not, the receiver still reads the descriptor (sizes differ, so the
  transport hands over the message it refused) and raises ``CollectiveMismatch`` naming
  both calls. The failing rank's abort notice tells the rest.
* **One wait for a phase.** ``wait`` checks the descriptors heard so far, then waits for
  every request posted in the call.
* **Scratch kept across calls** (``buffer``): fresh pages cost more than the network.

``as_bytes`` is how a tensor's memory is handed to a transport (send/recv use it too).
"""

from __future__ import annotations

import ctypes
import struct

import torch

from ..transport.errors import MessageSizeMismatch
from .descriptor import NWORDS, Call, CollectiveMismatch

COLLECTIVE_TAG = 1
PIGGYBACK_BYTES = 64 << 10  # data up to this size travels in one message with the descriptor
_DESC = struct.Struct(f"!{NWORDS + 1}q")


class NetCall:
    """The network half of one collective call: descriptor-checked sends and receives.

    Parameters
    ----------
    net : transport.base.NetTransport
        The group's between-nodes transport.
    topo : Topology
        Where the group's ranks sit (``neuron_dist.topology.Topology``).
    call, seq : Call, int
        This rank's call and its sequence number in the group.
    deadline : float
        ``time.monotonic()`` value after which waits raise ``PeerTimeout``.
    scratch : dict, optional
        The group's pool of buffers, kept across calls (see ``buffer``).
    """

    def __init__(self, net, topo, call: Call, seq: int, deadline: float,
                 scratch: dict | None = None):
        self.net, self.topo, self.call, self.seq = net, topo, call, seq
        self._scratch = {} if scratch is None else scratch  # the group's, across calls
        self.deadline = deadline
        self._told: set = set()  # peers that got our descriptor in this call
        self._heard: dict = {}  # peer -> (descriptor box, request, data dest or None)
        self._pending: list = []

    def begin(self, call: Call, seq: int, deadline: float) -> None:
        """Make this NetCall describe a new call (one call at a time may reuse one)."""
        self.call, self.seq, self.deadline = call, seq, deadline
        self._told.clear()
        self._heard.clear()
        self._pending.clear()

    def _words(self) -> bytes:
        return _DESC.pack(*self.call.words(self.seq), 0)

    def send(self, peer: int, buf):
        """Post a send of ``buf`` to ``peer``; returns its request (done: ``buf`` is free)."""
        data = as_bytes(buf)
        if peer not in self._told:
            self._told.add(peer)
            if _nbytes(data) <= PIGGYBACK_BYTES:
                # one copy, into an immutable bytes object the transport keeps as it is
                req = self.net.isend(peer, COLLECTIVE_TAG, b"".join((self._words(), data)))
                self._pending.append(req)
                return req
            self._pending.append(self.net.isend(peer, COLLECTIVE_TAG, self._words()))
        req = self.net.isend(peer, COLLECTIVE_TAG, data)
        self._pending.append(req)
        return req

    def recv(self, peer: int, buf):
        """Post a receive from ``peer`` into ``buf``. Returns its request, or None for the
        call's first message from ``peer`` when it is small (it travels with the
        descriptor and is copied into ``buf`` by ``check``)."""
        data = as_bytes(buf)
        if peer not in self._heard:
            n = _nbytes(data)
            if n <= PIGGYBACK_BYTES:
                box = bytearray(_DESC.size + n)
                self._heard[peer] = (box, self.net.irecv(peer, COLLECTIVE_TAG, box), data)
                return None
            box = bytearray(_DESC.size)
            self._heard[peer] = (box, self.net.irecv(peer, COLLECTIVE_TAG, box), None)
        req = self.net.irecv(peer, COLLECTIVE_TAG, data)
        self._pending.append(req)
        return req

    def buffer(self, key: str, numel: int, dtype) -> torch.Tensor:
        """A scratch tensor kept across calls (allocating fresh pages every call costs more
        than the network: the kernel zero-fills each one)."""
        pool = self._scratch
        nbytes = numel * dtype.itemsize
        entry = pool.get(key)
        if entry is None or entry[0].numel() < nbytes:
            entry = pool[key] = (torch.empty(max(nbytes, 64), dtype=torch.uint8), {})
        base, views = entry  # typed views of it, kept: torch view ops cost µs each
        view = views.get((numel, dtype))
        if view is None:
            if len(views) >= 64:
                views.clear()
            view = views[(numel, dtype)] = base[:nbytes].view(dtype)
        return view

    def wait(self) -> None:
        """Wait for everything posted; check the peers' descriptors first."""
        self.check()
        pending, self._pending = self._pending, []
        for req in pending:
            req.wait(self.deadline)

    def check(self) -> None:
        """Wait for the descriptors of the peers heard from so far and check them: a peer
        that made another call raises ``CollectiveMismatch`` here, naming both calls."""
        for peer, (box, req, dest) in sorted(self._heard.items()):
            if box is None:
                continue
            try:
                req.wait(self.deadline)
                words = bytes(box[:_DESC.size])
            except MessageSizeMismatch as e:  # a message of another size: another call?
                words = bytes(e.message)[:_DESC.size]
                if len(words) < _DESC.size:
                    raise
                self._check(peer, words)
                raise
            self._check(peer, words)
            if dest is not None:
                memoryview(dest).cast("B")[:] = memoryview(box)[_DESC.size:]
            self._heard[peer] = (None, req, None)

    def _check(self, peer: int, words: bytes) -> None:
        theirs = _DESC.unpack(words)[:NWORDS]
        if theirs != self.call.words(self.seq):
            their_seq, their_call = Call.from_words(theirs)
            raise CollectiveMismatch(
                f"collective mismatch: rank {self.topo.rank} called #{self.seq} "
                f"{self.call.describe()}; rank {peer} called #{their_seq} "
                f"{their_call.describe()}", self.call, {peer: their_call})


def _nbytes(data) -> int:
    return data.nbytes if hasattr(data, "nbytes") else len(data)


_BYTE_ARRAYS: dict = {}


def as_bytes(t):
    """A writable byte view of a contiguous tensor's memory, which the view keeps alive (or
    a bytes-like object as it is). Made with ctypes from the data pointer: torch's own view
    ops cost several µs each on small machines, and this is on every message's path."""
    if not isinstance(t, torch.Tensor):
        return t
    if not t.is_contiguous():
        raise ValueError("as_bytes needs a contiguous tensor")
    nbytes = t.numel() * t.element_size()
    if not nbytes:
        return memoryview(bytearray(0))
    kind = _BYTE_ARRAYS.get(nbytes)
    if kind is None:
        if len(_BYTE_ARRAYS) >= 256:
            _BYTE_ARRAYS.clear()
        kind = _BYTE_ARRAYS[nbytes] = ctypes.c_char * nbytes
    arr = kind.from_address(t.data_ptr())
    arr.tensor = t
    return memoryview(arr).cast("B")
