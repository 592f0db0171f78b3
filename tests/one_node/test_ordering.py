"""Weakly ordered CPUs: ranks never share memory there (transport/shm/ordering.py).

The machine name is faked in the test process before the ranks are forked, so the ranks see
an aarch64 CPU.
"""

from __future__ import annotations

import platform

import pytest
import torch
import torch.distributed as dist

from helpers.harness import run_ranks


def all_reduce_ranks(rank, world):
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    return t.tolist() == [float(world * (world + 1) // 2)] * 1000


@pytest.mark.timeout(60)
def test_shared_memory_is_refused_on_a_weakly_ordered_cpu(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    res = run_ranks(all_reduce_ranks, 2, timeout=40, expect_errors=True)
    for rank in (0, 1):
        assert res[rank][0] == "error", f"rank {rank} shared memory on aarch64: {res[rank]}"
        message = res[rank][2]
        assert "share a node whose CPU is aarch64" in message, message
        assert "x86-64's store ordering" in message and "NEURON_DIST_NODE_NAME" in message, message


@pytest.mark.timeout(60)
def test_one_rank_per_node_runs_over_the_network_on_a_weakly_ordered_cpu(monkeypatch):
    """The way out the error names: every rank its own node."""
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    res = run_ranks(all_reduce_ranks, 2, timeout=40,
                    env=lambda r: {"NEURON_DIST_NODE_NAME": f"arm-{r}"})
    assert res == {0: True, 1: True}


def test_only_x86_64_shares_memory():
    from neuron_dist.transport.shm.ordering import shares_memory_safely

    assert shares_memory_safely("x86_64") and shares_memory_safely("AMD64")
    for arch in ("aarch64", "arm64", "ppc64le", "riscv64", "s390x", ""):
        assert not shares_memory_safely(arch), arch
