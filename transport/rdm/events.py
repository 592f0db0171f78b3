"""What the rdm protocol's endpoint reports and returns (protocol.py describes the protocol).

``Endpoint.events()`` returns the events, oldest first: ``MessageReceived``,
``SendCompleted``, ``PeerFailed``, ``MessageRefused``, ``SendRefused`` and
``FrameRejected``. ``poll_transmit`` returns the frames to send as ``Transmit``s. A caller
that misuses the endpoint gets ``ProtocolError``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Union

from ..errors import TransportError

if TYPE_CHECKING:
    from typing_extensions import TypeAlias

    from .frames import Bytes


class MessageReceived(NamedTuple):
    """A whole message arrived and is next in order on its ``(src, tag)`` stream.

    Attributes
    ----------
    src, tag, msg_id : int
        Where it came from and which message it is.
    data : memoryview or bytearray
        The message: a view of the first ``len(message)`` bytes of the posted buffer when
        ``posted`` is true, else a fresh ``bytearray``.
    posted : bool
        Whether the message landed in (or was copied into) the buffer of ``post_recv``.
        False with a buffer posted for this position means the buffer was too small; the
        buffer is then released untouched.
    """

    src: int
    tag: int
    msg_id: int
    data: memoryview | bytearray
    posted: bool = False


class SendCompleted(NamedTuple):
    """Every segment of message ``msg_id`` to ``peer`` was acknowledged."""

    peer: int
    msg_id: int


class PeerFailed(NamedTuple):
    """``peer`` is unreachable; ``msg_ids`` are the sends to it that will never complete."""

    peer: int
    reason: str
    msg_ids: tuple[int, ...] = ()


class MessageRefused(NamedTuple):
    """The message at the next position of ``(src, tag)`` was refused (protocol.py, "Refusal"):
    ``size`` bytes, larger than the ``expected`` bytes of the receive bound to that
    position and than this rank's private memory for the peer. The receive's buffer is
    released untouched; the next message of the stream goes to the next receive."""

    src: int
    tag: int
    msg_id: int
    size: int
    expected: int


class SendRefused(NamedTuple):
    """``peer`` refused message ``msg_id`` (``tag``, ``size`` bytes): its receive holds
    ``expected`` bytes and the message exceeds its private memory. No segment of it is
    sent again; its buffer is free once the driver has dropped the frames it holds."""

    peer: int
    msg_id: int
    tag: int
    size: int
    expected: int


class FrameRejected(NamedTuple):
    """A frame that arrived on ``rail`` was garbage and was dropped."""

    rail: int
    reason: str


class Transmit(NamedTuple):
    """A frame to put on the wire: on ``rail`` towards ``peer``, ``header`` then ``payload``.

    ``payload`` is a view of the sender's buffer (not copied); a stream driver writes both
    with one scatter-gather send, a datagram driver sends ``data``.
    """

    peer: int
    rail: int
    header: bytes
    payload: Bytes = b""
    trailer: bytes = b""  # piggybacked ack entries (DATA frames)

    @property
    def data(self) -> bytes:
        """The whole frame as one bytes object (a copy of the payload)."""
        return self.header + bytes(self.payload) + self.trailer


class ProtocolError(TransportError):
    """The caller misused the endpoint (for example, sent to a peer that failed)."""



# what ``events()`` returns
Event: TypeAlias = Union[MessageReceived, SendCompleted, PeerFailed, MessageRefused, SendRefused,
                         FrameRejected]

__all__ = ["Event", "FrameRejected", "MessageReceived", "MessageRefused", "PeerFailed",
           "ProtocolError", "SendCompleted", "SendRefused", "Transmit"]
