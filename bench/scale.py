"""Scale benchmark: ``python -m bench.scale --nodes N --nproc-per-node L``.

N virtual nodes of L ranks each, every node in its own network namespace
(``launch/vnodes.py --netns``: 10.x addresses on a bridge, ``eth0`` inside, a private
``/dev/shm``, its own hostname ``vnodeI``), so ranks of one node share memory and ranks of
different nodes only meet over the veth links. Needs root. In one run, one backend after the
other (``--backends``, default ``neuron,gloo,mpich,floor``), each in fresh processes:

* **neuron**, **gloo**, **floor** (``neuron_floor`` of ``bench/floor_pg.py``: a Python
  process group over raw TCP, one connection per pair, no protocol, neuron's binomial
  trees among more than two ranks; it has only all_reduce, broadcast and barrier, so its
  other rows are n/a): ``vnodes.run`` starts one torchrun agent per node
  (a real multi-node static rendezvous); each rank runs ``scale_worker.py``, whose default
  group is the backend under test (``dist.init_process_group(backend)``).
* **mpich**: the same ops with mpi4py (Allreduce in place, Allgather, Reduce_scatter_block,
  Bcast, Barrier) under MPICH's hydra ``mpiexec`` (the ``mpich`` wheel, next to this
  python), L ranks per node in the same kind of namespaces. vnodes.run only builds a network
  around torchrun, so :class:`Nodes` builds one with vnodes' own functions (same names, so a
  stale one is removed by the next vnodes run) and keeps it up while mpiexec runs inside
  node 0's namespace (hostname vnode0, /etc/hosts naming every node). Hydra's ssh launcher
  (``-launcher ssh -launcher-exec SCRIPT``) reaches the other nodes through a small script
  written to the run's temporary directory: ``SCRIPT -x vnodeI CMD`` runs ``CMD`` as
  ``ip netns exec <node I's namespace> unshare --mount --uts`` with that node's hostname,
  hosts file and a private /dev/shm, like a vnodes agent. Ranks get ``UCX_TLS=tcp`` and
  ``UCX_NET_DEVICES=eth0``: MPICH's UCX netmod otherwise talks between "nodes" through
  shared memory / cross-memory attach, which namespaces do not separate (11 x 1 MiB
  Allreduce between two namespaces sent 17 KB on eth0 with UCX's defaults, 11.6 MB with
  tcp). Inside a node MPICH uses its own shared memory, as neuron does.
* **neuron-mpi** (not in the default list): neuron under the same mpiexec, with
  ``NEURON_DIST_TRANSPORT=mpi`` (the rendezvous variables from MPI, ``mpi_launch``), so its
  network phases are MPICH's own collectives (collectives/net_mpi.py); its ratios to gloo,
  MPICH and neuron over rdm get columns of their own.

Every rank times, in this order: all_reduce float32 SUM of 8 B, 64 KiB and 1 MiB;
all_gather_into_tensor with 1 MiB of output in all; reduce_scatter_tensor with 1 MiB of
input in all; broadcast of 64 KiB from rank 0; barrier. Each op is checked for the exact
expected values before and after its timed iterations (see ``scale_worker.py``); a wrong
value fails the run (exit 1, ``CHECK FAILED`` in the output).

Timing: ``--warmup`` untimed iterations, then ``--iters`` K timed ones; one iteration =
a barrier of the backend under test, then a batch of ops back to back (16 below 256 KiB, 4
at 1 MiB), timed on every rank with its own clock, sample = mean per op. Iteration time =
**the max over ranks**; the reported time = median over the K iterations (min kept in
the JSON). CPU per op = ``getrusage(RUSAGE_SELF)`` user + system of the whole process
(every thread) over the timed batches (barriers and refills excluded) / ops; the table
shows **the max over ranks**, the JSON also the sum over ranks. Ratios are
``other's time / neuron's time`` (> 1 = neuron faster).

Resources, per rank after the ops: open sockets (``/proc/self/fd`` entries that are
sockets), threads (``/proc/self/status`` Threads, and ``threading.active_count()``), RSS
(VmRSS); shown as min / median / max over ranks (every rank in the JSON). Init time =
``init_process_group`` (mpich: ``MPI_Init_thread``) + the first barrier, measured on each
rank from just before the one to just after the other, after a full garbage collection
(bench/scale_worker.py says why); **max over ranks**. "eth0 MB" =
bytes the nodes' eth0 sent during the run of that backend (the traffic did cross the links).

Bounded: ``--timeout`` for the whole run (each backend gets what is left; vnodes kills its
agents and deletes its namespaces on every exit path, :class:`Nodes` kills every process in
its namespaces and deletes them); ``--op-timeout`` per op inside every rank (a watchdog that
ends the rank, and torch's own per-collective timeout). Nothing is left behind: no
processes, namespaces, or /dev/shm entries (each node's /dev/shm is a tmpfs of its own
mount namespace; the root /dev/shm is compared before and after, and any namespace of this
run still present is reported). Traffic stays inside the namespaces.

Output: the command, commit and machine on top; a table of time per op per backend with
the ratios, one of CPU per op, one of resources per backend. ``--json FILE`` writes all of
it with the command line, the git commit (and whether the tree is dirty) and machine facts.
Exit status: 0 when every backend ran and every check passed, 1 otherwise, 2 for bad
arguments or when network namespaces are not available.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import glob
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from .sweep import human_size

WORKER = "bench.scale_worker"
BACKENDS = ("neuron", "gloo", "mpich", "floor", "neuron-mpi")
MPIEXEC_BACKENDS = ("mpich", "neuron-mpi")  # started by hydra's mpiexec, not torchrun
OPS = (("all_reduce", 8), ("all_reduce", 64 << 10), ("all_reduce", 1 << 20),
       ("all_gather", 1 << 20), ("reduce_scatter", 1 << 20), ("broadcast", 64 << 10),
       ("barrier", 0))

EPILOG = """\
time: per iteration a barrier of the backend under test, then a batch of ops (16 below
256 KiB, 4 at 1 MiB) timed on every rank; iteration time = max over ranks; time = median
over --iters iterations. CPU: whole process, user + system, timed batches only, per op;
max over ranks. Ratios: other / neuron time (> 1 = neuron faster).
all_gather: 1 MiB = the gathered output; reduce_scatter: 1 MiB = the input.

