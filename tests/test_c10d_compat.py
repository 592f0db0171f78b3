"""What torch's own distributed tests and users expect of a backend, beyond the matrices:
all_gather_coalesced's list-per-rank layout.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

NODES = {"one-node": None, "2-nodes": ["a", "b", "a"]}


def _node_env(names):
    if names is None:
        return None
    return lambda rank: {"NEURON_DIST_NODE_NAME": names[rank]}


def _try(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


# ------------------------------------------------------------- all_gather_coalesced
def gather_coalesced(rank, world):
    fails = []
    shapes = [(3,), (2, 2), (0,), (5,), ()]  # an empty and a 0-dim tensor among them
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.complex64, torch.bool):
        def value(r, i, shape):
            n = max(1, torch.Size(shape).numel())
            base = torch.arange(n, dtype=torch.float64) + 100 * r + 10 * i
            if dtype == torch.complex64:
                return torch.complex(base, -base).to(dtype)[:torch.Size(shape).numel()].view(shape)
            if dtype == torch.bool:
                base = base.remainder(2 + r)
            return base.to(dtype)[:torch.Size(shape).numel()].view(shape)
        ins = [value(rank, i, s) for i, s in enumerate(shapes)]
        outs = [[torch.full(s, 7, dtype=dtype) if dtype != torch.complex64 else
                 torch.zeros(s, dtype=dtype) for s in shapes] for _ in range(world)]
        dist.all_gather_coalesced(outs, ins)
        for r in range(world):
            for i, s in enumerate(shapes):
                if not torch.equal(outs[r][i], value(r, i, s)):
                    fails.append(f"{dtype} output[{r}][{i}]: {outs[r][i]} != {value(r, i, s)}")
    # async, and a non-contiguous output
    ins = [torch.full((2, 3), float(rank))]
    outs = [[torch.zeros(3, 2).t()] for _ in range(world)]
    dist.all_gather_coalesced(outs, ins, async_op=True).wait()
    for r in range(world):
        if not torch.equal(outs[r][0], torch.full((2, 3), float(r))):
            fails.append(f"non-contiguous output[{r}]: {outs[r][0]}")
    # wrong layouts fail before anything is sent, naming the problem
    errors = [
        _try(lambda: dist.all_gather_coalesced([[torch.zeros(2)]], [torch.zeros(2)])),
        _try(lambda: dist.all_gather_coalesced([[torch.zeros(2)] * 2] * world, [torch.zeros(2)])),
        _try(lambda: dist.all_gather_coalesced([[torch.zeros(3)]] * world, [torch.zeros(2)])),
    ]
    want = ["has 1 entries, expected " + str(world), "output list 0 has 2 tensors, expected one "
            "per input (1)", "output[0][0] (vs input 0) has 3 elements, expected 2"]
    for err, w in zip(errors, want):
        if not (err and err.startswith("ValueError") and w in err):
            fails.append(f"expected ValueError with {w!r}, got {err}")
    dist.all_reduce(torch.ones(1))  # the group is still aligned
    return fails


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nodes", list(NODES))
def test_all_gather_coalesced_takes_one_list_per_rank(nodes):
    names = NODES[nodes]
    res = run_ranks(gather_coalesced, 3 if names else 2, env=_node_env(names), timeout=100)
    assert not any(res.values()), res
