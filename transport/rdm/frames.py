"""Wire format of the reliable-datagram (rdm) protocol: one frame per datagram.

Every frame is a fixed 64-byte header in network byte order followed by a payload::

    off size field     meaning
      0   2  magic     b"NR"
      2   1  version   VERSION (1)
      3   1  type      DATA (1), ACK (2) or REFUSE (3)
      4   1  flags     FLAG_CRC (bit 0): ``crc`` covers header and payload
      5   1  rail      rail the sender put the frame on (a hint; receivers use their own)
      6   2  nacks     ack entries riding behind a DATA frame's payload (0 on an ACK)
      8   4  src       sending rank
     12   4  dst       receiving rank
     16   8  msg_id    message number, per (src -> dst) pair, 0, 1, 2, ...
     24   8  tag       user tag (signed on the wire, must be >= 0)
     32   8  seq       position of the message in its (src, dst, tag) stream
     40   8  total     length of the whole message in bytes
     48   8  offset    where this segment's payload goes in the message
     56   4  length    payload bytes that follow the header
     60   4  crc       CRC-32 of header (with crc = 0), payload and ack entries if
                         FLAG_CRC, else 0

A DATA frame carries one segment: ``payload`` is ``message[offset:offset + length]``.
A 0-byte message travels as a single DATA frame with ``total = offset = length = 0``.
Behind its payload come ``nacks`` ack entries (as in an ACK frame, below) the sender had
to send to this peer anyway: the acks of a request ride on its reply.

An ACK frame acknowledges segments individually: its payload is a packed array of
``(msg_id: u64, offset: u64)`` entries (16 bytes each, 1..MAX_ACKS_PER_FRAME of them);
its header has ``msg_id = tag = seq = offset = 0`` and ``total = length``.

A REFUSE frame tells the sender that its receiver will never take message ``msg_id``: the
message is larger than the receive buffer posted for it and than the memory the receiver
may hold for it (see "Refusal" in protocol.py). Its header repeats the message's
``msg_id``, ``tag``, ``seq`` and ``total`` and carries the size of that receive buffer in
``offset`` (so ``offset < total``); it has no payload (``length = 0``) and no acks.

``decode`` trusts nothing on the wire: magic, version, type, flags, the reserved field,
every length against the real buffer size, ``offset + length <= total``, ``total`` against
the configured maximum message size, ranks against the world size, the sign of the tag,
the ACK payload shape, the REFUSE shape and (when present or required) the CRC. Anything else raises
``FrameError`` naming the first problem found.
"""

from __future__ import annotations

import struct
import zlib
from typing import TYPE_CHECKING, NamedTuple, Sequence

if TYPE_CHECKING:
    from typing_extensions import TypeAlias

    # what a frame's bytes are handed in: the caller's buffer or a copy
    Bytes: TypeAlias = bytes | bytearray | memoryview

MAGIC = b"NR"
VERSION = 3  # 2: DATA frames carry piggybacked acks (``nacks``); 3: REFUSE frames

DATA = 1
ACK = 2
REFUSE = 3
FRAME_TYPES = {DATA: "DATA", ACK: "ACK", REFUSE: "REFUSE"}

FLAG_CRC = 0x01
KNOWN_FLAGS = FLAG_CRC

HEADER = struct.Struct("!2sBBBBHIIQqQQQII")
HEADER_SIZE = HEADER.size  # 64
# On a rail every frame follows an 8-byte prefix naming its group (links.py): one rail
# carries the frames of every group its two processes share.
LINK_PREFIX = 8
_CRC_OFFSET = HEADER_SIZE - 4

ACK_ENTRY = struct.Struct("!QQ")
MAX_ACKS_PER_FRAME = 256

MAX_SEGMENT_BYTES = 0xFFFFFFFF  # the length field is 32 bits
_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF
_I64 = 0x7FFFFFFFFFFFFFFF


class FrameError(ValueError):
    """A byte string is not a well-formed frame (truncated, oversized, corrupt, garbage)."""


