"""Both between-nodes transports keep the same contract (net_contract.py): the rdm
transport with three ranks in threads of this process, the MPI transport with three MPI
ranks under mpiexec."""

from __future__ import annotations

import threading

import pytest

from across_nodes import net_contract as C
from across_nodes.test_rdm_driver import _pair

def _rdm_group():
    return _pair(rails=2, world=C.WORLD, group=b"contract")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", C.CASES, ids=lambda c: c.__name__[5:])
def test_rdm_keeps_the_contract(case):
    ts = _rdm_group()
    barrier = threading.Barrier(C.WORLD, timeout=30)
    errors = {}

    def rank(r):
        try:
            case(ts[r], r, barrier.wait)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[r] = e
            barrier.abort()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(C.WORLD)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
    finally:
        for t in ts:
            t.close()
    real = {r: e for r, e in errors.items() if not isinstance(e, threading.BrokenBarrierError)}
    assert not real, real
    assert not errors, errors


@pytest.mark.timeout(150)
def test_mpi_keeps_the_contract():
    from across_nodes.test_mpi_transport import _report, run_mpi
    out, err, seconds = run_mpi(C.WORLD, "mpi_job_contract.py", timeout=120)
    report = _report(out, "@@contract ")
    assert report["passed"] == [c.__name__ for c in C.CASES], report
