"""The sweep itself, independent of any backend: sizes, the op catalogue, timing, bandwidth.

Sizes follow nccl-tests: start at ``-b`` bytes and multiply by ``-f`` while the size stays
at most ``-e``. A size is the *total message bytes per rank* as nccl-tests defines it for
each op (see ``OPS``): the buffer for all_reduce / broadcast / send_recv, the full gathered
(all_gather) or scattered (reduce_scatter) buffer, and the whole send buffer for all_to_all.
Each size is rounded down to whole elements (and to a multiple of the world size where the
buffer is split into one chunk per rank; never below one element per rank), so a row's
``bytes`` is what really moved and may differ from the requested size.

Timing (``time_iterations``): for every sample, the caller's ``prepare`` refills in-place
buffers (untimed), then a barrier of the backend under test, then ``batch`` operations back
to back are timed with ``time.perf_counter`` on every rank; the sample is their mean. Small
sizes run up to ``MAX_BATCH`` operations per sample (``ops_per_sample``), as nccl-tests
times a loop of operations: a single small operation right after a barrier also times how
unevenly the ranks left the barrier (a late wake-up of one rank added ~350 µs to a few
sizes of every sweep, in either backend). In-place operations repeated in a batch work on
their own results; values are checked on a fresh, separate iteration (see the runners).
``combine`` takes, per sample, the *maximum over ranks* of the per-rank times (the slowest
rank defines when the collective is done), and reports the median, min and mean over
samples. send_recv is a ping-pong between ranks 0 and 1 (other ranks idle); its time is
half the round trip, i.e. one direction.

Rounds (``--rounds R``): the whole sweep of a world size runs R times, the torch backends
and MPI taking turns at going first, and ``combine_rounds`` makes one row per (op, world,
bytes, backend) from the R rows: the median of the rounds' medians (``rounds_us`` keeps
them all, ``spread`` is their max over min), the fastest sample of any round, the mean of
the means. MPI runs in processes of its own, minutes apart from the torch backends in a
single round; on a shared 2-core machine one backend's median moved 2x between two such
runs, so a single round can put either side ahead at a size. Alternating rounds expose
both to the same drift.

Bandwidth as nccl-tests: ``algbw = bytes / time`` and ``busbw = algbw * factor(n)`` with
all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, all_to_all (n-1)/n, broadcast
1, send_recv 1. GB/s are 1e9 bytes per second.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from typing import Callable

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}

DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4,
               "int64": 8, "int8": 1, "uint8": 1}


def parse_size(text: str) -> int:
    """``"256M"`` -> 268435456 (K, M, G are powers of 1024, as in nccl-tests)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 8, 64K, 16M, 1G)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def human_size(n: int) -> str:
    """1024 -> '1 KiB', 1536 -> '1.5 KiB', 8 -> '8 B'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{n} B"


def size_range(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """nccl-tests' ``-b -e -f``: min, min*f, min*f^2, ... up to and including max."""
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"need 0 < -b <= -e (got {min_bytes}, {max_bytes})")
    if factor <= 1:
        raise ValueError(f"-f must be > 1 (got {factor})")
    sizes, s = [], float(min_bytes)
    while s <= max_bytes:
        sizes.append(int(s))
        s *= factor
    return sizes


@dataclass(frozen=True)
class OpSpec:
    """How an op's size maps to buffers and how its bus bandwidth is derived."""
    name: str
    chunked: bool                   # the size is split into one chunk per rank
    min_world: int                  # smallest world size the op makes sense for
    bus_factor: Callable[[int], float]
    meaning: str                    # what "bytes" is, for the docs and the JSON meta


OPS = {
    "all_reduce": OpSpec("all_reduce", False, 1, lambda n: 2 * (n - 1) / n,
                         "in-place buffer per rank"),
    "all_gather": OpSpec("all_gather", True, 1, lambda n: (n - 1) / n,
                         "full gathered output per rank (input = bytes/n)"),
    "reduce_scatter": OpSpec("reduce_scatter", True, 1, lambda n: (n - 1) / n,
                             "full input per rank (output = bytes/n)"),
    "broadcast": OpSpec("broadcast", False, 1, lambda n: 1.0, "buffer, root 0"),
    "all_to_all": OpSpec("all_to_all", True, 1, lambda n: (n - 1) / n,
                         "whole send buffer per rank (bytes/n to each peer)"),
    "send_recv": OpSpec("send_recv", False, 2, lambda n: 1.0,
                        "one message, rank 0 <-> 1 ping-pong; time = round trip / 2"),
}