class Frame(NamedTuple):
    """One decoded frame (a tuple: cheap to build on the per-frame path).

    Attributes
    ----------
    type : int
        ``DATA``, ``ACK`` or ``REFUSE``.
    flags : int
        Bit set of ``FLAG_*``.
    rail : int
        The rail the sender chose (a hint).
    src, dst : int
        Sending and receiving rank.
    msg_id, tag, seq, total, offset : int
        See the module docstring (all 0 except ``total`` in an ACK; ``offset`` is the
        receive buffer's size in a REFUSE).
    payload : bytes
        The segment (DATA) or the packed ack entries (ACK).
    piggyback : bytes
        Packed ack entries riding behind a DATA frame's payload (empty otherwise).
    """

    type: int
    flags: int
    rail: int
    src: int
    dst: int
    msg_id: int
    tag: int
    seq: int
    total: int
    offset: int
    payload: bytes
    piggyback: bytes = b""

    @property
    def acks(self) -> list[tuple[int, int]]:
        """The ``(msg_id, offset)`` entries the frame carries (an ACK's payload, or the
        entries riding behind a DATA frame's)."""
        return list(ACK_ENTRY.iter_unpack(self.payload if self.type == ACK else self.piggyback))


def _check_range(name: str, value: int, lo: int, hi: int) -> None:
    if not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name}={value!r} is outside [{lo}, {hi}]")


def encode(type: int, src: int, dst: int, *, msg_id: int = 0, tag: int = 0, seq: int = 0,
           total: int | None = None, offset: int = 0, payload: Bytes = b"", rail: int = 0,
           crc: bool = False, acks: Sequence[tuple[int, int]] = ()) -> bytes:
    """Build one frame: ``encode_header(...) + payload + packed acks``.

    Parameters
    ----------
    type : int
        ``DATA`` or ``ACK``.
    src, dst : int
        Sending and receiving rank.
    msg_id, tag, seq, total, offset : int
        Header fields (``total`` defaults to ``offset + len(payload)``).
    payload : bytes-like
        Segment bytes, or packed ack entries (see ``encode_ack``).
    rail : int
        Rail hint, 0..255.
    crc : bool
        Set ``FLAG_CRC`` and fill the CRC-32 of header, payload and acks.
    acks : sequence of (msg_id, offset)
        Ack entries to piggyback on a DATA frame (at most ``MAX_ACKS_PER_FRAME``).

    Returns
    -------
    bytes
        The frame, ``HEADER_SIZE + len(payload)`` bytes.

    Raises
    ------
    ValueError
        A field does not fit its wire width or the frame would be inconsistent.
    """
    trailer = pack_acks(acks) if acks else b""
    header = encode_header(type, src, dst, msg_id=msg_id, tag=tag, seq=seq, total=total,
                           offset=offset, payload=payload, rail=rail, crc=crc, trailer=trailer)
    return header + bytes(payload) + trailer


def pack_acks(entries: Sequence[tuple[int, int]]) -> bytes:
    """Ack entries ``[(msg_id, offset), ...]`` as they travel (an ACK's payload, or behind
    a DATA frame's)."""
    return struct.pack(f"!{2 * len(entries)}Q", *[x for entry in entries for x in entry])


