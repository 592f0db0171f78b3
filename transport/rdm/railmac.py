"""Authentication of the frames on one rail, with the session key of its handshake.

Used when the job has a key (``NEURON_DIST_AUTH_KEY``) or ``NEURON_DIST_NET_MAC=1``. The
handshake (handshake.py) derives a key for the connection from the job key, both fresh
challenges, the group, both ranks and the rail (``handshake.session_key``), so a tag made
for one connection is worth nothing on another, and someone who relays the handshake
without the job key cannot read or write tags. From it each direction gets its own key.

Every frame then carries, on the rail's byte stream::

    header (64) | htag (16) | payload | trailer (acks) | ttag (16, see below)

* ``htag = HMAC-SHA256(k_dir, n | header)[:16]``, where ``n`` counts the frames sent in
  that direction on that rail (0, 1, 2, ...; TCP keeps them in order), so a frame cannot
  be altered, replayed, dropped or reordered without the next header check failing. The
  receiver checks it before the header is used (before a payload is placed anywhere).
* ``ttag = HMAC-SHA256(k_dir, n | "tail" | header | covered)[:16]``, present when the frame
  carries acks (an ACK frame, whose acks are its payload, or a DATA frame with acks riding
  behind it) or in payload mode (``NEURON_DIST_NET_MAC=1``): ``covered`` is the payload
  (ACK frames always, DATA frames in payload mode) then the trailer. It is checked before
  the acks or the payload are acted on.

Any failure is a ``FrameError``: the driver closes the rail as for a malformed frame.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from .frames import ACK, FrameError, HEADER_SIZE

TAG = 16
_N = struct.Struct("!Q")


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
        self._tail = None  # the tail tag being computed for the frame being read

    def tail(self, ftype: int, nacks: int) -> bool:
        """Does a frame of this type with ``nacks`` piggybacked acks carry a tail tag?"""
        return self.payload or ftype == ACK or nacks > 0

    def seal(self, tx):
        """``tx`` (a ``protocol.Transmit``) with its tags: the htag right after the 64-byte
        header, the ttag (if any) after the trailer. (An ACK's ``tx.header`` holds the
        whole frame: its entries follow the header.)"""
        n = _N.pack(self._sent)
        self._sent += 1
        frame = bytes(tx.header)
        header, extra = frame[:HEADER_SIZE], frame[HEADER_SIZE:]
        sealed = header + hmac.digest(self._send, n + header, "sha256")[:TAG] + extra
        ftype, nacks = header[3], (header[6] << 8) | header[7]
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

    def check_header(self, buf) -> None:
        """Check the htag of the header in ``buf`` (``HEADER_SIZE + TAG`` bytes)."""
        n = _N.pack(self._read)
        header = bytes(buf[:HEADER_SIZE])
        expect = hmac.digest(self._recv, n + header, "sha256")[:TAG]
        if not hmac.compare_digest(expect, bytes(buf[HEADER_SIZE:HEADER_SIZE + TAG])):
            raise FrameError(f"frame {self._read} on this rail failed authentication (header "
                             f"tag): altered, forged, replayed or out of order, or the two "
                             f"ends differ in NEURON_DIST_AUTH_KEY / NEURON_DIST_NET_MAC")
        self._read += 1
        if self.tail(header[3], (header[6] << 8) | header[7]):
            prefix = n + b"tail" + header  # (payload mode: hashed as the payload lands)
            self._tail = hmac.new(self._recv, prefix, hashlib.sha256) if self.payload else prefix

    def absorb(self, data) -> None:
        """Feed bytes the tail tag covers (the payload read in place, in payload mode)."""
        self._tail.update(data)

    def check_tail(self, covered, tag) -> None:
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
