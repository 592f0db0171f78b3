"""Command line of the collectives benchmark: ``python -m bench``.

Parses nccl-tests-style flags, then for each world size (``-n 2,4``) runs the torch ranks
(neuron, gloo, null and shmfloor interleaved, see ``torch_runner``; null is a group that
does nothing, the dispatch floor every Python backend pays, and shmfloor one that only
moves the bytes, through shared memory or one cross-memory read) and then the MPI baseline (see
``mpi_runner``), printing a progress line per (op, size) on stderr; ``--rounds R`` does
that R times, MPI going first every other round, and reports the median of the rounds
(``sweep.combine_rounds``). At the end it prints
the table (and the overlap / shared-memory reports when asked) on stdout and writes the
JSON, CSV and PNG files asked for. Exit status: 0 if everything ran and every ``--check``
passed, 1 if a check failed or a run failed or timed out, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import sys

from . import report
from .sweep import (BATCH_BYTES, DTYPE_BYTES, MAX_BATCH, OPS, combine_rounds, human_size,
                    parse_size, progress_line, size_range)

BACKENDS = ("neuron", "gloo", "null", "shmfloor", "mpi")

EPILOG = """\
bytes per op (nccl-tests): all_reduce, broadcast: the buffer; all_gather: the full gathered
output (input = bytes/n); reduce_scatter: the full input (output = bytes/n); all_to_all: the
whole send buffer; send_recv: one message (ping-pong rank 0 <-> 1, time = round trip / 2).
timing: per iteration a barrier of the backend under test, then the op is timed on every
rank; iteration time = max over ranks; time_us = median (min_us = fastest iteration).
busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter, all_to_all),
1 (broadcast, send_recv). neuron, gloo, null (a process group that does nothing: the
dispatch floor) and shmfloor (one that moves the bytes through shared memory, or with one
cross-memory read beyond 1 MiB, and does nothing else: the floor of a Python backend on
one node) share the rank processes and alternate per size; MPI (mpiexec + mpi4py)
runs after them for each world size (with --rounds, before them every other round).
x null = time / null's time (how many dispatch floors); vs mpi = MPI's time / time.

examples:
  python -m bench -b 8 -e 256M -f 2 -n 2,4 --check --json r.json --plot r.png
  python -m bench -b 1M -e 1M --ops all_reduce --overlap --report-shm
  python -m bench -b 64K -e 32M -f 4 --rounds 5 --backends neuron,mpi
