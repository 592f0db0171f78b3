"""Inter-node benchmark: ``python -m bench.internode [--json FILE]``.

Two virtual nodes with one rank each, every node in its own network namespace
(``launch/vnodes.py --netns``: 10.x addresses on a bridge, ``eth0`` inside, private
``/dev/shm``), so every byte between the ranks crosses the veth link. One run measures,
interleaved per size, in the same two processes:

* **p2p**: rank 0 ``send`` -> rank 1 ``recv``, one direction (osu_bw style: a window of
  ``isend``/``irecv`` in flight, then a one-element ack; rank 0's clock), GB/s = bytes / time;
* **all_reduce** (float32 SUM, in place): time and nccl-tests busbw
  (algbw x 2(n-1)/n, = algbw for 2 ranks),

for the neuron backend with ``NEURON_DIST_RAILS=1``, with ``NEURON_DIST_RAILS=4`` and for
gloo (``GLOO_SOCKET_IFNAME=eth0``), and, for ping-pongs, p2p and all_reduces, for the
*floor*: ``neuron_floor`` (``bench/floor_pg.py``), a Python process group over raw TCP with
as many connections per pair as neuron's most rails and no protocol at all. For small
messages it is what torch's dispatch to any Python backend plus the socket calls cost in
this run (``floor/gloo`` is the best ratio to gloo a Python backend could show); for large
ones it is the link itself, several raw TCP streams on the same veth (``4r/floor`` is
neuron's share of it). ``--no-floor`` leaves it out. The rank side is ``internode_worker.py`` (see its
docstring for groups and timing); it prints ``INTERNODE {json}`` lines that this command
collects from the launcher's ``Result.stdout``. Progress lines go to stderr while the run
goes (through a temporary file the worker appends to; removed at the end).

Output: the command and set-up on top, one table per op (nccl-tests-like) with a column
pair per backend and the ratios ``4r/gloo`` (neuron 4 rails busbw / gloo busbw: > 1 means
neuron is faster), ``floor/gloo``, ``4r/floor`` and ``4r/1r``; a summary at the large
sizes. Every reference is measured in the same run. ``--json FILE`` writes everything.

Bounded: ``--timeout`` for the whole run (vnodes kills every agent and deletes the
namespaces on every exit path), ``--pg-timeout`` per operation inside the ranks.
Exit status: 0 when every cell ran and checked OK, 1 otherwise, 2 for bad arguments or
when network namespaces are not available (needs root).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import threading

from .sweep import human_size, parse_size

WORKER = "bench.internode_worker"
TAG = "INTERNODE "
OPS = ("pingpong", "p2p", "all_reduce", "all_gather", "reduce_scatter")

EPILOG = """\
p2p: rank 0 -> rank 1 only (osu_bw style). One iteration = W isends posted at once on
rank 0 and W irecvs on rank 1 (W = clamp(--window-bytes / size, 1, 64)), all waited, then
a 1-element ack back; time on rank 0 from its first isend to the ack; time_us below = per
message (iteration / W); GB/s = W x size / time.
all_reduce: buffer refilled, barrier of the backend under test, then a batch of ops back to
back timed on both ranks (16 below 256 KiB, down to 1 from 4 MiB: bench/sweep.py); iteration
time = their mean, max over ranks; busbw = algbw x 2(n-1)/n (nccl-tests).
Both: median over iterations; iterations per size = clamp(--iter-bytes / size, --min-iters,
--iters). Backends take turns in a rotating order per size, in the same processes.

examples:
  python -m bench.internode --json results/internode-veth.json
  python -m bench.internode --p2p-max 16M --ar-max 16M --iters 5
