"""Typed failures a transport reports. The c10d layer turns them into DistBackendErrors."""

from __future__ import annotations

from typing import Iterable


class TransportError(RuntimeError):
    """Base class of every transport failure."""


class PeerTimeout(TransportError):
    """Peers did not reach a step in time.

    Attributes
    ----------
    ranks : list[int]
        Group ranks that had not arrived when the deadline passed.
    waited : float
        Seconds spent waiting.
    network : bool
        Raised by a between-nodes transport (``ranks`` are group ranks, and the message
        says what stalled); False: by the node's shared memory (``ranks`` are the node's
        local indices).
    """

    def __init__(self, ranks: Iterable[int], waited: float, detail: str = "",
                 network: bool = False):
        self.ranks = list(ranks)
        self.waited = waited
        self.network = network
        super().__init__(detail or f"rank(s) {self.ranks} did not arrive within {waited:.1f} s")


class PeerDied(TransportError):
    """A peer process is gone (killed or exited) while we waited for it."""

    def __init__(self, rank: int, pid: int | None, detail: str = ""):
        self.rank = rank
        self.pid = pid
        super().__init__(detail or f"rank {rank} (pid {pid}) is no longer running")


ABORTED, ABORTED_TIMEOUT, ABORTED_PEER_DIED, ABORTED_MISMATCH = 1, 2, 3, 4


class PeerAborted(TransportError):
    """A peer marked the group as failed and said why (``kind``: one of ABORTED_*).

    ``network``: the notice came from another node (the ranks of this node may not know
    yet); ``rank`` is then a group rank, else a local index of this node.
    """

    def __init__(self, rank: int, reason: str, kind: int = ABORTED, network: bool = False):
        self.rank = rank
        self.reason = reason
        self.kind = kind
        self.network = network
        super().__init__(f"rank {rank} aborted the group: {reason}")


class ChannelClosed(TransportError):
    """The local endpoint was closed (destroy_process_group or abort) while in use."""


class PeerUnreachable(PeerDied):
    """Every network path to a peer failed (its process died, or the network between us)."""

    def __init__(self, rank: int, detail: str):
        super().__init__(rank, None, detail)


class Claimed(TransportError):
    """A receive from any rank took nothing: another path (shared memory) satisfied it
    first (``RdmTransport.irecv_any``'s ``claim``). Its owner expects this and ignores it."""


class MessageSizeMismatch(TransportError, ValueError):
    """A message's size differs from its receive's buffer. The receive fails with this and
    the message is consumed (the next receive of the stream gets the next message).

    Attributes
    ----------
    src, tag : int
        Where the message came from.
    sent, expected : int
        Its size, and the size of the receive's buffer.
    message : bytes-like
        The message itself (callers read a header in it to explain the mismatch); empty
        when the message was too large to keep (rdm refuses it, and its sender's request
        fails with this error too, ``src`` then naming the receiver).
    """

    def __init__(self, src: int, tag: int, sent: int, expected: int,
                 message: bytes | bytearray | memoryview = b"", detail: str = ""):
        self.src, self.tag, self.sent, self.expected = src, tag, sent, expected
        self.message = message
        super().__init__(detail or f"rank {src} sent {sent} bytes, the receive expects "
                                   f"{expected} (tag {tag})")


class DescriptorLimit(TransportError):
    """A rank cannot open the connections a group needs within its file-descriptor limit
    (``transport/rdm/fd_budget.py``); the message names the numbers and the ways out."""


class StepDeferred(TransportError):
    """Not a failure: a step asked not to wait (``StepChannel.defer_once``) found a peer
    behind. The step is published; running the call again completes it (see engine.py).

    Attributes
    ----------
    epoch : int
        The step (or, from a ``NetCall``, the call's sequence number) deferred.
    last : bool
        No step of the call follows this one (set by the call, ``Context``).
    resumes : bool
        The call is finished by ``NetCall.resume``, not run again (set by a ``NetCall``).
    """

    def __init__(self, epoch: int, last: bool = False, resumes: bool = False):
        self.epoch = epoch
        self.last = last
        self.resumes = resumes
        super().__init__(f"step {epoch} deferred: a peer has not published it yet")