def encode_header(type: int, src: int, dst: int, *, msg_id: int = 0, tag: int = 0, seq: int = 0,
                  total: int | None = None, offset: int = 0, payload: Bytes = b"", rail: int = 0,
                  crc: bool = False, trailer: Bytes = b"") -> bytes:
    """The 64-byte header of the frame ``encode`` would build, without copying ``payload``.

    A driver writes the header, the payload (a view of the caller's buffer) and the packed
    piggybacked acks ``trailer`` with one scatter-gather send. Parameters and errors as
    for ``encode``.
    """
    if type not in FRAME_TYPES:
        raise ValueError(f"unknown frame type {type!r}")
    nacks, odd = divmod(len(trailer), ACK_ENTRY.size)
    if odd or nacks > MAX_ACKS_PER_FRAME or (nacks and type != DATA):
        raise ValueError(f"a DATA frame carries 0..{MAX_ACKS_PER_FRAME} whole ack entries "
                         f"behind its payload, an ACK none ({len(trailer)} bytes given)")
    length = len(payload) if not isinstance(payload, memoryview) else payload.nbytes
    if total is None:
        total = offset + length
    for name, value, hi in (("src", src, _U32), ("dst", dst, _U32), ("msg_id", msg_id, _U64),
                            ("tag", tag, _I64), ("seq", seq, _U64), ("total", total, _U64),
                            ("offset", offset, _U64), ("length", length, _U32), ("rail", rail, 0xFF)):
        _check_range(name, value, 0, hi)
    if offset + length > total:
        raise ValueError(f"segment [{offset}, {offset + length}) exceeds the message length {total}")
    flags = FLAG_CRC if crc else 0
    header = HEADER.pack(MAGIC, VERSION, type, flags, rail, nacks, src, dst, msg_id, tag, seq,
                         total, offset, length, 0)
    if crc:
        value = zlib.crc32(trailer, zlib.crc32(payload, zlib.crc32(header)))
        header = header[:_CRC_OFFSET] + value.to_bytes(4, "big")
    return header


def pack_data_header(src: int, dst: int, msg_id: int, tag: int, seq: int, total: int,
                     offset: int, length: int, rail: int, nacks: int = 0) -> bytes:
    """``encode_header`` of a DATA frame without CRC, for a caller whose fields are valid
    by construction (the protocol's own counters): no range checks on the per-frame path."""
    return HEADER.pack(MAGIC, VERSION, DATA, 0, rail, nacks, src, dst, msg_id, tag, seq,
                       total, offset, length, 0)


def pack_ack(src: int, dst: int, entries: Sequence[tuple[int, int]], rail: int) -> bytes:
    """``encode_ack`` without CRC and without checks, for 1..MAX_ACKS_PER_FRAME entries the
    protocol produced itself."""
    n = len(entries)
    return HEADER.pack(MAGIC, VERSION, ACK, 0, rail, 0, src, dst, 0, 0, 0, 16 * n, 0,
                       16 * n, 0) + pack_acks(entries)


def encode_refuse(src: int, dst: int, msg_id: int, tag: int, seq: int, total: int,
                  expected: int, *, rail: int = 0, crc: bool = False) -> bytes:
    """Build a REFUSE frame: message ``msg_id`` (``tag``, ``seq``, ``total`` bytes) is
    refused; the receive buffer posted for it holds ``expected`` bytes (< ``total``).

    Raises
    ------
    ValueError
        A field does not fit, or ``expected`` is not smaller than ``total``.
    """
    if not 0 <= expected < total:
        raise ValueError(f"a refusal names a buffer smaller than the message, not {expected} "
                         f"bytes for {total}")
    return encode(REFUSE, src, dst, msg_id=msg_id, tag=tag, seq=seq, total=total,
                  offset=expected, rail=rail, crc=crc)


def encode_ack(src: int, dst: int, entries: Sequence[tuple[int, int]], *, rail: int = 0,
               crc: bool = False) -> bytes:
    """Build an ACK frame for ``entries``, a sequence of ``(msg_id, offset)`` pairs.

    Raises
    ------
    ValueError
        No entries, or more than ``MAX_ACKS_PER_FRAME``.
    """
    if not 1 <= len(entries) <= MAX_ACKS_PER_FRAME:
        raise ValueError(f"an ACK frame carries 1..{MAX_ACKS_PER_FRAME} entries, not {len(entries)}")
    return encode(ACK, src, dst, payload=pack_acks(entries), rail=rail, crc=crc)


def _header_fields(view: memoryview) -> tuple[int, ...]:
    if view.nbytes < HEADER_SIZE:
        raise FrameError(f"truncated frame: {view.nbytes} bytes, the header alone is {HEADER_SIZE}")
    fields = HEADER.unpack_from(view, 0)
    magic, version, ftype, flags, _rail, nacks = fields[:6]
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise FrameError(f"unsupported version {version} (expected {VERSION})")
    if ftype not in FRAME_TYPES:
        raise FrameError(f"unknown frame type {ftype}")
    if flags & ~KNOWN_FLAGS:
        raise FrameError(f"unknown flags 0x{flags:02x}")
    if nacks and ftype != DATA:
        raise FrameError(f"an ACK frame with {nacks} piggybacked acks")
    if nacks > MAX_ACKS_PER_FRAME:
        raise FrameError(f"{nacks} piggybacked acks (at most {MAX_ACKS_PER_FRAME})")
    return fields


