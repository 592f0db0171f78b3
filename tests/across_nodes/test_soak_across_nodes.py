"""Soak across nodes: thousands of mixed collectives and send/recvs between virtual nodes,
every result checked whole, at the sizes where the inter-node paths change.

The sizes sit on both sides of each threshold of the between-nodes code: the read-ahead of
a rail (64 KiB), a call descriptor riding with its data (``net.PIGGYBACK_BYTES``), eager
sends and delayed acks (``driver.EAGER_BYTES``), segments (``NEURON_DIST_NET_SEGMENT_BYTES``
64 KiB here, so larger messages are cut up and spread over the rails) and the two-node
all-reduce in halves (``selection.HALVES_BYTES``). Operations are synchronous or
asynchronous at random (up to 8 in flight, the same sequence on every rank), in three
groups (the world, a pair across the two nodes and a pair inside one), with send/recv
between random pairs among them (a pair of one node through shared memory, others over
the network), half the receives from any rank (posted on both paths at once:
neuron_dist/p2p_any.py; the tag is the operation's, so exactly one message matches, and
the reported source is checked). Inputs depend on the rank and the position, so a block
from the wrong rank, at the wrong offset or from another call shows.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from helpers.cases import pattern as _pattern, send_recv, settle as _settle
from helpers.harness import run_ranks
from neuron_dist.collectives.net import PIGGYBACK_BYTES
from neuron_dist.collectives.selection import HALVES_BYTES
from neuron_dist.transport.rdm.driver import EAGER_BYTES

NAMES = ["a", "a", "b", "b"]
TOTAL = 4000
_EDGES = [64 << 10, PIGGYBACK_BYTES, EAGER_BYTES, 1 << 20]
# float32 elements per rank: tiny, just below / at / above every edge, and one halves size
HALVES_N = HALVES_BYTES // 4 + 1  # (all_reduce only: the other collectives take 15 instead)
SIZES = [1, 15] + [e // 4 + d for e in _EDGES for d in (-1, 0, 1)] + [HALVES_N]
WEIGHTS = [20, 20] + [6] * (3 * len(_EDGES)) + [2]


def soak(rank, world):
    torch.set_num_threads(1)
    across = dist.new_group([1, 2])  # one rank of each node
    inside = dist.new_group([2, 3])  # the two ranks of node b
    groups = [None, across, inside]
    rng = random.Random(4321)  # the same sequence on every rank
    pending = []
    counts = {"checked": 0, "p2p": 0, "halves": 0, "any": 0}

    def settle():
        counts["checked"] += _settle(pending)

    for i in range(TOTAL):
        n = rng.choices(SIZES, WEIGHTS)[0]
        kind = rng.randrange(6)
        if n == HALVES_N and kind not in (0, 1):
            n = 15
        async_op = rng.random() < 0.5
        g = groups[rng.randrange(3)]
        src, dst = rng.sample(range(world), 2)
        from_any = rng.random() < 0.5
        if kind == 5:  # send/recv between two ranks of the world, a tag per operation
            if send_recv(rank, src, dst, n, i, pending, from_any) and rank == dst:
                counts["p2p"] += 1
                counts["any"] += from_any
        elif g is None or rank in dist.get_process_group_ranks(g):
            gsize, me = dist.get_world_size(g), dist.get_rank(g)
            ranks_sum = float(gsize * (gsize - 1) // 2)
            base = _pattern(n)
            if kind in (0, 1):
                t = base + me
                w = dist.all_reduce(t, group=g, async_op=async_op)
                pending.append((w, f"op {i} (all_reduce)", t, lambda base=base, gsize=gsize,
                                s=ranks_sum: base * gsize + s))
                counts["halves"] += n == HALVES_N and g is across
            elif kind == 2:
                out = torch.empty(n * gsize)
                w = dist.all_gather_into_tensor(out, base + 1000 * me, group=g,
                                                async_op=async_op)
                pending.append((w, f"op {i} (all_gather)", out, lambda base=base, gsize=gsize:
                                torch.cat([base + 1000 * k for k in range(gsize)])))
            elif kind == 3:
                out = torch.empty(n)
                w = dist.reduce_scatter_tensor(out, _pattern(n * gsize) + me, group=g,
                                               async_op=async_op)
                pending.append((w, f"op {i} (reduce_scatter)", out,
                                lambda n=n, gsize=gsize, me=me, s=ranks_sum:
                                _pattern(n * gsize)[me * n:(me + 1) * n] * gsize + s))
            else:
                root = gsize - 1
                t = base + 7 if me == root else torch.zeros(n)
                w = dist.broadcast(t, src=dist.get_global_rank(g, root) if g else root,
                                   group=g, async_op=async_op)
                pending.append((w, f"op {i} (broadcast)", t, lambda base=base: base + 7))
        if len(pending) > 8 or not async_op:
            settle()
    settle()
    dist.barrier()
    return counts


@pytest.mark.timeout(300)
def test_mixed_operations_across_nodes_at_every_threshold_land_exactly():
    res = run_ranks(soak, len(NAMES), timeout=240,
                    env=lambda r: {"NEURON_DIST_NODE_NAME": NAMES[r],
                                   "NEURON_DIST_NET_SEGMENT_BYTES": "64K"})
    for rank, counts in res.items():
        assert counts["checked"] > TOTAL * 0.25, (rank, counts)  # (rank 0 is in the world only)
        assert counts["p2p"] > counts["any"] > 0, (rank, counts)
    # the two-node all-reduce in halves ran (ranks 1 and 2 are the pair across)
    assert res[1]["halves"] > 0 and res[2]["halves"] > 0, res
