"""Inter-node transport over MPI (mpi4py), for clusters where the MPI library owns the fabric.

``MpiTransport`` has the rdm transport's API (``isend``/``irecv``/``irecv_any``/``Request``/
``connect``/``abort``/``close``/``stats``), so the two-level collectives and send/recv run
over either unchanged. See ``driver`` for how it works.
mpi4py is imported when a transport is created, not when this package is imported.
Nothing here imports torch.
"""

from .driver import MpiTransport, Request, mpi_lock, thread_level, world_rank

__all__ = ["MpiTransport", "Request", "mpi_lock", "thread_level", "world_rank"]
