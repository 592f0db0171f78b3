"""Soak: 10,000 mixed collectives and send/recvs keep memory, file descriptors, threads and
/dev/shm flat, and every result right. Send/recv sizes fall on both sides of
``collectives.p2p.READ_MIN_BYTES`` (streamed through the ring, or read from the sender's
memory) and of the mailbox (4 MiB)."""

from __future__ import annotations

import os
import random
import threading

import pytest
import torch
import torch.distributed as dist

from helpers.cases import pattern as _pattern, send_recv, settle as _settle
from helpers.harness import run_ranks

TOTAL = 10_000


def _usage():
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    shm = len([n for n in os.listdir("/dev/shm") if n.startswith("neuron-")])
    return {"rss_kib": rss, "fds": len(os.listdir("/proc/self/fd")),
            "threads": threading.active_count(), "shm_names": shm}


def soak(rank, world):
    """Every result is compared whole with its exact value: inputs depend on the rank and
    on the position, so a block from the wrong rank or at the wrong offset shows."""
    torch.set_num_threads(1)
    groups = [None, dist.new_group(list(range(world))), dist.new_group([0, 1])]
    rng = random.Random(1234)  # same sequence on every rank
    sizes = [2, 64, 4096, 65_536, 1 << 20, 4 << 20]  # elements of float32: 8 B .. 16 MiB
    weights = [40, 30, 15, 10, 4, 1]
    pending, marks = [], {}
    checked = expected = 0

    def settle():
        nonlocal checked
        checked += _settle(pending)

    for i in range(TOTAL):
        if i in (1000, TOTAL - 1):
            settle()
            dist.barrier()
            marks[i] = _usage()
        g = groups[rng.randrange(3)]
        n = rng.choices(sizes, weights)[0]
        kind = rng.randrange(5)
        async_op = rng.random() < 0.5
        src, dst = rng.sample(range(world), 2)
        if kind == 4:  # send/recv between two ranks of the world, a tag per operation
            if send_recv(rank, src, dst, n, i, pending):
                expected += 1
                if len(pending) > 8 or not async_op:
                    settle()
            continue
        if g is groups[2] and rank not in (0, 1):
            continue
        expected += 1
        gsize, me = dist.get_world_size(g), dist.get_rank(g)
        ranks_sum = float(gsize * (gsize - 1) // 2)
        base = _pattern(n)
        if kind == 0:
            t = base + me
            w = dist.all_reduce(t, group=g, async_op=async_op)
            check = (t, lambda base=base, gsize=gsize, s=ranks_sum: base * gsize + s)
        elif kind == 1:
            out = torch.empty(n * gsize)
            w = dist.all_gather_into_tensor(out, base + 1000 * me, group=g, async_op=async_op)
            check = (out, lambda base=base, gsize=gsize:
                     torch.cat([base + 1000 * k for k in range(gsize)]))
        elif kind == 2:
            out = torch.empty(n)
            w = dist.reduce_scatter_tensor(out, _pattern(n * gsize) + me, group=g,
                                           async_op=async_op)
            check = (out, lambda n=n, gsize=gsize, me=me, s=ranks_sum:
                     _pattern(n * gsize)[me * n:(me + 1) * n] * gsize + s)
        else:
            t = base + 7 if me == 0 else torch.zeros(n)
            w = dist.broadcast(t, src=0, group=g, async_op=async_op)
            check = (t, lambda base=base: base + 7)
        pending.append((w, f"op {i}", *check))
        if len(pending) > 8 or not async_op:
            settle()
    settle()
    marks["checked"], marks["expected"] = checked, expected
    return marks


# The 3 ranks took 40 s on the 2-core machine this was written on (shared with other test
# runs). The harness kills hung ranks after 240 s, printing their stacks, well inside
# pytest's 300 s limit (pyproject.toml), so a hang is reported by the harness, naming them.
@pytest.mark.slow
def test_soak_ten_thousand_mixed_collectives_stays_flat():
    res = run_ranks(soak, 3, timeout=240)
    for rank, marks in res.items():
        assert marks["checked"] == marks["expected"] > TOTAL * 0.5, (rank, marks)
        early, late = marks[1000], marks[TOTAL - 1]
        assert late["fds"] <= early["fds"], (rank, marks)
        assert late["threads"] <= early["threads"], (rank, marks)
        assert late["shm_names"] == 0, (rank, marks)
        # RSS may still settle (allocator caches); it must not grow with the op count
        assert late["rss_kib"] < early["rss_kib"] * 1.25 + 64 * 1024, (rank, marks)
