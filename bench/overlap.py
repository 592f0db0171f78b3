"""``--overlap``: does an asynchronous all_reduce run while the caller computes?

Runs inside the torch ranks, for each torch backend, on one float32 all_reduce size
(``--overlap-bytes``) and a loop of square float32 matmuls (``--overlap-matmul``) whose
length is calibrated on rank 0 so that the loop takes about as long as the all_reduce alone.
Every measurement is a median over ``--iters`` iterations, each after a barrier; the
overlapped and serial runs of a variant take turns, sample by sample.

* ``balanced``: every rank measures ``compute`` (the matmul loop alone), ``comm`` (the
  all_reduce alone), ``serial`` (a synchronous all_reduce, then the loop) and ``overlapped``
  (``all_reduce(async_op=True)``, the loop, ``wait()``); per iteration the slowest rank
  counts. With as many ranks as cores (2 ranks on 2 cores) there is no idle core for the
  backend's progress thread, so little overlap is possible: the ratio mostly tells what
  the asynchronous path costs.
* ``late``: the last rank is a straggler: after the barrier it sleeps as long as the matmul
  loop takes, then joins the all_reduce (and computes nothing). The other ranks measure
  ``serial`` and ``overlapped`` as above; ``comm`` is the time the synchronous all_reduce
  blocked them (the wait for the straggler plus the transfer). The sleeping rank leaves a
  core idle, so this shows whether waiting for a late peer is hidden behind useful compute
  when the collective is issued asynchronously (ideal: overlapped ~ max(compute, comm)).

``overlap_ratio = (serial - overlapped) / min(compute, comm)``: 1 = the shorter of the two
is completely hidden, 0 = no overlap, negative = the asynchronous path made it slower.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .sweep import time_iterations


def _median_over(ranks_samples: list[list[float]], ranks: list[int]) -> float:
    per_iter = [max(vals) for vals in zip(*(ranks_samples[r] for r in ranks))]
    return statistics.median(per_iter)


def measure(rank: int, world: int, backend: str, group, exchange, nbytes: int,
            matmul: int, iters: int, warmup: int) -> list[dict]:
    """Both variants for one backend; rows are complete on rank 0 (others get them too)."""
    clock = time.perf_counter
    x = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    a = torch.randn(matmul, matmul) / matmul
    c = torch.empty_like(a)
    barrier = lambda: dist.barrier(group=group)  # noqa: E731
    allreduce = lambda: dist.all_reduce(x, group=group)  # noqa: E731

    # calibrate: the all_reduce alone, one matmul alone -> matmuls per loop (rank 0 decides)
    time_iterations(allreduce, barrier, max(1, warmup))
    comm_alone = time_iterations(allreduce, barrier, iters)
    for _ in range(3):
        torch.mm(a, a, out=c)
    one_mm = statistics.median(time_iterations(lambda: torch.mm(a, a, out=c), lambda: None, 9))
    k = exchange.all(max(1, round(statistics.median(comm_alone) / one_mm)))[0]

    def compute():
        for _ in range(k):
            torch.mm(a, a, out=c)

    def overlapped():
        w = dist.all_reduce(x, group=group, async_op=True)
        compute()
        w.wait()

    blocked = []

    def serial():
        t0 = clock()
        allreduce()
        blocked.append(clock() - t0)
        compute()

    time_iterations(compute, barrier, 1)
    compute_alone = time_iterations(compute, barrier, iters)
    shared = exchange.all([comm_alone, compute_alone])
    everyone = list(range(world))
    comm_med = _median_over([s[0] for s in shared], everyone)
    compute_med = _median_over([s[1] for s in shared], everyone)

    rows = []
    base = {"backend": backend, "world": world, "bytes": x.numel() * 4, "matmul": matmul,
            "matmuls": k}
    # balanced
    time_iterations(overlapped, barrier, max(1, warmup))
    t_over, t_serial = _alternating(overlapped, serial, barrier, iters)
    shared = exchange.all([t_over, t_serial])
    rows.append(_row(base, "balanced", compute_med, comm_med,
                     _median_over([s[1] for s in shared], everyone),
                     _median_over([s[0] for s in shared], everyone)))

    # late: the last rank sleeps as long as the compute loop takes, then joins
    late = world - 1
    delay = exchange.all(compute_med)[0]
    early = list(range(world - 1)) or [0]

    def straggler():
        time.sleep(delay)
        allreduce()

    if world > 1:
        if rank == late:
            t_over, t_serial = _alternating(straggler, straggler, barrier, iters)
            blocked = [0.0] * iters
        else:
            blocked.clear()
            t_over, t_serial = _alternating(overlapped, serial, barrier, iters)
        shared = exchange.all([t_over, t_serial, blocked])
        rows.append(_row(base, "late", compute_med,
                         _median_over([s[2] for s in shared], early),
                         _median_over([s[1] for s in shared], early),
                         _median_over([s[0] for s in shared], early),
                         note=f"rank {late} sleeps {delay * 1e3:.1f} ms before its all_reduce"))
    return rows


def _alternating(first, second, barrier, iters: int) -> tuple[list, list]:
    """``iters`` timed samples of each of two runs, taking turns (first, second, then
    second, first, ...), each after a barrier: a machine that slows down or speeds up
    during the measurement moves both alike."""
    a, b = [], []
    for i in range(iters):
        for run, out in ((first, a), (second, b)) if i % 2 == 0 else ((second, b), (first, a)):
            out.extend(time_iterations(run, barrier, 1))
    return a, b


def _row(base, variant, compute, comm, serial, overlapped, note=""):
    shorter = min(compute, comm)
    ratio = (serial - overlapped) / shorter if shorter > 0 else float("nan")
    return dict(base, variant=variant, compute_us=compute * 1e6, comm_us=comm * 1e6,
                serial_us=serial * 1e6, overlapped_us=overlapped * 1e6, overlap_ratio=ratio,
                note=note)