examples:
  python -m bench.scale --nodes 4 --nproc-per-node 2 --json scale-4x2.json
  python -m bench.scale --nodes 16 --nproc-per-node 1 --backends neuron,gloo
"""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def _backends(text: str) -> list[str]:
    names = [b.strip() for b in text.split(",") if b.strip()]
    bad = [b for b in names if b not in BACKENDS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"backends are {', '.join(BACKENDS)} (got {text!r})")
    return list(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.scale",
        description="Small collectives, barrier and per-rank resources at N network-namespace "
                    "virtual nodes x L ranks: neuron vs gloo vs MPICH (and the floor).",
        epilog=EPILOG, formatter_class=_Formatter)
    p.add_argument("--nodes", type=int, required=True, help="virtual nodes (namespaces)")
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks per node")
    p.add_argument("--backends", type=_backends, default=",".join(BACKENDS[:4]),
                   help="comma list, measured in this order")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per op")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per op")
    p.add_argument("--json", metavar="FILE", help="write everything as JSON")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds for the whole run; then every rank is killed")
    p.add_argument("--op-timeout", type=float, default=300.0,
                   help="seconds per op (warm-up, checks and iterations) in every rank")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    return p


# ----------------------------------------------------------------------------- network

class Nodes:
    """``with Nodes(n, tmpdir) as nodes:`` n network namespaces and a bridge, built with
    ``launch/vnodes.py``'s own functions and kept up until the block ends; then every
    process still in them is killed and they are deleted."""

    def __init__(self, nodes: int, tmpdir: str):
        self.nodes, self.tmpdir = nodes, tmpdir
        self.created: list[str] = []
        self.ns: list[str] = []
        self.tag = self.hosts = None

    def __enter__(self) -> "Nodes":
        from neuron_dist.launch import vnodes

        vnodes.cleanup_stale()
        seq = next(vnodes._RUN_COUNTER)
        self.tag = vnodes._launcher_tag(seq)
        octet = vnodes._subnet_octet(os.getpid(), seq)
        try:
            self.ns, _ = vnodes._build_network(self.nodes, self.tag, octet, None, self.created)
        except BaseException:
            self.close()
            raise
        addrs = [f"10.{octet}.0.{i + 1}" for i in range(self.nodes)]
        self.hosts = os.path.join(self.tmpdir, "hosts")
        with open(self.hosts, "w") as f:  # as vnodes.run writes it
            f.write("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n")
            f.writelines(f"{a}\tvnode{i}\n" for i, a in enumerate(addrs))
            f.writelines(f"::ffff:{a}\tvnode{i}\n" for i, a in enumerate(addrs))
        return self

    def node_cmd(self, i: int, cmd: list[str]) -> list[str]:
        """``cmd`` as it runs on node ``i`` (its namespace, hostname, hosts, /dev/shm)."""
        from neuron_dist.launch import vnodes

        return ["ip", "netns", "exec", self.ns[i], "unshare", "--mount", "--uts", "sh", "-c",
                vnodes._NODE_SH, "sh", f"vnode{i}", self.hosts, *cmd]

    def ssh_script(self) -> str:
        """Write the launcher script for hydra (``SCRIPT -x vnodeI CMD...``); its path."""
        from neuron_dist.launch import vnodes

        path = os.path.join(self.tmpdir, "netns_ssh.sh")
        with open(path, "w") as f:
            f.write("#!/bin/sh\n"
                    "# hydra's ssh launcher: THIS [-x] vnodeI COMMAND...; runs COMMAND (a shell\n"
                    "# command line, as ssh would) on virtual node I.\n"
                    'while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done\n'
                    'host="$1"; shift\n'
                    'case "$host" in vnode[0-9]*) ;; *) echo "netns_ssh: unknown host $host" >&2;'
                    ' exit 255 ;; esac\n'
                    f'exec ip netns exec "{self.tag}n${{host#vnode}}" unshare --mount --uts '
                    f'sh -c {shlex.quote(vnodes._NODE_SH)} sh "$host" {shlex.quote(self.hosts)} '
                    'sh -c "$*"\n')
        os.chmod(path, 0o755)
        return path

    def pids(self) -> list[int]:
        out = []
        for ns in self.created:
            proc = subprocess.run(["ip", "netns", "pids", ns], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, timeout=30)
            out += [int(p) for p in proc.stdout.split() if p.isdigit()]
        return out

    def close(self) -> list[int]:
        """Kill every process in the namespaces (TERM, then KILL), delete them; return the
        pids that would not die."""
        from neuron_dist.launch import vnodes

        left = []
        for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            left = self.pids()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and self.pids():
                time.sleep(0.05)
            left = self.pids()
        stuck = vnodes._delete_netns(self.created)
        if stuck:
            print(f"scale: could not delete network namespaces {stuck}", file=sys.stderr)
        return left

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


# ----------------------------------------------------------------------------- runs

def _read_rank_files(outdir: str, backend: str) -> dict[int, list[dict]]:
    by_rank = {}
    for path in glob.glob(os.path.join(outdir, f"{backend}-rank*.jsonl")):
        rank = int(path.rsplit("-rank", 1)[1].split(".")[0])
        lines = []
        with open(path) as f:
            for line in f:
                try:
                    lines.append(json.loads(line))
                except ValueError:
                    pass
        by_rank[rank] = lines
    return by_rank


class _Tail(threading.Thread):
    """Progress lines from rank 0's file while a backend runs."""

    def __init__(self, path: str, backend: str, log):
        super().__init__(daemon=True)
        self.path, self.backend, self.log = path, backend, log
        self.stop = threading.Event()

    def run(self) -> None:
        pos, buf = 0, ""
        while True:
            stopping = self.stop.is_set()
            try:
                with open(self.path) as f:
                    f.seek(pos)
                    buf += f.read()
                    pos = f.tell()
            except OSError:
                pass
            *lines, buf = buf.split("\n")
            for line in lines:
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                k = obj.get("kind")
                if k == "init":
                    self.log(f"[{self.backend}] init on rank 0: {obj['init_s']:.2f} s "
                             f"(world {obj['world']})")
                elif k == "op":
                    med = statistics.median(obj["samples"]) * 1e6 if obj["samples"] else 0
                    self.log(f"[{self.backend}] {obj['op']} {human_size(obj['bytes'])}: rank 0 "
                             f"median {med:.1f} us, check {obj['check']} ({obj['cell_s']:.1f} s)")
                elif k == "error":
                    self.log(f"[{self.backend}] ERROR {obj['op']}: {obj['error']}")
            if stopping:
                return
            self.stop.wait(0.3)


