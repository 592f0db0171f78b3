"""Deterministic inputs and single-process references for the collective tests.

Float inputs are small integers, so sums are exact in every dtype and every reduction
order; each rank can therefore compute exactly what the whole group must produce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
ALL_DTYPES = FLOATS + INTS + [torch.bool]

OPS = {
    "SUM": dist.ReduceOp.SUM, "AVG": dist.ReduceOp.AVG, "PRODUCT": dist.ReduceOp.PRODUCT,
    "MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX, "BAND": dist.ReduceOp.BAND,
    "BOR": dist.ReduceOp.BOR, "BXOR": dist.ReduceOp.BXOR,
}


def ops_for(dtype):
    if dtype is torch.bool:
        return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
    if dtype.is_floating_point:
        return ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"]
    return ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def make(rank: int, n: int, dtype, salt: int = 0, op: str = "SUM") -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 17 * n + salt)
    if dtype is torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if op == "PRODUCT":
        v = torch.randint(1, 3, (n,), generator=g)  # 1 or 2: products stay exact
        if dtype.is_floating_point or dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
            v = v * torch.where(torch.randint(0, 2, (n,), generator=g) == 0, -1, 1)
        return v.to(dtype)
    lo = 0 if dtype is torch.uint8 else -8
    return torch.randint(lo, 9, (n,), generator=g).to(dtype)


def premul_factor():
    return 0.5


def reduce_ref(inputs, op: str, dtype) -> torch.Tensor:
    """The exact result of reducing ``inputs`` (one tensor per rank) with ``op``."""
    world = len(inputs)
    if dtype is torch.bool:
        x = torch.stack(inputs)
        if op in ("SUM", "MAX", "BOR"):
            return x.any(0)
        if op in ("PRODUCT", "MIN", "BAND"):
            return x.all(0)
        return (x.sum(0) % 2).bool()
    if dtype.is_floating_point:
        x = torch.stack([t.double() for t in inputs])
        if op == "PREMUL_SUM":
            x = torch.stack([(t * premul_factor()).double() for t in inputs])
        out = {"SUM": lambda: x.sum(0), "PREMUL_SUM": lambda: x.sum(0),
               "AVG": lambda: x.sum(0) / world, "PRODUCT": lambda: x.prod(0),
               "MIN": lambda: x.min(0).values, "MAX": lambda: x.max(0).values}[op]()
        return out.to(dtype)
    x = torch.stack([t.long() for t in inputs])
    if op in ("BAND", "BOR", "BXOR"):
        acc = x[0].clone()
        f = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        for t in x[1:]:
            acc = f(acc, t)
        return acc.to(dtype)
    out = {"SUM": lambda: x.sum(0), "AVG": lambda: torch.div(x.sum(0), world, rounding_mode="trunc"),
           "PRODUCT": lambda: x.prod(0), "MIN": lambda: x.min(0).values,
           "MAX": lambda: x.max(0).values}[op]()
    if op == "AVG":
        # wrap-around of the sum happens in the tensor's own dtype before dividing
        out = torch.div(x.sum(0).to(dtype).long(), world, rounding_mode="trunc")
    return out.to(dtype)


def torch_op(op: str):
    if op == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(premul_factor())
    return OPS[op]


def close(a: torch.Tensor, b: torch.Tensor, dtype) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if dtype in (torch.float16, torch.bfloat16):
        return torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)
    if dtype.is_floating_point:
        return torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    return torch.equal(a, b)


def pattern(n: int, cache: dict = {}) -> torch.Tensor:  # noqa: B006 - a deliberate cache
    """0, 1, .., 250, 0, 1, ... as float32 (exact in every sum of the soak tests)."""
    if n not in cache:
        cache[n] = (torch.arange(n) % 251).float()
    return cache[n]


def settle(pending: list) -> int:
    """Wait for every ``(work, label, got, want)`` of ``pending`` (``work`` may be None)
    and compare ``got`` whole with ``want()``; raise naming the first wrong element, else
    empty ``pending`` and return how many were checked."""
    for work, label, got, want in pending:
        if work is not None:
            work.wait()
        expected = want()
        if not torch.equal(got, expected):
            bad = (got != expected).nonzero()[0].item()
            raise AssertionError(f"{label} ({got.numel()} elements): element {bad} is "
                                 f"{got[bad].item()}, expected {expected[bad].item()}")
    checked = len(pending)
    pending.clear()
    return checked


def send_recv(rank: int, src: int, dst: int, n: int, i: int, pending: list,
              from_any: bool = False) -> bool:
    """Operation ``i`` of a soak: ``src`` isends ``pattern(n) + src`` to ``dst`` with tag
    ``i`` and ``dst`` irecvs it (from any rank if ``from_any``: the tag is the operation's,
    so exactly one message matches); what to check goes on ``pending`` (see ``settle``), the
    receive's reported source included. True if this rank took part."""
    if rank == src:
        w = dist.isend(pattern(n) + src, dst, tag=i)
        pending.append((w, f"op {i} (send)", torch.zeros(0), lambda: torch.zeros(0)))
    elif rank == dst:
        t = torch.full((n,), -1.0)
        w = dist.irecv(t, None if from_any else src, tag=i)
        pending.append((w, f"op {i} (recv from {src})", t,
                        lambda: _sent_by(w, src, i) + pattern(n)))
    return rank in (src, dst)


def _sent_by(work, src: int, i: int) -> int:
    """``src``, after checking that ``work`` says its message came from there."""
    got = work._source_rank()
    if got != src:
        raise AssertionError(f"op {i}: a receive of rank {src}'s message reports rank {got}")
    return src
