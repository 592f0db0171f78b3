"""A tiny multi-node job for tests/across_nodes/test_vnodes.py (run under torchrun by
launch/vnodes.py).

Each rank initialises the process group (``--backend``), checks its rank and world
against torchrun's environment,
runs an all_reduce, finds out which other ranks can see its files in ``/dev/shm``, and
prints one line::

    VNODE_JOB {"rank": 0, "world": 4, "hostname": ..., "node_name": "vnode0",
               "shm_dev": 40, "ip": "10.12.0.1", "shm_peers": [0, 1], ...}

``--fail-rank R --fail-code C`` makes rank R exit with code C right after initialisation
(its peers then block in the all_reduce until the launcher stops them).
``--tag T`` is a marker that tests look for in /proc to find leftover processes.
``--send-bytes N`` times a send of N bytes from rank 0 to the last rank (on another node
when there is one rank per node), acknowledged by a 1-element reply, and reports rank 0's
``"send_MBps"`` (what a link rate limit must cap).
``--unresolvable-hostname`` (netns nodes only: each has its own UTS namespace) renames the
node to a host name nothing resolves and drops ``NEURON_DIST_NODE_NAME``, so the backend
must find nodes and addresses on its own, as on hosts whose name is not in DNS (gloo
hangs there).
``--matrix`` also runs one_node/test_collectives.py's collective x dtype x op matrices (exact
references) and reports their failures as ``"matrix_fails"``.
"""

import argparse
import json
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist


def local_ip(master_addr: str, master_port: int) -> str:
    """The source address this host uses to reach the master (UDP connect: no packet sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_addr, master_port))
        return s.getsockname()[0]


def unresolvable_hostname(name: str) -> None:
    """Rename this node (its own UTS namespace) to ``name``, which must not resolve."""
    # launch/vnodes.py --netns names each node's own UTS namespace vnodeI (and the node's
    # other ranks may have renamed it already); anywhere else this would rename the machine.
    if socket.gethostname() not in (f"vnode{os.environ['GROUP_RANK']}", name):
        raise SystemExit("--unresolvable-hostname needs a netns node with its own hostname")
    socket.sethostname(name)
    try:
        socket.getaddrinfo(name, None)
    except socket.gaierror:
        pass
    else:
        raise SystemExit(f"{name} resolves; the test would prove nothing")
    os.environ.pop("NEURON_DIST_NODE_NAME", None)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="gloo")
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-code", type=int, default=3)
    p.add_argument("--latency-iters", type=int, default=0,
                   help="time this many 1-element all_reduces after the check")
    p.add_argument("--tag", default="")
    p.add_argument("--send-bytes", type=int, default=0)
    p.add_argument("--matrix", action="store_true")
    p.add_argument("--unresolvable-hostname", action="store_true")
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.unresolvable_hostname:
        unresolvable_hostname(f"nohost-node{os.environ['GROUP_RANK']}.invalid")
    dist.init_process_group(args.backend)
    assert dist.get_rank() == rank and dist.get_world_size() == world, (
        dist.get_rank(), rank, dist.get_world_size(), world)

    if rank == args.fail_rank:
        print(f"rank {rank} failing on purpose with code {args.fail_code}", flush=True)
        os._exit(args.fail_code)

    # Which ranks share this rank's /dev/shm? Each rank drops a file, then looks.
    shm_name = f"/dev/shm/vnodejob-{os.environ['MASTER_PORT']}-{rank}"

    def on_term(signum, frame):  # torchrun stops the others when one rank fails: tidy up
        try:
            os.unlink(shm_name)
        except OSError:
            pass
        os._exit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)
    with open(shm_name, "w") as f:
        f.write(str(rank))
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)  # also a barrier: every rank has written its file
        expected = world * (world + 1) / 2
        assert t.item() == expected, (t.item(), expected)
        prefix = f"vnodejob-{os.environ['MASTER_PORT']}-"
        shm_peers = sorted(int(n[len(prefix):]) for n in os.listdir("/dev/shm")
                           if n.startswith(prefix))
        dist.barrier()  # nobody removes its file before everyone has looked
    finally:
        os.unlink(shm_name)

    latency = None
    if args.latency_iters:
        x = torch.zeros(1)
        dist.all_reduce(x)
        start = time.perf_counter()
        for _ in range(args.latency_iters):
            dist.all_reduce(x)
        latency = (time.perf_counter() - start) / args.latency_iters

    send_mbps = None
    if args.send_bytes and world > 1 and rank in (0, world - 1):
        payload, ack = torch.zeros(args.send_bytes, dtype=torch.uint8), torch.zeros(1)
        peer = world - 1 - rank
        for timed in (False, True):  # a small warm-up exchange first
            data = payload if timed else payload[:64]
            start = time.perf_counter()
            if rank == 0:
                dist.send(data, peer)
                dist.recv(ack, peer)
            else:
                dist.recv(data, peer)
                dist.send(ack, peer)
            if timed and rank == 0:
                send_mbps = args.send_bytes / (time.perf_counter() - start) / 1e6

    matrix_fails = None
    if args.matrix:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from one_node import test_collectives as tc
        matrix_fails = []
        for fn in (tc.all_reduce_matrix, tc.gather_family_matrix, tc.reduce_family_matrix,
                   tc.alltoall_matrix):
            matrix_fails += fn(rank, world)

    neuron_nodes = None
    if args.backend == "neuron":  # how the backend itself grouped the ranks into nodes
        topo = dist.group.WORLD._get_backend(torch.device("cpu"))._topo
        neuron_nodes = [list(n) for n in topo.nodes]

    report = {
        "matrix_fails": matrix_fails, "neuron_nodes": neuron_nodes,
        "rank": rank, "world": world, "local_rank": int(os.environ["LOCAL_RANK"]),
        "group_rank": int(os.environ["GROUP_RANK"]), "sum": t.item(),
        "hostname": socket.gethostname(),
        "node_name": os.environ.get("NEURON_DIST_NODE_NAME"),
        "socket_ifname": os.environ.get("NEURON_DIST_SOCKET_IFNAME"),
        "shm_dev": os.stat("/dev/shm").st_dev, "shm_peers": shm_peers,
        "ip": local_ip(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
        "master_addr": os.environ["MASTER_ADDR"], "allreduce_s": latency,
        "send_MBps": send_mbps,
    }
    # One write() per line (< PIPE_BUF, so atomic): ranks of a node share one pipe.
    sys.stdout.write("VNODE_JOB " + json.dumps(report) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
