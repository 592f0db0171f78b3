"""The interfaces algorithms are written against.

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
"""

from __future__ import annotations

from typing import Protocol, Sequence


class StepChannel(Protocol):
    rank: int
    size: int
    slot_bytes: int

    def my_slot(self, dtype=None):
        """Tensor (uint8, or viewed as ``dtype``) this rank fills before the next ``step``."""

    def slot(self, rank: int, parity: int, dtype=None):
        """``rank``'s slot of step parity ``parity`` (a step ``e`` fills slots of parity
        ``e & 1``), uint8 or viewed as ``dtype``: for plans prepared once and reused."""

    def slot_like(self, rank: int, parity: int, like):
        """``slot(rank, parity)`` viewed with the dtype and shape of tensor ``like``."""

    def step(self, deadline: float, descriptor: Sequence[int] | None = None) -> None:
        """Publish my slot and wait for every rank to publish the same step.

        With ``descriptor`` (at most ``layout.HEAD_WORDS + layout.DESC_WORDS`` int64 words,
        the first the call's sequence number), it is posted with the step and every peer's
        descriptor of the same step is available from ``peer_descriptor`` afterwards. Its
        first ``layout.HEAD_WORDS`` words are the cheapest to read: keep what every call
        compares there.
        """

    def peer_slot(self, rank: int, dtype=None):
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

    def staged(self) -> bool:
        """Is the next step published already (deferred): this rank's slot holds it."""

    def all_posted(self, seq: int, head) -> bool:
        """Did every peer post ``head`` (the first ``layout.HEAD_WORDS`` words) as the head
        of its descriptor of collective ``seq``? (A call's one check when all is well.)"""

    def peer_descriptor(self, rank: int, seq: int, nwords: int) -> tuple[int, ...]:
        """Descriptor ``rank`` posted with collective ``seq``'s first step."""

    def abort(self, reason: str) -> None:
        """Tell every peer the group failed, so their waits end with ``PeerAborted``."""

    def close(self) -> None:
        """Release the channel's resources."""


class Mailbox(Protocol):
    """Ordered byte stream from one rank to another (single producer, single consumer)."""

    def free(self) -> int:
        """Bytes the producer may write now."""

    def available(self) -> int:
        """Bytes the consumer may read now."""

    def write(self, src, nbytes: int) -> None:
        """Append ``nbytes`` bytes of the uint8 tensor ``src`` (at most ``free()``)."""

    def read_into(self, dst, nbytes: int) -> None:
        """Consume ``nbytes`` bytes into the uint8 tensor ``dst`` (at most ``available()``)."""


class NetRequest(Protocol):
    """A posted send or receive of a ``NetTransport``.

    Attributes: ``peer`` (None: a receive from any rank), ``tag``, ``nbytes``, ``is_send``,
    ``source`` (the sender, once a receive completed), ``error`` (once failed).
    """

    def test(self) -> bool:
        """True once complete; raises the request's error if it failed."""

    def wait(self, deadline: float) -> None:
        """Block until complete or ``deadline`` (``time.monotonic()``).

        Raises ``PeerTimeout`` naming the peer past the deadline; the request then stays
        posted and still owns its buffer: wait again, or ``NetTransport.cancel`` it.
        Raises the request's error if it failed.
        """

    def on_complete(self, callback) -> None:
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
    # collectives/net_mpi.py), or None: the transport has none.
    column: list | None

    def connect(self, peers, deadline: float) -> None:
        """Make every rank of ``peers`` ({rank: address} or ranks) reachable by ``deadline``,
        or ``PeerTimeout``. A transport may open its connections here or on first use
        (rdm opens a peer's rails when it first sends to it, with the same time budget)."""

    def isend(self, peer: int, tag: int, buf, callback=None) -> NetRequest:
        """Send the bytes of ``buf`` to ``peer`` on stream ``tag``."""

    def irecv(self, peer: int, tag: int, buf, callback=None) -> NetRequest:
        """Receive the next message of ``(peer, tag)`` into ``buf`` (exactly its size)."""

    def irecv_any(self, tag: int, buf, callback=None) -> NetRequest:
        """Receive the next message of ``tag`` from any rank (``request.source`` says which)."""

    def cancel(self, req: NetRequest, error: Exception) -> bool:
        """Withdraw ``req`` if it has not completed (see "Deadlines and withdrawal")."""

    def abort(self, reason: str, kind: int = ...) -> None:
        """Tell every peer this rank failed the group, then close."""

    def close(self, error: Exception | None = None) -> None:
        """Release everything; pending requests fail with ``error``."""
