"""A back-to-back loop of one small operation, for latency and for profiling.

The sweep (``python -m bench``) puts a barrier before every timed sample of up
to 16 operations, so its small-message times still carry a share of how unevenly ranks
leave that barrier. This loop issues the operation back to back for a fixed time, with no
barrier at all, and prints the mean time per operation. Run it under a sampling profiler
to see where a small collective's time goes, e.g.::

    py-spy record -r 300 -f raw -o prof.txt -- python -m bench.hotloop -n 1
    python -m bench.hotloop --summarise prof.txt   # share of time per frame
    python -m bench.hotloop -n 2 --backend gloo
    python -m bench.hotloop -n 2 --nodes 2   # virtual nodes on loopback

``--nodes K`` splits the ranks into K virtual nodes (``NEURON_DIST_NODE_NAME``), so neuron
goes over its inter-node transport on loopback (for a real link use ``bench.internode``).
``--thread-cpu`` adds, per rank, the CPU time each thread spent per operation (user +
system, from /proc; resolution one clock tick over the whole loop): a sampling profile
shows where Python spends its time, this shows which thread is busy and how much of it
is the kernel (copies, wake-ups), e.g. for a 2 MiB all_reduce between two nodes::

    python -m bench.hotloop -n 2 --nodes 2 --bytes 2097152 --thread-cpu

``send_recv`` is a round trip between ranks 0 and 1 (the others idle): with ``-n 4 --nodes
2`` the two share a node in a group that spans nodes.

Each rank uses one torch thread unless ``--threads`` says otherwise; ``--threads 0`` keeps
torch's default (a thread per core in every rank), as a script that sets nothing gets.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = ("all_reduce", "broadcast", "all_gather", "send_recv")


def make_op(name: str, rank: int, world: int, t: torch.Tensor, group=None):
    """One operation ``name`` (of ``OPS``) on ``t`` over ``group`` (default: the world) as a
    callable without arguments; ``send_recv`` is one round trip between ranks 0 and 1."""
    if name == "all_reduce":
        return lambda: dist.all_reduce(t, group=group)
    if name == "broadcast":
        return lambda: dist.broadcast(t, 0, group=group)
    if name == "all_gather":
        out = torch.empty(world * t.numel(), dtype=t.dtype)
        return lambda: dist.all_gather_into_tensor(out, t, group=group)
    peer = 1 - rank  # send_recv: ping-pong between ranks 0 and 1, one round trip per op
    if rank > 1:
        return lambda: None
    if rank == 0:
        return lambda: (dist.send(t, peer, group=group), dist.recv(t, peer, group=group))
    return lambda: (dist.recv(t, peer, group=group), dist.send(t, peer, group=group))


def thread_cpu() -> dict:
    """{thread name: [user seconds, system seconds]} of this process's threads (Linux /proc;
    threads that Python did not start are named by their id)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread has ended
            continue
        cpu = out.setdefault(names.get(int(task), f"thread {task}"), [0.0, 0.0])
        cpu[0] += int(fields[11]) / tick  # utime, stime: fields 14 and 15 of stat(5)
        cpu[1] += int(fields[12]) / tick
    return out


def _cpu_line(rank: int, before: dict, after: dict, n: int) -> str:
    used = {k: (u - before.get(k, (0, 0))[0], s - before.get(k, (0, 0))[1])
            for k, (u, s) in after.items()}
    busy = sorted(((u + s, k, u, s) for k, (u, s) in used.items() if u + s > 0), reverse=True)
    parts = [f"{k} {u / n * 1e6:.0f}+{s / n * 1e6:.0f}" for _, k, u, s in busy]
    return (f"rank {rank} CPU per operation, user+system us by thread: "
            + (", ".join(parts) or "none measurable"))


def _say(line: str) -> None:
    """One line in one write: the ranks share stdout (print writes the newline apart)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _rank(rank: int, world: int, port: int, args) -> None:
    os.environ["NEURON_DIST_NODE_NAME"] = f"hotloop-node{rank * args.nodes // world}"
    import neuron_dist  # noqa: F401 - registers the backend in spawned processes
    from bench import job_floor_pg, null_pg, shm_floor_pg
    null_pg.register()  # --backend null: the dispatch floor (its ranks never synchronise)
    shm_floor_pg.register()  # --backend neuron_shm_floor: shared memory and nothing else
    job_floor_pg.register()  # --backend floor: that inside a node, plain TCP between nodes
    if args.threads:
        torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group(args.backend, store=store, rank=rank, world_size=world)
    t = torch.ones(max(1, args.bytes // 4))
    op = make_op(args.op, rank, world, t)
    for _ in range(200):
        op()
    # Every rank runs the same number of operations: rank 0 decides it from a short probe.
    dist.barrier()
    started = time.perf_counter()
    for _ in range(200):
        op()
    probe = (time.perf_counter() - started) / 200
    count = torch.tensor([max(1, int(args.seconds / max(probe, 1e-6)))])
    dist.broadcast(count, 0)
    n = int(count.item())
    # What set-up made is never collected again: a full collection of it (tens of ms with
    # torch loaded) would land in some loops and not others (bench.instructions does this too)
    gc.collect()
    gc.freeze()
    dist.barrier()
    before = thread_cpu() if args.thread_cpu else None
    started = time.perf_counter()
    for _ in range(n):
        op()
    per_op = (time.perf_counter() - started) / n
    if before is not None:
        _say(_cpu_line(rank, before, thread_cpu(), n))
    if rank == 0:
        _say(f"{args.backend} {args.op} {t.numel() * 4} B, {world} rank(s) on "
             f"{args.nodes} node(s): {per_op * 1e6:.1f} us per operation ({n} back to back)")
    dist.barrier()  # (send_recv: ranks 2.. finish their loop at once)
    dist.destroy_process_group()


def summarise(path: str, top: int = 30) -> str:
    """Inclusive share of samples per frame (function and line) of a py-spy raw profile,
    counting only samples inside the timed loop."""
    from collections import Counter
    inclusive, total = Counter(), 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            if not any(fr.startswith("_rank (") and "hotloop.py" in fr for fr in frames):
                continue
            total += int(count)
            for fr in set(frames):
                inclusive[fr] += int(count)
    lines = [f"{total} samples in the loop; inclusive share per frame:"]
    lines += [f"{100 * n / max(total, 1):5.1f}%  {fr[:140]}" for fr, n in inclusive.most_common(top)]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.hotloop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nprocs", type=int, default=2)
    p.add_argument("--backend", default="neuron")
    p.add_argument("--op", choices=OPS, default="all_reduce")
    p.add_argument("--bytes", type=int, default=8, help="float32 elements x 4 (default 8)")
    p.add_argument("--seconds", type=float, default=5.0, help="length of the timed loop")
    p.add_argument("--nodes", type=int, default=1, help="virtual nodes the ranks are split into")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per rank (0: torch's default, a thread per core)")
    p.add_argument("--thread-cpu", action="store_true",
                   help="also print each rank's CPU time per operation by thread")
    p.add_argument("--summarise", metavar="RAW", help="print a py-spy raw profile's summary and exit")
    args = p.parse_args(argv)
    if args.summarise:
        print(summarise(args.summarise))
        return
    if not 1 <= args.nodes <= args.nprocs:
        p.error("--nodes must be between 1 and the number of ranks")
    if args.op == "send_recv" and args.nprocs < 2:
        p.error("send_recv needs -n 2 or more")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.nprocs == 1:
        _rank(0, 1, port, args)
    else:
        mp.spawn(_rank, args=(args.nprocs, port, args), nprocs=args.nprocs)


if __name__ == "__main__":
    main()