def element_count(op: str, nbytes: int, elem: int, world: int) -> int:
    """Elements per buffer (the full buffer for chunked ops) for a requested size."""
    count = max(1, nbytes // elem)
    if OPS[op].chunked:
        count = max(world, count - count % world)
    return count


def plan(op: str, sizes: list[int], elem: int, world: int) -> list[int]:
    """Distinct element counts for ``sizes`` (rounding can merge neighbouring sizes)."""
    out = []
    for s in sizes:
        c = element_count(op, s, elem, world)
        if c not in out:
            out.append(c)
    return out


MAX_BATCH = 16  # operations per timed sample for the smallest sizes
BATCH_BYTES = 4 << 20  # from here up, one operation per sample


def ops_per_sample(nbytes: int, max_batch: int = MAX_BATCH) -> int:
    """How many operations one timed sample of an ``nbytes`` buffer runs back to back: a
    function of the size alone, so every rank (and every backend) runs the same count."""
    return max(1, min(max_batch, BATCH_BYTES // max(1, nbytes)))


def time_iterations(run: Callable[[], None], barrier: Callable[[], None], iters: int,
                    prepare: Callable[[], None] | None = None, batch: int = 1) -> list[float]:
    """This rank's mean seconds per operation for each of ``iters`` samples: a barrier,
    then ``batch`` runs back to back."""
    samples = []
    clock = time.perf_counter
    for _ in range(iters):
        if prepare is not None:
            prepare()
        barrier()
        t0 = clock()
        for _ in range(batch):
            run()
        samples.append((clock() - t0) / batch)
    return samples


def combine(per_rank: list[list[float]], op: str) -> dict:
    """Per-iteration max over ranks -> median / min / mean seconds."""
    per_iter = [max(vals) for vals in zip(*per_rank)]
    if op == "send_recv":
        per_iter = [t / 2 for t in per_iter]
    return {"median_s": statistics.median(per_iter), "min_s": min(per_iter),
            "mean_s": statistics.fmean(per_iter)}


def bandwidths(op: str, nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9)."""
    if seconds <= 0:
        return float("nan"), float("nan")
    alg = nbytes / seconds / 1e9
    return alg, alg * OPS[op].bus_factor(world)


def make_row(op: str, world: int, backend: str, count: int, dtype: str, iters: int,
             times: dict | None = None, check: str = "-", note: str = "",
             batch: int = 1) -> dict:
    """One result row (``times`` None = the backend does not support this op: n/a)."""
    nbytes = count * DTYPE_BYTES[dtype]
    row = {"op": op, "world": world, "bytes": nbytes, "count": count, "dtype": dtype,
           "backend": backend, "iters": iters, "batch": batch,
           "status": "ok" if times else "n/a",
           "time_us": None, "min_us": None, "mean_us": None, "algbw_gbs": None,
           "busbw_gbs": None, "check": check, "note": note}
    if times:
        alg, bus = bandwidths(op, nbytes, times["median_s"], world)
        row.update(time_us=round(times["median_s"] * 1e6, 3), min_us=round(times["min_s"] * 1e6, 3),
                   mean_us=round(times["mean_s"] * 1e6, 3), algbw_gbs=float(f"{alg:.6g}"),
                   busbw_gbs=float(f"{bus:.6g}"))
    return row


def progress_line(rows: list[dict]) -> str:
    """``[all_reduce 16 MiB n=2] neuron 3.10 GB/s 41.2 us OK | gloo 0.90 GB/s ...``."""
    head = rows[0]
    parts = []
    for r in rows:
        if r["status"] != "ok":
            parts.append(f"{r['backend']} n/a")
            continue
        chk = f" {r['check']}" if r["check"] != "-" else ""
        parts.append(f"{r['backend']} {r['busbw_gbs']:.2f} GB/s {r['time_us']:.1f} us{chk}")
    return f"[{head['op']} {human_size(head['bytes'])} n={head['world']}] " + " | ".join(parts)


def combine_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per (op, world, bytes, backend) from the rows of several rounds of the same
    sweep (see the module docstring). A key that is not ``ok`` in some round keeps the
    first such row (n/a, or an error note); one that a round does not have at all (that
    round's run failed) is combined over the rounds that have it, and its note says how
    many; ``check`` is FAIL if any round failed it."""
    keyed: dict = {}
    for rows in rounds:
        for r in rows:
            keyed.setdefault((r["op"], r["world"], r["bytes"], r["backend"]), []).append(r)
    out = []
    for (op, world, nbytes, _), rows in keyed.items():
        bad = [r for r in rows if r["status"] != "ok"]
        if bad:
            out.append(dict(bad[0], rounds_us=None, spread=None))
            continue
        medians = [r["time_us"] for r in rows]
        median_s = statistics.median(medians) / 1e6
        alg, bus = bandwidths(op, nbytes, median_s, world)
        checks = {r["check"] for r in rows}
        row = dict(rows[0])
        row.update(time_us=round(median_s * 1e6, 3), min_us=min(r["min_us"] for r in rows),
                   mean_us=round(statistics.fmean(r["mean_us"] for r in rows), 3),
                   algbw_gbs=float(f"{alg:.6g}"), busbw_gbs=float(f"{bus:.6g}"),
                   check="FAIL" if "FAIL" in checks else rows[0]["check"],
                   note="; ".join(dict.fromkeys(
                       [r["note"] for r in rows if r["note"]]
                       + ([f"in {len(rows)} of {len(rounds)} rounds"]
                          if len(rows) != len(rounds) else []))),
                   rounds_us=medians, spread=round(max(medians) / min(medians), 3))
        out.append(row)
    return out
