"""Instructions per small operation on a rank's calling thread, counted by callgrind.

``python -m bench.instructions [--run NODES:BACKENDS ...] [--json FILE]``

How it works
------------
Callgrind counts the instructions a thread executes, so unlike a time the figure does not
change with the machine's load. Per ``--run`` (default: one node with null, shmfloor, neuron and gloo;
two virtual nodes with null, floor and neuron) the command starts a world of 2 ranks: rank 0
under ``valgrind --tool=callgrind --instr-atstart=no --separate-threads=yes``, rank 1 natively.
``--nodes 2`` is ``bench.hotloop``'s: the ranks get different ``NEURON_DIST_NODE_NAME``s, so
neuron uses its inter-node transport, on loopback. Both ranks create a group per backend
(``null``: ``null_pg``, collectives that do nothing, the dispatch floor; ``floor``:
``floor_pg``, raw TCP with no protocol; ``shmfloor``: ``shm_floor_pg``, shared memory with
nothing else; the world group, gloo, only synchronises) and warm up
every op with ``hotloop``'s op functions, uninstrumented. Then rank 0 turns instrumentation
on and, per round, op and backend, runs ``hotloop``'s loop (the op back to back, no barrier)
of N1 and then N2 operations, each after a world barrier and between two callgrind dumps.
A dump made by a client request writes the instructions (Ir) that the requesting thread ran
since its previous dump (``--separate-threads=yes``: each thread's are apart), so the figure
per operation is ``(Ir(N2) - Ir(N1)) / (N2 - N1)`` of the thread that ran the loop, which
removes what a loop costs once (the dump requests, leaving the barrier). Before the loops
the collector is emptied and frozen, and before each loop it runs, so each loop meets the
same collector counts; ``--rounds`` repeats every pair.

The dumps and the start of instrumentation are callgrind client requests: valgrind's magic
instruction sequence (x86-64) in a page of executable memory, called through ctypes; outside
valgrind it does nothing. Rank 1 runs at native speed, many times faster than rank 0, so
rank 0 mostly finds its peer's part already there, and its count is the work of an
operation (the peer may have gone to sleep meanwhile, so waking it is counted). Mostly: a
rank that polls for its peer's data (over TCP above all) still polls a few times now and
then, more on a loaded machine; that only adds instructions, so the figure is the smallest
over the rounds, with the spread over rounds beside it. Only the calling thread is counted:
work that a backend hands to threads of its own, as gloo does, is not in the figure.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import gc
import glob
import json
import mmap
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

OPS = ("all_reduce", "broadcast", "send_recv")
BACKENDS = ("null", "neuron", "gloo", "floor", "shmfloor")
FLOOR_OPS = ("all_reduce", "send_recv")  # what floor_pg implements of OPS
DEFAULT_RUNS = ("1:null,shmfloor,neuron,gloo", "2:null,floor,neuron")
CALLING_THREAD = 1  # valgrind's number of the process's first thread, which runs the loops

# rolq $3,$13,$61,$51 %rdi; xchgq %rbx,%rbx: %rdx = request(%rax), as valgrind.h on amd64
_REQUEST_CODE = bytes.fromhex("31d2" "4889f8" "48c1c703" "48c1c70d" "48c1c73d" "48c1c733"
                              "4887db" "4889d0" "c3")
_RUNNING_ON_VALGRIND = 0x1001
_CALLGRIND = (ord("C") << 24) | (ord("T") << 16)
_DUMP_STATS_AT, _START_INSTRUMENTATION = _CALLGRIND + 3, _CALLGRIND + 4


class ClientRequests:
    """Callgrind client requests from Python (x86-64 Linux only)."""

    def __init__(self):
        if platform.machine() not in ("x86_64", "AMD64"):
            raise RuntimeError(f"callgrind client requests: x86-64 only, not {platform.machine()}")
        self._page = mmap.mmap(-1, mmap.PAGESIZE,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        self._page.write(_REQUEST_CODE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._page))
        self._call = ctypes.CFUNCTYPE(ctypes.c_ulong, ctypes.c_void_p)(address)
        self._labels: dict = {}  # label -> its C string (made ahead: see labels())

    def _request(self, code: int, arg: int = 0) -> int:
        args = (ctypes.c_ulong * 6)(code, arg, 0, 0, 0, 0)
        return self._call(ctypes.addressof(args))

    def running_on_valgrind(self) -> bool:
        return self._request(_RUNNING_ON_VALGRIND) > 0

    def start_instrumentation(self) -> None:
        self._request(_START_INSTRUMENTATION)

    def labels(self, labels) -> None:
        """Make the C strings of the dumps' labels now: making one in a measured interval
        would count there (the first string of a length makes a new ctypes type)."""
        for label in labels:
            self._labels[label] = ctypes.create_string_buffer(label.encode())

    def dump(self, label: str) -> None:
        """Write the calling thread's counts since its last dump to a file of their own and
        zero them; the file says ``label`` (one of ``labels()``)."""
        self._request(_DUMP_STATS_AT, ctypes.addressof(self._labels[label]))


def plan(backends, ops, counts, rounds: int) -> list:
    """``(label, backend, op, n, round)`` of every measured loop, in order (the same on every
    rank)."""
    return [(f"{b} {op} {n} r{r}", b, op, n, r) for r in range(rounds) for op in ops
            for b in backends if _implements(b, op) for n in counts]


def _implements(backend: str, op: str) -> bool:
    return op in FLOOR_OPS if backend == "floor" else True


# ---------------------------------------------------------------- the ranks

def _rank(args) -> None:
    rank, world = args.rank, 2
    os.environ["NEURON_DIST_NODE_NAME"] = f"hotloop-node{rank * args.nodes // world}"
    import torch
    import torch.distributed as dist

    import neuron_dist  # noqa: F401 - registers the backend
    from . import floor_pg, null_pg, shm_floor_pg
    from .hotloop import make_op
    torch.set_num_threads(1)
    cg = ClientRequests()
    if rank == 0 and not cg.running_on_valgrind():
        raise SystemExit("instructions: rank 0 must run under valgrind --tool=callgrind")
    timeout = _dt.timedelta(seconds=args.timeout)
    store = dist.TCPStore("127.0.0.1", args.port, world, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    null_pg.register()
    floor_pg.register(1)
    shm_floor_pg.register()
    names = {"null": null_pg.BACKEND_NAME, "floor": floor_pg.BACKEND_NAME,
             "shmfloor": shm_floor_pg.BACKEND_NAME}
    groups = {b: dist.new_group(backend=names.get(b, b), timeout=timeout) for b in args.backends}
    t = torch.ones(max(1, args.bytes // 4))
    loops = plan(args.backends, args.ops, args.counts, args.rounds)
    fns = {(b, op): make_op(op, rank, world, t, groups[b]) for _, b, op, _, _ in loops}
    for fn in fns.values():
        for _ in range(200):
            fn()
    cg.labels(["-", *(label for label, *_ in loops)])
    gc.collect()
    gc.freeze()  # what set-up made is never collected again: no huge collections in a loop
    dist.barrier()
    if rank == 0:
        cg.start_instrumentation()
    for label, b, op, n, _ in loops:
        fn = fns[(b, op)]
        gc.collect()  # every loop starts from the same collector counts, so collects alike
        dist.barrier()
        if rank == 0:
            cg.dump("-")
        for _ in range(n):
            fn()
        if rank == 0:
            cg.dump(label)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- callgrind's files

_DESC = re.compile(r"^desc: Trigger: Client Request: (.*)$", re.M)
_TOTALS = re.compile(r"^(?:totals|summary): (\d+)", re.M)
_NAME = re.compile(r"\.(\d+)-(\d+)$")  # <prefix>.<dump number>-<thread>


def parse_dump(text: str) -> tuple:
    """``(label, Ir)`` of one callgrind output file written by a client request (label
    None for any other dump, e.g. at program termination)."""
    desc, totals = _DESC.search(text), _TOTALS.search(text)
    if totals is None:
        raise ValueError("callgrind output without a totals: or summary: line")
    return (desc.group(1).strip() if desc else None), int(totals.group(1))


def read_dumps(prefix: str) -> dict:
    """{label: {thread: Ir}} of the dump files ``<prefix>.<n>-<thread>``."""
    out: dict = {}
    for path in glob.glob(glob.escape(prefix) + ".*-*"):
        m = _NAME.search(path)
        if not m:
            continue
        with open(path) as f:
            label, ir = parse_dump(f.read())
        if label and label != "-":
            out.setdefault(label, {})[int(m.group(2))] = ir
    return out


def per_op(dumps: dict, loops: list, counts) -> list:
    """One row per (backend, op): instructions per operation on the calling thread per round
    (``(Ir(N2) - Ir(N1)) / (N2 - N1)``), the smallest of them and their spread."""
    n1, n2 = counts
    labels = {(b, op, n, r): label for label, b, op, n, r in loops}
    rows: dict = {}
    for (b, op, n, r), label in labels.items():
        if n != n2:
            continue
        short, long_ = dumps.get(labels[(b, op, n1, r)], {}), dumps.get(label, {})
        if CALLING_THREAD not in short or CALLING_THREAD not in long_:
            raise RuntimeError(f"instructions: no callgrind dump of the calling thread for "
                               f"{labels[(b, op, n1, r)]!r} or {label!r}")
        row = rows.setdefault((b, op), {"backend": b, "op": op, "rounds": []})
        row["rounds"].append((long_[CALLING_THREAD] - short[CALLING_THREAD]) / (n2 - n1))
    for row in rows.values():
        row["instr_per_op"] = min(row["rounds"])
        row["spread"] = (max(row["rounds"]) - min(row["rounds"])) / row["instr_per_op"]
    return list(rows.values())


# ---------------------------------------------------------------- the command

def _measure(nodes: int, backends: list, args, workdir: str) -> list:
    """One world of 2 ranks (rank 0 under callgrind) on ``nodes`` virtual nodes; its rows."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prefix = os.path.join(workdir, f"callgrind.nodes{nodes}")
    for old in glob.glob(glob.escape(prefix) + "*"):  # (a --keep directory used before)
        os.remove(old)
    worker = ["-m", "bench.instructions", "--worker", "--port", str(port),
              "--nodes", str(nodes), "--backends", ",".join(backends), "--ops", ",".join(args.ops),
              "--counts", ",".join(map(str, args.counts)), "--rounds", str(args.rounds),
              "--bytes", str(args.bytes), "--timeout", str(args.timeout)]
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
                f"--callgrind-out-file={prefix}", f"--log-file={prefix}.log"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logs = [f"{prefix}.rank{r}.out" for r in (0, 1)]
    procs = []
    for r, cmd in enumerate([[*valgrind, sys.executable], [sys.executable]]):
        with open(logs[r], "w") as out:
            procs.append(subprocess.Popen([*cmd, *worker, "--rank", str(r)], env=env,
                                          stdout=out, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + args.timeout
    try:  # until both are through, one fails or time is up
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if any(codes):
        tail = []
        for r, path in enumerate([*logs, f"{prefix}.log"]):
            if not os.path.exists(path):
                continue
            with open(path, errors="replace") as f:
                who = f"rank {r}" if r < 2 else "valgrind"
                tail += [f"{who}: {ln}" for ln in f.read().splitlines()[-12:]]
        raise RuntimeError(f"instructions: the run on {nodes} node(s) failed or timed out "
                           f"(exit codes {codes}):\n" + "\n".join(tail))
    loops = plan(backends, args.ops, args.counts, args.rounds)
    rows = per_op(read_dumps(prefix), loops, args.counts)
    null = {r["op"]: r["instr_per_op"] for r in rows if r["backend"] == "null"}
    for r in rows:
        r["nodes"] = nodes
        r["x_null"] = r["instr_per_op"] / null[r["op"]] if null.get(r["op"]) else None
    return rows


def _valgrind_version() -> str:
    out = subprocess.run(["valgrind", "--version"], capture_output=True, text=True)
    return out.stdout.strip()


def _loadavg():
    return [round(x, 2) for x in os.getloadavg()]


def _k(x: float) -> str:
    return f"{x / 1000:.1f}k"


def report(meta: dict, rows: list) -> str:
    lines = [f"# {meta['command']}",
             f"# host {meta['host']}, {meta['cores']} cores, load {meta['loadavg_before']} before "
             f"/ {meta['loadavg_after']} after, torch {meta['torch']}, neuron-dist "
             f"{meta['neuron_dist']}, python {meta['python']}, {meta['valgrind']}",
             f"# 2 ranks; rank 0 under callgrind, rank 1 native; {meta['bytes']} B float32; "
             f"loops of N1={meta['counts'][0]} and N2={meta['counts'][1]} ops back to back "
             f"(bench/hotloop.py), {meta['rounds']} round(s); run {meta['duration_s']:.0f} s",
             "# instr/op: (Ir(N2) - Ir(N1)) / (N2 - N1) of rank 0's calling thread, smallest "
             "over rounds (polling for the peer only adds); spread: (max - min) / smallest",
             "# x null: over the null group's in the same run (null: collectives that do "
             "nothing, the dispatch floor); floor: raw TCP, no protocol (bench/floor_pg.py); "
             "shmfloor: shared memory, nothing else (bench/shm_floor_pg.py)",
             "# only the calling thread is counted: gloo's work on its own threads is not",
             f"{'nodes':>5} {'backend':>8} {'op':>10} {'instr/op':>9} {'spread':>7} "
             f"{'x null':>7}"]
    for r in rows:
        xn = f"{r['x_null']:.2f}x" if r["x_null"] else "-"
        lines.append(f"{r['nodes']:>5} {r['backend']:>8} {r['op']:>10} "
                     f"{_k(r['instr_per_op']):>9} {100 * r['spread']:>6.1f}% {xn:>7}")
    return "\n".join(lines)


def _csv(choices):
    def parse(s: str) -> list:
        items = [x for x in s.split(",") if x]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}, not {s!r}")
        return items
    return parse


def _run_spec(s: str) -> tuple:
    nodes, _, backends = s.partition(":")
    if nodes not in ("1", "2"):
        raise argparse.ArgumentTypeError(f"--run NODES:BACKENDS with NODES 1 or 2, not {s!r}")
    return int(nodes), _csv(BACKENDS)(backends)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m bench.instructions",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", type=_run_spec, metavar="NODES:BACKENDS",
                   help="a world of 2 ranks on NODES (1 or 2) virtual nodes measuring BACKENDS "
                        f"(of {','.join(BACKENDS)}); repeatable "
                        f"(default: {' '.join(DEFAULT_RUNS)})")
    p.add_argument("--ops", type=_csv(OPS), default=list(OPS))
    p.add_argument("--counts", default=(100, 300),
                   type=lambda s: tuple(int(x) for x in s.split(",")),
                   help="N1,N2: the two loop lengths (default 100,300)")
    p.add_argument("--rounds", type=int, default=3, help="N1, N2 pairs per backend and op")
    p.add_argument("--bytes", type=int, default=8, help="float32 elements x 4 (default 8)")
    p.add_argument("--timeout", type=float, default=900.0, help="bound per run, seconds")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--keep", metavar="DIR", help="write callgrind's files into DIR and keep "
                   "them (callgrind_annotate reads them), not into a temporary directory")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--backends", type=_csv(BACKENDS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if len(args.counts) != 2 or not 0 < args.counts[0] < args.counts[1]:
        p.error("--counts needs two loop lengths N1 < N2")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.worker:
        _rank(args)
        return 0
    if shutil.which("valgrind") is None:
        print("instructions: valgrind is not installed", file=sys.stderr)
        return 2
    import torch

    import neuron_dist
    runs = args.run or [_run_spec(s) for s in DEFAULT_RUNS]
    started = _dt.datetime.now().astimezone()
    load_before, t0 = _loadavg(), time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="neuron-instructions-") as tmp:
        workdir = args.keep or tmp
        os.makedirs(workdir, exist_ok=True)
        for nodes, backends in runs:
            print(f"[instructions] {nodes} node(s): {','.join(backends)}", file=sys.stderr,
                  flush=True)
            try:
                rows += _measure(nodes, backends, args, workdir)
            except RuntimeError as exc:
                print(exc, file=sys.stderr)
                return 1
    meta = {"command": " ".join(["python -m bench.instructions", *argv]),
            "started": started.isoformat(timespec="seconds"),
            "finished": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "host": platform.node(), "cores": len(os.sched_getaffinity(0)),
            "loadavg_before": load_before, "loadavg_after": _loadavg(),
            "python": platform.python_version(), "torch": torch.__version__,
            "neuron_dist": neuron_dist.__version__, "valgrind": _valgrind_version(),
            "duration_s": round(time.monotonic() - t0, 1), "runs": [list(r) for r in runs],
            "ops": args.ops, "bytes": args.bytes, "counts": list(args.counts),
            "rounds": args.rounds, "calling_thread": CALLING_THREAD}
    print(report(meta, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
