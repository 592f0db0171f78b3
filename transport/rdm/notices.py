"""Abort notices: telling a group's peers that this rank has failed them, and hearing it.

How it works
------------
A notice is a message on the reserved tag ``ABORT_TAG`` (driver.py) whose payload is a
kind byte (``ABORTED``, ``ABORTED_TIMEOUT``: errors.py) and the reason. The endpoint
delivers it even with no receive posted (``notice_tags``), and the peer that hears it
fails every request with this rank with ``PeerAborted`` carrying that reason and kind, so
both ends raise the same error class.

A rank sends one when it aborts the group (``tell_all``: to every peer that has not
failed it, opening rails that are not open yet, within half the grace) and when it
withdraws a request, which leaves the stream between the two ranks out of step
(``withdrew``: to that peer only). A peer whose rails are not open yet is told when they
open (``rails_up``): it needs to know only once it sends to this rank.

Everything but ``tell_all`` runs under the process's network lock (progress.NET_LOCK).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..errors import ABORTED, ABORTED_TIMEOUT, PeerAborted, PeerTimeout

if TYPE_CHECKING:
    from .driver import RdmTransport

log = logging.getLogger("neuron_dist.rdm")

_REASON_BYTES = 4000  # a notice's reason is cut to this many bytes


class AbortNotices:
    """The abort notices of ``owner`` (a group's rdm transport), sent on ``tag``."""

    def __init__(self, owner: RdmTransport, tag: int):
        self._owner, self._tag = owner, tag
        self._waiting: dict[int, bytes] = {}  # peer -> notice to send once its rails are up

    def waiting_for(self, peer: int) -> bool:
        """Does a notice wait for ``peer``'s rails to come up?"""
        return peer in self._waiting

    def rails_up(self, peer: int) -> None:
        """The rails to ``peer`` are up: send the notice that waited for them, if any."""
        notice = self._waiting.pop(peer, None)
        if notice is not None:  # (it failed us before there were rails to tell it)
            self.send(peer, notice)
            self._owner.wire.pump()

    def send(self, peer: int, payload: bytes) -> int | None:
        """Send ``peer`` the notice ``payload``; its msg_id, or None (the peer is gone)."""
        try:
            return self._owner.ep.send(peer, self._tag, payload)
        except Exception:  # noqa: BLE001 - the peer is gone already
            return None

    def withdrew(self, peer: int, error: Exception) -> None:
        """A request with ``peer`` was withdrawn with ``error``: stop talking to it, and
        tell it (now, or once its rails are up)."""
        owner = self._owner
        if peer in owner.failed:
            return
        owner.failed[peer] = error
        kind = ABORTED_TIMEOUT if isinstance(error, PeerTimeout) else ABORTED
        payload = bytes([kind]) + (f"rank {owner.rank} withdrew a request with this rank: "
                                   f"{error}").encode("utf-8", "replace")[:_REASON_BYTES]
        if peer in owner.opening.up:
            self.send(peer, payload)
        else:  # told when it opens its rails (to send to us: only then does it need to know)
            self._waiting[peer] = payload
        owner.pending.fail_peer(peer, error)

    def heard(self, peer: int, data: bytes) -> None:
        """``peer``'s notice ``data`` arrived: every request with it fails with its reason."""
        owner = self._owner
        kind = data[0] if data else ABORTED
        error = PeerAborted(peer, data[1:].decode("utf-8", "replace"), kind, network=True)
        owner.failed[peer] = error
        log.info("neuron %s: %s", owner.label, error)
        owner.pending.fail_peer(peer, error)

    def tell_all(self, reason: str, kind: int, grace: float) -> None:
        """Tell every peer that has not failed this rank (and those this rank failed by
        withdrawing a request and has not told yet) that it failed the group; wait at most
        ``grace`` seconds for the notices to be acknowledged (not under the lock)."""
        from .driver import Request  # (driver.py imports this module)

        owner = self._owner
        payload = bytes([kind]) + reason.encode("utf-8", "replace")[:_REASON_BYTES]
        reqs: list[Request] = []
        deadline = time.monotonic() + grace
        with owner.lock:
            told = {p for p in owner.opening.expected
                    if p not in owner.failed or p in self._waiting}
        if not owner.closed:
            for peer in sorted(told - owner.opening.up):
                try:
                    owner.opening.open(peer, deadline - grace / 2, notice=True)
                except Exception:  # noqa: BLE001 - best effort: it learns otherwise
                    pass
        with owner.lock:
            if owner.closed:
                return
            for peer in sorted(owner.opening.up):
                if peer in told:
                    msg_id = self.send(peer, payload)
                    if msg_id is None:
                        continue
                    req = Request(peer, self._tag, memoryview(payload), True, owner)
                    owner.pending.sends[(peer, msg_id)] = req
                    reqs.append(req)
            owner.wire.pump()
        for req in reqs:
            try:
                req.wait(deadline)
            except Exception:  # noqa: BLE001 - best effort
                pass
