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
* **Deferring the wait of an async call** (``defer_once``, ``deferrable``, ``wait_then``,
  ``resume``). An async collective is first run by the caller's thread with ``defer_once``
  set (engine.py, ``try_now``). An algorithm that posts all its messages before its one
  network wait says so (``deferrable``) and hands that wait the rest of the call, local
  work only (``wait_then(rest)``): if a peer's data is not in yet, the wait keeps ``rest``
  and raises ``StepDeferred`` instead of blocking, with this rank's sends posted, so the
  peers complete without it. Whoever finishes the call (the thread that waits for its
  Work, or the engine thread) calls ``resume``: it waits for what the first run posted and
  runs ``rest``. Nothing of the call runs twice, so no work needs to be repeatable. Any
  other algorithm raises ``StepDeferred`` at its first send, receive, buffer or wait,
  before anything is posted, and the engine thread runs it from the start, as it ran
  every async collective before.

* **Algorithms written as generators** (``run``). The log-depth algorithms
  (net_recursive_doubling.py, net_rabenseifner.py, net_halving.py, net_bruck.py,
  net_binomial.py, net_dissemination.py) post with ``send`` / ``recv``, combine with
  ``reduce`` and ``yield`` where they need everything posted so far to be complete:
  ``run`` waits there. The simulator (bench/netsim.py) drives the same
  generators for thousands of ranks in one process.

