"""Argument checks that run before anything is sent, so bad input fails locally and clearly."""

from __future__ import annotations

import torch

from .collectives.descriptor import dtype_code


def tensor(t, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ValueError(f"{what} is on {t.device}; the neuron backend takes CPU tensors")
    if t.layout != torch.strided:
        sparse = " (sparse COO tensors: all_reduce with SUM only)" if t.layout == torch.sparse_coo else ""
        raise ValueError(f"{what} has layout {t.layout}; only dense (strided) tensors are "
                         f"supported{sparse}")
    dtype_code(t.dtype)
    return t


def single(tensors, what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"{what}: expected a list with exactly one tensor, got {len(tensors)}")
    return tensor(tensors[0], what)


def rank(r: int, size: int, what: str) -> int:
    if not 0 <= r < size:
        raise ValueError(f"{what} {r} is out of range for a group of size {size}")
    return r


def same_dtype(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"{what}: dtypes differ ({a.dtype} vs {b.dtype})")


def numel(t: torch.Tensor, expected: int, what: str) -> None:
    if t.numel() != expected:
        raise ValueError(f"{what} has {t.numel()} elements, expected {expected}")


def length(items, expected: int, what: str) -> None:
    if len(items) != expected:
        raise ValueError(f"{what} has {len(items)} entries, expected {expected} (the group size)")
