"""Neuron's own tensor work runs on the thread that does it, never on torch's thread pool.

Why
---
A collective's copies and reductions are memory-bound and small next to the compute of a
training step. torch hands any op on more than 32768 elements (a 32 KiB byte copy) to its
OpenMP pool, whose threads wake for it and then spin, waiting for more work. When threads
outnumber cores, which torch's default of one thread per core gives as soon as two ranks
share a machine, or a rank's engine thread runs a collective while its main thread
computes, the spinning threads take the cores that the peer ranks need in order to answer,
and a small collective takes many times as long (docs/performance.md, "Torch's default
thread count"). gloo and MPI copy and reduce on one thread too.

How
---
OpenMP's thread count is a per-thread setting (the ``nthreads-var`` ICV): an
``omp_set_num_threads`` on one thread leaves every other thread as it was. torch's own
``set_num_threads`` is not used: it also changes the count that threads started later
take. ``enter`` sets the calling thread's count to 1 and returns the count to restore;
``leave`` restores it. The count is read through ``torch.get_num_threads``, which first
initialises torch's per-thread setting (were that left to the first parallel op inside
the scope, torch would overwrite the 1). A torch build without OpenMP has no such
functions: ``enter`` then does nothing (returns 0).
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable

import torch

# Ops on at most this many elements stay on the calling thread anyway (torch's
# at::internal::GRAIN_SIZE): work on fewer bytes needs no scope.
GRAIN_BYTES = 32768


def _omp_setter() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime torch's kernels use: looked up from
    torch's CPU library (a lookup through a library's handle searches what it was linked
    against first), so another runtime loaded into the process cannot be taken for it."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    for path in (os.path.join(lib, "libtorch_cpu.so"), None):
        try:
            setter = ctypes.CDLL(path).omp_set_num_threads
        except (AttributeError, OSError):
            continue
        setter.argtypes, setter.restype = [ctypes.c_int], None
        return setter
    return None


_set = _omp_setter()
_get = torch.get_num_threads


def enter() -> int:
    """Run torch ops of the calling thread on that thread alone, until ``leave``.

    Returns
    -------
    int
        What to pass to ``leave``: the thread's previous count, or 0 when nothing changed
        (it was 1 already, or torch has no OpenMP pool).
    """
    if _set is None:
        return 0
    count = _get()
    if count <= 1:
        return 0
    _set(1)
    return count


def leave(count: int) -> None:
    """Give the calling thread back the thread count ``enter`` returned (0: nothing)."""
    if count:  # (non-zero only from an enter that found _set)
        _set(count)  # type: ignore[misc]
