"""Authentication of the frames on one rail, with the session key of its handshake.

Used when the job has a key (``NEURON_DIST_AUTH_KEY``) or ``NEURON_DIST_NET_MAC=1``. The
handshake (handshake.py) derives a key for the connection from the job key, both fresh
challenges, the group, both ranks and the rail (``handshake.session_key``), so a tag made
for one connection is worth nothing on another, and someone who relays the handshake
without the job key cannot read or write tags. From it each direction gets its own key.

Every frame then carries, on the rail's byte stream::

    prefix (8) | header (64) | htag (16) | payload | trailer (acks) | ttag (16, see below)

(``prefix``: the context naming the frame's group, links.py; ``head`` below is prefix and
header, so a frame cannot be moved to another group either.)

* ``htag = HMAC-SHA256(k_dir, n | head)[:16]``, where ``n`` counts the frames sent in
  that direction on that rail (0, 1, 2, ...; TCP keeps them in order), so a frame cannot
  be altered, replayed, dropped or reordered without the next header check failing. The
  receiver checks it before the header is used (before a payload is placed anywhere).
* ``ttag = HMAC-SHA256(k_dir, n | "tail" | head | covered)[:16]``, present when the frame
  carries acks (an ACK frame, whose acks are its payload, or a DATA frame with acks riding
  behind it) or in payload mode (``NEURON_DIST_NET_MAC=1``): ``covered`` is the payload
  (ACK frames always, DATA frames in payload mode) then the trailer. It is checked before
  the acks or the payload are acted on.
* A link's control block (context 0, links.py) carries an htag only.

Any failure is a ``FrameError``: the driver closes the rail as for a malformed frame.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import TYPE_CHECKING

from .frames import ACK, FrameError, HEADER_SIZE, LINK_PREFIX

if TYPE_CHECKING:
    from .frames import Bytes
    from .protocol import Transmit

TAG = 16
_N = struct.Struct("!Q")
_HEAD = LINK_PREFIX + HEADER_SIZE  # what the htag covers: prefix and header
_TYPE, _NACKS = LINK_PREFIX + 3, LINK_PREFIX + 6  # where the header has them
_CONTROL = bytes(LINK_PREFIX)  # the prefix of a link's control block


def _key(session: bytes, label: bytes) -> bytes:
    return hmac.new(session, label, hashlib.sha256).digest()


class RailMac:
    """Tags for the frames one end of a rail sends, and checks for those it reads."""

    __slots__ = ("payload", "_send", "_recv", "_sent", "_read", "_tail")

    def __init__(self, session: bytes, dialer: bool, payload: bool):
        mode = b" with payload" if payload else b""  # (ends that differ fail the first frame)
        d2a = _key(session, b"dialer to acceptor" + mode)
        a2d = _key(session, b"acceptor to dialer" + mode)
        self._send, self._recv = (d2a, a2d) if dialer else (a2d, d2a)
        self.payload = payload
        self._sent = self._read = 0
        # the tail tag being computed for the frame being read
        self._tail: hmac.HMAC | bytes | None = None

    def tail(self, ftype: int, nacks: int) -> bool:
        """Does a frame of this type with ``nacks`` piggybacked acks carry a tail tag?"""
        return self.payload or ftype == ACK or nacks > 0

    def seal(self, tx: Transmit, head: bytes) -> Transmit:
        """``tx`` (a ``protocol.Transmit``) as it goes on the rail, with its tags: ``head``
        (the prefix, then ``tx.header``) with the htag right after the 64-byte header, the
        ttag (if any) after the trailer. (An ACK's ``tx.header`` holds the whole frame: its
        entries follow the header.)"""
        n = _N.pack(self._sent)
        self._sent += 1
        header, extra = head[:_HEAD], head[_HEAD:]
        sealed = header + hmac.digest(self._send, n + header, "sha256")[:TAG] + extra
        ftype, nacks = header[_TYPE], (header[_NACKS] << 8) | header[_NACKS + 1]
        if not self.tail(ftype, nacks):
            return type(tx)(tx.peer, tx.rail, sealed, tx.payload, tx.trailer)
        prefix = n + b"tail" + header
        if not self.payload:  # (one-shot: the cheapest HMAC call from Python)
            covered = extra + bytes(tx.payload) if ftype == ACK else b""
            tag = hmac.digest(self._send, prefix + covered + bytes(tx.trailer), "sha256")
            return type(tx)(tx.peer, tx.rail, sealed, tx.payload, tx.trailer + tag[:TAG])
        h = hmac.new(self._send, prefix, hashlib.sha256)
        h.update(extra)
        if len(tx.payload):
            h.update(memoryview(tx.payload).cast("B"))
        h.update(tx.trailer)
        return type(tx)(tx.peer, tx.rail, sealed, tx.payload, tx.trailer + h.digest()[:TAG])

    def seal_block(self, block: bytes) -> bytes:
        """A link's control block (prefix included) with its htag."""
        n = _N.pack(self._sent)
        self._sent += 1
        return block + hmac.digest(self._send, n + block, "sha256")[:TAG]

    def check_header(self, buf: Bytes) -> None:
        """Check the htag of the prefix and header in ``buf`` (``_HEAD + TAG`` bytes)."""
        n = _N.pack(self._read)
        header = bytes(buf[:_HEAD])
        expect = hmac.digest(self._recv, n + header, "sha256")[:TAG]
        if not hmac.compare_digest(expect, bytes(buf[_HEAD:_HEAD + TAG])):
            raise FrameError(f"frame {self._read} on this rail failed authentication (header "
                             f"tag): altered, forged, replayed or out of order, or the two "
                             f"ends differ in NEURON_DIST_AUTH_KEY / NEURON_DIST_NET_MAC")
        self._read += 1
        if header[:LINK_PREFIX] != _CONTROL and self.tail(
                header[_TYPE], (header[_NACKS] << 8) | header[_NACKS + 1]):
            prefix = n + b"tail" + header  # (payload mode: hashed as the payload lands)
            self._tail = hmac.new(self._recv, prefix, hashlib.sha256) if self.payload else prefix

    def absorb(self, data: Bytes) -> None:
        """Feed bytes the tail tag covers (the payload read in place, in payload mode)."""
        # (an HMAC: only payload mode absorbs, inside a frame with a tail)
        self._tail.update(data)  # type: ignore[union-attr]

    def check_tail(self, covered: Bytes, tag: Bytes) -> None:
        """Finish the frame's tail tag over ``covered`` (what was not ``absorb``-ed yet) and
        compare it with ``tag``."""
        h, self._tail = self._tail, None
        if h is None:
            raise FrameError("a tail tag where the frame has none")
        if isinstance(h, bytes):
            expect = hmac.digest(self._recv, h + bytes(covered), "sha256")
        else:
            h.update(covered)
            expect = h.digest()
        if not hmac.compare_digest(expect[:TAG], bytes(tag)):
            raise FrameError(f"frame {self._read - 1} on this rail failed authentication "
                             f"(acks{' or payload' if self.payload else ''} altered)")
