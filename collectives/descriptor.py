"""Call descriptors: what each rank thinks the collective is, checked on its first step.

Every collective posts a few int64 words with its first step — sequence number, op, dtype,
element count, root, reduce op and a digest of any per-rank sizes. After that step every
rank compares all peers' words with its own. All ranks read the same words at the same
step, so they all reach the same verdict and raise together; because each rank has done
exactly one step of the failed call, the group stays aligned and usable afterwards.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from .reduce_ops import CODES as REDUCE_CODES

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather",
       "scatter", "all_to_all", "barrier")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
          torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2)
_OP_CODE = {name: i + 1 for i, name in enumerate(OPS)}
DTYPE_CODES = {dt: i + 1 for i, dt in enumerate(DTYPES)}
_REDUCE_NAME = {code: name for name, code in REDUCE_CODES.items()}
NWORDS = 7


class CollectiveMismatch(RuntimeError):
    """Ranks called different collectives (or the same one with different arguments)."""

    def __init__(self, message, mine, theirs):
        super().__init__(message)
        self.mine = mine
        self.theirs = theirs  # {rank: Call}


def digest(values) -> int:
    """A stable 31-bit digest of a sequence of ints (e.g. split sizes)."""
    return zlib.crc32(",".join(map(str, values)).encode())


def dtype_code(dtype) -> int:
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
    dtype: object = None
    count: int = 0
    root: int = -1
    reduce: str | None = None
    extra: int = 0
    tail: tuple = field(init=False, repr=False, compare=False)  # words(seq)[1:], computed once

    def __post_init__(self):
        object.__setattr__(self, "tail", (  # (op 0: an unknown op read from a peer's words)
            _OP_CODE.get(self.op, 0), dtype_code(self.dtype), self.count, self.root,
            REDUCE_CODES[self.reduce] if self.reduce else 0, self.extra))

    def words(self, seq: int) -> tuple[int, ...]:
        return (seq,) + self.tail

    @classmethod
    def from_words(cls, words) -> tuple[int, "Call"]:
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


def check_all_match(channel, call: Call, seq: int, epoch: int) -> None:
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
        theirs = channel.peer_descriptor(k, seq, NWORDS + 1)
        if theirs[:NWORDS] != mine:
            bad[k] = Call.from_words(theirs)
        elif theirs[NWORDS] != epoch:
            epochs[k] = theirs[NWORDS]
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