"""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rails(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rails takes counts like 1,4 (got {text!r})") from None
    if not vals or not all(1 <= v <= 64 for v in vals):
        raise argparse.ArgumentTypeError(f"rail counts must be 1..64 (got {text!r})")
    return list(dict.fromkeys(vals))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.internode",
        description="Inter-node p2p bandwidth and all_reduce over a veth link between two "
                    "network-namespace virtual nodes: neuron (1 and 4 rails) vs gloo.",
        epilog=EPILOG, formatter_class=_Formatter)
    s = p.add_argument_group("sizes (bytes; K, M, G = powers of 1024)")
    s.add_argument("--p2p-min", type=_size, default="64K")
    s.add_argument("--p2p-max", type=_size, default="256M")
    s.add_argument("--ar-min", type=_size, default="8")
    s.add_argument("--ar-max", type=_size, default="256M")
    s.add_argument("--ag-min", type=_size, default="8")
    s.add_argument("--ag-max", type=_size, default="0", help="0: no all_gather rows")
    s.add_argument("--rs-min", type=_size, default="8")
    s.add_argument("--rs-max", type=_size, default="0", help="0: no reduce_scatter rows")
    s.add_argument("--pingpong", type=_size, default="0",
                   help="send/recv round trip of this size (0: none; 64 in the results)")
    s.add_argument("-f", "--stepfactor", type=float, default=4.0,
                   help="size multiplier; the max is always included")
    m = p.add_argument_group("measurement")
    m.add_argument("--rails", type=_rails, default="1,4", help="neuron groups to measure")
    m.add_argument("--no-gloo", action="store_true", help="do not measure gloo")
    m.add_argument("--no-floor", action="store_true",
                   help="do not measure the floor (a Python process group over raw TCP with no "
                        "protocol: bench/floor_pg.py) on ping-pongs, p2p and all_reduces")
    m.add_argument("--iters", type=int, default=20, help="most timed iterations per size")
    m.add_argument("--min-iters", type=int, default=5, help="fewest timed iterations per size")
    m.add_argument("--iter-bytes", type=_size, default="1G",
                   help="timed iterations per size = this / size, within min/max")
    m.add_argument("-w", "--warmup", type=int, default=2,
                   help="untimed iterations per size (fewer when --iter-bytes allows fewer)")
    m.add_argument("--window-bytes", type=_size, default="16M", help="p2p window (see below)")
    m.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write meta, rows and the reference as JSON")
    o.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    t = p.add_argument_group("limits")
    t.add_argument("--timeout", type=float, default=480.0,
                   help="seconds for the whole run; then every rank is killed")
    t.add_argument("--pg-timeout", type=float, default=60.0, help="per-operation timeout")
    t.add_argument("--tag", default="", help=argparse.SUPPRESS)  # marker for tests
    return p


def sizes_between(lo: int, hi: int, factor: float) -> list[int]:
    """lo, lo*f, lo*f^2, ... below hi, then hi itself (always included)."""
    if lo <= 0 or hi < lo:
        raise ValueError(f"need 0 < min <= max (got {lo}, {hi})")
    if factor <= 1:
        raise ValueError(f"-f must be > 1 (got {factor})")
    out, s = [], float(lo)
    while s < hi:
        out.append(int(s))
        s *= factor
    out.append(hi)
    return sorted(set(out))


# ----------------------------------------------------------------------------- run

def parse_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        i = line.find(TAG)
        if i < 0:
            continue
        try:
            out.append(json.loads(line[i + len(TAG):]))
        except ValueError:
            continue
    return out


def _progress(row: dict) -> str:
    if row.get("kind") != "row":
        return ""
    head = f"[{row['op']} {human_size(row['bytes'])}]" if "bytes" in row else f"[{row['op']}]"
    if row["status"] != "ok":
        return f"{head} {row['backend']}: {row['status']}: {row.get('error', '')}"
    chk = "" if row.get("check") == "OK" else f" check {row.get('check')}"
    return (f"{head} {row['backend']}: {row['busbw_gbs']:.3f} GB/s, {row['time_us']:.1f} us"
            f" ({row['iters']} iters, {row['cell_s']:.1f} s){chk}")


class _Tail(threading.Thread):
    """Prints progress lines from the file the worker appends to, while the run goes."""

    def __init__(self, path: str, log):
        super().__init__(daemon=True)
        self.path, self.log, self.stop = path, log, threading.Event()

    def run(self) -> None:
        pos, buf = 0, ""
        while True:
            stopping = self.stop.is_set()
            try:
                with open(self.path) as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
            except OSError:
                chunk = ""
            buf += chunk
            *lines, buf = buf.split("\n")
            for line in lines:
                for row in parse_lines(line):
                    text = _progress(row)
                    if text:
                        self.log(text)
            if stopping:
                return
            self.stop.wait(0.3)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run_bench(args, p2p_sizes: list[int], ar_sizes: list[int], log, ag_sizes=(), rs_sizes=(),
              pp_sizes=()) -> dict:
    """Launch the worker on 2 netns nodes; return ``{"rows", "meta_ranks", "result", ...}``."""
    from neuron_dist.launch import vnodes

    fd, progress = tempfile.mkstemp(prefix="neuron-internode-", suffix=".log")
    os.close(fd)
    worker_argv = ["-m", WORKER,
                   "--p2p-sizes", ",".join(map(str, p2p_sizes)),
                   "--ar-sizes", ",".join(map(str, ar_sizes)),
                   "--ag-sizes", ",".join(map(str, ag_sizes)),
                   "--rs-sizes", ",".join(map(str, rs_sizes)),
                   "--pp-sizes", ",".join(map(str, pp_sizes)),
                   "--rails", ",".join(map(str, args.rails)),
                   "--iters", str(args.iters), "--min-iters", str(args.min_iters),
                   "--warmup", str(args.warmup), "--iter-bytes", str(args.iter_bytes),
                   "--window-bytes", str(args.window_bytes), "--threads", str(args.threads),
                   "--pg-timeout", str(args.pg_timeout), "--progress", progress]
    if args.no_gloo:
        worker_argv.append("--no-gloo")
    if not args.no_floor:
        worker_argv.append("--floor")
    if args.tag:
        worker_argv += ["--tag", args.tag]
    env = {"GLOO_SOCKET_IFNAME": vnodes.NODE_IFNAME,
           "NEURON_DIST_SOCKET_IFNAME": vnodes.NODE_IFNAME,
           "OMP_NUM_THREADS": str(args.threads)}
    tail = _Tail(progress, log) if not args.quiet else None
    if tail:
        tail.start()
    try:
        res = vnodes.run(2, 1, worker_argv, netns=True, timeout=args.timeout, env=env,
                         grace=10.0)
    finally:
        if tail:
            tail.stop.set()
            tail.join(5)
        try:
            os.unlink(progress)
        except OSError:
            pass
    lines = parse_lines(res.stdout[0]) if res.stdout else []
    return {"lines": lines, "result": res, "worker_argv": worker_argv, "env": env}


# ----------------------------------------------------------------------------- report

def _backends(rails: list[int], gloo: bool, floor: bool = False) -> list[str]:
    names = [f"neuron-{r}rail" + ("s" if r != 1 else "") for r in rails]
    if gloo:
        names.append("gloo")
    if floor:
        names.append("floor")
    return names


def _ratio(a, b):
    if a is None or b is None or not b:
        return None
    return a / b


def _cell(row: dict | None) -> tuple[str, str]:
    if row is None:
        return "-", "-"
    if row["status"] != "ok":
        return row["status"], "-"
    mark = "" if row.get("check") == "OK" else "!"
    g = row["busbw_gbs"]
    return f"{row['time_us']:.1f}", (f"{g:.3f}" if g >= 0.01 else f"{g:.2e}") + mark


def table(op: str, rows: list[dict], backends: list[str], ratio_pairs) -> str:
    by = {(r["bytes"], r["backend"]): r for r in rows if r["op"] == op}
    sizes = sorted({b for b, _ in by})
    w = max(13, max((len(b) for b in backends), default=0) + 1)
    top = f"{'':>12} " + " ".join(f"{b:>{w * 2 + 1}}" for b in backends)
    unit = "GB/s" if op == "p2p" else "busbw"
    head = f"{'size':>12} " + " ".join(f"{'time_us':>{w}} {unit:>{w}}" for _ in backends)
    for label, _, _ in ratio_pairs:
        top += f" {'':>8}"
        head += f" {label:>8}"
    lines = [top, head, "-" * len(head)]
    for size in sizes:
        parts = [f"{size:>12}"]
        for b in backends:
            t, g = _cell(by.get((size, b)))
            parts.append(f"{t:>{w}} {g:>{w}}")
        for _, num, den in ratio_pairs:
            rn, rd = by.get((size, num)), by.get((size, den))
            r = _ratio(rn and rn.get("busbw_gbs"), rd and rd.get("busbw_gbs"))
            parts.append(f"{(f'{r:.2f}x' if r is not None else '-'):>8}")
        lines.append(" ".join(parts))
    return "\n".join(lines)


def cpu_table(op: str, rows: list[dict], backends: list[str]) -> str:
    """CPU per operation (max over ranks; every thread of the process, user + system)."""
    by = {(r["bytes"], r["backend"]): r for r in rows if r["op"] == op}
    sizes = sorted({b for b, _ in by})
    w = max(13, max((len(b) for b in backends), default=0) + 1)
    head = f"{'size':>12} " + " ".join(f"{b:>{w}}" for b in backends)
    lines = [head, "-" * len(head)]
    for size in sizes:
        parts = [f"{size:>12}"]
        for b in backends:
            cpu = (by.get((size, b)) or {}).get("cpu_us") or []
            cpu = [c for c in cpu if c is not None]
            parts.append(f"{(f'{max(cpu):.1f}' if cpu else '-'):>{w}}")
        lines.append(" ".join(parts))
    return "\n".join(lines)


def summarize(rows: list[dict], backends: list[str], ratio_pairs, large: int) -> dict:
    """Per op: busbw per backend at the largest size and the median over sizes >= large."""
    out = {}
    for op in OPS:
        ok = [r for r in rows if r["op"] == op and r.get("status") == "ok"]
        if not ok:
            continue
        top = max(r["bytes"] for r in ok)
        big = sorted({r["bytes"] for r in ok if r["bytes"] >= min(large, top)})
        per = {}
        for b in backends:
            at_top = next((r["busbw_gbs"] for r in ok if r["backend"] == b and r["bytes"] == top), None)
            vals = [r["busbw_gbs"] for r in ok if r["backend"] == b and r["bytes"] in big]
            per[b] = {"at_max_gbs": at_top,
                      "median_large_gbs": statistics.median(vals) if vals else None,
                      "best_gbs": max((r["busbw_gbs"] for r in ok if r["backend"] == b), default=None)}
        ratios = {}
        for label, num, den in ratio_pairs:
            ratios[label] = {"at_max": _ratio(per.get(num, {}).get("at_max_gbs"),
                                              per.get(den, {}).get("at_max_gbs")),
                             "median_large": _ratio(per.get(num, {}).get("median_large_gbs"),
                                                    per.get(den, {}).get("median_large_gbs"))}
        out[op] = {"max_bytes": top, "large_sizes": big, "backends": per, "ratios": ratios}
    return out


def summary_lines(summ: dict) -> list[str]:
    out = []
    for op, s in summ.items():
        what = "GB/s" if op == "p2p" else "busbw GB/s"
        sizes = ", ".join(human_size(b) for b in s["large_sizes"])
        out.append(f"# {op} {what} at {human_size(s['max_bytes'])} (median over {sizes}; best size):")
        for b, v in s["backends"].items():
            f = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
            out.append(f"#   {b:<14} {f(v['at_max_gbs']):>7}  ({f(v['median_large_gbs'])}; "
                       f"best {f(v['best_gbs'])})")
        for label, r in s["ratios"].items():
            f = lambda x: "n/a" if x is None else f"{x:.2f}x"  # noqa: E731
            out.append(f"#   {label:<14} {f(r['at_max']):>7}  ({f(r['median_large'])})")
    return out


def _header(meta: dict, ranks: list[dict]) -> list[str]:
    lines = [f"# {meta['command']}",
             f"# host {meta['host']}, {meta['cores']} cores, load {meta['loadavg_before']} before / "
             f"{meta['loadavg_after']} after, torch {meta['torch']}, neuron-dist {meta['neuron_dist']}",
             f"# 2 virtual nodes x 1 rank, netns + veth + bridge (launch/vnodes.py); run "
             f"{meta['duration_s']:.1f} s, exit codes {meta['node_returncodes']}"]
    for r in ranks:
        gs = []
        for name, info in r.get("groups", {}).items():
            if "error" in info:
                gs.append(f"{name}: ERROR {info['error']}")
            elif name.startswith("neuron"):
                gs.append(f"{name}: {info.get('transport_rails')} rail(s) from {info.get('address')}")
            elif name == "gloo":
                gs.append(f"{name}: GLOO_SOCKET_IFNAME={info.get('GLOO_SOCKET_IFNAME')}")
            else:
                gs.append(f"{name}: {info.get('what', '')}")
        lines.append(f"# rank {r['rank']} on {r['hostname']} (NEURON_DIST_NODE_NAME="
                     f"{r['node_name']}, ifname {r['socket_ifname']}): " + "; ".join(gs))
    lines += [f"# sizes: p2p {human_size(meta['p2p_sizes'][0])}..{human_size(meta['p2p_sizes'][-1])}, "
              f"all_reduce {human_size(meta['ar_sizes'][0])}..{human_size(meta['ar_sizes'][-1])}, "
              f"x{meta['stepfactor']:g}; iters {meta['min_iters']}..{meta['iters']} "
              f"(<= {human_size(meta['iter_bytes'])} per size), warmup {meta['warmup']}, "
              f"float32, {meta['threads']} torch thread(s) per rank",
              "# " + meta["timing"]]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    err = sys.stderr

    def log(text: str) -> None:
        print(text, file=err, flush=True)

    try:
        p2p_sizes = sizes_between(args.p2p_min, args.p2p_max, args.stepfactor)
        ar_sizes = sizes_between(args.ar_min, args.ar_max, args.stepfactor)
        ag_sizes = sizes_between(args.ag_min, args.ag_max, args.stepfactor) if args.ag_max else []
        rs_sizes = sizes_between(args.rs_min, args.rs_max, args.stepfactor) if args.rs_max else []
        pp_sizes = [args.pingpong] if args.pingpong else []
    except ValueError as exc:
        log(f"internode: {exc}")
        return 2
    if args.iters < 1 or args.min_iters < 1 or args.min_iters > args.iters or args.warmup < 1:
        log("internode: need 1 <= --min-iters <= --iters and --warmup >= 1")
        return 2

    from neuron_dist.launch import vnodes

    if not vnodes.netns_available():
        log("internode: needs network namespaces (root, ip netns, veth, bridge, unshare)")
        return 2

    import torch

    import neuron_dist

    cmd = "python -m bench.internode" + "".join(
        " " + shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    started = _dt.datetime.now().astimezone()
    load_before = _loadavg()
    log(f"internode: 2 netns nodes x 1 rank; p2p {len(p2p_sizes)} sizes, all_reduce "
        f"{len(ar_sizes)} sizes; backends neuron rails {args.rails}"
        + ("" if args.no_gloo else " + gloo") + f"; timeout {args.timeout:g} s")
    try:
        out = run_bench(args, p2p_sizes, ar_sizes, log, ag_sizes, rs_sizes, pp_sizes)
    except KeyboardInterrupt:
        log("internode: interrupted (everything was stopped and removed)")
        return 130
    except (RuntimeError, ValueError) as exc:
        log(f"internode: {exc}")
        return 2
    res = out["result"]
    lines = out["lines"]
    rows = [x for x in lines if x.get("kind") == "row"]
    metas = [x for x in lines if x.get("kind") == "meta"]
    done = [x for x in lines if x.get("kind") == "done"]
    backends = _backends(args.rails, not args.no_gloo, not args.no_floor)
    ratio_pairs = []
    if "gloo" in backends:
        for r in args.rails:
            if r == max(args.rails):
                name = backends[args.rails.index(r)]
                ratio_pairs.append((f"{r}r/gloo", name, "gloo"))
                if "floor" in backends:
                    ratio_pairs.append(("floor/gloo", "floor", "gloo"))
    if "floor" in backends:
        hi = max(args.rails)
        ratio_pairs.append((f"{hi}r/floor", backends[args.rails.index(hi)], "floor"))
    if len(args.rails) > 1:
        hi, lo = max(args.rails), min(args.rails)
        ratio_pairs.append((f"{hi}r/{lo}r", backends[args.rails.index(hi)],
                            backends[args.rails.index(lo)]))

    errors = []
    if res.timed_out:
        errors.append(f"run exceeded --timeout {args.timeout:g} s; every rank was killed")
    if not res.ok and not res.timed_out:
        errors.append(f"node exit codes {res.node_returncodes} (vnode{res.failed_node} failed first)")
    if not done and not res.timed_out:
        errors.append("the worker did not finish (no 'done' line)")
    for r in rows:
        if r["status"] != "ok":
            errors.append(f"{r['op']} {r.get('bytes', '')} B {r['backend']}: {r['status']}: "
                          f"{r.get('error', '')}")
        elif r.get("check") != "OK":
            errors.append(f"{r['op']} {r['bytes']} B {r['backend']}: check {r.get('check')}: "
                          f"{r.get('note', '')}")
    stderr_tail = []
    if errors:
        for i, text in enumerate(res.stderr):
            tail = [ln for ln in text.splitlines() if ln.strip()][-25:]
            if tail:
                stderr_tail.append({"node": i, "lines": tail})

    meta = {
        "command": cmd, "started": started.isoformat(timespec="seconds"),
        "finished": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(), "cores": _cores(), "loadavg_before": load_before,
        "loadavg_after": _loadavg(), "python": platform.python_version(),
        "torch": torch.__version__, "neuron_dist": neuron_dist.__version__,
        "nodes": 2, "nproc_per_node": 1, "netns": True, "duration_s": round(res.duration, 2),
        "node_returncodes": res.node_returncodes, "timed_out": res.timed_out,
        "namespaces_used": res.namespaces, "worker_argv": out["worker_argv"],
        "agent_env": out["env"], "p2p_sizes": p2p_sizes, "ar_sizes": ar_sizes,
        "ag_sizes": ag_sizes, "rs_sizes": rs_sizes, "pp_sizes": pp_sizes,
        "stepfactor": args.stepfactor, "iters": args.iters, "min_iters": args.min_iters,
        "iter_bytes": args.iter_bytes, "warmup": args.warmup, "window_bytes": args.window_bytes,
        "threads": args.threads, "backends": backends,
        "ranks": metas[0]["ranks"] if metas else [],
        "worker_seconds": done[0]["seconds"] if done else None,
        "timing": ("p2p: rank 0 -> 1, window of W isend/irecv in flight + 1-element ack, "
                   "rank 0's clock, time_us per message, GB/s = bytes/time (1e9). all_reduce: barrier, "
                   "then a batch of ops back to back (up to 16, one from 4 MiB) timed on both "
                   "ranks, mean per op, max over ranks, median over iterations; "
                   "busbw = algbw x 2(n-1)/n. Ratios: busbw of the first / the second "
                   "(> 1 = first is faster). '!' after GB/s = result check failed."),
    }
    print("\n".join(_header(meta, meta["ranks"])))
    titles = {"pingpong": "pingpong: send/recv round trip rank 0 -> 1 -> 0; time_us per round "
                          "trip ('busbw' = 2 x bytes / time)",
              "p2p": "p2p: rank 0 send -> rank 1 recv (one direction); time_us per message",
              "all_reduce": "all_reduce: float32 SUM, in place; busbw (nccl-tests)",
              "all_gather": "all_gather_into_tensor: size = the gathered buffer; busbw",
              "reduce_scatter": "reduce_scatter_tensor: float32 SUM, size = the input; busbw"}
    for op in OPS:
        if not any(r["op"] == op for r in rows):
            continue
        print(f"#\n# {titles[op]}")
        print(table(op, rows, backends, ratio_pairs))
        print(f"# {op}: CPU us per {'message' if op == 'p2p' else 'operation'} (the whole "
              f"process, every thread, barriers included; max over ranks)")
        print(cpu_table(op, rows, backends))
    summ = summarize(rows, backends, ratio_pairs, large=64 << 20)
    print("#\n# summary (large sizes)")
    for line in summary_lines(summ):
        print(line)
    for e in errors:
        print(f"# error: {e}")
    for t in stderr_tail:
        print(f"# stderr of vnode{t['node']} (last lines):")
        for ln in t["lines"]:
            print(f"#   {ln}")
    sys.stdout.flush()

    if args.json:
        doc = {"meta": meta, "results": rows, "summary": summ,
               "errors": errors, "stderr_tail": stderr_tail}
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        log(f"wrote {args.json}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
