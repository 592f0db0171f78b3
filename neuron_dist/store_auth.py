"""Authenticated values in the rendezvous store (with ``NEURON_DIST_AUTH_KEY`` set).

Why: the store decides whom a rank talks to (peers' rail addresses), what it maps (the
node's shared-memory segment), which ranks it shares memory with (node identities) and
which group a rail belongs to (the group nonce). With a job key, someone who can write the
store must not be able to change any of that.

How it works
------------
* A store key ``K_store = HMAC-SHA256(derive_key(NEURON_DIST_AUTH_KEY), "neuron-dist store
  v1")`` is derived from the job key (a different key than the rail handshake's, so a tag
  of one kind is never valid as the other).
* A value is written as ``b"NSA1" | tag (32 bytes) | value`` where
  ``tag = HMAC-SHA256(K_store, parts)`` over the length-prefixed parts: the scope (the
  group size), the *session* (below, empty for the first round), the full key name (which
  holds the group's generation and the node's index), the writer's rank (its group rank,
  or its index on its node for the node's keys) and the value.
* The reader knows which rank must have written a key and checks the tag (constant-time)
  before using the value. A missing or wrong tag raises ``StoreAuthError`` naming the key
  and the rank that should have written it; nothing is used unchecked.
* Freshness: in the first round every rank writes its node identity with 16 fresh random
  bytes (``fresh``). The *session* is the SHA-256 of every rank's first-round value as
  read, and a rank checks that its own value came back unchanged. Every later value is
  bound to the session, so a value copied from another group, another generation or an
  earlier run with the same key (a replay), or a first-round value altered for some ranks
  only, fails the check on the first rank that reads a later value.

Without a key (the default), ``StoreAuth(store, None, ...)`` writes and reads plain values:
the store is trusted then (and holds the random job key in clear).

Not covered: counters (``store.add``: the generation number, the count of ranks that
attached the segment) cannot carry a tag. Someone who changes them can only make set-up
fail or time out (ranks that disagree on the generation read different keys), never
redirect a rank. Likewise deleting a key only delays a reader until its timeout.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from torch.distributed import DistStoreError

from .errors import NeuronDistError

MAGIC = b"NSA1"
_TAG = 32


class StoreAuthError(NeuronDistError):
    """A value read from the rendezvous store failed authentication with the job key."""


def store_key(job_key: bytes) -> bytes:
    """The key store values are tagged with, from the 32-byte job key (``derive_key``)."""
    return hmac.new(job_key, b"neuron-dist store v1", hashlib.sha256).digest()


def _encode(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class StoreAuth:
    """Reads and writes a group's set-up values in ``store``, tagged when ``job_key`` is set.

    Parameters
    ----------
    store : torch.distributed.Store
        The group's store.
    job_key : bytes or None
        ``derive_key(NEURON_DIST_AUTH_KEY)``, or None (no key: plain values, trusted store).
    scope : str
        What every rank of the group agrees on before the first read (e.g. the group size).
    rank : int
        The writer's rank for ``set`` (see ``for_rank`` for a node's local index).
    """

    def __init__(self, store, job_key: bytes | None, scope: str, rank: int,
                 session: bytes = b""):
        self.store, self.rank, self.scope, self.session = store, rank, scope, session
        self._key = store_key(job_key) if job_key else None
        self._ranks = None  # group ranks of a node's indices (for_rank), for messages

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def for_rank(self, rank: int, ranks=None) -> "StoreAuth":
        """The same store, key and session, writing as ``rank`` (a rank's index on its
        node; ``ranks[i]`` is the group rank of index ``i``, for error messages)."""
        other = StoreAuth(self.store, None, self.scope, rank, self.session)
        other._key, other._ranks = self._key, ranks
        return other

    def _who(self, writer: int) -> str:
        if self._ranks is None or not 0 <= writer < len(self._ranks):
            return f"rank {writer}"
        return f"rank {self._ranks[writer]} (index {writer} on its node)"

    def bind(self, session: bytes) -> None:
        """Bind every later value to ``session`` (see the module docstring)."""
        self.session = session

    def _tag(self, name: str, writer: int, value: bytes) -> bytes:
        parts = (b"neuron-dist store value", self.scope.encode(), self.session, name.encode(),
                 str(writer).encode(), value)
        msg = b"".join(struct.pack("!I", len(p)) + p for p in parts)
        return hmac.new(self._key, msg, hashlib.sha256).digest()

    def seal(self, name: str, value, writer: int | None = None) -> bytes:
        """What ``set`` stores for ``value`` under ``name``."""
        value = _encode(value)
        if self._key is None:
            return value
        return MAGIC + self._tag(name, self.rank if writer is None else writer, value) + value

    def set(self, name: str, value) -> None:
        """Store ``value`` (str or bytes) under ``name``, written by this rank."""
        self.store.set(name, self.seal(name, value))

    def open(self, name: str, raw: bytes, writer: int) -> bytes:
        """The value in ``raw`` (read from ``name``) once its tag proves ``writer`` wrote it."""
        raw = bytes(raw)
        if self._key is None:
            return raw
        if len(raw) < len(MAGIC) + _TAG or raw[:len(MAGIC)] != MAGIC:
            raise StoreAuthError(
                f"store key {name!r} (should have been written by {self._who(writer)}) holds a "
                f"value without an authentication tag: NEURON_DIST_AUTH_KEY is set, so every rank "
                f"must write tagged values. Either a rank runs without the key, or someone "
                f"else wrote the store")
        tag, value = raw[len(MAGIC):len(MAGIC) + _TAG], raw[len(MAGIC) + _TAG:]
        if not hmac.compare_digest(tag, self._tag(name, writer, value)):
            raise StoreAuthError(
                f"store key {name!r} failed authentication: it was not written by "
                f"{self._who(writer)} of this group with this NEURON_DIST_AUTH_KEY (a different "
                f"key, a value altered or copied from another group, generation or run, or ranks "
                f"that saw different values earlier in the set-up). Refusing to use it")
        return value

    def get(self, name: str, writer: int) -> bytes:
        """The value under ``name`` (waiting for it as ``store.get`` does), checked to have
        been written by ``writer``.

        Raises
        ------
        StoreAuthError
            With a key set: the value has no valid tag for ``writer`` (names key and rank).
        """
        return self.open(name, self.store.get(name), writer)

    def get_all(self, names: list[str], writers: list[int]) -> list[bytes]:
        """``get`` of every name in one round trip to the store (``multi_get``, which waits
        for all of them): set-up reads a value of every rank, and at many ranks one round
        trip each, through a store every rank is reading at once, is most of it."""
        try:
            raws = self.store.multi_get(names)
        except DistStoreError as e:  # (its message lists every key: name the missing ones)
            missing = sorted({w for name, w in zip(names, writers) if not self.store.check([name])})
            if not missing:
                raise
            shown = ", ".join(map(str, missing[:20])) + (", ..." if len(missing) > 20 else "")
            raise DistStoreError(
                f"{len(missing)} rank(s) of this {self.scope} never wrote their set-up "
                f"values ({names[0].rsplit('/', 1)[0]}/<rank>) within the store's timeout: "
                f"rank(s) {shown}. Did every rank call init_process_group / new_group for "
                f"this group? ({e})") from None
        return [self.open(name, raw, writer) for name, raw, writer in zip(names, raws, writers)]
