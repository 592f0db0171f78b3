"""neuron-dist's collectives benchmark, in the spirit of nccl-tests: ``python -m bench``.

It sweeps message sizes (``-b/-e/-f``) over world sizes (``-n 2,4``) for all_reduce,
all_gather, reduce_scatter, broadcast, all_to_all and send_recv, and compares the neuron
backend with gloo and with a group that does nothing (same rank processes, interleaved per
size) and with MPI (mpi4py under
mpiexec, run afterwards). It reports median and min time, algbw and nccl-tests' busbw, the
ratio to gloo, optional result checks, compute/communication overlap and the shared-memory
footprint, as a table, JSON, CSV and a PNG plot.

Modules, one concern each: ``sweep`` (sizes, op catalogue, timing loop, bandwidths),
``patterns`` (buffer contents and --check expectations), ``torch_runner`` (neuron, gloo and
null ranks), ``null_pg`` (the do-nothing group: the dispatch floor), ``mpi_runner`` (mpiexec launcher and mpi4py worker), ``overlap`` (--overlap),
``report`` (table, JSON, CSV), ``plot`` (matplotlib PNG), ``__main__`` (the command line).
Nothing heavy is imported here, so ``python -m bench.mpi_runner`` stays light.

The lab is not installed with the backend: it runs from the repository (``python -m
bench.X`` in its root) over the installed ``neuron_dist``. Importing it puts the
repository's root on ``PYTHONPATH``, so the rank processes it starts (``python -m
bench.scale_worker`` under torchrun, mpiexec or a virtual node) import it the same way,
wherever their working directory is.
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_path = os.environ.get("PYTHONPATH", "")
if ROOT not in _path.split(os.pathsep):
    os.environ["PYTHONPATH"] = ROOT + (os.pathsep + _path if _path else "")
