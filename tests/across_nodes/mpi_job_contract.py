"""The between-nodes transport contract (net_contract.py) against MpiTransport: 3 MPI
ranks under mpiexec, run by test_net_contract.py. Prints ``@@contract {json}`` on rank 0."""

import json
import time

from mpi4py import MPI

from neuron_dist.transport.mpi import MpiTransport, mpi_lock

import mpi_job_common as common
import net_contract as C

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
LOCK = mpi_lock()


def sync() -> None:
    common.barrier(LOCK)


def main() -> None:
    assert WORLD.Get_size() == C.WORLD
    t = MpiTransport(RANK, C.WORLD, list(range(C.WORLD)), label="contract",
                     deadline=time.monotonic() + 30)
    t.connect(range(C.WORLD), time.monotonic() + 30)
    passed = []
    for case in C.CASES:
        sync()
        case(t, RANK, sync)
        passed.append(case.__name__)
    sync()
    t.close()
    if RANK == 0:
        print("@@contract " + json.dumps({"passed": passed}), flush=True)


if __name__ == "__main__":
    common.run(main)
