"""neuron-dist's collectives benchmark, in the spirit of nccl-tests: ``python -m neuron_dist.bench``.

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
Nothing heavy is imported here, so ``python -m neuron_dist.bench.mpi_runner`` stays light.
"""


def main(argv=None) -> int:
    """Run the command line (``neuron-dist-bench``) and return its exit status."""
    from .__main__ import main as _main

    return _main(argv)
