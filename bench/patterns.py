"""What every rank puts in its buffers, and what ``--check`` expects to find afterwards.

Backend neutral: a pattern is a list of ``(start, stop, value)`` segments over a flat buffer,
so torch ranks and mpi4py ranks fill and verify exactly the same numbers. Values are small
integers, exact in every supported dtype, so results are compared for equality:

* all_reduce: buffer = rank+1 everywhere; expect n(n+1)/2.
* all_gather: input = rank+1; output chunk r must hold r+1.
* reduce_scatter: input chunk j = (rank+1)(j+1); output on rank r = (r+1) n(n+1)/2.
* broadcast (root 0): buffer = rank+1; expect 1.
* all_to_all: input chunk j = rank*n + j + 1; output chunk j must hold j*n + rank + 1.
* send_recv: rank 0 sends 1s and gets 2s back; rank 1 receives 1s and sends 2s.

In-place ops (all_reduce, broadcast) are refilled before every iteration (untimed), so the
values never grow; out-of-place outputs are poisoned with -1 before each backend's turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Segments = list  # [(start, stop, value)]


@dataclass
class Pattern:
    in_count: int
    in_fill: Segments
    out_count: int              # 0: the op works in place on the input buffer
    expect: Segments            # over the output (or the in-place buffer)
    refill: bool = False        # in place: refill the input before every iteration
    notes: list = field(default_factory=list)


def _chunks(count: int, world: int, value_of) -> Segments:
    per = count // world
    return [(j * per, (j + 1) * per, value_of(j)) for j in range(world)]


def pattern(op: str, count: int, rank: int, world: int) -> Pattern:
    """Buffers of ``rank`` for ``op`` on ``count`` elements (full buffer for chunked ops)."""
    n = world
    tri = n * (n + 1) // 2
    if op == "all_reduce":
        return Pattern(count, [(0, count, rank + 1)], 0, [(0, count, tri)], refill=True)
    if op == "broadcast":
        return Pattern(count, [(0, count, rank + 1)], 0, [(0, count, 1)], refill=True)
    if op == "all_gather":
        per = count // n
        return Pattern(per, [(0, per, rank + 1)], count, _chunks(count, n, lambda j: j + 1))
    if op == "reduce_scatter":
        per = count // n
        return Pattern(count, _chunks(count, n, lambda j: (rank + 1) * (j + 1)), per,
                       [(0, per, (rank + 1) * tri)])
    if op == "all_to_all":
        return Pattern(count, _chunks(count, n, lambda j: rank * n + j + 1), count,
                       _chunks(count, n, lambda j: j * n + rank + 1))
    if op == "send_recv":
        if rank == 0:
            return Pattern(count, [(0, count, 1)], count, [(0, count, 2)])
        if rank == 1:
            return Pattern(count, [(0, count, 2)], count, [(0, count, 1)])
        return Pattern(0, [], 0, [])
    raise ValueError(f"unknown op {op!r}")


def fill(buf_fill, segments: Segments) -> None:
    """Apply ``segments`` with ``buf_fill(start, stop, value)``."""
    for a, b, v in segments:
        buf_fill(a, b, v)


def mismatch(segments: Segments, all_equal, first_bad) -> str | None:
    """None if every segment holds its value, else a short description of the first miss.

    ``all_equal(a, b, v)`` -> bool; ``first_bad(a, b, v)`` -> (index, found value).
    """
    for a, b, v in segments:
        if not all_equal(a, b, v):
            i, found = first_bad(a, b, v)
            return f"element {i}: expected {v}, found {found}"
    return None