def _worker_args(backend: str, outdir: str, args) -> list[str]:
    return ["-m", WORKER, "--backend", backend, "--out", outdir, "--iters", str(args.iters),
            "--warmup", str(args.warmup), "--op-timeout", str(args.op_timeout),
            "--nproc-per-node", str(args.nproc_per_node)]


def run_torch(backend: str, outdir: str, args, timeout: float) -> dict:
    """One backend under torchrun on the vnodes; ``{"returncode", "duration_s", ...}``."""
    from neuron_dist.launch import vnodes

    env = {"GLOO_SOCKET_IFNAME": vnodes.NODE_IFNAME,
           "NEURON_DIST_SOCKET_IFNAME": vnodes.NODE_IFNAME, "OMP_NUM_THREADS": "1"}
    res = vnodes.run(args.nodes, args.nproc_per_node, _worker_args(backend, outdir, args),
                     netns=True, timeout=timeout, env=env, grace=10.0)
    return {"returncode": res.returncode, "timed_out": res.timed_out,
            "duration_s": round(res.duration, 2), "node_returncodes": res.node_returncodes,
            "stderr": res.stderr, "namespaces": res.namespaces, "launcher": "vnodes.run (torchrun)",
            "env": env}


def run_mpich(outdir: str, args, timeout: float, tmpdir: str, backend: str = "mpich") -> dict:
    """The worker of ``backend`` (``mpich``: mpi4py; ``neuron-mpi``: neuron over the MPI
    transport) under hydra's mpiexec, across the namespaces of :class:`Nodes`."""
    from .mpi_runner import find_mpiexec, unavailable_reason

    why = unavailable_reason()
    if why:
        return {"returncode": None, "skipped": why, "duration_s": 0.0}
    mpiexec = find_mpiexec()
    start = time.monotonic()
    n, ppn = args.nodes, args.nproc_per_node
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0",
               UCX_TLS="tcp", UCX_NET_DEVICES="eth0")
    log_path = os.path.join(tmpdir, f"mpiexec-{backend}.log")
    timed_out, rc, left, stderr = False, None, [], ""
    with Nodes(n, tmpdir) as nodes:
        script = nodes.ssh_script()
        cmd = [mpiexec, "-launcher", "ssh", "-launcher-exec", script,
               "-hosts", ",".join(f"vnode{i}:{ppn}" for i in range(n)),
               "-n", str(n * ppn), "-ppn", str(ppn),
               "-genv", "UCX_TLS", "tcp", "-genv", "UCX_NET_DEVICES", "eth0",
               "-genv", "OMP_NUM_THREADS", "1",
               "-genv", "NEURON_DIST_SOCKET_IFNAME", "eth0",
               sys.executable, *_worker_args(backend, outdir, args)]
        full = nodes.node_cmd(0, cmd)
        with open(log_path, "w") as logf:
            proc = subprocess.Popen(full, env=env, stdin=subprocess.DEVNULL, stdout=logf,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                deadline = start + timeout
                while proc.poll() is None:
                    if time.monotonic() >= deadline:
                        timed_out = True
                        break
                    time.sleep(0.1)
            finally:
                if proc.poll() is None:
                    for sig in (signal.SIGTERM, signal.SIGKILL):
                        try:
                            os.killpg(proc.pid, sig)
                        except ProcessLookupError:
                            break
                        try:
                            proc.wait(timeout=3)
                            break
                        except subprocess.TimeoutExpired:
                            pass
                rc = proc.poll()
                left = nodes.close()
        with open(log_path, errors="replace") as f:
            stderr = f.read()
    return {"returncode": 124 if timed_out else rc, "timed_out": timed_out,
            "duration_s": round(time.monotonic() - start, 2), "stderr": [stderr],
            "namespaces": list(nodes.created), "left_pids": left,
            "launcher": f"{mpiexec} (hydra, ssh launcher via ip netns exec)",
            "mpiexec_cmd": cmd, "env": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0",
                                        "OMP_NUM_THREADS": "1",
                                        "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}}


# ----------------------------------------------------------------------------- combine

def _spread(vals: list) -> dict | None:
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals)}


