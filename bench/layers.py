"""Where a small collective's time goes, layer by layer down the express lane.

``python -m bench.layers [-n 2] [--ops broadcast,all_reduce] [--calls N]
[--rounds R] [--json FILE]``

How it works
------------
Every rank initialises neuron and the ``null`` group (``null_pg``: torch's dispatch to a
Python process group that does nothing), makes one 8-byte float32 call of each op through
``dist`` (which prepares the express lane's entry and plan) and records the arguments the
lane hands to its plan. Then every rank times the same loops, in the same order, of
``--calls`` calls each, each loop entering the stack one layer lower:

========  ===========================================  =====================================
layer     the loop calls                                its own cost (this less the next)
========  ===========================================  =====================================
whole     ``dist.<op>(t)``                              torch's c10d and the process group
lane      ``ExpressLane.<op>(t, opts, seconds)``        the lane: checks, its entry's lookup
run       ``ExpressLane._run(entry, ...)``              the Work kept for reuse, the closure
engine    ``CollectiveEngine.run_now(fn, ...)``         ordering against the engine thread,
                                                        flight recorder, stats, the Work's
                                                        description
call      ``fn(seq, record)``                           the context's ``begin``
plan      ``plan.run(ctx, ...)``                        the plan's torch calls (staging, copy
                                                        out, reduction)
step      ``Context.step()``, a call's first step       the call descriptor: post and check
channel   ``ShmChannel.step()``                         the step itself (with 2 ranks: the
                                                        hand-off between them)
========  ===========================================  =====================================

The calls pair up across ranks because every rank runs the same loops. With 2 ranks each
figure includes one hand-off between them, the same at every layer, so the differences
leave it out; with 1 rank (``-n 1``) there is no peer and every figure is CPU. ``null`` is
timed in the same rounds: ``whole`` less ``null`` is what neuron adds to torch's dispatch.
A round runs every loop once; a figure is the median over rounds of a loop's mean time per
call (rank 0's; its peers run the same loops).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = ("broadcast", "all_reduce")
LAYERS = ("whole", "lane", "run", "engine", "call", "plan", "step", "channel")


def _loops(op: str, t, group, pg) -> dict:
    """Layer name -> a callable making one call at that layer (see the module docstring)."""
    lane, engine = pg._express, pg._engine
    (dist.broadcast(t, 0) if op == "broadcast" else dist.all_reduce(t))  # (prepares the plan)
    entry, args = lane.planned(op, t)  # what the lane hands its plan (ExpressLane.planned)
    outputs, seconds = [t], 300.0  # (each timed call's deadline)
    ctx, plan_run, name = lane._ctx, entry.plan.run, entry.name
    if op == "broadcast":
        opts, lane_call = dist.BroadcastOptions(), lane.broadcast
        opts.rootRank = 0
        whole = lambda: dist.broadcast(t, 0)  # noqa: E731
        null = lambda: dist.broadcast(t, 0, group=group)  # noqa: E731
    else:
        opts, lane_call = dist.AllreduceOptions(), lane.all_reduce
        whole = lambda: dist.all_reduce(t)  # noqa: E731
        null = lambda: dist.all_reduce(t, group=group)  # noqa: E731
    opts.asyncOp = False

    def fn(seq, rec):  # (ExpressLane._run's closure)
        ctx.begin(entry.call, seq, time.monotonic() + seconds, rec)
        plan_run(ctx, *args)

    # Below the engine, each call still takes the group's next sequence number, as the
    # engine would give it: a descriptor is posted by the parity of its call's number.
    def call():
        engine.seq += 1
        fn(engine.seq, None)

    def plan():
        engine.seq = ctx.seq = engine.seq + 1
        ctx._checked = False  # (each call's plan makes the call's first step)
        plan_run(ctx, *args)

    def step():
        engine.seq = ctx.seq = engine.seq + 1
        ctx._checked = False
        ctx.step()

    channel, far = ctx.channel, time.monotonic() + 3600
    return {
        "null": null,
        "whole": whole,
        "lane": lambda: lane_call(t, opts, seconds),
        "run": lambda: lane._run(entry, outputs, seconds, *args),
        "engine": lambda: engine.run_now(fn, entry.work, name, entry.call, entry.nbytes,
                                         entry.algo),
        "call": call,
        "plan": plan,
        "step": step,
        "channel": lambda: channel.step(far),
    }


def _time(loop, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        loop()
    return (time.perf_counter() - started) / calls


def _rank(rank: int, world: int, port: int, args, out) -> None:
    import neuron_dist  # noqa: F401 - registers the backend in spawned processes
    from bench import null_pg
    null_pg.register()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("neuron", store=store, rank=rank, world_size=world)
    group = dist.new_group(backend=null_pg.BACKEND_NAME)
    pg = dist.group.WORLD._get_backend(torch.device("cpu"))
    t = torch.zeros(2)  # (a sum of zeros stays zero, call after call)
    loops = {op: _loops(op, t, group, pg) for op in args.ops}
    for op in args.ops:  # warm up every loop
        for loop in loops[op].values():
            _time(loop, max(1, args.calls // 10))
    gc.collect()
    gc.freeze()
    times = {op: {layer: [] for layer in loops[op]} for op in args.ops}
    for _ in range(args.rounds):
        for op in args.ops:
            for layer, loop in loops[op].items():
                dist.barrier(group=dist.group.WORLD)
                times[op][layer].append(_time(loop, args.calls))
    dist.barrier()
    if rank == 0:
        out.put({op: {layer: statistics.median(v) * 1e6 for layer, v in layers.items()}
                 for op, layers in times.items()})
    dist.destroy_process_group()


_OWN = {"whole": "torch's c10d and the process group", "lane": "the express lane",
        "run": "Work reuse, the call's closure",
        "engine": "engine: ordering, flight recorder, stats",
        "call": "the context's begin", "plan": "the plan's torch calls",
        "step": "the call descriptor", "channel": "the step (and hand-off)"}


def report(result: dict, world: int) -> str:
    """The table ``main`` prints: per op, every layer's time per call and its own cost."""
    lines = [f"# {world} rank(s), 8 B float32; time per call in us (median over rounds of "
             "the loop's mean); own = this layer less the next"]
    for op, times in result.items():
        lines.append(f"{op}: null {times['null']:.2f} us; neuron adds "
                     f"{times['whole'] - times['null']:.2f} us to it")
        lines.append(f"  {'layer':8s} {'time':>7s} {'own':>7s}  own cost of")
        for i, layer in enumerate(LAYERS):
            below = times[LAYERS[i + 1]] if i + 1 < len(LAYERS) else 0.0
            lines.append(f"  {layer:8s} {times[layer]:7.2f} {times[layer] - below:7.2f}  "
                         f"{_OWN[layer]}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.layers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nprocs", type=int, default=2, choices=(1, 2, 3, 4))
    p.add_argument("--ops", default=",".join(OPS), help="comma list of " + ",".join(OPS))
    p.add_argument("--calls", type=int, default=20000, help="calls per loop")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    for op in args.ops:
        if op not in OPS:
            p.error(f"unknown op {op!r} (choose from {', '.join(OPS)})")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_rank, args=(args.nprocs, port, args, out), nprocs=args.nprocs,
                       start_method="spawn")
    result = out.get(timeout=10)
    command = "python -m bench.layers " + " ".join(argv if argv is not None
                                                                 else sys.argv[1:])
    print(f"# {command.strip()}")
    print(f"# load {[round(x, 2) for x in os.getloadavg()]} at end, torch {torch.__version__}")
    print(report(result, args.nprocs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command.strip(), "world": args.nprocs, "calls": args.calls,
                       "rounds": args.rounds, "us_per_call": result}, f, indent=1)


if __name__ == "__main__":
    main()
