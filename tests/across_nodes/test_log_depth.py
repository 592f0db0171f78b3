"""The log-depth algorithms between nodes in real processes, on loopback virtual nodes.

The full matrix of each algorithm runs on the simulator (tests/units/test_net_algorithms.py);
here the same code runs over the rdm transport between processes (``NEURON_DIST_NODE_NAME``
per rank makes the nodes): the collective matrices of test_collectives (every dtype and
op, exact references) with NEURON_DIST_ALGO forcing each log-depth algorithm, on 5 nodes of
one rank (a fold: 5 is not a power of two), 3 nodes of 2 ranks (columns of 3) and uneven
nodes (leaders); results bit-identical on every rank for random bfloat16 data; and 8 nodes
with the default choice, checking that a rank opens rails only to the peers the
algorithms name and that its sockets stay bounded.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from helpers.harness import run_ranks
from neuron_dist.collectives.selection import Selection
from one_node.test_collectives import (SMALL_SLOTS, all_reduce_matrix, gather_family_matrix,
                                       reduce_family_matrix)

FORCED = {
    "recursive_doubling": "all_reduce=recursive_doubling,all_gather=recursive_doubling,"
                          "reduce_scatter=halving",
    "rabenseifner": "all_reduce=rabenseifner,all_gather=bruck,reduce_scatter=halving",
    "tree": "all_reduce=tree,barrier=tree",
}
LAYOUTS = {
    "5x1": ["a", "b", "c", "d", "e"],
    "3x2": ["a", "b", "c", "a", "b", "c"],
    "uneven": ["a", "a", "b", "c", "d", "d"],  # leaders 0, 2, 3, 4 exchange
}


def _env(names, **extra):
    def env(rank):
        return {**SMALL_SLOTS, "NEURON_DIST_NODE_NAME": names[rank],
                "NEURON_DIST_NET_SEGMENT_BYTES": "64K", "NEURON_DIST_RAILS": "1", **extra}
    return env


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout,algo,matrix", [
    ("5x1", "recursive_doubling", all_reduce_matrix),
    ("5x1", "rabenseifner", all_reduce_matrix),
    ("5x1", "recursive_doubling", reduce_family_matrix),
    ("5x1", "rabenseifner", gather_family_matrix),
    ("5x1", "recursive_doubling", gather_family_matrix),
    ("3x2", "rabenseifner", all_reduce_matrix),
    ("3x2", "recursive_doubling", reduce_family_matrix),
    ("uneven", "rabenseifner", all_reduce_matrix),
    ("5x1", "tree", all_reduce_matrix),
    ("3x2", "tree", all_reduce_matrix),
    ("uneven", "tree", all_reduce_matrix),
], ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_matrix_with_log_depth_algorithms(layout, algo, matrix):
    names = LAYOUTS[layout]
    results = run_ranks(matrix, len(names), env=_env(names, NEURON_DIST_ALGO=FORCED[algo]),
                        timeout=360, pg_timeout=120)
    fails = {r: f for r, f in results.items() if f}
    assert not fails, fails


def _bits_everywhere(rank, world):
    """Random bfloat16 and float32 all_reduce (sums that round): every rank's result has the
    same bits, and the flight recorder names the algorithm forced."""
    from neuron_dist.flight_recorder import recorder
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        for n in (7, 5000, 70_001):
            g = torch.Generator().manual_seed(rank * 31 + n)
            t = torch.randn(n, generator=g).to(dtype)
            dist.all_reduce(t)
            mine = t.view(-1).view(torch.uint8)
            every = torch.empty(world * mine.numel(), dtype=torch.uint8)
            dist.all_gather_into_tensor(every, mine)
            rows = every.view(world, -1)
            out[f"{dtype} {n}"] = all(torch.equal(rows[0], rows[k]) for k in range(world))
    out["algos"] = sorted({str(r.algo) for r in recorder._ring if r.op == "all_reduce"})
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("algo", list(FORCED))
def test_every_rank_gets_the_same_bits(algo):
    names = LAYOUTS["5x1"]
    results = run_ranks(_bits_everywhere, len(names),
                        env=_env(names, NEURON_DIST_ALGO=FORCED[algo]), timeout=180)
    for rank, out in results.items():
        assert all(v for k, v in out.items() if k != "algos"), (rank, out)
        assert all(algo in a for a in out["algos"]), (rank, out["algos"])


def _is_socket(fd: str) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    except OSError:  # (closed since listed: the listing's own descriptor, say)
        return False


def _eight_nodes(rank, world):
    from neuron_dist.flight_recorder import recorder
    pg = dist.group.WORLD._get_backend(torch.device("cpu"))
    ok = []
    for n in (2, 16 << 10, 256 << 10):  # 8 B, 64 KiB, 1 MiB of float32
        t = torch.full((n,), float(rank + 1))
        dist.all_reduce(t)
        ok.append(bool((t == world * (world + 1) / 2).all()))
    block = 1 << 10  # (4 KiB a rank: log2 N messages beat N - 1 in the cost model)
    out = torch.empty(world * block)
    dist.all_gather_into_tensor(out, torch.full((block,), float(rank)))
    ok.append(torch.equal(out, torch.arange(world, dtype=torch.float32).repeat_interleave(block)))
    mine = torch.empty(block)
    dist.reduce_scatter_tensor(mine, torch.arange(world * block, dtype=torch.float32))
    ok.append(torch.equal(mine, world * torch.arange(rank * block, (rank + 1) * block,
                                                     dtype=torch.float32)))
    b = torch.full((16 << 10,), float(rank))
    dist.broadcast(b, 3)
    ok.append(bool((b == 3).all()))
    dist.barrier()
    dist.barrier()  # (every rank has finished its collectives before any counts)
    deadline = time.monotonic() + 30  # (the acceptor adds rails as their handshakes end)
    while sorted(pg._net._up) != sorted(pg._net._rails) and time.monotonic() < deadline:
        time.sleep(0.01)
    sockets = sum(1 for fd in os.listdir("/proc/self/fd") if _is_socket(fd))
    algos = {}
    for r in recorder._ring:
        if r.state == "completed":
            algos[r.op] = algos.get(r.op, "") + f" {r.algo}"
    return {"ok": ok, "peers": sorted(pg._net._rails), "sockets": sockets, "algos": algos,
            "crowd": pg._selection.crowd}


@pytest.mark.timeout(300)
def test_eight_nodes_talk_to_log_n_peers():
    """8 nodes of one rank, default settings: every result right, the log-depth algorithms
    chosen, and rails opened only to the 3 peers rank ^ 2^k (8 is a power of two: every
    algorithm pairs ranks that way); sockets per rank bounded by those peers. With fewer
    cores than the 8 ranks (CI's 2) the small all_reduce and the barrier take the tree,
    which pairs ranks the same way; with a core each, recursive doubling."""
    names = [f"n{k}" for k in range(8)]
    results = run_ranks(_eight_nodes, 8, env=_env(names), timeout=280, pg_timeout=120)
    for rank, out in results.items():
        assert all(out["ok"]), (rank, out)
        partners = {rank ^ d for d in (1, 2, 4)}
        assert set(out["peers"]) == partners, (rank, out["peers"])
        # one rail each way per peer at most, the store, the listener and a few spare
        assert out["sockets"] <= 2 * len(partners) + 8, (rank, out["sockets"])
        assert out["crowd"] == 8 / len(os.sched_getaffinity(0)), out["crowd"]
        choose = Selection(crowd=out["crowd"]).select
        small = "tree" if out["crowd"] >= 2 else "recursive_doubling"
        assert choose("all_reduce/network", 8, 8, numel=2) == small
        assert small in out["algos"]["all_reduce"], out["algos"]  # 8 B
        large = choose("all_reduce/network", 1 << 20, 8, numel=1 << 18)
        assert large in out["algos"]["all_reduce"], out["algos"]  # 1 MiB
        assert "recursive_doubling" in out["algos"]["all_gather_into_tensor"], out["algos"]
        assert "halving" in out["algos"]["reduce_scatter_tensor"], out["algos"]
        assert small in out["algos"]["barrier"], out["algos"]



@pytest.mark.timeout(200)
@pytest.mark.parametrize("algo", list(FORCED))
def test_async_collectives_with_a_late_rank(algo):
    """Every rank alone on its node, one late: async all_reduce, all_gather and
    reduce_scatter (in place) with multi-round algorithms (not deferred: the engine thread
    runs them from the start) return at once on the ranks on time, and every result is
    right."""
    from across_nodes.test_async_net import three_ranks_one_late
    from one_node.test_async import LATE

    world = 5
    res = run_ranks(three_ranks_one_late, world, timeout=180,
                    env=_env(LAYOUTS["5x1"], NEURON_DIST_ALGO=FORCED[algo]))
    total = sum(100.0 * r for r in range(world))
    for rank, out in res.items():
        assert out["all_reduce"] == [world * i + total for i in range(6)], (rank, out)
        assert out["avg"] == [(world + 1) / 2] * 4, (rank, out)
        assert out["ag"] == [float(x) for r in range(world) for x in (r, -r)], (rank, out)
        assert out["rs"] == [world * (world + 1) / 2 * (3 * rank + i) for i in range(3)], \
            (rank, out)
    for rank in range(world - 1):
        assert res[rank]["returned"] < LATE / 3, res[rank]  # it did not wait for the late one
