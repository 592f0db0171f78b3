"""Single-copy (cross-memory attach) collectives for large messages.

Each case runs with CMA on and off in the same ranks' lifetimes (two groups), and the
results must be bitwise equal to each other (both reduce in rank order) and right. Then
NEURON_DIST_ALGO forces all_to_all's algorithm (slots for large blocks, single copy for
small ones, and single copy where it cannot run), checked by the results and by the
algorithm the flight recorder names.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from helpers.harness import cma_expected, run_ranks
from neuron_dist.collectives.selection import SINGLE_COPY_BYTES

# float32 elements: above the threshold, uneven, and all_reduce's per-rank share (1/world
# of the tensor) above it too up to 4 ranks
N = (SINGLE_COPY_BYTES // 4) * 4 + 13


def _cases(rank, world, group):
    g = torch.Generator().manual_seed(rank)
    out = {}
    base = torch.randn(N, generator=g)
    for name, op, dtype in (("sum", dist.ReduceOp.SUM, torch.float32),
                            ("avg_bf16", dist.ReduceOp.AVG, torch.bfloat16),
                            ("max_i64", dist.ReduceOp.MAX, torch.int64),
                            ("premul", dist._make_nccl_premul_sum(0.25), torch.float32)):
        t = (base * 100).to(dtype)
        dist.all_reduce(t, op=op, group=group)
        out[f"all_reduce_{name}"] = t
    # all_gather: out of place, in place (the input is the output's own block, as in FSDP)
    # and the list form
    full = torch.empty(N * world)
    dist.all_gather_into_tensor(full, base, group=group)
    out["all_gather"] = full
    inplace = torch.zeros(N * world)
    inplace[rank * N:(rank + 1) * N] = base
    dist.all_gather_into_tensor(inplace, inplace[rank * N:(rank + 1) * N], group=group)
    out["all_gather_inplace"] = inplace
    parts = [torch.empty(N) for _ in range(world)]
    dist.all_gather(parts, base, group=group)
    out["all_gather_list"] = torch.cat(parts)
    # reduce_scatter: tensor form (sum, premul) and list form (max)
    big = torch.randn(N * world, generator=g)
    for name, op in (("sum", dist.ReduceOp.SUM), ("premul", dist._make_nccl_premul_sum(0.5))):
        mine = torch.empty(N)
        dist.reduce_scatter_tensor(mine, big, op=op, group=group)
        out[f"reduce_scatter_{name}"] = mine
    mine = torch.empty(N)
    dist.reduce_scatter(mine, list(big.chunk(world)), op=dist.ReduceOp.MAX, group=group)
    out["reduce_scatter_list_max"] = mine
    # the output is the input's own block (in place), and an average in bfloat16 (summed
    # in float32, out of place)
    inplace = big.clone()
    dist.reduce_scatter_tensor(inplace[rank * N:(rank + 1) * N], inplace, group=group)
    out["reduce_scatter_inplace"] = inplace
    mine = torch.empty(N, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(mine, (big * 100).to(torch.bfloat16), op=dist.ReduceOp.AVG,
                               group=group)
    out["reduce_scatter_avg_bf16"] = mine
    # all_to_all: even (tensor form), uneven splits, list form
    even = torch.empty(N * world)
    dist.all_to_all_single(even, big, group=group)
    out["all_to_all_even"] = even

    def split(a, b):  # elements rank a sends to rank b
        return N // 2 + (a * 7 + b * 3) * 101
    send = [split(rank, b) for b in range(world)]
    recv = [split(a, rank) for a in range(world)]
    src = torch.randn(sum(send), generator=g)
    dst = torch.full((sum(recv),), float("nan"))
    dist.all_to_all_single(dst, src, recv, send, group=group)
    out["all_to_all_uneven"] = dst
    ins = list(big.chunk(world))
    outs = [torch.empty(N) for _ in range(world)]
    dist.all_to_all(outs, ins, group=group)
    out["all_to_all_list"] = torch.cat(outs)
    return out, base, big


def compare(rank, world):
    on = dist.new_group(list(range(world)))
    os.environ["NEURON_DIST_CMA"] = "0"
    off = dist.new_group(list(range(world)))
    os.environ["NEURON_DIST_CMA"] = "1"
    uses = [dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))]
    cma_on = on._get_backend(torch.device("cpu"))._channel.cma
    cma_off = off._get_backend(torch.device("cpu"))._channel.cma
    got_on, base, big = _cases(rank, world, on)
    got_off, _, _ = _cases(rank, world, off)
    bases = [torch.empty(N) for _ in range(world)]
    dist.all_gather(bases, base, group=off)
    bigs = [torch.empty(N * world) for _ in range(world)]
    dist.all_gather(bigs, big, group=off)
    fails = [k for k in got_on if not torch.equal(got_on[k], got_off[k])]
    # independent expectations for a few (the rest are equal to these paths by the above)
    stacked = torch.stack(bases)
    if not torch.allclose(got_on["all_reduce_sum"], (stacked * 100).sum(0), rtol=1e-5, atol=1e-3):
        fails.append("all_reduce_sum value")
    if not torch.allclose(got_on["all_reduce_premul"], (stacked * 100 * 0.25).sum(0), rtol=1e-5, atol=1e-3):
        fails.append("all_reduce_premul value")
    if not torch.equal(got_on["all_gather"], torch.cat(bases)):
        fails.append("all_gather value")
    if not torch.equal(got_on["all_gather_inplace"], torch.cat(bases)):
        fails.append("all_gather_inplace value")
    block = torch.stack([b[rank * N:(rank + 1) * N] for b in bigs])
    if not torch.allclose(got_on["reduce_scatter_sum"], block.sum(0), rtol=1e-5, atol=1e-5):
        fails.append("reduce_scatter_sum value")
    inplace = bigs[rank].clone()
    inplace[rank * N:(rank + 1) * N] = got_on["reduce_scatter_sum"]
    if not torch.equal(got_on["reduce_scatter_inplace"], inplace):
        fails.append("reduce_scatter_inplace value")
    if not torch.equal(got_on["reduce_scatter_list_max"], block.max(0).values):
        fails.append("reduce_scatter_list_max value")
    if not torch.equal(got_on["all_to_all_even"], torch.cat([b[rank * N:(rank + 1) * N] for b in bigs])):
        fails.append("all_to_all_even value")
    if torch.isnan(got_on["all_to_all_uneven"]).any():
        fails.append("all_to_all_uneven left holes")
    del uses
    return cma_on, cma_off, fails


@pytest.mark.parametrize("world", [2, 3, 4])
def test_single_copy_matches_slot_algorithms(world):
    results = run_ranks(compare, world, timeout=180)
    for rank, (cma_on, cma_off, fails) in results.items():
        assert cma_on == cma_expected(), f"rank {rank}: CMA probe said {cma_on}"
        assert cma_off is False
        assert fails == [], f"rank {rank}: {fails}"


# NEURON_DIST_ALGO, NEURON_DIST_CMA -> the algorithm named for large blocks, for 8-byte ones
CMA = "single_copy" if cma_expected() else "slots"
FORCED = {
    ("auto", "1"): (CMA, "slots"),  # (8 bytes: the express lane's even-split plan)
    ("all_to_all=slots", "1"): ("slots", "slots"),
    ("all_to_all=single_copy", "1"): (CMA, CMA),
    ("all_to_all=single_copy", "0"): ("slots", "slots"),  # cannot run: the table's rows
}


def forced_all_to_all(rank, world):
    from neuron_dist.flight_recorder import recorder

    n = SINGLE_COPY_BYTES // 4 + 13  # float32 per block: above single copy's threshold
    out, before = {}, os.environ.get("NEURON_DIST_CMA")
    for (text, cma), want in FORCED.items():
        os.environ["NEURON_DIST_ALGO"], os.environ["NEURON_DIST_CMA"] = text, cma
        group = dist.new_group(list(range(world)))
        got = []
        for m in (n, 2):  # (2 float32: 8 bytes per block)
            inp = torch.arange(world * m, dtype=torch.float32) + 1e6 * rank
            res = torch.full_like(inp, float("nan"))
            dist.all_to_all_single(res, inp, group=group)
            ref = torch.cat([torch.arange(rank * m, (rank + 1) * m, dtype=torch.float32)
                             + 1e6 * k for k in range(world)])
            rec = recorder._ring[-1]
            got.append((torch.equal(res, ref), rec.op, rec.algo))
        out[(text, cma)] = got == [(True, "all_to_all_single", w) for w in want], got
    os.environ.pop("NEURON_DIST_ALGO")
    if before is None:
        os.environ.pop("NEURON_DIST_CMA")
    else:
        os.environ["NEURON_DIST_CMA"] = before
    return out


def test_forced_all_to_all_algorithms_run_and_are_named():
    for rank, out in run_ranks(forced_all_to_all, 2, timeout=120).items():
        assert all(ok for ok, _ in out.values()), (rank, out)
