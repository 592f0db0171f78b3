"""Mutual challenge-response authentication of a new rail connection.

Only processes of the same job may open rails to a listener. Both ends know a per-job
secret ``key`` (32 random bytes that group rank 0 puts in the c10d store, or derived from
``NEURON_DIST_AUTH_KEY`` when the store is not trusted) and a public ``group`` nonce that
names the group, so a rail of one group is never accepted by another.

    acceptor -> dialer   HELLO  b"NRH2" | challenge_a (32 random bytes)
    dialer   -> acceptor PROOF  b"NRH2" | rank u32 | rail u16 | dst u32 | group id (16)
                                | challenge_d (32)
                                | HMAC-SHA256(key, b"dial" | group | challenge_a | rank | rail | dst)
    acceptor -> dialer   OK     b"NROK" | HMAC-SHA256(key, b"accept" | group | challenge_d | dst)
                  or     CROSSED b"NRXX" | HMAC-SHA256(key, b"crossed" | group | challenge_d | dst)
                  or     NO     b"NRNO" | reason (32 bytes of ASCII, NUL-padded)

The acceptor answers NO when it refuses a dialer that sent a whole PROOF (the proof does
not check out, the group is not here, the rank may not open that rail): the dialer fails
at once, naming the reason (``HandshakeError``). A connection that ends without an answer
was dropped, not refused (the listener sheds unfinished handshakes under a flood of
strangers, listener.py): the dialer sees ``HandshakeDropped`` and dials again.

Rails are opened on first use, by the rank that sends first (opening.py), so two ranks may
dial each other at once. The acceptor that is itself dialing the dialer and has the higher
rank answers CROSSED instead of OK: its own rails will be the pair's, and the dialer
(``Crossed``) waits for them instead of opening its own.

One listener serves every group of a process: the group id (``group_id(group)``, a hash
of the public group nonce) and ``dst`` tell the acceptor which group's rank is dialled
(``resolve``), whose key and nonce then check the proof (constant-time); the acceptor
also checks that the claimed rank may dial it, and the dialer checks the acceptor's
answer, so neither end talks to an impostor. Fresh challenges on both sides defeat replay. A peer that fails, stalls
(the whole handshake has one deadline, however slowly its bytes come) or sends garbage
gets its connection closed and nothing else: the caller logs it and goes on accepting.

A connection, once open, is shared by every group of the two processes (links.py): a
later group proves its membership in band, with a JOIN whose proof (``join_proof``) is an
HMAC with that group's key over the connection's session key, so it cannot be replayed on
another connection.

Both ends then know a fresh *session key* for the connection (``session_key``): an HMAC
with the job key over both challenges, the group, both ranks and the rail. With frame
authentication on (a job key set by the user, or ``NEURON_DIST_NET_MAC=1``), every frame
on the rail carries tags made with it (railmac.py), which binds the handshake to the
connection that follows: relaying the handshake gains nothing without the job key.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
import socket
import struct
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from typing_extensions import TypeAlias

    from .opening import RailOpening

    # ``resolve(group_id, dst)``: ``(owner, key, group, may_dial, release)`` of the group
    # and rank dialled, or None (see ``accept``)
    Resolve: TypeAlias = Callable[
        [bytes, int], tuple[RailOpening, bytes, bytes, Callable[[int, int], bool | bytes],
                            Callable[[int, int], None]] | None]

MAGIC = b"NRH2"
OK = b"NROK"
CROSSED = b"NRXX"
NO = b"NRNO"
_PROOF = struct.Struct("!4sIHI16s32s32s")
_HELLO_SIZE = 4 + 32
_OK_SIZE = 4 + 32


class HandshakeError(ConnectionError):
    """A connection failed authentication or spoke something else than the handshake."""


class HandshakeDropped(HandshakeError):
    """The connection closed or was reset before the handshake ended, with no refusal:
    the listener dropped it (too many unfinished handshakes) or its process is going.
    The dialer may dial again."""


class HandshakeTimeout(HandshakeError, TimeoutError):
    """The handshake was not finished by its deadline: the other end is stalled (or
    trickles), which callers report as a timeout, not as a refusal."""


class Crossed(HandshakeError):
    """Both ranks dialed each other at once, and the other rank's rails win (it has the
    higher rank): wait for them instead of opening these."""


def group_id(group: bytes) -> bytes:
    """The 16-byte name of a group on the wire (its nonce is no secret; neither is this)."""
    return hashlib.sha256(b"neuron-dist group\0" + group).digest()[:16]


@functools.lru_cache(maxsize=4)
def derive_key(secret: str | bytes) -> bytes:
    """A 32-byte key from a user-supplied secret (``NEURON_DIST_AUTH_KEY``).

    scrypt (n=2**14, r=8: about 16 MiB and tens of ms), salted with this protocol's name,
    so a guess of the secret costs an attacker who read the store's tags that much each
    instead of one hash; computed once per process (groups opened later reuse it)."""
    if isinstance(secret, str):
        secret = secret.encode()
    return hashlib.scrypt(secret, salt=b"neuron-dist auth key v2", n=1 << 14, r=8, p=1,
                          maxmem=64 << 20, dklen=32)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def session_key(key: bytes, group: bytes, challenge_a: bytes, challenge_d: bytes,
                dialer: int, rail: int, acceptor: int) -> bytes:
    """The key of one rail connection, from the job key and the handshake's fresh values."""
    return _mac(key, b"session", group, challenge_a, challenge_d,
                struct.pack("!IHI", dialer, rail, acceptor))


