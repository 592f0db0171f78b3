"""Rank side of the inter-node benchmark (``bench.internode``); runs under torchrun.

Launched by ``launch/vnodes.py`` (one torchrun agent per virtual node), so every rank reads
torchrun's env:// variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

Groups, all over the same ranks, created in the same order on every rank:

* the default group is **gloo**: the control plane (agreement on errors, gathering the
  per-rank timings). It is never timed.
* one **neuron** group per rail count (``--rails 1,4``): ``NEURON_DIST_RAILS`` is read by
  ``Settings.from_env()`` each time the backend creates a group, so this process sets
  ``os.environ["NEURON_DIST_RAILS"]`` just before each ``dist.new_group(backend="neuron")``
  (and restores it afterwards). The rail count the group really uses is read back from
  the group (``settings.rails`` and its transport) and reported.
* one more **gloo** group: the gloo under test (separate from the control group).

For each size (ascending), the ops that include it run in turn: ``pingpong``, ``p2p``,
``all_reduce``, ``all_gather``, ``reduce_scatter``; within an op, every backend measures the same buffers, the order of the
backends rotating from one size to the next so that machine noise hits all of them alike.

p2p (rank 0 -> rank 1, like osu_bw): one iteration = rank 0 posts ``W`` ``isend``s of
the size at once and waits for them, rank 1 posts ``W`` ``irecv``s (into distinct
buffers) and waits, then sends a one-element acknowledgement; rank 0 times from its first
isend to the arrival of the ack, on its own clock. GB/s = W x size / time.
``W = clamp(window_bytes / size, 1, 64)`` keeps messages in flight at small sizes and
amortises the ack's latency; large messages go one per iteration.

all_reduce (SUM, float32, in place): per iteration the buffer is refilled, then a barrier
of the backend under test, then a batch of ops back to back (``sweep.ops_per_sample``: up
to 16 for small sizes) is timed on every rank; iteration time = their mean, max over ranks
(as ``bench/sweep.py``).

pingpong (send/recv round trip, rank 0 -> 1 -> 0): timed like all_reduce (batches after a
barrier), on rank 0's clock; time_us per round trip.

all_gather (``all_gather_into_tensor``; size = the gathered buffer) and reduce_scatter
(``reduce_scatter_tensor``, SUM; size = the input): timed like all_reduce; busbw =
algbw x (n-1)/n.

All: time = median over iterations (min also kept). ``cpu_us``: per rank, the CPU time of the
whole process (every thread, user and system) over the timed iterations, per operation
(p2p: per message), barriers included. Wall time also counts waiting for the peer and for
a core; CPU time says how much work each backend did (it too grows on a loaded machine:
caches and cores are shared). Before timing, warm-up iterations,
after which the result is checked once (p2p: the received bytes; all_reduce: the sum).
A backend that fails (any rank raised) gets an error row and is skipped for the rest of
the run; the others go on.

Output: rank 0 prints one ``INTERNODE {json}`` line per result (and a ``meta`` line first,
a ``done`` line last), flushed at once, so the parent has partial results even if the run
is cut short.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from neuron_dist.config import environment
from . import floor_pg
from .sweep import ops_per_sample, time_iterations

TAG = "INTERNODE "
FLOOR_OPS = ("pingpong", "p2p", "all_reduce")  # what the floor backend measures


_PROGRESS = None  # file the parent tails for progress lines (--progress)


def _cpu() -> float:
    """CPU seconds of this whole process so far (every thread, user and system)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _emit(obj: dict) -> None:
    line = TAG + json.dumps(obj) + "\n"
    sys.stdout.write(line)
    sys.stdout.flush()
    if _PROGRESS is not None:
        try:
            _PROGRESS.write(line)
            _PROGRESS.flush()
        except OSError:
            pass


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _err(exc: BaseException) -> str:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"[:400]


def _backend_obj(group):
    """The ProcessGroupNeuron behind a group (torch may hand back a wrapper)."""
    if hasattr(group, "settings"):
        return group
    try:
        return group._get_backend(torch.device("cpu"))
    except Exception:  # noqa: BLE001
        return None


def _neuron_group(rails: int, timeout: timedelta):
    old = environment().get("NEURON_DIST_RAILS")
    os.environ["NEURON_DIST_RAILS"] = str(rails)
    try:
        group = dist.new_group(backend="neuron", timeout=timeout)
    finally:
        if old is None:
            os.environ.pop("NEURON_DIST_RAILS", None)
        else:
            os.environ["NEURON_DIST_RAILS"] = old
    pg = _backend_obj(group)
    info = {"requested_rails": rails}
    if pg is not None:
        net = getattr(pg, "_net", None)
        topo = getattr(pg, "_topo", None)
        info.update(settings_rails=getattr(getattr(pg, "settings", None), "rails", None),
                    transport_rails=getattr(net, "nrails", None),
                    address=getattr(net, "address", None),
                    spans_nodes=net is not None,
                    topology=topo.describe() if topo is not None else None)
    return group, info


