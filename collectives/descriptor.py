"""Call descriptors: what each rank thinks the collective is, checked on its first step.

A call is its op, dtype, element count, root, reduce op and a digest of any per-rank
sizes (``Call.words``). Every collective posts a few int64 words with its first step: the
*head*, ``(seq, code, step)``, where ``code`` packs the call's fields into one word
(``Call.code``) and ``step`` is the channel step the call starts at; a call whose fields do
not fit one word (a per-rank size digest, more than 2**33 elements, a root of 65535 or
more) has code ``LONG`` and its words follow the head. A channel keeps the head where
peers read it cheapest (shared memory: in the step counter's cache line). After that step
every rank compares all peers' heads (and following words) with its own. All ranks read
the same words at the same step, so they all reach the same verdict and raise together;
because each rank has done exactly one step of the failed call, the group stays aligned
and usable afterwards.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from .reduce_ops import CODES as REDUCE_CODES

if TYPE_CHECKING:
    from ..transport.base import StepChannel

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather",
       "scatter", "all_to_all", "barrier")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
          torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2)
_OP_CODE = {name: i + 1 for i, name in enumerate(OPS)}
DTYPE_CODES = {dt: i + 1 for i, dt in enumerate(DTYPES)}
_REDUCE_NAME = {code: name for name, code in REDUCE_CODES.items()}
NWORDS = 7  # Call.words: the sequence number and the call's six fields
HEAD = 3  # words a first step posts in front: seq, Call.code, the step it starts at
LONG = -1  # the code of a call whose fields do not fit one word (they follow the head)
# Call.code, from the lowest bit: op, dtype, reduce op, root + 1, element count
_OP_BITS, _DTYPE_BITS, _REDUCE_BITS, _ROOT_BITS, _COUNT_BITS = 4, 6, 4, 16, 33
_DTYPE_AT = _OP_BITS
_REDUCE_AT = _DTYPE_AT + _DTYPE_BITS
_ROOT_AT = _REDUCE_AT + _REDUCE_BITS
_COUNT_AT = _ROOT_AT + _ROOT_BITS
assert _COUNT_AT + _COUNT_BITS == 63  # (a code is never negative, so never LONG)


class CollectiveMismatch(RuntimeError):
    """Ranks called different collectives (or the same one with different arguments)."""

    def __init__(self, message: str, mine: Call, theirs: dict[int, Call]):
        super().__init__(message)
        self.mine = mine
        self.theirs = theirs  # {rank: Call}


def digest(values: Iterable[int]) -> int:
    """A stable 31-bit digest of a sequence of ints (e.g. split sizes)."""
    return zlib.crc32(",".join(map(str, values)).encode())


def dtype_code(dtype: torch.dtype | None) -> int:
    if dtype is None:
        return 0
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(f"neuron does not support tensors of dtype {dtype}") from None


@dataclass(frozen=True)
class Call:
    """One collective call as this rank sees it."""

    op: str
    dtype: torch.dtype | None = None
    count: int = 0
    root: int = -1
    reduce: str | None = None
    extra: int = 0
    tail: tuple[int, ...] = field(init=False, repr=False, compare=False)  # words(seq)[1:], once
    code: int = field(init=False, repr=False, compare=False)  # the fields in one word, or LONG
    rest: tuple[int, ...] = field(init=False, repr=False, compare=False)  # posted after the head

    def __post_init__(self) -> None:
        tail = (  # (op 0: an unknown op read from a peer's words)
            _OP_CODE.get(self.op, 0), dtype_code(self.dtype), self.count, self.root,
            REDUCE_CODES[self.reduce] if self.reduce else 0, self.extra)
        code = encode(tail)
        object.__setattr__(self, "tail", tail)
        object.__setattr__(self, "code", code)
        object.__setattr__(self, "rest", tail if code == LONG else ())

    def words(self, seq: int) -> tuple[int, ...]:
        return (seq,) + self.tail

    @classmethod
    def from_words(cls, words: Sequence[int]) -> tuple[int, Call]:
        seq, op, dt, count, root, red, extra = words[:NWORDS]
        name = OPS[op - 1] if 0 < op <= len(OPS) else f"<unknown op {op}>"
        dtype = DTYPES[dt - 1] if 0 < dt <= len(DTYPES) else None
        return seq, cls(name, dtype, count, root, _REDUCE_NAME.get(red), extra)

    def describe(self) -> str:
        parts = []
        if self.dtype is not None:
            parts.append(str(self.dtype).replace("torch.", ""))
        if self.op not in ("barrier", "all_to_all"):  # (all_to_all: sizes may differ by rank)
            parts.append(f"{self.count} elements")
        if self.root >= 0:
            parts.append(f"root={self.root}")
        if self.reduce:
            parts.append(self.reduce)
        if self.extra:
            parts.append(f"sizes#{self.extra:08x}")
        return f"{self.op}({', '.join(parts)})"


def encode(tail: tuple[int, ...]) -> int:
    """``Call.tail``'s six fields in one non-negative word, or ``LONG`` if they do not fit."""
    op, dt, count, root, red, extra = tail
    if (extra or not (0 <= op < 1 << _OP_BITS and 0 <= dt < 1 << _DTYPE_BITS
                      and 0 <= red < 1 << _REDUCE_BITS and -1 <= root < (1 << _ROOT_BITS) - 1
                      and 0 <= count < 1 << _COUNT_BITS)):
        return LONG
    return op | dt << _DTYPE_AT | red << _REDUCE_AT | (root + 1) << _ROOT_AT | count << _COUNT_AT