``as_bytes`` is how a tensor's memory is handed to a transport (send/recv use it too).
"""

from __future__ import annotations

import ctypes
import struct
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence, overload

import torch

from ..transport.base import Deferrable
from ..transport.errors import MessageSizeMismatch, StepDeferred
from .descriptor import NWORDS, Call, CollectiveMismatch
from .reduce_ops import ReduceSpec, Scratch, reduce_into

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from ..transport.base import NetRequest, NetTransport

COLLECTIVE_TAG = 1
_DESC = struct.Struct(f"!{NWORDS + 1}q")
DESCRIPTOR_BYTES = _DESC.size
# Data up to this size travels in one message with the descriptor: one message less per
# peer and call (some 30 µs of Python at each end) for one copy more at each end (a few µs).
# The limit keeps descriptor and data within the rdm transport's eager size
# (transport/rdm/driver.py ``EAGER_BYTES``), so the send still completes at once; a larger
# one message would wait for its ack and lose (docs/design.md, "Thresholds and why").
# A message larger than ACKED_BYTES is not eager: its send completes when the peer's ack
# comes (an ACK frame of its own and one wait more: net_cost.py prices them).
ACKED_BYTES = 256 << 10  # (the rdm transport's EAGER_BYTES: a test keeps them equal)
PIGGYBACK_BYTES = ACKED_BYTES - _DESC.size
_BOX_REUSE_BYTES = 4 << 10  # receive boxes from this size are reused across calls ...
_BOXES_KEPT = 4  # ... this many per size (a fresh one is zero-filled memory, maybe new pages)


class Exchange(Protocol):
    """What an algorithm between nodes posts and combines through (the ``net_*.py``
    generators): a ``NetCall``, or the simulator's stand-in (bench/netsim.py)."""

    def send(self, peer: int, buf: torch.Tensor | Buffer) -> object:
        """Post a send of ``buf`` to group rank ``peer``."""

    def recv(self, peer: int, buf: torch.Tensor | Buffer) -> object:
        """Post a receive from group rank ``peer`` into ``buf``."""

    def buffer(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A scratch tensor kept across calls."""

    def reduce(self, out: torch.Tensor, inputs: Sequence[torch.Tensor],
               spec: ReduceSpec) -> None:
        """``out = inputs[0] op inputs[1] ...``"""


class Topo(Protocol):
    """Where a group's ranks sit on nodes, as the algorithms across nodes read it
    (neuron_dist/topology.py's ``Topology``)."""

    @property
    def rank(self) -> int:
        """This process's group rank."""

    @property
    def size(self) -> int:
        """Ranks in the group."""

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """Group ranks of each node, nodes ordered by their lowest rank."""

    @property
    def my_node(self) -> int:
        """This rank's node (an index into ``nodes``)."""

    @property
    def local(self) -> tuple[int, ...]:
        """Group ranks of this node, in local-index order."""

    @property
    def even(self) -> bool:
        """Do all nodes have as many ranks?"""

    def node_of(self, rank: int) -> int:
        """The node of group rank ``rank``."""

    def leader(self, node: int) -> int:
        """The lowest group rank of ``node``."""

    def speakers(self, root: int) -> tuple[int, ...]:
        """The group rank that speaks for each node (node order) in a collective rooted
        at ``root``: the root on its node, the leader elsewhere."""


class NetCall(Deferrable):
    """The network half of one collective call: descriptor-checked sends and receives
    (and what a deferred first run goes through: ``transport.base.Deferrable``).

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

    def __init__(self, net: NetTransport, topo: Topo, call: Call, seq: int, deadline: float,
                 scratch: dict[str, Any] | None = None):
        self.net, self.topo, self.call, self.seq = net, topo, call, seq
        # the group's, across calls (buffers, boxes and reduction scratch, by key)
        self._scratch: dict[str, Any] = {} if scratch is None else scratch
        self.deadline = deadline
        self._told: set[int] = set()  # peers that got our descriptor in this call
        # peer -> (descriptor box, request, data dest or None)
        self._heard: dict[int, tuple[bytearray | None, NetRequest, Buffer | None]] = {}
        self._pending: list[NetRequest] = []
        self.defer_once = False  # set for the first run of an async call (engine.try_now)
        self._deferrable = False  # the algorithm said it may be deferred (``deferrable``)
        # what a deferred first run left to ``resume``
        self._rest: Callable[[], object] | None = None
        self._mine: bytes | None = None  # this rank's descriptor, as it travels (``_words``)

    def begin(self, call: Call, seq: int, deadline: float) -> None:
        """Make this NetCall describe a new call (one call at a time may reuse one)."""
        self.call, self.seq, self.deadline = call, seq, deadline
        self._mine = None
        self._told.clear()
        self._heard.clear()
        self._pending.clear()
        self._deferrable, self._rest = False, None

    def deferrable(self) -> None:
        """Said by an algorithm that posts every message of the call before one
        ``wait_then``, after which only local work follows: a first run may be deferred
        there (see the module docstring)."""
        self._deferrable = True

    def again(self, seq: int, deadline: float) -> None:
        """Before the call runs (or ``resume`` finishes it): its number and deadline."""
        self.seq, self.deadline = seq, deadline
        self._mine = None

    def deferred(self) -> bool:
        """Did the call's first run defer its wait (``resume`` finishes it)?"""
        return self._rest is not None

    def resume(self) -> None:
        """Finish a call whose first run deferred its wait: wait for everything it posted,
        then run the rest it handed to ``wait_then``."""
        rest, self._rest = self._rest, None
        self.wait()
        rest()  # type: ignore[misc]  # (set: the first run deferred)

    def peers_published(self) -> bool:
        """Has everything the call posted so far completed (so ``wait`` would not block)?"""
        return (all(r.done() for _, r, _ in self._heard.values())
                and all(r.done() for r in self._pending))

    def withdraw(self, error: Exception) -> None:
        """The call will not run again (its group is going away): withdraw every request it
        posted that has not completed, so on return no message of it lands in its
        buffers (the peers are told: ``NetTransport.cancel``)."""
        reqs = [r for _, r, _ in self._heard.values()] + self._pending
        self._rest = None
        for req in reqs:
            if not req.done():
                try:
                    self.net.cancel(req, error)
                except Exception:  # noqa: BLE001 - a transport closed meanwhile touches nothing
                    pass

    def not_deferrable(self) -> None:
        """In a first run (``defer_once``) of an algorithm that has not said ``deferrable``:
        raise ``StepDeferred``, so the engine thread runs the call from the start. Every
        send, receive, buffer and wait says this first; an algorithm says it itself before
        work that cannot be done twice."""
        if self.defer_once and not self._deferrable:
            raise StepDeferred(self.seq)

    def _words(self) -> bytes:
        mine = self._mine
        if mine is None:  # (once per call: it goes to every peer and is compared with theirs)
            mine = self._mine = _DESC.pack(*self.call.words(self.seq), 0)
        return mine

    def descriptor(self) -> bytes:
        """This rank's call descriptor, as it travels (``DESCRIPTOR_BYTES``)."""
        return self._words()

    def check_descriptor(self, peer: int, words: bytes) -> None:
        """Raise ``CollectiveMismatch`` unless ``peer``'s descriptor ``words`` names this
        call (for algorithms that exchange descriptors themselves: net_mpi.py)."""
        self._check(peer, words)

    def send(self, peer: int, buf: torch.Tensor | Buffer) -> NetRequest:
        """Post a send of ``buf`` to ``peer``; returns its request (done: ``buf`` is free)."""
        if self.defer_once and not self._deferrable:
            raise StepDeferred(self.seq)
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

    def recv(self, peer: int, buf: torch.Tensor | Buffer) -> NetRequest | None:
        """Post a receive from ``peer`` into ``buf``. Returns its request, or None for the
        call's first message from ``peer`` when it is small (it travels with the
        descriptor and is copied into ``buf`` by ``check``)."""
        if self.defer_once and not self._deferrable:
            raise StepDeferred(self.seq)
        data = as_bytes(buf)
        if peer not in self._heard:
            n = _nbytes(data)
            if n <= PIGGYBACK_BYTES:
                box = self._take_box(_DESC.size + n)
                self._heard[peer] = (box, self.net.irecv(peer, COLLECTIVE_TAG, box), data)
                return None
            box = bytearray(_DESC.size)
            self._heard[peer] = (box, self.net.irecv(peer, COLLECTIVE_TAG, box), None)
        req = self.net.irecv(peer, COLLECTIVE_TAG, data)
        self._pending.append(req)
        return req

    def buffer(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A scratch tensor kept across calls (allocating fresh pages every call costs more
        than the network: the kernel zero-fills each one)."""
        if self.defer_once:
            self.not_deferrable()
        pool = self._scratch
        nbytes = numel * dtype.itemsize
        entry: tuple[torch.Tensor, dict[tuple[int, torch.dtype], torch.Tensor]] | None
        entry = pool.get(key)
        if entry is None or entry[0].numel() < nbytes:
            entry = (torch.empty(max(nbytes, 64), dtype=torch.uint8), {})
            pool[key] = entry
        base, views = entry  # typed views of it, kept: torch view ops cost µs each
        view = views.get((numel, dtype))
        if view is None:
            if len(views) >= 64:
                views.clear()
            view = views[(numel, dtype)] = base[:nbytes].view(dtype)
        return view

    def forget(self, key: str) -> None:
        """Drop scratch buffer ``key`` from the pool for good (something may still write
        it: a later call gets a fresh one)."""
        self._scratch.pop(key, None)

    def run(self, algorithm: Iterable[object]) -> None:
        """Run a between-nodes algorithm written as a generator: each ``yield`` waits for
        everything posted so far (``wait``). An algorithm yields after its last post, so on
        return everything it posted is complete (the simulator checks that)."""
        for _ in algorithm:
            self.wait()

    def reduce(self, out: torch.Tensor, inputs: Sequence[torch.Tensor], spec: ReduceSpec) -> None:
        """``out = inputs[0] op inputs[1] ...`` (reduce_ops.reduce_into; ``out`` may alias
        the first two inputs)."""
        scratch = self._scratch.get("reduce")
        if scratch is None:
            scratch = self._scratch["reduce"] = Scratch()
        reduce_into(out, inputs, spec, len(inputs), scratch)

    def wait(self) -> None:
        """Wait for everything posted; check the peers' descriptors first."""
        if self.defer_once:
            self.not_deferrable()
        self.check()
        pending, self._pending = self._pending, []
        for req in pending:
            req.wait(self.deadline)

    def wait_then(self, rest: Callable[[], object]) -> None:
        """``wait``, then ``rest()``: the rest of the call, local work only. Only in a first
        run with ``defer_once`` set (an algorithm that said ``deferrable``), if something
        posted has not completed, it keeps ``rest`` and raises ``StepDeferred`` instead of
        waiting: ``resume`` finishes the call (see the module docstring)."""
        if self.defer_once:
            self.not_deferrable()
            if not self.peers_published():
                self._rest = rest
                raise _deferred_resumes(self.seq)
        self.wait()
        rest()

    def check(self) -> None:
        """Wait for the descriptors of the peers heard from so far and check them: a peer
        that made another call raises ``CollectiveMismatch`` here, naming both calls."""
        if self.defer_once:
            self.not_deferrable()
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
                self._give_box(box)
            self._heard[peer] = (None, req, None)

    def _take_box(self, n: int) -> bytearray:
        """A buffer for a descriptor with its data: one kept from an earlier call if there is
        one of this size (``_give_box``), else a new one. It belongs to the receive alone
        until ``check`` has copied the data out and given it back; a receive that fails or
        is withdrawn never gives its box back, so nothing can land in a box in use."""
        if n >= _BOX_REUSE_BYTES:
            kept = self._scratch.get("boxes", {}).get(n)
            if kept:
                try:
                    # (atomic: two calls never get the same box)
                    return kept.pop()  # type: ignore[no-any-return]
                except IndexError:
                    pass
        return bytearray(n)

    def _give_box(self, box: bytearray) -> None:
        n = len(box)
        if n >= _BOX_REUSE_BYTES:
            boxes = self._scratch.setdefault("boxes", {})
            if n not in boxes and len(boxes) >= 16:
                boxes.clear()  # (sizes change: keep the recent ones only)
            kept = boxes.setdefault(n, [])
            if len(kept) < _BOXES_KEPT:
                kept.append(box)

    def _check(self, peer: int, words: bytes) -> None:
        if words == self._words():  # (the usual case: the same call, told by one comparison)
            return
        theirs = _DESC.unpack(words)[:NWORDS]
        if theirs != self.call.words(self.seq):
            their_seq, their_call = Call.from_words(theirs)
            raise CollectiveMismatch(
                f"collective mismatch: rank {self.topo.rank} called #{self.seq} "
                f"{self.call.describe()}; rank {peer} called #{their_seq} "
                f"{their_call.describe()}", self.call, {peer: their_call})


def _deferred_resumes(seq: int) -> StepDeferred:
    # (made here, not in the raising frame: a local naming the exception in the frame its
    # traceback holds would be a reference cycle)
    return StepDeferred(seq, last=True, resumes=True)


def _nbytes(data: Buffer) -> int:
    return data.nbytes if hasattr(data, "nbytes") else len(data)  # type: ignore[arg-type]


_BYTE_ARRAYS: dict[int, type[ctypes.Array[ctypes.c_char]]] = {}


@overload
def as_bytes(t: torch.Tensor) -> memoryview: ...
@overload
def as_bytes(t: Buffer) -> Buffer: ...


def as_bytes(t: torch.Tensor | Buffer) -> Buffer:
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
    arr.tensor = t  # type: ignore[attr-defined]  # (the view keeps the tensor alive)
    return memoryview(arr).cast("B")