def _check_lengths(view: memoryview | None, ftype: int, tag: int, total: int, offset: int,
                   length: int, max_message_bytes: int | None, nacks: int = 0) -> None:
    if view is not None and length + nacks * ACK_ENTRY.size != view.nbytes - HEADER_SIZE:
        raise FrameError(f"length field says {length} payload bytes and {nacks} acks, the "
                         f"frame carries {view.nbytes - HEADER_SIZE} bytes")
    if offset + length > total:
        raise FrameError(f"segment [{offset}, {offset + length}) exceeds the message length {total}")
    if max_message_bytes is not None and total > max_message_bytes:
        raise FrameError(f"message length {total} exceeds the maximum {max_message_bytes}")
    if tag < 0:
        raise FrameError(f"negative tag {tag}")
    if ftype == DATA and length == 0 and total != 0:
        raise FrameError(f"empty segment of a {total}-byte message")
    if ftype == ACK:
        if offset != 0 or total != length or length % ACK_ENTRY.size:
            raise FrameError(f"malformed ACK (offset {offset}, total {total}, length {length})")
        if not 1 <= length // ACK_ENTRY.size <= MAX_ACKS_PER_FRAME:
            raise FrameError(f"ACK with {length // ACK_ENTRY.size} entries "
                             f"(1..{MAX_ACKS_PER_FRAME} allowed)")
    elif ftype == REFUSE and (length or offset >= total):
        raise FrameError(f"malformed REFUSE (buffer {offset} bytes for a message of {total}, "
                         f"{length} payload bytes)")


def _check_crc(view: memoryview, flags: int, stored: int, require_crc: bool) -> None:
    if not flags & FLAG_CRC:
        if require_crc:
            raise FrameError("frame has no CRC but this endpoint requires one")
        if stored:
            raise FrameError(f"CRC field is 0x{stored:08x} but FLAG_CRC is not set")
        return
    value = zlib.crc32(view[:_CRC_OFFSET])
    value = zlib.crc32(b"\0\0\0\0", value)
    value = zlib.crc32(view[HEADER_SIZE:], value)  # payload and piggybacked acks
    if value != stored:
        raise FrameError(f"CRC mismatch (computed 0x{value:08x}, frame says 0x{stored:08x})")


class Header(NamedTuple):
    """A validated header whose payload has not been read yet (see ``decode_header``)."""

    type: int
    flags: int
    rail: int
    src: int
    dst: int
    msg_id: int
    tag: int
    seq: int
    total: int
    offset: int
    length: int
    crc: int
    nacks: int = 0

    @property
    def trailer_bytes(self) -> int:
        """Bytes of piggybacked ack entries after the payload."""
        return self.nacks * ACK_ENTRY.size


def decode_header(buf: Bytes, *, world_size: int | None = None,
                  max_message_bytes: int | None = None, max_payload: int | None = None,
                  require_crc: bool = False) -> Header:
    """Parse and validate the 64-byte header of a frame arriving on a byte stream.

    Everything ``decode`` checks that does not need the payload is checked here, plus
    ``length <= max_payload``, so a driver can size (or place) the payload read safely.
    ``check_payload`` finishes the job once the payload is in.

    Raises
    ------
    FrameError
        The header is not well-formed under these limits.
    """
    if len(buf) == HEADER_SIZE:  # fast path: a DATA frame without CRC, checked in one go
        (magic, version, ftype, flags, rail, nacks, src, dst, msg_id, tag, seq, total, offset,
         length, crc) = HEADER.unpack_from(buf)
        if (magic == MAGIC and version == VERSION and ftype == DATA and not flags and not crc
                and not require_crc and nacks <= MAX_ACKS_PER_FRAME and tag >= 0
                and offset + length <= total and (length or not total)
                and (max_payload is None or length <= max_payload)
                and (max_message_bytes is None or total <= max_message_bytes)
                and (world_size is None or (src < world_size and dst < world_size))):
            return Header(ftype, flags, rail, src, dst, msg_id, tag, seq, total, offset,
                          length, crc, nacks)
    return _decode_header_checked(buf, world_size, max_message_bytes, max_payload, require_crc)