def combine(backend: str, by_rank: dict[int, list[dict]], world: int) -> dict:
    """Per op: max over ranks per iteration, median; CPU per op per rank; resources."""
    out = {"ops": {}, "ranks": {}, "errors": [], "checks_failed": []}
    missing = [r for r in range(world) if r not in by_rank]
    if missing:
        out["errors"].append(f"{backend}: no output from rank(s) {missing[:8]}"
                             + (" ..." if len(missing) > 8 else ""))
    for rank, lines in sorted(by_rank.items()):
        info = out["ranks"].setdefault(rank, {})
        for obj in lines:
            k = obj.get("kind")
            if k == "init":
                info.update({x: obj.get(x) for x in ("hostname", "node_name", "local_rank",
                                                     "init_s", "mpi_library")})
            elif k == "resources":
                info.update({x: obj.get(x) for x in ("sockets", "py_threads", "os_threads",
                                                     "rss_kib", "hwm_kib", "node_tx_bytes",
                                                     "local_rank")})
            elif k == "done":
                info["done"] = True
            elif k == "error":
                out["errors"].append(f"{backend} rank {rank}: {obj['op']}: {obj['error']}")
            elif k == "op":
                key = f"{obj['op']} {obj['bytes']}"
                cell = out["ops"].setdefault(key, {"op": obj["op"], "bytes": obj["bytes"],
                                                   "batch": obj["batch"], "iters": obj["iters"],
                                                   "per_rank": {}})
                cell["per_rank"][rank] = obj
    for key, cell in out["ops"].items():
        per = cell.pop("per_rank")
        ranks = sorted(per)
        samples = [per[r]["samples"] for r in ranks]
        per_iter = [max(v) for v in zip(*samples)] if samples else []
        cpu = [per[r]["cpu_s"] / per[r]["nops"] * 1e6 for r in ranks if per[r]["nops"]]
        fails = [per[r]["check"] for r in ranks if per[r]["check"] != "OK"]
        cell.update(
            ranks_reporting=len(ranks),
            time_us=statistics.median(per_iter) * 1e6 if per_iter else None,
            min_us=min(per_iter) * 1e6 if per_iter else None,
            rank0_median_us=statistics.median(per[0]["samples"]) * 1e6 if 0 in per else None,
            iter_us=[round(x * 1e6, 2) for x in per_iter],
            cpu_us_max=max(cpu) if cpu else None, cpu_us_sum=sum(cpu) if cpu else None,
            cpu_us_per_rank=[round(c, 2) for c in cpu],
            check="OK" if not fails and len(ranks) == world else (fails[0] if fails else
                                                                  f"only {len(ranks)} ranks"),
        )
        if fails:
            out["checks_failed"].append(f"{backend}: {fails[0]}"
                                        + (f" (and {len(fails) - 1} more rank(s))"
                                           if len(fails) > 1 else ""))
    ranks = out["ranks"].values()
    txs = [r.get("node_tx_bytes") for r in ranks if r.get("local_rank") == 0]
    out["summary"] = {
        "sockets": _spread([r.get("sockets") for r in ranks]),
        "os_threads": _spread([r.get("os_threads") for r in ranks]),
        "py_threads": _spread([r.get("py_threads") for r in ranks]),
        "rss_mib": _spread([r["rss_kib"] / 1024 if r.get("rss_kib") else None for r in ranks]),
        "init_s": _spread([r.get("init_s") for r in ranks]),
        "eth0_tx_mb_all_nodes": (sum(t for t in txs if t is not None) / 1e6
                                 if any(t is not None for t in txs) else None),
        "ranks_done": sum(1 for r in ranks if r.get("done")),
    }
    return out


