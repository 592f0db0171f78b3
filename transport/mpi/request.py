"""A request of the MPI transport: a send or receive, waited for by driving MPI."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..requests import Request as _Request

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from .driver import MpiTransport


class Request(_Request):
    """A pending ``isend``, ``irecv`` or ``irecv_any`` (see transport/requests.py).

    Waiting drives MPI's progress from the waiting thread (``MpiTransport.drive``).
    """

    __slots__ = ("_owner",)
    VIA = "MPI"

    def __init__(self, peer: int | None, tag: int, buf: memoryview, is_send: bool,
                 owner: MpiTransport):
        super().__init__(peer, tag, buf, is_send, owner.callbacks)
        self._owner = owner

    def _block(self, deadline: float) -> bool:
        return self._owner.polling.drive(self.completion, deadline)


def writable(buf: Buffer) -> memoryview:
    """``buf`` as a writable byte view (a receive's buffer), or ValueError."""
    view = memoryview(buf).cast("B")
    if view.readonly:
        raise ValueError("a receive needs a writable buffer")
    return view