def decode(code: int) -> tuple[int, ...]:
    """The six fields ``encode`` packed into ``code`` (not ``LONG``)."""
    return (code & (1 << _OP_BITS) - 1, code >> _DTYPE_AT & (1 << _DTYPE_BITS) - 1,
            code >> _COUNT_AT, (code >> _ROOT_AT & (1 << _ROOT_BITS) - 1) - 1,
            code >> _REDUCE_AT & (1 << _REDUCE_BITS) - 1, 0)


def posted(channel: StepChannel, rank: int, seq: int) -> tuple[tuple[int, ...], int]:
    """``(words, step)``: ``Call.words`` of what ``rank`` posted with the first step of
    collective ``seq`` (or, for a rank that has not posted it, of the last call of that
    parity; all zeros if none), and the channel step that call started at."""
    their_seq, code, step = channel.peer_descriptor(rank, seq, HEAD)
    if code == LONG:
        tail = channel.peer_descriptor(rank, seq, HEAD + NWORDS - 1)[HEAD:]
    elif code > 0:
        tail = decode(code)
    else:  # (0: a rank that never posted; other negative codes are no call of ours)
        tail = (0, 0, 0, 0, 0, 0)
    return (their_seq,) + tuple(tail), step


def check_all_match(channel: StepChannel, call: Call, seq: int, epoch: int) -> None:
    """Compare every peer's descriptor of this step with ours; raise CollectiveMismatch.

    ``epoch`` is the channel step this call started at: equal calls must also start at the
    same step, or an earlier collective took a different number of steps on two ranks (a
    backend bug, reported as such instead of silently reading the wrong step's data).
    """
    mine = call.words(seq)
    bad, epochs = {}, {}
    for k in range(channel.size):
        if k == channel.rank:
            continue
        theirs, their_epoch = posted(channel, k, seq)
        if theirs != mine:
            bad[k] = Call.from_words(theirs)
        elif their_epoch != epoch:
            epochs[k] = their_epoch
    if not bad and epochs:
        detail = "; ".join(f"rank {k} at step {s}" for k, s in sorted(epochs.items()))
        raise CollectiveMismatch(
            f"internal error: #{seq} {call.describe()} started at channel step {epoch} on rank "
            f"{channel.rank} but {detail}: an earlier collective took a different number of "
            "steps on these ranks (please report this with the flight-recorder dumps)", call, {})
    if not bad:
        return
    lines = [f"rank {channel.rank} called #{seq} {call.describe()}"]
    for k, (their_seq, their_call) in sorted(bad.items()):
        lines.append(f"rank {k} called #{their_seq} {their_call.describe()}")
    raise CollectiveMismatch("collective mismatch: " + "; ".join(lines), call,
                             {k: c for k, (_, c) in bad.items()})