# ----------------------------------------------------------------------------- report

def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def _ratio(num, den):
    return None if num is None or den is None or not den else num / den


def tables(results: dict, backends: list[str], world: int) -> list[str]:
    ran = [b for b in backends if results.get(b, {}).get("ops") is not None]
    w = 10
    others = [b for b in ("gloo", "mpich", "floor") if b in ran and "neuron" in ran]
    # neuron over the MPI transport against what it competes with there
    versus = [(b, "neuron-mpi") for b in ("gloo", "mpich", "neuron") if b in ran
              and "neuron-mpi" in ran]
    lines = [f"# time per op, us (median over iterations of the max over ranks); "
             f"ratio = other / neuron (> 1 = neuron faster)"]
    head = f"{'op':<15}{'size':>9} " + " ".join(f"{b:>{w}}" for b in ran) + "".join(
        f" {b + '/neuron':>13}" for b in others) + "".join(
        f" {a + '/' + b:>18}" for a, b in versus)
    lines += [head, "-" * len(head)]
    for op, nbytes in OPS:
        cells = {b: results[b]["ops"].get(f"{op} {_size_of(op, nbytes, world)}") for b in ran}
        t = {b: (c or {}).get("time_us") for b, c in cells.items()}
        mark = {b: ("" if c is None or c.get("check") == "OK" else "!") for b, c in cells.items()}
        row = f"{op:<15}{(human_size(nbytes) if nbytes else '-'):>9} " + " ".join(
            f"{_fmt(t[b]) + mark[b]:>{w}}" for b in ran)
        for b in others:
            r = _ratio(t[b], t["neuron"])
            row += f" {(f'{r:.2f}x' if r is not None else '-'):>13}"
        for a, b in versus:
            r = _ratio(t[a], t[b])
            row += f" {(f'{r:.2f}x' if r is not None else '-'):>18}"
        lines.append(row)
    lines += ["#", "# CPU per op, us (whole process, every thread, user + system, timed batches "
                   "only; max over ranks)"]
    cpu_others = [b for b in others if b == "gloo"]
    head = f"{'op':<15}{'size':>9} " + " ".join(f"{b:>{w}}" for b in ran) + "".join(
        f" {b + '/neuron':>13}" for b in cpu_others)
    lines += [head, "-" * len(head)]
    for op, nbytes in OPS:
        cells = {b: results[b]["ops"].get(f"{op} {_size_of(op, nbytes, world)}") for b in ran}
        c = {b: (x or {}).get("cpu_us_max") for b, x in cells.items()}
        row = f"{op:<15}{(human_size(nbytes) if nbytes else '-'):>9} " + " ".join(
            f"{_fmt(c[b]):>{w}}" for b in ran)
        for b in cpu_others:
            r = _ratio(c[b], c["neuron"])
            row += f" {(f'{r:.2f}x' if r is not None else '-'):>13}"
        lines.append(row)
    lines += ["#", "# resources per rank after the ops: min/median/max over ranks; init = "
                   "init (+ first barrier), max over ranks (median)"]
    head = (f"{'backend':<8} {'sockets':>12} {'threads(os)':>13} {'threads(py)':>12} "
            f"{'RSS MiB':>17} {'init s':>15} {'eth0 MB':>9} {'run s':>7}")
    lines += [head, "-" * len(head)]

    def mmm(s, spec="d"):
        if not s:
            return "-"
        f = (lambda v: format(int(round(v)), "d")) if spec == "d" else (lambda v: format(v, spec))
        return f"{f(s['min'])}/{f(s['median'])}/{f(s['max'])}"

    for b in backends:
        r = results.get(b, {})
        s = r.get("summary")
        if not s:
            lines.append(f"{b:<8} {r.get('status', '-')}")
            continue
        init = s["init_s"]
        init_txt = f"{init['max']:.2f} ({init['median']:.2f})" if init else "-"
        lines.append(f"{b:<8} {mmm(s['sockets']):>12} {mmm(s['os_threads']):>13} "
                     f"{mmm(s['py_threads']):>12} {mmm(s['rss_mib'], '.0f'):>17} "
                     f"{init_txt:>15} {_fmt(s['eth0_tx_mb_all_nodes']):>9} "
                     f"{_fmt(r.get('duration_s')):>7}")
    return lines


