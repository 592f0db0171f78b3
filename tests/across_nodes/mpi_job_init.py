"""One rank of the ``init_process_group("neuron")`` under mpiexec check, run by
tests/across_nodes/test_mpi_transport.py as
``mpiexec -n 4 python tests/across_nodes/mpi_job_init.py MODE``.

No torchrun: the rendezvous variables come from MPI (neuron_dist.mpi_launch). Ranks 0-1
and 2-3 are two virtual nodes (NEURON_DIST_NODE_NAME), so the world group runs two-level
collectives: shared memory inside a node, the inter-node transport between.

MODE
    explicit       ``mpi_launch.env_from_mpi()`` then ``init_process_group("neuron")``;
                   the rdm (TCP, loopback) transport between the virtual nodes.
    hook           only ``mpi_launch.install_env_hook()``: ``init_process_group`` itself
                   fills the variables in from MPI.
    mpi-transport  like explicit, with NEURON_DIST_TRANSPORT=mpi: the groups' inter-node
                   transport is an MpiTransport.
    clash          a partly pre-set environment: rank 1 has its own MASTER_PORT, rank 2 a
                   wrong LOCAL_RANK, rank 3 a RANK that agrees with MPI; ``env_from_mpi()``
                   must fail on every rank naming ranks 1 and 2 (and not 3), setting nothing.

Rank 0 prints ``@@mpi-init {json}`` (mode, what was set, timings) at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from datetime import timedelta

MODE = sys.argv[1] if len(sys.argv) > 1 else "explicit"
PMI_RANK = int(os.environ["PMI_RANK"])
os.environ["NEURON_DIST_NODE_NAME"] = f"n{PMI_RANK // 2}"  # 2 virtual nodes x 2 ranks
assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ, "expected a bare mpiexec env"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402
import neuron_dist.mpi_launch as m  # noqa: E402

import mpi_job_common as common  # noqa: E402

torch.set_num_threads(1)
warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's
TIMEOUT = timedelta(seconds=60)


def use_mpi_transport() -> None:
    """NEURON_DIST_TRANSPORT=mpi: the groups' inter-node transport is an MpiTransport."""
    os.environ["NEURON_DIST_TRANSPORT"] = "mpi"


def clash() -> None:
    preset = {1: ("MASTER_PORT", "1"), 2: ("LOCAL_RANK", "7"), 3: ("RANK", "3")}.get(PMI_RANK)
    if preset:
        os.environ[preset[0]] = preset[1]
    before = dict(os.environ)
    try:
        m.env_from_mpi()
    except RuntimeError as e:
        message = str(e)
    else:
        raise AssertionError("a partly pre-set environment was mixed with MPI's values")
    assert "rank 1: MASTER_PORT=1 (MPI: " in message, message
    assert "rank 2: LOCAL_RANK=7 (MPI: 2)" in message, message
    assert "rank 3" not in message and "rank 0" not in message, message
    assert dict(os.environ) == before, "env_from_mpi set variables although it failed"
    if PMI_RANK == 0:
        print("@@mpi-init " + json.dumps({"mode": MODE, "error": message}), flush=True)


def main() -> None:
    t0 = time.monotonic()
    if MODE == "clash":
        clash()
        return
    set_vars = None
    if MODE in ("explicit", "mpi-transport"):
        set_vars = m.env_from_mpi()
        assert set_vars is not None
        assert m.env_from_mpi() is None  # RANK and WORLD_SIZE are set now: no-op
    elif MODE == "hook":
        assert m.install_env_hook()
    else:
        raise SystemExit(f"unknown mode {MODE}")
    if MODE == "mpi-transport":
        use_mpi_transport()
    dist.init_process_group("neuron", timeout=TIMEOUT)
    t_init = time.monotonic() - t0
    rank, world = dist.get_rank(), dist.get_world_size()
    assert (rank, world) == (PMI_RANK, 4), (rank, world)
    assert os.environ["RANK"] == str(PMI_RANK) and os.environ["WORLD_SIZE"] == "4"
    # one host: MPI's shared-memory split puts all 4 ranks on one node
    assert os.environ["LOCAL_RANK"] == str(rank) and os.environ["LOCAL_WORLD_SIZE"] == "4"
    assert os.environ["MASTER_ADDR"] == "127.0.0.1", os.environ["MASTER_ADDR"]
    assert 0 < int(os.environ["MASTER_PORT"]) < 65536
    layout = neuron_dist.layout()
    assert "2 nodes" in layout, layout
    net = dist.group.WORLD._get_backend(torch.device("cpu"))._net
    kind = type(net).__name__
    assert kind == ("MpiTransport" if MODE == "mpi-transport" else "RdmTransport"), kind

    t1 = time.monotonic()
    # all_reduce: small (one step) and large (chunked), sum and max
    for n in (5, 300_000):
        x = torch.arange(n, dtype=torch.float32) + rank
        dist.all_reduce(x)
        want = torch.arange(n, dtype=torch.float32) * world + sum(range(world))
        assert torch.equal(x, want), f"all_reduce n={n}"
    y = torch.full((7,), float(rank))
    dist.all_reduce(y, op=dist.ReduceOp.MAX)
    assert (y == world - 1).all()
    # all_gather (list and into one tensor)
    outs = [torch.empty(3, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(outs, torch.full((3,), rank * 10, dtype=torch.int64))
    assert [int(o[0]) for o in outs] == [k * 10 for k in range(world)]
    flat = torch.empty(world * 1000)
    dist.all_gather_into_tensor(flat, torch.full((1000,), float(rank)))
    assert torch.equal(flat, torch.arange(world).repeat_interleave(1000).float())
    # broadcast from a rank of each node
    for root in (1, 2):
        b = torch.full((50_000,), float(rank))
        dist.broadcast(b, src=root)
        assert (b == root).all(), f"broadcast from {root}"
    # async all_reduce, then send/recv across the nodes (tags beyond MPI_TAG_UB)
    w = dist.all_reduce(torch.ones(10), async_op=True)
    w.wait()
    if rank in (0, 3):
        peer = 3 - rank
        out = torch.full((1000,), float(rank))
        got = torch.empty(1000)
        reqs = [dist.isend(out, peer, tag=7), dist.irecv(got, peer, tag=7)]
        for r in reqs:
            r.wait()
        assert (got == peer).all()
    # a receive from any rank across the nodes (the source is reported)
    if rank == 3:
        dist.send(torch.full((100,), 3.0), 0, tag=9)
    if rank == 0:
        anyone = torch.empty(100)
        assert dist.recv(anyone, tag=9) == 3 and (anyone == 3).all()
    # a subgroup spanning both nodes
    sub = dist.new_group([0, 2], timeout=TIMEOUT)
    if rank in (0, 2):
        s = torch.full((4,), float(rank + 1))
        dist.all_reduce(s, group=sub)
        assert (s == 4).all()
    dist.barrier()
    t_ops = time.monotonic() - t1
    dist.destroy_process_group()
    if rank == 0:
        print("@@mpi-init " + json.dumps({"mode": MODE, "transport": kind, "set": set_vars,
                                          "layout": layout, "init_s": round(t_init, 2),
                                          "ops_s": round(t_ops, 2)}), flush=True)


if __name__ == "__main__":
    common.run(main)
