"""Python calls and CPU per small collective between nodes, per rank: ``python -m bench.net_calls``.

``python -m bench.net_calls --nodes 8 [--op all_reduce|barrier|broadcast] [--bytes 8]
[--calls 500]``

How it works
------------
``launch/vnodes.py --netns`` starts N virtual nodes of one rank each (a real torchrun
static rendezvous, every node a network namespace), and every rank runs this module as
its worker (``--worker``): it makes the call 300 times to warm up, then ``--calls`` times
under ``cProfile`` and prints the Python calls the calling thread made per call (the
thread that waits drives the progress engine itself: the engine's own thread polls only
when nobody has waited for a while, transport/rdm/progress.py), then as many calls again
unprofiled and prints the process's CPU time (every thread, user + system) per call. Each rank's line comes back through vnodes; the table has one row per
rank: its role in the tree the call takes shows in its counts (at 8 nodes the 8-byte
all_reduce's root is rank 0, its leaves the odd ranks).

A change to the path of a small collective between nodes should not raise these counts:
unlike a time they do not move with the machine's load, though a rank's count varies by a
call or two from run to run with how often its waits poll.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

MARK = "@@net_calls "


def _worker(op: str, nbytes: int, calls: int) -> None:
    import cProfile
    import pstats

    import torch
    import torch.distributed as dist

    import neuron_dist  # noqa: F401  (registers the backend)

    dist.init_process_group("neuron")
    rank = dist.get_rank()
    t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)

    def call() -> None:
        if op == "all_reduce":
            dist.all_reduce(t)
        elif op == "broadcast":
            dist.broadcast(t, 0)
        else:
            dist.barrier()

    for _ in range(300):
        call()
    dist.barrier()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    counted = pstats.Stats(prof).total_calls / calls
    dist.barrier()
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        call()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    print(MARK + json.dumps({"rank": rank, "calls": round(counted, 1),
                             "cpu_us": round(cpu / calls * 1e6, 1),
                             "wall_us": round(wall / calls * 1e6, 1)}), flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.net_calls", description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=8, help="virtual nodes, one rank each")
    p.add_argument("--op", choices=("all_reduce", "broadcast", "barrier"), default="all_reduce")
    p.add_argument("--bytes", type=int, default=8, help="buffer size (all_reduce, broadcast)")
    p.add_argument("--calls", type=int, default=500, help="profiled calls (and timed ones)")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on the whole run, s")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.op, args.bytes, args.calls)
        return 0
    from neuron_dist.launch import vnodes

    env = {"NEURON_DIST_SOCKET_IFNAME": vnodes.NODE_IFNAME, "OMP_NUM_THREADS": "1"}
    job = ["-m", "bench.net_calls", "--worker", "--op", args.op, "--bytes", str(args.bytes),
           "--calls", str(args.calls)]
    res = vnodes.run(args.nodes, 1, job, netns=True, timeout=args.timeout, env=env,
                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rows = sorted((json.loads(line[len(MARK):]) for line in res.stdout if line.startswith(MARK)),
                  key=lambda r: r["rank"])
    if res.returncode != 0 or len(rows) != args.nodes:
        sys.stderr.write("".join(res.stderr[-40:]))
        print(f"net_calls: the run failed (exit {res.returncode}, {len(rows)} of "
              f"{args.nodes} ranks reported)", file=sys.stderr)
        return 1
    print(f"# python -m bench.net_calls --nodes {args.nodes} --op {args.op} --bytes {args.bytes} "
          f"--calls {args.calls}")
    print(f"# {args.nodes} netns virtual nodes x 1 rank; per call of {args.op}")
    print(f"{'rank':>4} {'calls':>8} {'CPU us':>8} {'wall us':>8}")
    for r in rows:
        print(f"{r['rank']:>4} {r['calls']:>8.1f} {r['cpu_us']:>8.1f} {r['wall_us']:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