def _size_of(op: str, nbytes: int, world: int) -> int:
    """The byte count a worker reports for (op, nbytes) at ``world`` ranks."""
    if op == "barrier":
        return 0
    count = max(1, nbytes // 4)
    if op in ("all_gather", "reduce_scatter"):
        count = max(world, count // world * world)
    return count * 4


# ----------------------------------------------------------------------------- facts

def _git(repo: str) -> dict:
    def git(*a):
        p = subprocess.run(["git", "--no-optional-locks", "-C", repo, *a], capture_output=True,
                           text=True, timeout=30)
        return p.stdout.strip() if p.returncode == 0 else None

    status = git("status", "--porcelain")
    lines = status.splitlines() if status else []
    return {"repo": repo, "commit": git("rev-parse", "HEAD"),
            "dirty": any(not ln.startswith("??") for ln in lines),
            "modified": [ln[3:] for ln in lines if not ln.startswith("??")][:50],
            "untracked": [ln[3:] for ln in lines if ln.startswith("??")][:50]}


def _machine() -> dict:
    facts = {"host": platform.node(), "kernel": platform.release(),
             "python": platform.python_version()}
    try:
        facts["cores"] = len(os.sched_getaffinity(0))
    except AttributeError:
        facts["cores"] = os.cpu_count()
    try:
        with open("/proc/meminfo") as f:
            facts["mem_total_gib"] = round(int(f.readline().split()[1]) / 2 ** 20, 1)
        with open("/proc/cpuinfo") as f:
            facts["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f
                                 if ln.startswith("model name")), None)
    except OSError:
        pass
    return facts


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _shm_entries() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


class _Terminated(BaseException):
    pass


def _raise_terminated(signum, frame):
    raise _Terminated(signum)


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def log(text: str) -> None:
        if not args.quiet:
            print(text, file=sys.stderr, flush=True)

    if args.nodes < 1 or args.nproc_per_node < 1 or args.iters < 1 or args.warmup < 0:
        print("scale: need --nodes, --nproc-per-node, --iters >= 1 and --warmup >= 0",
              file=sys.stderr)
        return 2
    from neuron_dist.launch import vnodes

    if not vnodes.netns_available():
        print("scale: needs network namespaces (root, ip netns, veth, bridge, unshare)",
              file=sys.stderr)
        return 2
    import torch

    import neuron_dist

    world = args.nodes * args.nproc_per_node
    cmd = "python -m bench.scale" + "".join(
        " " + shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(neuron_dist.__file__)))
    started = _dt.datetime.now().astimezone()
    t_start = time.monotonic()
    load_before = _loadavg()
    shm_before = _shm_entries()
    log(f"scale: {args.nodes} netns nodes x {args.nproc_per_node} ranks = {world}; backends "
        f"{', '.join(args.backends)}; {args.iters} iterations; timeout {args.timeout:g} s")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_terminated)
    tmpdir = tempfile.mkdtemp(prefix="neuron-scale-")
    os.chmod(tmpdir, 0o755)
    results: dict = {}
    errors: list[str] = []
    interrupted = False
    try:
        for b in args.backends:
            left = args.timeout - (time.monotonic() - t_start)
            if left < 10:
                results[b] = {"status": "skipped: --timeout used up"}
                errors.append(f"{b}: not run, --timeout used up")
                continue
            outdir = os.path.join(tmpdir, b)
            os.makedirs(outdir)
            log(f"scale: [{b}] starting ({left:.0f} s left)")
            tail = _Tail(os.path.join(outdir, f"{b}-rank0.jsonl"), b, log)
            tail.start()
            try:
                if b in MPIEXEC_BACKENDS:
                    run = run_mpich(outdir, args, left, tmpdir, b)
                else:
                    run = run_torch(b, outdir, args, left)
            except (RuntimeError, ValueError, OSError) as exc:
                run = {"returncode": None, "error": f"{type(exc).__name__}: {exc}",
                       "duration_s": None}
            finally:
                tail.stop.set()
                tail.join(5)
            if run.get("skipped"):
                results[b] = {"status": f"skipped: {run['skipped']}", **run}
                errors.append(f"{b}: skipped: {run['skipped']}")
                continue
            comb = combine(b, _read_rank_files(outdir, b), world)
            stderr_tail = []
            bad = (run.get("returncode") != 0 or comb["errors"] or comb["checks_failed"]
                   or comb["summary"]["ranks_done"] != world)
            if bad:
                for i, text in enumerate(run.get("stderr") or []):
                    tail_lines = [ln for ln in text.splitlines() if ln.strip()][-20:]
                    if tail_lines:
                        stderr_tail.append({"node": i, "lines": tail_lines})
            status = "ok"
            if run.get("error"):
                status = f"error: {run['error']}"
            elif run.get("timed_out"):
                status = "timed out"
            elif run.get("returncode") != 0 or comb["summary"]["ranks_done"] != world:
                status = f"failed (exit {run.get('returncode')})"
            elif comb["checks_failed"]:
                status = "CHECK FAILED"
            results[b] = {"status": status, **{k: v for k, v in run.items() if k != "stderr"},
                          **comb, "stderr_tail": stderr_tail}
            errors += [f"CHECK FAILED: {c}" for c in comb["checks_failed"]]
            errors += comb["errors"]
            if status != "ok" and not comb["checks_failed"]:
                errors.append(f"{b}: {status}")
            log(f"scale: [{b}] {status} ({run.get('duration_s')} s)")
    except (KeyboardInterrupt, _Terminated):
        interrupted = True
        errors.append("interrupted (everything started was stopped and removed)")
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)

    # Leftovers: /dev/shm entries that appeared, our namespaces still present.
    from neuron_dist.launch import vnodes as _vn

    ours = {ns for r in results.values() for ns in (r.get("namespaces") or [])}
    still = sorted(ours & set(_vn._list_netns()))
    new_shm = sorted(_shm_entries() - shm_before)
    if still:
        errors.append(f"namespaces left behind: {still}")
    if new_shm:
        errors.append(f"/dev/shm entries appeared during the run: {new_shm[:10]}")

    meta = {
        "command": cmd, "argv": sys.argv if argv is None else ["scale", *argv],
        "started": started.isoformat(timespec="seconds"),
        "finished": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - t_start, 1),
        "git": _git(repo), "machine": _machine(), "loadavg_before": load_before,
        "loadavg_after": _loadavg(), "torch": torch.__version__,
        "neuron_dist": neuron_dist.__version__, "executable": sys.executable,
        "nodes": args.nodes, "nproc_per_node": args.nproc_per_node, "world": world,
        "netns": True, "backends": args.backends, "iters": args.iters, "warmup": args.warmup,
        "timeout": args.timeout, "op_timeout": args.op_timeout,
        "mpi_library": next((r.get("mpi_library") for r in
                             results.get("mpich", {}).get("ranks", {}).values()), None),
        "leftover_namespaces": still, "new_dev_shm_entries": new_shm,
        "timing": ("per iteration: barrier of the backend under test, then a batch of ops "
                   "(16 below 256 KiB, 4 at 1 MiB) timed on every rank, mean per op; "
                   "iteration time = max over ranks; time_us = median over iterations. "
                   "cpu: getrusage(RUSAGE_SELF) user+sys over the timed batches / ops, "
                   "cpu_us_max = max over ranks, cpu_us_sum = sum over ranks. init_s: "
                   "init_process_group (mpich: MPI_Init_thread) + first barrier per rank. "
                   "ratios: other time / neuron time (> 1 = neuron faster)."),
    }
    git = meta["git"]
    head = [f"# {cmd}",
            f"# commit {git['commit'] or '?'}" + (" (tree dirty: " + ", ".join(git["modified"][:5])
                                                 + ")" if git["dirty"] else " (clean tree)")
            + (f"; untracked: {', '.join(git['untracked'][:5])}" if git["untracked"] else ""),
            f"# {meta['machine'].get('host')}: {meta['machine'].get('cores')} cores, "
            f"{meta['machine'].get('mem_total_gib')} GiB, kernel {meta['machine'].get('kernel')}, "
            f"load {load_before} before / {meta['loadavg_after']} after; torch {torch.__version__}"
            + (f"; {meta['mpi_library']}" if meta["mpi_library"] else ""),
            f"# {args.nodes} virtual nodes x {args.nproc_per_node} rank(s) = {world} ranks, each "
            f"node a network namespace (veth + bridge, private /dev/shm); {args.iters} "
            f"iterations after {args.warmup} warm-up; run {meta['duration_s']} s",
            "# backends: " + "; ".join(f"{b} {results.get(b, {}).get('status', 'not run')} "
                                       f"({results.get(b, {}).get('duration_s')} s)"
                                       for b in args.backends)]
    if "mpich" in results and results["mpich"].get("ops") is not None:
        head.append("# mpich: hydra mpiexec in node 0's namespace, ssh launcher = ip netns exec "
                    "into the other nodes; UCX_TLS=tcp UCX_NET_DEVICES=eth0 between nodes, "
                    "MPICH shared memory inside a node")
    if "floor" in args.backends:
        head.append("# floor: neuron_floor (bench/floor_pg.py, raw TCP, 1 connection per "
                    "pair; binomial trees among more than 2 ranks) has only all_reduce, "
                    "broadcast and barrier")
    body = tables(results, args.backends, world) if results else []
    text = head + ["#"] + body
    for e in errors:
        text.append(f"# error: {e}")
    for b, r in results.items():
        for t in r.get("stderr_tail") or []:
            text.append(f"# stderr of {b} node {t['node']} (last lines):")
            text += [f"#   {ln}" for ln in t["lines"]]
    print("\n".join(text), flush=True)
    if any(e.startswith("CHECK FAILED") for e in errors):
        print("scale: CHECK FAILED: a backend returned wrong values (see above)",
              file=sys.stderr, flush=True)

    if args.json:
        doc = {"meta": meta, "results": results, "errors": errors, "text": text}
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
            f.write("\n")
        log(f"wrote {args.json}")
    if interrupted:
        return 130
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