def join_proof(key: bytes, group: bytes, session: bytes, src: int, dst: int,
               rail: int) -> bytes:
    """What a JOIN on a shared rail carries (links.py): proof that rank ``src`` of
    ``group`` (holding its key) joins it on this connection (``session``, the rail's own
    session key, so the proof is worth nothing on another one) toward rank ``dst``."""
    return _mac(key, b"join", struct.pack("!I", len(group)), group, session,
                struct.pack("!IIH", src, dst, rail))


def same(a: bytes, b: bytes) -> bool:
    """Constant-time comparison of two proofs."""
    return hmac.compare_digest(a, b)


def _read_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            _until(sock, deadline)
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            if deadline is None:
                raise
            raise HandshakeTimeout(f"handshake not finished in time ({got} of {n} bytes of a "
                                   f"handshake message came)") from None
        except (ConnectionResetError, ConnectionAbortedError) as e:
            raise HandshakeDropped(f"connection reset after {got} of {n} handshake bytes: "
                                   f"{e}") from None
        if k == 0:
            raise HandshakeDropped(f"connection closed after {got} of {n} handshake bytes")
        got += k
    return bytes(buf)


def _send(sock: socket.socket, data: bytes, deadline: float | None) -> None:
    if deadline is not None:
        _until(sock, deadline)
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as e:
        raise HandshakeDropped(f"connection dropped during the handshake: {e}") from None


def _refuse(sock: socket.socket, deadline: float | None, reason: str) -> None:
    """Tell the dialer why it is refused (a NO, best effort: it may be gone)."""
    try:
        _send(sock, NO + reason.encode("ascii", "replace")[:32].ljust(32, b"\0"), deadline)
    except (HandshakeError, OSError):
        pass


