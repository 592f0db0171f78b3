"""What a group's caller sees when something fails, and who else is told.

How it works
------------
The group's engine and its send/recv face catch what an operation raised and ask
``Failures.translate`` for the error to give the caller and whether the group is broken
by it (fatal). The transports and the selection raise their own exceptions (a peer that
timed out, died, aborted, a collective another rank did not call); this module turns
them into the public errors of errors.py, naming ranks in the group's numbering (the
shared-memory channel counts a node's ranks from 0), and tells the peers that must hear
of it: a fatal failure aborts the node's channel and, for a group that spans nodes, its
network transport, with the same kind, so every rank fails with the same class and
reason instead of waiting for a peer that will never come. Bad arguments and a failed
send/recv's own errors are the caller's alone and leave the group working.
"""

from __future__ import annotations

from typing import Callable

from .collectives.descriptor import Call, CollectiveMismatch, posted
from .collectives.p2p import P2PError
from .errors import (CollectiveMismatchError, GroupAbortedError, NeuronDistError, PeerDiedError,
                     PeerTimeoutError)
from .transport.errors import (ABORTED, ABORTED_MISMATCH, ABORTED_PEER_DIED, ABORTED_TIMEOUT,
                               ChannelClosed, PeerAborted, PeerDied, PeerTimeout)


class Failures:
    """A group's failure translation (see the module docstring).

    ``channel``: the node's shared-memory channel; ``net``: the network transport, None in
    a one-node group; ``local``: the group ranks of this node's ranks, in channel order;
    ``timeout_text``: the group's timeout as the errors name it. ``engine`` (set once the
    group's engine exists, which reports its failures here) gives the last call's number
    for a laggard's description and is marked broken by a fatal send/recv failure.
    """

    def __init__(self, channel, net, local: list[int], timeout_text: Callable[[], str]):
        self._channel, self._net, self._local = channel, net, local
        self._timeout_text = timeout_text
        self.engine = None

    def peer(self, k: int) -> int:
        """Group rank of the shared-memory channel's rank ``k`` (its node-local index)."""
        return self._local[k] if self._net is not None else k

    def on_p2p_error(self, exc: BaseException, what: str):
        """``translate`` for a send or receive, which the collective engine does not see: a
        fatal failure (the peers are told) also breaks the engine here, so this rank's later
        collectives fail at once naming it, as after a collective's failure."""
        error, fatal = self.translate(exc, what)
        if fatal:
            self.engine.mark_broken(error)
        return error, fatal

    def translate(self, exc: BaseException, what: str):
        """The error the caller of ``what`` gets for ``exc``, and whether it is fatal."""
        if isinstance(exc, CollectiveMismatch):
            error = CollectiveMismatchError(f"{what}: {exc}")
            if self._net is None:  # every rank saw every call: the group stays aligned
                return error, False
            # Across nodes, messages of the mismatched calls may be left in flight, and the
            # ranks of this node that exchanged nothing with the culprit must hear of it.
            self._channel.abort(str(error), ABORTED_MISMATCH)
            self._net.abort(str(error), ABORTED_MISMATCH)
            return error, True
        kind = ABORTED
        if isinstance(exc, PeerTimeout):
            detail = str(exc) if exc.network else self._describe_laggards(exc.ranks)
            error = PeerTimeoutError(
                f"{what}: Timed out after {self._timeout_text()}: {detail}")
            kind = ABORTED_TIMEOUT
        elif isinstance(exc, PeerDied):
            error = PeerDiedError(f"{what}: rank {self.peer(exc.rank)} (pid {exc.pid}) died"
                                  if exc.pid else f"{what}: {exc}")
            # a pid: found by this node's shared memory (a local index), else by the network
            error.ranks = (self.peer(exc.rank) if exc.pid else exc.rank,)
            kind = ABORTED_PEER_DIED
        elif isinstance(exc, PeerAborted):
            cls = {ABORTED_TIMEOUT: PeerTimeoutError, ABORTED_PEER_DIED: PeerDiedError,
                   ABORTED_MISMATCH: CollectiveMismatchError}.get(exc.kind, GroupAbortedError)
            if exc.network:  # from another node: tell this node's ranks
                error = cls(f"{what}: rank {exc.rank} aborted the group: {exc.reason}")
                self._channel.abort(str(error), exc.kind)
                return error, True
            error = cls(f"{what}: rank {self.peer(exc.rank)} aborted the group: {exc.reason}")
            if self._net is not None:
                # The aborting rank tells the other nodes itself, but a rank there may be
                # waiting on this one, and would otherwise see only its rails close when
                # this process goes on to exit: this rank's notice comes first.
                self._net.abort(str(error), exc.kind)
            return error, True
        elif isinstance(exc, ChannelClosed):
            return GroupAbortedError(f"{what}: {exc}"), True
        elif isinstance(exc, (ValueError, TypeError, P2PError)):
            return exc, False
        elif isinstance(exc, NeuronDistError):
            return exc, True
        else:
            error = NeuronDistError(f"{what} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        self._channel.abort(str(error), kind)
        if self._net is not None:  # ranks on other nodes get the same error class and reason
            self._net.abort(str(error), kind)
        return error, True

    def _describe_laggards(self, ranks) -> str:
        if self._net is not None:  # ranks are local indices of this node's channel
            return "; ".join(f"rank {self._local[k]} (same node) never arrived"
                             for k in ranks) or "peers did not arrive"
        parts = []
        for k in ranks:
            seq, call = Call.from_words(posted(self._channel, k, self.engine.seq - 1)[0])
            last = (f"its last collective was #{seq} {call.describe()}" if seq > 0
                    else "it has not entered any collective of this group")
            parts.append(f"rank {k} never arrived ({last})")
        return "; ".join(parts) or "peers did not arrive"
