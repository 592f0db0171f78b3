"""MPI requests that still own a buffer after the request they served has ended.

MPI cannot take back a buffer it was given (``MPI_Cancel`` cannot withdraw a started send
or a matched receive). When a request the transport no longer waits for still belongs to
MPI (a collective's staging buffers after a member failed, a note, a notice, an arrival
note of an abandoned group creation), its MPI request and its buffer are kept here, so the
buffer stays alive until MPI completes the request; ``sweep`` lets go of those it has.
A caller's own buffer never comes here: driver.py waits for MPI to give it back, or ends
the job (``active.Active.end_job``).
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any, Iterable

ORPHANS: list[tuple[Any, object]] = []  # [(mpi request, buffer)]
_LOCK = threading.Lock()


def keep(orphans: Iterable[tuple[Any, object]]) -> None:
    """Keep these (MPI request, buffer) pairs until MPI completes the requests."""
    orphans = list(orphans)
    if orphans:
        with _LOCK:
            ORPHANS.extend(orphans)


def sweep(MPI: ModuleType) -> None:
    """Let go of the orphaned requests MPI has completed since (under the transport's MPI
    lock: this calls MPI)."""
    with _LOCK:
        if not ORPHANS or MPI.Is_finalized():
            return
        kept = []
        for r, buf in ORPHANS:
            try:
                if not r.Test():
                    kept.append((r, buf))
            except MPI.Exception:
                pass
        ORPHANS[:] = kept