"""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def _csv_list(text: str, allowed, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if "all" in items and allowed is not None:
        return list(allowed)
    bad = [x for x in items if allowed is not None and x not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"unknown {what} {bad or text!r}; choose from "
                                         f"{', '.join(allowed)} (or all)")
    return list(dict.fromkeys(items))


def _worlds(text: str) -> list[int]:
    try:
        worlds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"-n takes world sizes like 2 or 2,4 (got {text!r})") from None
    if not worlds or min(worlds) < 1:
        raise argparse.ArgumentTypeError(f"world sizes must be >= 1 (got {text!r})")
    return list(dict.fromkeys(worlds))


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Collectives benchmark for the neuron backend, against gloo and MPI "
                    "(in the spirit of nccl-tests). Sizes are total message bytes per rank "
                    "as nccl-tests defines them per op.",
        epilog=EPILOG, formatter_class=_Formatter)
    g = p.add_argument_group("sweep")
    g.add_argument("-b", "--minbytes", type=_size, default="8", help="smallest size")
    g.add_argument("-e", "--maxbytes", type=_size, default="32M", help="largest size")
    g.add_argument("-f", "--stepfactor", type=float, default=2.0, help="size multiplier")
    g.add_argument("-n", "--nprocs", type=_worlds, default="2", help="world sizes, e.g. 2,4")
    g.add_argument("--ops", type=lambda s: _csv_list(s, OPS, "op"), default="all",
                   help="comma list of " + ",".join(OPS))
    g.add_argument("--backends", type=lambda s: _csv_list(s, BACKENDS, "backend"),
                   default=",".join(BACKENDS), help="comma list of " + ",".join(BACKENDS))
    g.add_argument("--dtype", choices=list(DTYPE_BYTES), default="float32")
    g.add_argument("--iters", type=int, default=20, help="timed samples per size")
    g.add_argument("--rounds", type=int, default=1,
                   help="run each world size's sweep this many times, the torch backends and "
                        "MPI taking turns at going first; a row is the median of the rounds' "
                        "medians")
    g.add_argument("--batch", type=int, default=MAX_BATCH,
                   help=f"most operations per sample, run back to back after the barrier "
                        f"(sizes under {BATCH_BYTES >> 20} MiB; 1: one operation per barrier)")
    g.add_argument("-w", "--warmup", type=int, default=5, help="untimed iterations per size")
    g.add_argument("--check", action="store_true", help="verify every result (OK/FAIL)")
    g.add_argument("--threads", type=int, default=0,
                   help="torch/OpenMP threads per rank (0: cores // world size, at least 1)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="F", help="write everything as JSON")
    o.add_argument("--csv", metavar="F", help="write the result rows as CSV")
    o.add_argument("--plot", metavar="F.png", help="busbw vs size, one subplot per op (matplotlib)")
    o.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    x = p.add_argument_group("extra measurements")
    x.add_argument("--overlap", action="store_true",
                   help="compute/communication overlap of async all_reduce (torch backends)")
    x.add_argument("--overlap-bytes", type=_size, default="4M",
                   help="all_reduce size for --overlap")
    x.add_argument("--overlap-matmul", type=int, default=256, help="matmul edge for --overlap")
    x.add_argument("--report-shm", action="store_true",
                   help="print the neuron shared-memory segment size per group")
    t = p.add_argument_group("limits")
    t.add_argument("--timeout", type=float, default=7200.0,
                   help="seconds for one run (torch or MPI, one world size); ranks are killed")
    t.add_argument("--stall-timeout", type=float, default=600.0,
                   help="kill a run when no result arrived for this many seconds")
    t.add_argument("--pg-timeout", type=float, default=300.0, help="process-group timeout")
    t.add_argument("--mpiexec", help="mpiexec to use (None: the one next to python, i.e. the mpich wheel, then PATH)")
    return p


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    """The entry point of ``python -m bench``; returns the exit status."""
    try:
        return _run(argv)
    except KeyboardInterrupt:  # ranks and mpiexec were killed on the way out
        print("bench: interrupted", file=sys.stderr)
        return 130


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    err = sys.stderr
    try:
        sizes = size_range(args.minbytes, args.maxbytes, args.stepfactor)
    except ValueError as exc:
        print(f"bench: {exc}", file=err)
        return 2
    if args.iters < 1 or args.warmup < 0 or args.batch < 1 or args.rounds < 1:
        print("bench: need --iters >= 1, --batch >= 1, --rounds >= 1 and "
              "--warmup >= 0", file=err)
        return 2

    def log(text: str) -> None:
        print(text, file=err, flush=True)

    def on_rows(rows):
        if not args.quiet:
            log(progress_line(rows))

    torch_backends = [b for b in args.backends if b != "mpi"]
    notes, errors = [], []
    mpi_meta = {}
    run_mpi = "mpi" in args.backends
    if run_mpi:
        from . import mpi_runner
        reason = mpi_runner.unavailable_reason(args.mpiexec)
        if reason:
            notes.append(f"MPI skipped: {reason}")
            log(f"note: MPI skipped: {reason}")
            run_mpi = False
    if args.overlap and not set(torch_backends) & {"neuron", "gloo"}:
        notes.append("--overlap needs neuron or gloo; skipped")

    cores = _cores()
    started = _dt.datetime.now().astimezone()
    results, overlap_rows, shm = [], [], []
    threads_used = {}
    for world in args.nprocs:
        threads = args.threads or max(1, cores // world)
        threads_used[world] = threads
        cfg = {"ops": args.ops, "dtype": args.dtype, "sizes": sizes, "iters": args.iters,
               "batch": args.batch, "warmup": args.warmup, "check": args.check, "threads": threads,
               "pg_timeout": args.pg_timeout, "report_shm": args.report_shm,
               "overlap": ({"bytes": args.overlap_bytes, "matmul": args.overlap_matmul}
                           if args.overlap else None)}
        rounds = []
        for rnd in range(args.rounds):
            # the first round alone measures overlap and reports shared memory
            extra = {} if rnd == 0 else {"overlap": None, "report_shm": False}
            runs = [_run_torch, _run_mpi] if rnd % 2 == 0 else [_run_mpi, _run_torch]
            rows = []
            for run in runs:
                out = run(args, world, dict(cfg, **extra), torch_backends, run_mpi, on_rows,
                          log, f" (round {rnd + 1} of {args.rounds})" if args.rounds > 1 else "")
                if out is None:
                    continue
                rows += out["results"]
                overlap_rows += out.get("overlap", [])
                shm += out.get("shm", [])
                errors += out["errors"]
                mpi_meta = out.get("meta") or mpi_meta
                for e in out["errors"]:
                    log(f"error: {e}")
            rounds.append(rows)
        results += rounds[0] if args.rounds == 1 else combine_rounds(rounds)

    report.add_ratios(results)
    results = report.sort_rows(results, args.ops, list(args.backends))
    meta = _meta(args, argv, sizes, cores, threads_used, started, mpi_meta)
    print(_header(meta))
    print(report.table(results))
    if overlap_rows:
        print("\n# overlap: async all_reduce issued before a matmul loop, then waited. balanced: every"
              "\n# rank computes; late: the last rank sleeps as long as the loop, then joins (times of"
              "\n# the others). overlap = (serial - overlapped) / min(compute, comm): 1 = the shorter is"
              "\n# fully hidden, 0 = none. Details: bench/overlap.py")
        print(report.overlap_table(overlap_rows))
    if shm:
        print("\n# neuron shared memory per group")
        for line in report.shm_lines(shm):
            print(f"#   {line}")
    fails = [r for r in results if r["check"] == "FAIL"]
    if args.check:
        checked = sum(r["check"] == "OK" for r in results)
        print(f"\n# check: {checked} OK, {len(fails)} FAIL" +
              "".join(f"\n#   FAIL {r['op']} {r['bytes']} B n={r['world']} {r['backend']}: {r['note']}"
                      for r in fails))
    for n in notes:
        print(f"# note: {n}")
    for e in errors:
        print(f"# error: {e}")
    sys.stdout.flush()

    doc = {"meta": meta, "results": results, "overlap": overlap_rows, "shm": shm,
           "notes": notes, "errors": errors}
    if args.json:
        report.write_json(args.json, doc)
        log(f"wrote {args.json}")
    if args.csv:
        report.write_csv(args.csv, results)
        log(f"wrote {args.csv}")
    if args.plot:
        from .plot import PlotUnavailable, save
        try:
            save(args.plot, results, args.ops,
                 title=f"neuron-dist bench, {args.dtype}, {meta['host']}, {started:%Y-%m-%d %H:%M}")
            log(f"wrote {args.plot}")
        except PlotUnavailable as exc:
            log(f"note: no plot: {exc}")
            print(f"# note: no plot: {exc}")
    return 1 if fails or errors else 0


def _run_torch(args, world, cfg, torch_backends, run_mpi, on_rows, log, which):
    if not torch_backends:
        return None
    from . import torch_runner
    how = " (interleaved)" if len(torch_backends) > 1 else ""
    log(f"== n={world}: {' + '.join(torch_backends)}{how}, {cfg['threads']} thread(s) per "
        f"rank{which}")
    return torch_runner.run_world(world, dict(cfg, backends=torch_backends), on_rows, log,
                                  args.timeout, args.stall_timeout)


def _run_mpi(args, world, cfg, torch_backends, run_mpi, on_rows, log, which):
    if not run_mpi:
        return None
    from . import mpi_runner
    log(f"== n={world}: mpi (mpiexec){which}")
    return mpi_runner.run_world(world, cfg, on_rows, log, args.timeout, args.stall_timeout,
                                args.mpiexec)


def _meta(args, argv, sizes, cores, threads, started, mpi_meta) -> dict:
    import torch

    import neuron_dist
    from neuron_dist.config import environment

    return {
        "command": "python -m bench " + " ".join(shlex.quote(a) for a in
                                                    (sys.argv[1:] if argv is None else argv)),
        "started": started.isoformat(timespec="seconds"),
        "finished": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(), "cores": cores,
        "loadavg_at_end": ([round(x, 2) for x in os.getloadavg()]
                           if hasattr(os, "getloadavg") else None),
        "python": platform.python_version(), "torch": torch.__version__,
        "neuron_dist": neuron_dist.__version__, "mpi": mpi_meta or None,
        "dtype": args.dtype, "iters": args.iters, "batch": args.batch, "warmup": args.warmup,
        "rounds": args.rounds,
        "requested_sizes": sizes, "worlds": args.nprocs, "threads_per_rank": threads,
        "ops": {op: {"bytes": OPS[op].meaning} for op in args.ops},
        "backends": args.backends,
        "neuron_env": environment(),
        "timing": f"per sample: barrier of the backend under test, then time `batch` ops back "
                  f"to back on every rank (min({args.batch}, {BATCH_BYTES >> 20} MiB / bytes), "
                  f"at least 1), sample = their mean; sample time = max over ranks; time_us = "
                  f"median over samples (min_us = fastest). send_recv: ping-pong rank 0<->1, "
                  f"time = round trip / 2. neuron, gloo, null (does nothing: the dispatch "
                  f"floor) and shmfloor (moves the bytes through shared memory, or by one "
                  f"cross-memory read beyond 1 MiB, and nothing else) run interleaved in the same ranks; MPI runs in its own processes"
                  + (f". {args.rounds} rounds, torch backends and MPI taking turns at going "
                     f"first; time_us = median of the rounds' medians (spread = their max / "
                     f"min), min_us = fastest of all" if args.rounds > 1 else
                     ", afterwards."),
        "bandwidth": "algbw = bytes / time (1e9 B/s); busbw = algbw * factor: all_reduce 2(n-1)/n,"
                     " all_gather/reduce_scatter/all_to_all (n-1)/n, broadcast/send_recv 1",
    }


def _header(meta: dict) -> str:
    sizes = meta["requested_sizes"]
    return "\n".join([
        f"# {meta['command']}",
        f"# host {meta['host']}, {meta['cores']} cores, load at end {meta['loadavg_at_end']}, "
        f"torch {meta['torch']}, neuron-dist {meta['neuron_dist']}"
        + (f", {meta['mpi']['mpi_library']} (mpi4py {meta['mpi']['mpi4py']})" if meta["mpi"] else ""),
        f"# dtype {meta['dtype']}, sizes {human_size(sizes[0])} .. {human_size(sizes[-1])} "
        f"({len(sizes)}), iters {meta['iters']}, batch up to {meta.get('batch', 1)}, "
        f"warmup {meta['warmup']}, threads per rank "
        + ", ".join(f"{t} (n={w})" for w, t in meta["threads_per_rank"].items()),
        f"# timing: {meta['timing']}",
        f"# {meta['bandwidth']}; vs gloo = gloo time / this time; vs mpi = MPI's time / this "
        f"time; x null = this time / the null group's (the dispatch floor)",
        "#",
    ])


if __name__ == "__main__":
    sys.exit(main())
