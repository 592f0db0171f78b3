"""Cost of authenticated frames: ``python -m bench.frame_auth [--json FILE]``.

Two processes on loopback, each holding three rdm transports (three groups) to the other:

* ``off``: no frame authentication (no ``NEURON_DIST_AUTH_KEY``, the default);
* ``headers``: every header and every ack tagged with the rail's session key (what
  ``NEURON_DIST_AUTH_KEY`` turns on);
* ``payload``: payloads too (``NEURON_DIST_NET_MAC=1``).

Per repetition the three are measured one after the other, size by size (interleaved, so
machine noise hits all alike); the table gives medians and each mode's ratio to ``off`` of
the same run. Small sizes: ping-pong (one-way latency = round trip / 2). Large sizes: one
direction, ``count`` messages in flight then a 1-byte ack (GB/s). Bounded by ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np

from neuron_dist.transport.rdm.driver import RdmTransport

MODES = {"off": {}, "headers": {"frame_mac": True},
         "payload": {"frame_mac": True, "payload_mac": True}}
PINGPONG = [8, 64 << 10]
STREAM = [(1 << 20, 16), (16 << 20, 4)]


def _pingpong(t, rank, n, iters, deadline):
    buf, back = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
    peer = 1 - rank
    start = time.perf_counter()
    for _ in range(iters):
        if rank == 0:
            t.isend(peer, 1, buf).wait(deadline)
            t.irecv(peer, 2, back).wait(deadline)
        else:
            t.irecv(peer, 1, back).wait(deadline)
            t.isend(peer, 2, buf).wait(deadline)
    return (time.perf_counter() - start) / iters / 2


def _stream(t, rank, n, count, bufs, deadline):
    ack = np.zeros(1, np.uint8)
    start = time.perf_counter()
    if rank == 0:
        reqs = [t.isend(1, 3, bufs[i]) for i in range(count)]
        for r in reqs:
            r.wait(deadline)
        t.irecv(1, 4, ack).wait(deadline)
    else:
        reqs = [t.irecv(0, 3, bufs[i]) for i in range(count)]
        for r in reqs:
            r.wait(deadline)
        t.isend(0, 4, ack).wait(deadline)
    return n * count / (time.perf_counter() - start) / 1e9


def _rank(rank, conn, reps, rails, iters, timeout):
    deadline = time.monotonic() + timeout
    ts = {m: RdmTransport(rank, 2, host="127.0.0.1", rails=rails, key=b"k" * 32,
                          group=f"frame-auth-bench-{m}".encode(), **kw)
          for m, kw in MODES.items()}
    try:
        conn.send({m: t.address for m, t in ts.items()})
        peer = conn.recv()
        for m, t in ts.items():
            t.connect({1 - rank: peer[m]}, deadline)
        bufs = {n: [np.ones(n, np.uint8) for _ in range(count)] for n, count in STREAM}
        rows = []
        for rep in range(reps + 1):  # repetition 0 warms up
            for n in PINGPONG:
                for m, t in ts.items():
                    v = _pingpong(t, rank, n, iters, deadline)
                    if rep:
                        rows.append({"mode": m, "op": "pingpong", "bytes": n, "us": v * 1e6})
            for n, count in STREAM:
                for m, t in ts.items():
                    v = _stream(t, rank, n, count, bufs[n], deadline)
                    if rep:
                        rows.append({"mode": m, "op": "stream", "bytes": n, "GBps": v})
        if rank == 0:
            conn.send(rows)
    finally:
        for t in ts.values():
            t.close()
        conn.close()


def summarize(rows):
    """[(op, bytes, mode, median, ratio to off)] from the per-repetition rows."""
    out = []
    keys = sorted({(r["op"], r["bytes"]) for r in rows}, key=lambda k: (k[0] != "pingpong", k[1]))
    for op, n in keys:
        metric = "us" if op == "pingpong" else "GBps"
        med = {m: statistics.median(r[metric] for r in rows
                                    if r["op"] == op and r["bytes"] == n and r["mode"] == m)
               for m in MODES}
        for m in MODES:
            out.append((op, n, m, med[m], med[m] / med["off"]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rails", type=int, default=1)
    p.add_argument("--iters", type=int, default=200, help="ping-pongs per measurement")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    ctx = mp.get_context("fork")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_rank, args=(r, pipes[r][1], a.reps, a.rails, a.iters,
                                               a.timeout)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        addrs = [pipes[r][0].recv() for r in range(2)]
        pipes[0][0].send(addrs[1])
        pipes[1][0].send(addrs[0])
        if not pipes[0][0].poll(a.timeout):
            print("timed out", file=sys.stderr)
            return 1
        rows = pipes[0][0].recv()
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    print(f"# python -m bench.frame_auth {' '.join(argv or sys.argv[1:])}")
    print(f"# loopback, 2 processes, {a.rails} rail(s), medians of {a.reps} interleaved "
          f"repetitions; ratio = mode / off of this run ({os.cpu_count()} CPUs)")
    print(f"{'op':<9} {'bytes':>10} {'mode':<8} {'value':>12} {'ratio':>7}")
    table = summarize(rows)
    for op, n, m, v, ratio in table:
        unit = "us one-way" if op == "pingpong" else "GB/s"
        print(f"{op:<9} {n:>10} {m:<8} {v:>8.2f} {unit:<4} {ratio:>6.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "summary": table, "reps": a.reps, "rails": a.rails}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
