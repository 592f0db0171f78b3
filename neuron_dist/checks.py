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


def rank_list(lists, like: torch.Tensor, size: int, what: str,
              equal_numel: bool = False) -> list:
    """c10d's ``[[one tensor per rank]]`` argument, checked against ``like``."""
    if len(lists) != 1:
        raise ValueError(f"{what}: expected exactly one list of tensors, got {len(lists)}")
    tensors = lists[0]
    length(tensors, size, f"{what} list")
    for k, t in enumerate(tensors):
        tensor(t, f"{what} tensor {k}")
        same_dtype(t, like, f"{what} tensor {k}")
        if equal_numel:
            numel(t, like.numel(), f"{what} tensor {k}")
    return tensors


def root_list(lists, like: torch.Tensor, root: int, me: int, size: int, what: str) -> list:
    """A rooted call's list of one tensor per rank: the root's, checked (each like
    ``like``); any other rank must pass none and gets ``[]``."""
    if me != root:
        if lists and any(len(x) for x in lists):
            raise ValueError(f"{what}: only the root (rank {root}) may pass a tensor list")
        return []
    return rank_list(lists, like, size, what, equal_numel=True)


def splits(t: torch.Tensor, sizes, size: int, what: str) -> list[int]:
    """all_to_all_single's split sizes of ``t`` along dim 0 (even when none are given), as
    element counts, checked."""
    rows = t.shape[0] if t.dim() else 1
    per_row = t.numel() // rows if rows else 0
    if not sizes:
        if rows % size:
            raise ValueError(f"all_to_all_single: {what} dim 0 ({rows}) is not divisible by "
                             f"the group size {size} and no split sizes were given")
        return [rows // size * per_row] * size
    length(sizes, size, f"all_to_all_single {what}_split_sizes")
    if any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise ValueError(f"all_to_all_single: {what}_split_sizes {list(sizes)} do not sum to "
                         f"the {what}'s dim 0 ({rows})")
    return [s * per_row for s in sizes]
