"""One rank of the "MPI's own collectives between nodes" check, run by
tests/across_nodes/test_mpi_transport.py as
``mpiexec -n N python tests/across_nodes/mpi_job_collectives.py LAYOUT``.

``init_process_group("neuron")`` under mpiexec with ``NEURON_DIST_TRANSPORT=mpi``; the
layout's virtual nodes (``NEURON_DIST_NODE_NAME``) make the network phases run among
columns, where the ``*/network`` tables pick ``mpi`` (collectives/net_mpi.py). Then:

* the collective matrices of test_collectives (every dtype and op, sizes 0 to 160 KB,
  exact references): the small sizes ride in the descriptor slot, the large ones take
  MPI's Iallreduce (float16 / bfloat16 in float32, bool as bytes, complex as reals),
  Iallgather, Ireduce_scatter_block or Ialltoall, Ibcast;
* random float32, bfloat16 and complex64 all_reduce: every rank's result has the same bits;
* the flight recorder names ``mpi`` for all_reduce, all_gather, reduce_scatter, broadcast
  (root 0) and barrier;
* (``3x1`` only) a call another rank did not make: rank 0 all-reduces 5 elements, the
  others 6; every rank fails with a collective mismatch naming both calls, none hangs.

LAYOUT: ``3x1`` (3 nodes of 1 rank), ``2x2`` (2 nodes of 2: two columns), ``uneven``
(nodes of 2 and 1 ranks: the leaders' column). Rank 0 prints ``@@mpi-coll {json}``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta

LAYOUTS = {"3x1": ["a", "b", "c"], "2x2": ["a", "a", "b", "b"], "uneven": ["a", "a", "b"]}
LAYOUT = sys.argv[1]
PMI_RANK = int(os.environ["PMI_RANK"])
NAMES = LAYOUTS[LAYOUT]
os.environ["NEURON_DIST_NODE_NAME"] = NAMES[PMI_RANK]
os.environ["NEURON_DIST_TRANSPORT"] = "mpi"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from one_node.test_collectives import (SMALL_SLOTS, all_reduce_matrix,  # noqa: E402
                                       gather_family_matrix, reduce_family_matrix)

os.environ.update(SMALL_SLOTS)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401
import neuron_dist.mpi_launch as m  # noqa: E402
from neuron_dist.flight_recorder import recorder  # noqa: E402

import mpi_job_common as common  # noqa: E402

torch.set_num_threads(1)
warnings.filterwarnings("ignore", category=FutureWarning)


def same_bits(rank: int, world: int) -> list:
    bad = []
    for dtype in (torch.float32, torch.bfloat16, torch.complex64):
        for n in (7, 5000, 70_001):
            g = torch.Generator().manual_seed(rank * 31 + n)
            t = torch.randn(n, generator=g, dtype=torch.float32 if not dtype.is_complex
                            else torch.complex64).to(dtype)
            dist.all_reduce(t)
            mine = t.view(-1).view(torch.uint8)
            every = torch.empty(world * mine.numel(), dtype=torch.uint8)
            dist.all_gather_into_tensor(every, mine)
            rows = every.view(world, -1)
            if not all(torch.equal(rows[0], rows[k]) for k in range(world)):
                bad.append(f"{dtype} n={n}")
    return bad


def mismatch(rank: int) -> str:
    t = torch.ones(5 if rank == 0 else 6)
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001 - the error is what is checked
        return str(e)
    return ""


def main() -> None:
    m.env_from_mpi()
    dist.init_process_group("neuron", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == len(NAMES), (world, NAMES)
    net = dist.group.WORLD._get_backend(torch.device("cpu"))._net
    assert type(net).__name__ == "MpiTransport", type(net).__name__
    fails = []
    for matrix in (all_reduce_matrix, gather_family_matrix, reduce_family_matrix):
        fails += matrix(rank, world)
    assert not fails, f"rank {rank}: {fails}"
    bad = same_bits(rank, world)
    assert not bad, f"rank {rank}: results differ between ranks: {bad}"
    dist.all_gather_into_tensor(torch.empty(world * 3000), torch.ones(3000))
    dist.reduce_scatter_tensor(torch.empty(3000), torch.ones(world * 3000))
    dist.broadcast(torch.ones(100_000), 0)
    dist.barrier()
    algos = {}
    for r in recorder._ring:
        if r.state == "completed" and r.algo:
            algos.setdefault(r.op, set()).add(str(r.algo))
    wanted = ["broadcast"]
    if NAMES.index(NAMES[rank]) == rank or LAYOUT != "uneven":
        wanted.append("all_reduce")  # (in uneven nodes only the leaders' network phase)
    if NAMES.index(NAMES[rank]) == rank:  # (a node's leader runs the network barrier)
        wanted.append("barrier")
    if LAYOUT != "uneven":  # (uneven nodes gather and scatter through the leaders)
        wanted += ["all_gather_into_tensor", "reduce_scatter_tensor"]
    for op in wanted:
        assert any("mpi" in a for a in algos.get(op, ())), (rank, op, algos.get(op))
    report = {"layout": LAYOUT, "algos": {k: sorted(v) for k, v in algos.items()}}
    if LAYOUT == "3x1":
        error = mismatch(rank)
        assert "collective mismatch" in error and "#" in error, (rank, error)
        report["mismatch"] = error[:300]
    if rank == 0:
        print("@@mpi-coll " + json.dumps(report), flush=True)
    if LAYOUT != "3x1":
        dist.destroy_process_group()


if __name__ == "__main__":
    common.run(main)