def _until(sock: socket.socket, deadline: float) -> None:
    """Let the next socket call wait only until ``deadline`` (one budget for a handshake,
    however slowly its bytes trickle in)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise HandshakeTimeout("handshake not finished in time")
    sock.settimeout(remaining)


def accept(sock: socket.socket, resolve: Resolve, deadline: float | None = None,
           progress: Callable[[int], None] | None = None
           ) -> tuple[RailOpening, int, int, bytes]:
    """Authenticate a dialer on the accepted ``sock``; return ``(owner, rank, rail,
    session)``, ``session`` being the connection's ``session_key``.

    ``resolve(group_id, dst)`` returns ``(owner, key, group, may_dial, release)`` for the
    group and rank dialled, or None (no such group here): ``may_dial(rank, rail)`` says
    whether that rank may open that rail to us now (a rank of this group, a rail not yet
    connected): True, False, or ``CROSSED`` (we are dialing that rank ourselves, and our
    rails win: the dialer is told so, authenticated, and ``Crossed`` is raised here). A rail
    granted (True) is the caller's to hand to ``owner`` once this returns; if the handshake
    fails after the grant, ``release(rank, rail)`` gives it back here. The whole handshake
    must end by ``deadline`` (``time.monotonic()``); without one, ``sock`` must have a
    timeout set. ``progress(level)``, if given, is called as the dialer shows it is one:
    level 1 once its PROOF starts with the magic, 2 once the proof checked out (the
    listener sheds connections that have not, first).

    Raises
    ------
    HandshakeError
        Authentication failed, or the peer misbehaved; close the socket.
    """
    challenge = secrets.token_bytes(32)
    if deadline is not None:
        _until(sock, deadline)
    sock.sendall(MAGIC + challenge)
    magic = _read_exact(sock, len(MAGIC), deadline)
    if magic != MAGIC:
        raise HandshakeError(f"not a neuron rail (magic {magic!r})")
    if progress is not None:
        progress(1)
    _, rank, rail, dst, gid, their_challenge, proof = _PROOF.unpack(
        magic + _read_exact(sock, _PROOF.size - len(MAGIC), deadline))
    found = resolve(gid, dst)
    if found is None:
        _refuse(sock, deadline, "no such group here")
        raise HandshakeError(f"rank {rank} dialled rank {dst} of a group this process does "
                             f"not have (wrong job, or a group that closed)")
    owner, key, group, may_dial, release = found
    expect = _mac(key, b"dial", group, challenge, struct.pack("!IHI", rank, rail, dst))
    if not hmac.compare_digest(proof, expect):
        _refuse(sock, deadline, "authentication failed")
        raise HandshakeError("authentication failed (wrong job key or group)")
    if progress is not None:
        progress(2)
    my_rank = dst
    verdict = may_dial(rank, rail)
    if verdict is CROSSED:
        if deadline is not None:
            _until(sock, deadline)
        sock.sendall(CROSSED + _mac(key, b"crossed", group, their_challenge,
                                    struct.pack("!I", my_rank)))
        raise Crossed(f"rank {rank} and rank {my_rank} dialed each other; rank {my_rank}'s "
                      f"rails are kept")
    if not verdict:
        _refuse(sock, deadline, f"rail {rail} not open to rank {rank}")
        raise HandshakeError(f"rank {rank} may not open rail {rail} here (unknown or duplicate)")
    try:
        if deadline is not None:
            _until(sock, deadline)
        sock.sendall(OK + _mac(key, b"accept", group, their_challenge, struct.pack("!I", my_rank)))
    except BaseException:
        release(rank, rail)
        raise
    return owner, rank, rail, session_key(key, group, challenge, their_challenge, rank, rail,
                                          my_rank)


def dial(sock: socket.socket, key: bytes, group: bytes, my_rank: int, rail: int,
         dst: int, deadline: float | None = None) -> bytes:
    """Authenticate to the acceptor ``dst`` on the connected ``sock``; return the
    connection's ``session_key``. ``deadline`` (``time.monotonic()``) bounds the whole
    handshake, however slowly the acceptor's bytes trickle in (else the socket's timeout
    bounds each read).

    Raises
    ------
    Crossed
        ``dst`` is dialing us at the same time, and its rails are kept.
    HandshakeDropped
        The connection ended without an answer (dropped, not refused): dial again.
    HandshakeTimeout
        The deadline passed.
    HandshakeError
        The other end is not ``dst`` of this job, or refused us.
    """
    hello = _read_exact(sock, _HELLO_SIZE, deadline)
    if hello[:4] != MAGIC:
        raise HandshakeError(f"the listener at {sock.getpeername()} is not a neuron rail")
    challenge = secrets.token_bytes(32)
    ids = struct.pack("!IHI", my_rank, rail, dst)
    _send(sock, _PROOF.pack(MAGIC, my_rank, rail, dst, group_id(group), challenge,
                            _mac(key, b"dial", group, hello[4:], ids)), deadline)
    answer = _read_exact(sock, _OK_SIZE, deadline)
    if answer[:4] == NO:
        reason = answer[4:].rstrip(b"\0").decode("ascii", "replace")
        raise HandshakeError(f"rank {dst} at {sock.getpeername()} refused the handshake: "
                             f"{reason}")
    if answer[:4] == CROSSED and hmac.compare_digest(
            answer[4:], _mac(key, b"crossed", group, challenge, struct.pack("!I", dst))):
        raise Crossed(f"rank {dst} is dialing rank {my_rank} too; rank {dst}'s rails are kept")
    expect = _mac(key, b"accept", group, challenge, struct.pack("!I", dst))
    if answer[:4] != OK or not hmac.compare_digest(answer[4:], expect):
        raise HandshakeError(f"rank {dst} at {sock.getpeername()} did not prove the job key")
    return session_key(key, group, hello[4:], challenge, my_rank, rail, dst)
