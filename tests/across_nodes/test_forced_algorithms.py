"""NEURON_DIST_ALGO forces each all_reduce algorithm, and it runs: on two loopback virtual
nodes of two ranks each (``NEURON_DIST_NODE_NAME``), every override gets a group of its own
(settings are read per group) spanning both nodes, or one node's two ranks; each group
all-reduces several sizes and dtypes, checks the results exactly against a reference, and
reads the algorithm the flight recorder and the TRACE log name for the call. Ranks with different overrides
are refused a group."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist

from helpers.harness import cma_expected, run_ranks

NAMES = ["a", "a", "b", "b"]
# sizes in elements: one element, uneven small, above the one-step limit and a slot,
# large enough for single copy's 1 MiB blocks (float32, two ranks)
SIZES = [1, 1003, 300_001]
# override -> the algorithm names the record of the last call (2.4 MB) must show, in order;
# with ``leader`` only the leaders (ranks 0 and 2) take part in the exchange among nodes
ACROSS = {
    "all_reduce=leader": ["leader", "direct"],  # (2.4 MB between two leaders: direct)
    "all_reduce=leader,all_reduce=two_step,all_reduce=ring": ["leader", "two_step", "ring"],
    "all_reduce=hierarchical,all_reduce=ring": ["hierarchical", "ring"],
    "all_reduce=hierarchical,all_reduce=halves": ["hierarchical", "halves"],
    "all_reduce=direct": ["hierarchical", "direct"],
    # the all_gather that ends the hierarchical all_reduce chooses for itself, after the
    # call's first step (the reduce_scatter phase took it): single copy where CMA works
    "all_reduce=hierarchical,all_gather=single_copy": [
        "hierarchical", "direct", "single_copy" if cma_expected() else "slots"],
}
ONE_NODE = {
    "all_reduce=one_step": ["one_step"],
    "all_reduce=two_step": ["two_step"],
    "all_reduce=single_copy": ["single_copy" if cma_expected() else "two_step"],
}


def _forced(rank, world):
    from neuron_dist.flight_recorder import recorder

    out = {}
    cases = [(text, list(range(world)), want) for text, want in ACROSS.items()]
    cases += [(text, [0, 1], want) for text, want in ONE_NODE.items()]
    cases += [(text, [2, 3], want) for text, want in ONE_NODE.items()]
    for text, ranks, want in cases:
        os.environ["NEURON_DIST_ALGO"] = text
        group = dist.new_group(ranks, backend="neuron")  # (every rank creates every group)
        if rank not in ranks:
            continue
        for n in SIZES:
            for dtype in (torch.float32, torch.int64):
                base = torch.arange(n, dtype=torch.int64).remainder_(1001) - 500
                t = (base * (rank + 1) + rank).to(dtype)
                dist.all_reduce(t, group=group)
                ref = sum(base * (r + 1) + r for r in ranks).to(dtype)
                ok = torch.equal(t, ref)
                t = (base * (rank % 3) - rank).to(dtype)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                ref = torch.stack([base * (r % 3) - r for r in ranks]).amax(0).to(dtype)
                out[f"{text} {ranks} {n} {dtype}"] = ok and torch.equal(t, ref)
        algo = recorder._ring[-1].algo or ""
        out[f"{text} {ranks} trace"] = _trace_names(group, algo)
        if want[0] == "leader" and rank % 2:
            want = want[:-1]  # (not a leader: no exchange among nodes)
        parts = algo.split("+")
        # the names wanted appear in this order (local phases may add others between them)
        it = iter(parts)
        out[f"{text} {ranks} names {algo}"] = all(name in it for name in want)
    # ranks that would choose differently: the group is refused on every rank, naming it
    os.environ["NEURON_DIST_ALGO"] = "all_reduce=ring" if rank == 1 else "auto"
    try:
        dist.new_group(list(range(world)), backend="neuron")
        out["different settings refused"] = False
    except Exception as e:  # noqa: BLE001
        out["different settings refused"] = ("settings that choose algorithms" in str(e)
                                             and "rank 1 'NEURON_DIST_ALGO=all_reduce/network"
                                             in str(e))
    os.environ.pop("NEURON_DIST_ALGO", None)
    # network settings too (issue: "network settings are not compared across ranks"): a
    # rank with other rails or segments is refused at once, not later as a bad frame
    for var, value in (("NEURON_DIST_RAILS", "2"), ("NEURON_DIST_NET_SEGMENT_BYTES", "128K")):
        if rank == 1:
            os.environ[var] = value
        try:
            dist.new_group(list(range(world)), backend="neuron")
            out[f"different {var} refused"] = False
        except Exception as e:  # noqa: BLE001
            out[f"different {var} refused"] = (
                "frame the network's messages" in str(e) and f"{var}=" in str(e))
        if rank == 1:
            del os.environ[var]
    return out


def _trace_names(group, algo: str) -> bool:
    """NEURON_DIST_DEBUG=TRACE's line for the same call names the same algorithm."""
    log = logging.getLogger("neuron_dist")
    lines = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        dist.all_reduce(torch.ones(300_001, dtype=torch.int64), group=group)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    done = [ln for ln in lines if ln.startswith("neuron: done")]
    return len(done) == 1 and done[0].endswith(f"algorithm {algo}")


@pytest.mark.timeout(200)
def test_forced_all_reduce_algorithms_run_and_are_named():
    env = {"NEURON_DIST_SHM_SLOT_BYTES": "256K", "NEURON_DIST_NET_SEGMENT_BYTES": "64K"}
    results = run_ranks(_forced, len(NAMES), timeout=180,
                        env=lambda r: {**env, "NEURON_DIST_NODE_NAME": NAMES[r]})
    bad = {r: [k for k, ok in out.items() if not ok] for r, out in results.items()}
    assert not any(bad.values()), bad
    assert all(len(out) >= len(ACROSS) for out in results.values()), results