class Control:
    """Agreement and gathering over the (untimed) default gloo group."""

    def __init__(self, world: int):
        self.world = world

    def all(self, value):
        out = [None] * self.world
        dist.all_gather_object(out, value)
        return out


def _p2p_window(size: int, window_bytes: int) -> int:
    return max(1, min(64, window_bytes // max(1, size)))


def _iters_for(size: int, iters: int, min_iters: int, budget: int) -> int:
    return max(min_iters, min(iters, budget // max(1, size)))


def _p2p_case(rank: int, count: int, window: int):
    """Rank 0: one send buffer (sent W times); rank 1: W distinct receive buffers."""
    n = window if rank == 1 else 1
    flat = torch.empty(count * n, dtype=torch.float32)
    views = [flat[i * count:(i + 1) * count] for i in range(n)]
    return flat, views, torch.zeros(1, dtype=torch.float32)


def _p2p_run(rank: int, views, ack, window: int, group):
    """One iteration: W isends (rank 0) / W irecvs (rank 1) in flight at once, then an ack."""
    if rank == 0:
        buf = views[0]

        def run():
            works = [dist.isend(buf, 1, group=group) for _ in range(window)]
            for w in works:
                w.wait()
            dist.recv(ack, 1, group=group)
    elif rank == 1:
        def run():
            works = [dist.irecv(v, 0, group=group) for v in views]
            for w in works:
                w.wait()
            dist.send(ack, 0, group=group)
    else:
        def run():
            pass
    return run


def measure(op: str, size: int, backend: str, group, rank: int, world: int, ctl: Control,
            args, bufs: dict) -> dict:
    """One (op, size, backend) cell; every rank returns the same row."""
    count = max(1, size // 4)
    nbytes = count * 4
    iters = _iters_for(nbytes, args.iters, args.min_iters, args.iter_bytes)
    warmup = max(1, min(args.warmup, args.iter_bytes // nbytes))
    row = {"kind": "row", "op": op, "bytes": nbytes, "backend": backend, "world": world,
           "iters": iters, "warmup": warmup}
    barrier = lambda: dist.barrier(group=group)  # noqa: E731
    err = bad = None
    samples: list[float] = []
    cpu0 = 0.0
    t_cell = time.monotonic()
    try:
        if op == "p2p":
            window = bufs["window"]
            row["window"] = window
            flat, views, ack = bufs["p2p"]
            flat.fill_(7.0 if rank == 0 else -1.0)
            run = _p2p_run(rank, views, ack, window, group)
            time_iterations(run, barrier, warmup)
            if rank == 1 and not bool((flat == 7.0).all()):
                bad = f"rank 1 received wrong data (first value {flat[0].item()})"
            cpu0 = _cpu()
            samples = time_iterations(run, barrier, iters)
        elif op == "pingpong":
            x = bufs["pingpong"]
            peer = 1 - rank
            def run():  # one round trip: rank 0 -> 1 -> 0
                if rank == 0:
                    dist.send(x, peer, group=group)
                    dist.recv(x, peer, group=group)
                elif rank == 1:
                    dist.recv(x, peer, group=group)
                    dist.send(x, peer, group=group)
            x.fill_(float(rank))
            time_iterations(run, barrier, 1)
            if not bool((x == 0.0).all()):
                bad = f"rank {rank}: ping-pong data wrong (got {x[0].item()})"
            batch = row["batch"] = ops_per_sample(nbytes)
            if warmup > 1:
                time_iterations(run, barrier, warmup - 1, None, batch)
            cpu0 = _cpu()
            samples = time_iterations(run, barrier, iters, None, batch)
        elif op in ("all_gather", "reduce_scatter"):
            inp, outp = bufs[op]
            if op == "all_gather":  # size = the gathered buffer; each rank gives 1/world
                inp.fill_(float(rank + 1))
                run = lambda: dist.all_gather_into_tensor(outp, inp, group=group)  # noqa: E731
                want = torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(
                    inp.numel())
            else:  # size = the input; each rank gets the sum of its 1/world share
                inp.fill_(float(rank + 1))
                run = lambda: dist.reduce_scatter_tensor(outp, inp, group=group)  # noqa: E731
                want = torch.full_like(outp, world * (world + 1) / 2)
            time_iterations(run, barrier, 1)
            if not torch.equal(outp, want):
                bad = f"rank {rank}: {op} result wrong (first value {outp[0].item()})"
            batch = row["batch"] = ops_per_sample(nbytes)
            if warmup > 1:
                time_iterations(run, barrier, warmup - 1, None, batch)
            cpu0 = _cpu()
            samples = time_iterations(run, barrier, iters, None, batch)
        else:
            buf = bufs["all_reduce"]
            buf.fill_(float(rank + 1))
            run = lambda: dist.all_reduce(buf, group=group)  # noqa: E731
            time_iterations(run, barrier, 1)
            want = world * (world + 1) / 2
            if not bool((buf == want).all()):
                bad = f"rank {rank}: sum wrong (got {buf[0].item()}, want {want})"
            batch = row["batch"] = ops_per_sample(nbytes)
            refill = lambda: buf.fill_(1.0)  # noqa: E731 - doubles per op: exact in float32
            if warmup > 1:
                time_iterations(run, barrier, warmup - 1, refill, batch)
            cpu0 = _cpu()
            samples = time_iterations(run, barrier, iters, refill, batch)
    except Exception as exc:  # noqa: BLE001 - a failing backend must not stop the others
        err = _err(exc)
        if args.verbose:
            traceback.print_exc(file=sys.stderr)
    cpu_s = _cpu() - cpu0 if samples else None
    row["cell_s"] = round(time.monotonic() - t_cell, 3)
    shared = ctl.all([samples, err, bad, cpu_s])
    errors = [(r, s[1]) for r, s in enumerate(shared) if s[1]]
    if errors:
        row.update(status="error", error=f"rank {errors[0][0]}: {errors[0][1]}",
                   errors={str(r): e for r, e in errors})
        return row
    bads = [s[2] for s in shared if s[2]]
    if op == "p2p":
        per_iter = shared[0][0]  # rank 0's clock spans the whole exchange
        moved = nbytes * row["window"]
    elif op == "pingpong":
        per_iter = shared[0][0]  # rank 0's clock spans the round trip
        moved = nbytes
    else:
        per_iter = [max(v) for v in zip(*[s[0] for s in shared])]
        moved = nbytes
    med = statistics.median(per_iter)
    fastest = min(per_iter)
    ops = len(per_iter) * row.get("batch", 1) * (row["window"] if op == "p2p" else 1)
    row["cpu_us"] = [round(s[3] / ops * 1e6, 2) if s[3] is not None else None for s in shared]
    row.update(status="ok", check="FAIL" if bads else "OK", time_us=round(med / (moved / nbytes) * 1e6, 3),
               min_us=round(fastest / (moved / nbytes) * 1e6, 3),
               iter_s=[round(x, 6) for x in per_iter])
    algbw = moved / med / 1e9
    row["algbw_gbs"] = float(f"{algbw:.6g}")
    factor = {"p2p": 1.0, "pingpong": 2.0, "all_reduce": 2 * (world - 1) / world}.get(
        op, (world - 1) / world)  # (pingpong: both directions; all_gather, reduce_scatter)
    row["busbw_gbs"] = float(f"{algbw * factor:.6g}")
    row["best_gbs"] = float(f"{moved / fastest / 1e9 * factor:.6g}")
    if bads:
        row["note"] = bads[0]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--p2p-sizes", type=_ints, required=True, help="bytes, comma list")
    p.add_argument("--ar-sizes", type=_ints, required=True, help="bytes, comma list")
    p.add_argument("--ag-sizes", type=_ints, default=[], help="bytes, comma list")
    p.add_argument("--rs-sizes", type=_ints, default=[], help="bytes, comma list")
    p.add_argument("--pp-sizes", type=_ints, default=[], help="bytes, comma list")
    p.add_argument("--rails", type=_ints, default=[1, 4])
    p.add_argument("--no-gloo", action="store_true")
    p.add_argument("--floor", action="store_true",
                   help="also measure neuron_floor (bench/floor_pg.py: raw TCP, as many "
                        "streams as the most rails) on ping-pongs, p2p and all_reduces")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iter-bytes", type=int, default=256 << 20,
                   help="iterations per size = clamp(this / size, min-iters, iters)")
    p.add_argument("--window-bytes", type=int, default=16 << 20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=60.0)
    p.add_argument("--progress", metavar="FILE", help="also append the output lines here")
    p.add_argument("--tag", default="", help="marker on the command line (tests)")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    global _PROGRESS
    if args.progress and int(os.environ.get("RANK", "0")) == 0:
        _PROGRESS = open(args.progress, "a")

    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=args.pg_timeout)
    t0 = time.monotonic()
    dist.init_process_group("gloo", timeout=timeout)
    ctl = Control(world)

    groups, infos = {}, {}
    for rails in args.rails:
        name = f"neuron-{rails}rail" + ("s" if rails != 1 else "")
        try:
            groups[name], infos[name] = _neuron_group(rails, timeout)
        except Exception as exc:  # noqa: BLE001
            infos[name] = {"requested_rails": rails, "error": _err(exc)}
            traceback.print_exc(file=sys.stderr)
    if not args.no_gloo:
        groups["gloo"] = dist.new_group(backend="gloo", timeout=timeout)
        infos["gloo"] = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME")}
    if args.floor:
        streams = max(args.rails)
        floor_pg.register(streams)
        try:
            groups["floor"] = dist.new_group(backend=floor_pg.BACKEND_NAME, timeout=timeout)
            infos["floor"] = {"what": f"raw TCP: {streams} connection(s) per pair, no protocol",
                              "streams": streams}
        except Exception as exc:  # noqa: BLE001
            infos["floor"] = {"error": _err(exc)}
            traceback.print_exc(file=sys.stderr)
    setup_s = time.monotonic() - t0
    env = environment()
    ident = {"rank": rank, "hostname": socket.gethostname(),
             "node_name": env.get("NEURON_DIST_NODE_NAME"),
             "socket_ifname": env.get("NEURON_DIST_SOCKET_IFNAME"),
             "groups": infos, "setup_s": round(setup_s, 3)}
    everyone = ctl.all(ident)
    # A group that failed on any rank is unusable on all of them.
    failed = {n for who in everyone for n, i in who["groups"].items() if "error" in i}
    backends = [b for b in groups if b not in failed]
    if rank == 0:
        _emit({"kind": "meta", "ranks": everyone, "backends": list(groups) + sorted(failed - set(groups)),
               "torch": torch.__version__, "threads": args.threads})
        for n in sorted(failed):
            errs = {str(w["rank"]): w["groups"][n]["error"] for w in everyone
                    if "error" in w["groups"].get(n, {})}
            _emit({"kind": "row", "op": "setup", "backend": n, "status": "error",
                   "error": "; ".join(f"rank {r}: {e}" for r, e in errs.items())})

    per_op = (("pingpong", args.pp_sizes), ("p2p", args.p2p_sizes), ("all_reduce", args.ar_sizes),
              ("all_gather", args.ag_sizes), ("reduce_scatter", args.rs_sizes))
    sizes = sorted(set().union(*(set(s) for _, s in per_op)))
    dead: dict[str, str] = {}
    for i, size in enumerate(sizes):
        for op, op_sizes in per_op:
            if size not in op_sizes:
                continue
            count = max(1, size // 4)
            if op in ("all_gather", "reduce_scatter"):
                count = max(world, count // world * world)
            if op == "p2p":
                window = _p2p_window(count * 4, args.window_bytes)
                bufs = {"p2p": _p2p_case(rank, count, window), "window": window}
            elif op == "pingpong":
                bufs = {"pingpong": torch.empty(count, dtype=torch.float32)}
            elif op == "all_gather":
                bufs = {op: (torch.empty(count // world), torch.empty(count))}
            elif op == "reduce_scatter":
                bufs = {op: (torch.empty(count), torch.empty(count // world))}
            else:
                bufs = {"all_reduce": torch.empty(count, dtype=torch.float32)}
            k = i % len(backends) if backends else 0
            order = backends[k:] + backends[:k]
            for b in order:
                if b == "floor" and op not in FLOOR_OPS:
                    continue
                if b in dead:
                    row = {"kind": "row", "op": op, "bytes": count * 4, "backend": b,
                           "world": world, "status": "skipped", "error": dead[b]}
                else:
                    row = measure(op, size, b, groups[b], rank, world, ctl, args, bufs)
                    if row["status"] == "error":
                        dead[b] = f"skipped after an earlier failure ({row['op']} {row['bytes']} B)"
                if rank == 0:
                    _emit(row)
            del bufs
    ctl.all("finished")
    if rank == 0:
        _emit({"kind": "done", "seconds": round(time.monotonic() - t0, 2), "dead": dead})
    sys.stdout.flush()
    sys.stderr.flush()
    if dead:
        os._exit(0)  # a broken group may not shut down cleanly: do not risk a hang
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
