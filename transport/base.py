"""The interfaces algorithms are written against.

Two shapes of communication, because shared memory and networks differ in kind:

* ``StepChannel`` — one-sided and group-wide, the natural shape of shared memory. Every
  rank owns a slot; a *step* is: fill my slot, publish, wait until every rank of the group
  has published the same step, then read any peer's slot directly. Slots are double
  buffered, so a rank may fill its next slot while peers still read the previous one. A
  step also carries a small call descriptor, which is how collectives detect that ranks
  called different things.
* ``Mailbox`` — two-sided, ordered byte streams between a pair of ranks, for send/recv.

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

    def my_slot_like(self, like):
        """My next slot viewed with the dtype and shape of tensor ``like`` (fits one slot)."""

    def peer_slot_like(self, rank: int, like):
        """``rank``'s current slot viewed with the dtype and shape of ``like``."""

    def step(self, deadline: float, descriptor: Sequence[int] | None = None) -> None:
        """Publish my slot and wait for every rank to publish the same step.

        With ``descriptor``, it is posted with the step and every peer's descriptor of the
        same step is available from ``peer_descriptor`` afterwards.
        """

    def peer_slot(self, rank: int, dtype=None):
        """Tensor (uint8, or viewed as ``dtype``) of ``rank``'s slot for the step just completed."""

    epoch: int  # steps this rank has completed

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