def _decode_header_checked(buf: Bytes, world_size: int | None, max_message_bytes: int | None,
                           max_payload: int | None, require_crc: bool) -> Header:
    """``decode_header`` one check at a time, naming the first that fails."""
    view = memoryview(buf).cast("B")
    if view.nbytes != HEADER_SIZE:
        raise FrameError(f"a header is {HEADER_SIZE} bytes, not {view.nbytes}")
    fields = _header_fields(view)
    (_, _, ftype, flags, rail, nacks, src, dst, msg_id, tag, seq, total, offset, length,
     crc) = fields
    if max_payload is not None and length > max_payload:
        raise FrameError(f"payload of {length} bytes exceeds the maximum {max_payload}")
    _check_lengths(None, ftype, tag, total, offset, length, max_message_bytes)
    if world_size is not None and not (src < world_size and dst < world_size):
        raise FrameError(f"rank out of range: src {src}, dst {dst}, world size {world_size}")
    if not flags & FLAG_CRC:
        if require_crc:
            raise FrameError("frame has no CRC but this endpoint requires one")
        if crc:
            raise FrameError(f"CRC field is 0x{crc:08x} but FLAG_CRC is not set")
    return Header(ftype, flags, rail, src, dst, msg_id, tag, seq, total, offset, length, crc,
                  nacks)


def check_payload(header_bytes: Bytes, header: Header, payload: Bytes,
                  trailer: Bytes = b"") -> None:
    """Verify the CRC of a frame read as header + payload + trailer (the piggybacked acks);
    a no-op without ``FLAG_CRC``."""
    if not header.flags & FLAG_CRC:
        return
    value = zlib.crc32(memoryview(header_bytes)[:_CRC_OFFSET])
    value = zlib.crc32(b"\0\0\0\0", value)
    value = zlib.crc32(trailer, zlib.crc32(payload, value))
    if value != header.crc:
        raise FrameError(f"CRC mismatch (computed 0x{value:08x}, frame says 0x{header.crc:08x})")


def decode(buf: Bytes, *, world_size: int | None = None, max_message_bytes: int | None = None,
           require_crc: bool = False) -> Frame:
    """Parse and validate one frame.

    Parameters
    ----------
    buf : bytes-like
        Exactly one frame (a datagram): the header, ``length`` payload bytes and ``nacks``
        ack entries, no more.
    world_size : int, optional
        When given, ``src`` and ``dst`` must be below it.
    max_message_bytes : int, optional
        When given, ``total`` must not exceed it.
    require_crc : bool
        Reject frames without ``FLAG_CRC``.

    Returns
    -------
    Frame
        The frame; its payload is a copy, so ``buf`` may be reused.

    Raises
    ------
    FrameError
        The bytes are not a well-formed frame under these limits.
    """
    try:
        view = memoryview(buf).cast("B")
    except TypeError as e:
        raise FrameError(f"not a contiguous bytes-like object: {e}") from None
    fields = _header_fields(view)
    (_, _, ftype, flags, rail, nacks, src, dst, msg_id, tag, seq, total, offset, length,
     crc) = fields
    _check_lengths(view, ftype, tag, total, offset, length, max_message_bytes, nacks)
    if world_size is not None and not (src < world_size and dst < world_size):
        raise FrameError(f"rank out of range: src {src}, dst {dst}, world size {world_size}")
    _check_crc(view, flags, crc, require_crc)
    end = HEADER_SIZE + length
    return Frame(ftype, flags, rail, src, dst, msg_id, tag, seq, total, offset,
                 bytes(view[HEADER_SIZE:end]), bytes(view[end:]))
