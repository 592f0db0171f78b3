"""What the scripts run under mpiexec (mpi_job_*.py) share. mpi4py's ``MPI`` is imported
only inside the functions: a script may first have to set ``mpi4py.rc``."""

from __future__ import annotations

import sys
import time


def wait_mpi(req, lock) -> None:
    """Wait for an MPI request of ours, testing it under ``lock`` (the transports' MPI
    lock, never held while waiting: this rank's transports need it to progress)."""
    while True:
        with lock:
            if req.Test():
                return
        time.sleep(0.001)


def barrier(lock) -> None:
    """MPI_Barrier that sleeps while it waits (MPICH's spins: a core of our two)."""
    from mpi4py import MPI
    with lock:
        req = MPI.COMM_WORLD.Ibarrier()
    wait_mpi(req, lock)


def run(main) -> None:
    """Run ``main()``; on any failure end the whole job now (a rank that just exits leaves
    its peers waiting in MPI)."""
    try:
        main()
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(1)
