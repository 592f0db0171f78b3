"""Soak: 10,000 mixed collectives keep memory, file descriptors, threads and /dev/shm flat."""

from __future__ import annotations

import os
import random
import threading

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

TOTAL = 10_000


def _usage():
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    shm = len([n for n in os.listdir("/dev/shm") if n.startswith("neuron-")])
    return {"rss_kib": rss, "fds": len(os.listdir("/proc/self/fd")),
            "threads": threading.active_count(), "shm_names": shm}


def soak(rank, world):
    torch.set_num_threads(1)
    groups = [None, dist.new_group(list(range(world))), dist.new_group([0, 1])]
    rng = random.Random(1234)  # same sequence on every rank
    sizes = [2, 64, 4096, 65_536, 1 << 20, 4 << 20]  # elements of float32: 8 B .. 16 MiB
    weights = [40, 30, 15, 10, 4, 1]
    pending, marks = [], {}
    for i in range(TOTAL):
        if i in (1000, TOTAL - 1):
            for w, _ in pending:
                w.wait()
            pending.clear()
            dist.barrier()
            marks[i] = _usage()
        g = groups[rng.randrange(3)]
        n = rng.choices(sizes, weights)[0]
        kind = rng.randrange(4)
        async_op = rng.random() < 0.5
        if g is groups[2] and rank not in (0, 1):
            continue
        gsize = dist.get_world_size(g)
        if kind == 0:
            t = torch.full((n,), 1.0)
            w = dist.all_reduce(t, group=g, async_op=async_op)
            check = (t, float(gsize))
        elif kind == 1:
            out = torch.empty(n * gsize)
            w = dist.all_gather_into_tensor(out, torch.full((n,), 1.0), group=g, async_op=async_op)
            check = (out, 1.0)
        elif kind == 2:
            out = torch.empty(n)
            w = dist.reduce_scatter_tensor(out, torch.ones(n * gsize), group=g, async_op=async_op)
            check = (out, float(gsize))
        else:
            t = torch.full((n,), 3.0)
            w = dist.broadcast(t, src=0, group=g, async_op=async_op)
            check = (t, 3.0)
        pending.append((w, check))
        if len(pending) > 8 or not async_op:
            for w, (t, want) in pending:
                if w is not None:
                    w.wait()
                if t[0].item() != want or t[-1].item() != want:
                    raise AssertionError(f"op {i}: got {t[0].item()} want {want}")
            pending.clear()
    for w, _ in pending:
        w.wait()
    return marks


@pytest.mark.slow
def test_soak_ten_thousand_mixed_collectives_stays_flat():
    res = run_ranks(soak, 3, timeout=900)
    for rank, marks in res.items():
        early, late = marks[1000], marks[TOTAL - 1]
        assert late["fds"] <= early["fds"], (rank, marks)
        assert late["threads"] <= early["threads"], (rank, marks)
        assert late["shm_names"] == 0, (rank, marks)
        # RSS may still settle (allocator caches); it must not grow with the op count
        assert late["rss_kib"] < early["rss_kib"] * 1.25 + 64 * 1024, (rank, marks)
