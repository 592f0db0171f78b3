"""Python calls and CPU per small collective between nodes, per rank: ``python -m bench.net_calls``.

``python -m bench.net_calls --nodes 8 [--op all_reduce|barrier|broadcast] [--bytes 8]
[--calls 500] [--backends neuron,floor]``

How it works
------------
``launch/vnodes.py --netns`` starts N virtual nodes of one rank each (a real torchrun
static rendezvous, every node a network namespace), and every rank runs this module as
its worker (``--worker``): it makes the call 300 times to warm up, then ``--calls`` times
under ``cProfile`` and prints the Python calls the calling thread made per call (the
thread that waits drives the progress engine itself: the engine's own thread polls only
when nobody has waited for a while, transport/rdm/progress.py), then as many calls again
unprofiled and prints the process's CPU time per call (every thread: user + system, and
each apart) and its voluntary context switches (wake-ups) per call. Each rank's line
comes back through vnodes; the table has one row per rank: its role in the tree the call
takes shows in its counts (at 8 nodes the 8-byte all_reduce's root is rank 0, its leaves
the odd ranks).

``--backends`` runs the same worker over each backend in turn: ``neuron``, and ``floor``
(``neuron_floor``, bench/floor_pg.py: the same binomial trees over one blocking TCP
connection per pair, nothing else), so the two tables show what neuron's path costs
above the same messages moved by the plainest Python (the c10d wrapper counts in both).

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


BACKENDS = {"neuron": "neuron", "floor": "neuron_floor"}


def _worker(backend: str, op: str, nbytes: int, calls: int) -> None:
    import cProfile
    import pstats
    import resource

    import torch
    import torch.distributed as dist

    import neuron_dist  # noqa: F401  (registers the backend)

    if backend == "neuron_floor":
        from . import floor_pg
        floor_pg.register()
    dist.init_process_group(backend)
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
    r0, c0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
    for _ in range(calls):
        call()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    r1 = resource.getrusage(resource.RUSAGE_SELF)

    def per_call_us(seconds: float) -> float:
        return round(seconds / calls * 1e6, 1)

    print(MARK + json.dumps({"rank": rank, "calls": round(counted, 1),
                             "cpu_us": per_call_us(cpu), "wall_us": per_call_us(wall),
                             "user_us": per_call_us(r1.ru_utime - r0.ru_utime),
                             "sys_us": per_call_us(r1.ru_stime - r0.ru_stime),
                             "wakeups": round((r1.ru_nvcsw - r0.ru_nvcsw) / calls, 2)}),
          flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.net_calls", description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=8, help="virtual nodes, one rank each")
    p.add_argument("--op", choices=("all_reduce", "broadcast", "barrier"), default="all_reduce")
    p.add_argument("--bytes", type=int, default=8, help="buffer size (all_reduce, broadcast)")
    p.add_argument("--calls", type=int, default=500, help="profiled calls (and timed ones)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="bound on each backend's run, s")
    p.add_argument("--backends", default="neuron,floor",
                   help=f"comma list of {', '.join(BACKENDS)}, run in this order")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.op, args.bytes, args.calls)
        return 0
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        p.error(f"--backends: unknown {unknown} (known: {', '.join(BACKENDS)})")
    from neuron_dist.launch import vnodes

    env = {"NEURON_DIST_SOCKET_IFNAME": vnodes.NODE_IFNAME, "OMP_NUM_THREADS": "1"}
    tables = {}
    for backend in backends:
        job = ["-m", "bench.net_calls", "--worker", BACKENDS[backend], "--op", args.op,
               "--bytes", str(args.bytes), "--calls", str(args.calls)]
        res = vnodes.run(args.nodes, 1, job, netns=True, timeout=args.timeout, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        rows = sorted((json.loads(line[len(MARK):]) for line in res.stdout
                       if line.startswith(MARK)), key=lambda r: r["rank"])
        if res.returncode != 0 or len(rows) != args.nodes:
            sys.stderr.write("".join(res.stderr[-40:]))
            print(f"net_calls: the {backend} run failed (exit {res.returncode}, {len(rows)} "
                  f"of {args.nodes} ranks reported)", file=sys.stderr)
            return 1
        tables[backend] = rows
    print(f"# python -m bench.net_calls --nodes {args.nodes} --op {args.op} --bytes {args.bytes} "
          f"--calls {args.calls} --backends {','.join(backends)}")
    print(f"# {args.nodes} netns virtual nodes x 1 rank; per call of {args.op}: Python calls "
          f"of the calling thread (cProfile), then the process's CPU (user + system, and each), "
          f"voluntary context switches (wake-ups) and wall time, unprofiled")
    for backend, rows in tables.items():
        print(f"# {backend}")
        print(f"{'rank':>4} {'calls':>8} {'CPU us':>8} {'user us':>8} {'sys us':>8} "
              f"{'wakeups':>8} {'wall us':>8}")
        for r in rows:
            print(f"{r['rank']:>4} {r['calls']:>8.1f} {r['cpu_us']:>8.1f} {r['user_us']:>8.1f} "
                  f"{r['sys_us']:>8.1f} {r['wakeups']:>8.2f} {r['wall_us']:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
