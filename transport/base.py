"""The interfaces algorithms are written against, and the optional capabilities of a driver.

Two shapes of communication, because shared memory and networks differ in kind:

* ``StepChannel`` — one-sided and group-wide, the natural shape of shared memory. Every
  rank owns a slot; a *step* is: fill my slot, publish, wait until every rank of the group
  has published the same step, then read any peer's slot directly. Slots are double
  buffered, so a rank may fill its next slot while peers still read the previous one. A
  step also carries a small call descriptor, which is how collectives detect that ranks
  called different things.
* ``Mailbox`` — two-sided, ordered byte streams between a pair of ranks, for send/recv.
* ``NetTransport`` — between nodes: tagged messages between any two ranks of a group
  (``rdm`` over TCP rails, ``mpi`` over MPI), with ``NetRequest`` handles.

Every wait takes a deadline and raises a ``transport.errors`` exception naming the peer.

Capabilities
------------
What only some drivers offer is a protocol of its own that extends ``NetTransport``, which
a driver that has it names as its base class (so the type checker holds it to the
protocol), and which callers test with ``isinstance`` where they choose a path, never per
message:

* ``SharedAnySource`` — a receive from any rank that another path may satisfy instead
  (``irecv_any(claim=)``, ``drive_until``, ``wake``): rdm. neuron_dist/p2p_any.py posts a
  receive from any rank on shared memory and the network at once only over such a
  transport.
* ``ColumnCollectives`` — MPI's own nonblocking collectives among the transport's
  ``column`` (collectives/net_mpi.py): mpi. ``NetTransport.column`` is not None only
  when the transport has them (and a column was set up).

``Deferrable`` is what a call's first run may be deferred through (neuron_dist/deferral.py):
the group's ``StepChannel``, or a call's ``collectives.net.NetCall`` between nodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, Sequence, runtime_checkable

from .errors import ABORTED

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer


class Deferrable(Protocol):
    """What a call's first run defers through (neuron_dist/deferral.py; the engine's ``try_now``).

    With ``defer_once`` set, the call's first wait that would block raises
    ``errors.StepDeferred`` instead (having published or posted what it had); the engine
    finishes the call later.
    """

    defer_once: bool

    def peers_published(self) -> bool:
        """Would the call's next wait return at once (every peer's part is in)?"""

    def withdraw(self, error: Exception) -> None:
        """The deferred call will not run again (its group is going away): take back what
        its first run posted, so nothing lands in its buffers once this returns (nothing,
        where a published step writes into nobody's buffer)."""


class StepChannel(Deferrable, Protocol):
    """The node's shared memory as a group's steps (see the module docstring)."""

    rank: int
    size: int
    slot_bytes: int
    # May the ranks read each other's memory (``read_peer``)? Set once at set-up.
    cma: bool

    def my_slot(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor (uint8, or viewed as ``dtype``) this rank fills before the next ``step``."""

    def slot(self, rank: int, parity: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``rank``'s slot of step parity ``parity`` (a step ``e`` fills slots of parity
        ``e & 1``), uint8 or viewed as ``dtype``: for plans prepared once and reused."""

    def slot_like(self, rank: int, parity: int, like: torch.Tensor) -> torch.Tensor:
        """``slot(rank, parity)`` viewed with the dtype and shape of tensor ``like``."""

    def step(self, deadline: float, descriptor: Sequence[int] | None = None) -> None:
        """Publish my slot and wait for every rank to publish the same step.

        With ``descriptor`` (at most ``layout.HEAD_WORDS + layout.DESC_WORDS`` int64 words,
        the first the call's sequence number), it is posted with the step and every peer's
        descriptor of the same step is available from ``peer_descriptor`` afterwards. Its
        first ``layout.HEAD_WORDS`` words are the cheapest to read: keep what every call
        compares there.
        """

    def peer_slot(self, rank: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor (uint8, or viewed as ``dtype``) of ``rank``'s slot for the step just completed."""

    epoch: int  # steps this rank has completed

    # Deferring a call's first step (how an async collective avoids a thread hand-off):
    # with ``defer_once`` set, a ``step`` that finds a peer behind publishes (slot and
    # descriptor) and raises ``errors.StepDeferred`` instead of waiting; the flag clears at
    # the next step either way. Running the same call again later repeats its staging
    # (the same bytes) and its ``step`` then waits without publishing twice.
    defer_once: bool

    def peers_published(self) -> bool:
        """Has every peer published the next step (so ``step`` would not wait)?"""

    def withdraw(self, error: Exception) -> None:
        """Nothing to take back: a published step writes into nobody's buffer."""

    def staged(self) -> bool:
        """Is the next step published already (deferred): this rank's slot holds it."""

    def all_posted(self, seq: int, head: Sequence[int]) -> bool:
        """Did every peer post ``head`` (the first ``layout.HEAD_WORDS`` words) as the head
        of its descriptor of collective ``seq``? (A call's one check when all is well.)"""

    def peer_descriptor(self, rank: int, seq: int, nwords: int) -> tuple[int, ...]:
        """Descriptor ``rank`` posted with collective ``seq``'s first step."""

    def read_peer(self, rank: int, local: int, remote: int, nbytes: int) -> None:
        """Copy ``nbytes`` at address ``remote`` of ``rank``'s memory to address ``local``
        of ours (cross-memory attach; only when ``cma``). Raises ``PeerDied`` if it exited."""

    def abort(self, reason: str, kind: int = ABORTED) -> None:
        """Tell every peer the group failed, so their waits end with ``PeerAborted``
        (``kind``: one of ``errors.ABORTED*``, the class of the original failure)."""

    def close(self) -> None:
        """Release the channel's resources."""


class Mailbox(Protocol):
    """Ordered byte stream from one rank to another (single producer, single consumer), in
    a ring of ``capacity`` bytes. Memory is named by address (``tensor.data_ptr()``).
    Frames (collectives/p2p.py) are 8-byte header words and a payload padded to keep the
    next frame aligned; the producer checks ``free()`` and the consumer ``available()``
    before each call."""

    __slots__ = ()  # (implementations keep theirs)

    capacity: int

    def free(self) -> int:
        """Bytes the producer may write now."""

    def available(self) -> int:
        """Bytes the consumer may read now."""

    def write(self, address: int, nbytes: int) -> None:
        """Append ``nbytes`` bytes from memory at ``address``."""

    def write_words(self, values: Sequence[int]) -> None:
        """Append 8-byte words (a frame's header: it never wraps)."""

    def write_frame(self, words: Sequence[int], address: int, nbytes: int,
                    padded: int) -> None:
        """Append a whole frame at once: header ``words``, ``nbytes`` from memory at
        ``address``, padding up to ``padded`` payload bytes (the reader sees all or none)."""

    def pad(self, nbytes: int) -> None:
        """Append ``nbytes`` without writing them (frame padding)."""

    def peek_words(self, count: int) -> list[int]:
        """The first ``count`` words at the read position (a frame's header)."""

    def read_into(self, address: int, nbytes: int) -> None:
        """Consume ``nbytes`` bytes into memory at ``address``."""

    def skip(self, nbytes: int) -> None:
        """Consume ``nbytes`` without copying them anywhere."""

    def take(self, skip: int, address: int, nbytes: int, frame: int) -> None:
        """Consume a whole frame of ``frame`` bytes at once, copying the ``nbytes`` that
        start ``skip`` bytes in to memory at ``address``."""


class NetRequest(Protocol):
    """A posted send or receive of a ``NetTransport``."""

    __slots__ = ()  # (implementations keep theirs: no per-request dict)

    peer: int | None  # the rank named when posting (None: a receive from any rank)
    tag: int
    nbytes: int
    is_send: bool
    source: int | None  # the sender, once a receive completed
    error: BaseException | None  # why it failed, once complete

    def done(self) -> bool:
        """True once complete, with or without an error (never raises)."""

    def test(self) -> bool:
        """True once complete; raises the request's error if it failed."""

    def wait(self, deadline: float) -> None:
        """Block until complete or ``deadline`` (``time.monotonic()``).

        Raises ``PeerTimeout`` naming the peer past the deadline; the request then stays
        posted and still owns its buffer: wait again, or ``NetTransport.cancel`` it.
        Raises the request's error if it failed.
        """

    def on_complete(self, callback: Callable[[NetRequest], object]) -> None:
        """Run ``callback(request)`` once it completes (now, if it has), never under a
        transport lock and never twice; it may post new requests."""


class NetTransport(Protocol):
    """Reliable tagged messages between the ranks of one group, across nodes.

    The contract both between-node transports keep (tested by the same contract tests):

    * **Matching.** ``isend(peer, tag, buf)`` and ``irecv(peer, tag, buf)`` match per
      ``(peer, tag)`` in posting order (MPI's non-overtaking rule); tags are integers in
      ``[0, 2**64)``. A message sent before its receive is posted is kept by the transport
      (within its memory limit) until a receive takes it. ``irecv_any(tag, buf)`` takes the
      earliest message of ``tag`` that no receive naming its source was waiting for.
    * **Exact sizes.** A receive's buffer must be exactly the message's size; otherwise the
      receive fails with ``MessageSizeMismatch`` (naming both sizes, carrying the message)
      and the message is consumed.
    * **Buffer ownership.** A send's buffer must stay unchanged, and a receive's buffer is
      written only by its own message, from posting until the request completes, fails or
      is withdrawn by ``cancel``; after that the transport never touches it again. Bytes
      that arrive later for it are discarded.
    * **Deadlines and withdrawal.** Every wait takes a deadline (``PeerTimeout``).
      ``cancel(req, error)`` withdraws a request that has not completed and returns True
      (False: it had completed). A withdrawn message leaves the stream between the two
      ranks out of step, so the peer is failed on both sides: later requests with it
      raise ``error``, and the peer is told (its requests with this rank fail with
      ``PeerAborted``). A withdrawn receive from any rank binds no stream: only it ends.
      A transport that cannot take a request's buffer back (MPI, for a receive it has
      matched or a send it has started, after a grace) never returns from ``cancel`` nor
      fails the request: it ends the job instead (transport/mpi/driver.py, "Buffers").
    * **Failure.** A peer that becomes unreachable fails every request with it with
      ``PeerUnreachable`` naming it; ``abort(reason, kind)`` tells every peer this rank
      failed the group (their requests with it fail with ``PeerAborted(kind, reason)``),
      then closes. ``close(error)`` fails what is pending with ``error``; without one it
      first lets sent messages be acknowledged (a graceful end).
    * **Memory.** What the transport keeps for receives not yet posted is bounded per
      peer; past the bound the peer is held back (not acknowledged), never a crash.
    * **Progress.** A thread waiting on a request drives what it needs; completions of
      requests nobody waits for happen in the background (callbacks run off any lock).
    """

    rank: int
    world_size: int
    address: str  # where peers reach this rank (for logs)
    # The group ranks this rank runs the transport's own collectives with (MPI: its column,
    # collectives/net_mpi.py), or None: the transport has none (not ``ColumnCollectives``).
    column: list[int] | None

    def connect(self, peers: dict[int, str], deadline: float) -> None:
        """Make every rank of ``peers`` ({rank: address}) reachable by ``deadline``, or
        ``PeerTimeout`` (MPI needs only the ranks: any iterable of them). A transport may
        open its connections here or on first use (rdm opens a peer's rails when it first
        sends to it, with the same time budget)."""

    def isend(self, peer: int, tag: int, buf: Buffer,
              callback: Callable[[NetRequest], object] | None = None) -> NetRequest:
        """Send the bytes of ``buf`` to ``peer`` on stream ``tag``."""

    def irecv(self, peer: int, tag: int, buf: Buffer,
              callback: Callable[[NetRequest], object] | None = None) -> NetRequest:
        """Receive the next message of ``(peer, tag)`` into ``buf`` (exactly its size)."""

    def irecv_any(self, tag: int, buf: Buffer,
                  callback: Callable[[NetRequest], object] | None = None) -> NetRequest:
        """Receive the next message of ``tag`` from any rank (``request.source`` says which)."""

    def cancel(self, req: NetRequest, error: Exception) -> bool:
        """Withdraw ``req`` if it has not completed (see "Deadlines and withdrawal")."""

    def abort(self, reason: str, kind: int = ABORTED) -> None:
        """Tell every peer this rank failed the group, then close."""

    def close(self, error: Exception | None = None) -> None:
        """Release everything; pending requests fail with ``error``."""

    def stats(self) -> dict[str, int]:
        """Counters for logs and benchmarks (messages, bytes, retransmissions, ...)."""


# ------------------------------------------------------------------------- capabilities

class ClaimableRequest(NetRequest, Protocol):
    """A receive from any rank of a ``SharedAnySource`` transport: its ``claim`` (see
    ``SharedAnySource.irecv_any``), which its owner clears once it is done with it."""

    __slots__ = ()

    claim: Callable[[], bool] | None


@runtime_checkable
class SharedAnySource(NetTransport, Protocol):
    """A ``NetTransport`` with a capability: a receive from any rank that another path
    (the node's shared memory) may satisfy instead, and a waiter that drives the transport
    while it also waits for that other path (neuron_dist/p2p_any.py)."""

    def irecv_any(self, tag: int, buf: Buffer,
                  callback: Callable[[NetRequest], object] | None = None,
                  claim: Callable[[], bool] | None = None) -> ClaimableRequest:
        """``NetTransport.irecv_any``; with ``claim``, ``claim()`` is called just before a
        message is bound to the receive. False means the other path got a message first:
        the receive takes nothing, the message stays for the next receive, and the request
        ends with ``errors.Claimed``. (``claim`` runs under the transport's lock: it must
        not wait on anything.)"""

    def drive_until(self, done: Callable[[], bool], deadline: float) -> bool:
        """Make progress from the calling thread until ``done()`` or ``deadline``; the
        result of ``done()``. Whoever makes ``done()`` true from another thread calls
        ``wake``."""

    def wake(self) -> None:
        """Make a thread in ``drive_until`` look at its condition again now."""


@runtime_checkable
class ColumnCollectives(NetTransport, Protocol):
    """A ``NetTransport`` with a capability: nonblocking collectives among its ``column``,
    in column order, on byte buffers (collectives/net_mpi.py). Each returns a request like
    ``NetTransport``'s; ``dtype`` is torch's name of the element type (``"float32"``), ``op``
    a reduction's (``"SUM"``, ``"PRODUCT"``, ``"MIN"``, ``"MAX"``, ``"BAND"``, ...)."""

    def reduces(self, dtype: str, op: str) -> bool:
        """Can ``iallreduce``/``ireduce_scatter`` reduce ``dtype`` with ``op``?"""

    def iallgather(self, send: Buffer, recv: Buffer) -> NetRequest:
        """Every member's ``send`` (equal sizes) into ``recv``, in column order."""

    def iallreduce(self, buf: Buffer, dtype: str, op: str) -> NetRequest:
        """Reduce ``buf`` in place over the column."""

    def ireduce_scatter(self, send: Buffer, recv: Buffer, dtype: str, op: str) -> NetRequest:
        """Block ``b`` of the reduction of every member's ``send`` into member ``b``'s
        ``recv``."""

    def ialltoall(self, send: Buffer, recv: Buffer) -> NetRequest:
        """Block ``b`` of ``send`` to member ``b``; member ``b``'s block ``me`` into
        ``recv``'s block ``b``."""

    def ibcast(self, buf: Buffer, root: int) -> NetRequest:
        """Member ``root``'s ``buf`` into every member's."""
