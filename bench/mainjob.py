"""Main job per backend, in one run: tokens/s, and CPU per training step against its floor.

``python -m bench.mainjob [--backends neuron,gloo,floor,null] [--steps 6,30] [--json FILE]``

How it works
------------
For each backend in turn (``--reps`` rounds of A B C, so machine noise hits all alike) the
main job runs twice, ``launch/vnodes.py --nodes 2 --nproc-per-node 2 --netns --
launch/train.py --backend B --steps S`` (plus ``--train-args``), once with the short and
once with the long step count. Around each run the command reads
``getrusage(RUSAGE_CHILDREN)``: vnodes waits for the torchrun agents, which wait for the
ranks, so the difference is the user+sys CPU of every process of the run. The long run
minus the short one, divided by the difference in steps, is the **CPU per step** (start-up,
imports and rendezvous cancel out). **tokens/s** is the long run's own mean (its summary
line); the median over rounds is reported. The long run's rank 0 also says how many threads
and sockets its process holds after the last step, with every group still open (the
most over rounds is reported): what a backend costs in resources besides time.

A run that fails (any backend: gloo itself has been seen to abort with SIGABRT now and
then) is run again, up to ``--retries`` times, so one crash does not lose the whole
measurement; every failure is kept in the JSON and counted in the report, so a backend
that fails is never hidden by its retry.

``null`` (``bench/null_pg.py``) is a process group whose collectives do nothing: its run
is the model's compute alone, so its CPU per step is the floor, and a backend's CPU per
step above it is what its communication costs. On a machine with fewer cores than ranks
the cores are saturated, a step cannot take less than (CPU per step / cores), and
``null``'s tokens/s bounds what any backend can reach (its losses are meaningless: nothing
is reduced). ``floor`` (``bench/job_floor_pg.py``) moves every collective's bytes the
plainest way a Python process group can (shared memory inside a node, one non-blocking TCP
connection per pair between nodes, no protocol, no overlap): between null and it is what
moving the bytes costs any Python backend here, between it and neuron is neuron's own.
``floor_inside`` and ``floor_between`` (same module) are the floor for one kind of group and
neuron for the other: ``--backends neuron,floor_inside,floor_between,floor`` says which of
neuron's groups its own cost sits in.
Needs root (network namespaces), like ``bench.internode``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time

from bench import ROOT

_SUMMARY = re.compile(r"summary: .*mean tokens/s (\d+)")
_RESOURCES = re.compile(r"resources of rank 0 after the last step: (\d+) threads, (\d+) sockets")


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(backend: str, steps: int, args) -> dict:
    """One main-job run: its tokens/s, CPU seconds (all processes) and wall seconds."""
    repo = ROOT
    cmd = [sys.executable, os.path.join(repo, "launch", "vnodes.py"), "--nodes", str(args.nodes),
           "--nproc-per-node", str(args.nproc_per_node), "--netns", "--timeout",
           str(args.timeout), "--", os.path.join(repo, "bench", "standin_train.py"), "--backend",
           backend, "--steps", str(steps), *args.train_args.split()]
    cpu0, t0 = _children_cpu(), time.monotonic()
    res = subprocess.run(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=args.timeout + 60)
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    found = _SUMMARY.findall(res.stdout)
    if res.returncode != 0 or not found:
        lines = res.stdout.splitlines()
        why = failure_reason(lines)
        raise RuntimeError(f"main job with {backend} (--steps {steps}) failed "
                           f"(exit {res.returncode})" + (f": {why}" if why else "") + ":\n"
                           + "\n".join(lines[-15:]))
    out = {"tokens_s": int(found[0]), "cpu_s": cpu, "wall_s": wall}
    held = _RESOURCES.findall(res.stdout)
    if held:
        out["threads"], out["sockets"] = int(held[0][0]), int(held[0][1])
    return out


def failure_reason(lines: list) -> str:
    """The line of a failed run's output that says why, shortened: torchrun's report of
    the first failure (``exitcode : -6 (pid: ...) (SIGABRT)``), else the last error or
    exception line; empty if there is none."""
    for line in lines:
        if "exitcode" in line:
            return " ".join(line.split("]", 1)[-1].split())
    for line in reversed(lines):
        text = line.split("]", 1)[-1].strip()
        if re.match(r"[\w.]*(Error|Exception)\b", text) or text.startswith("terminate called"):
            return text[:300]
    return ""


def _attempt(backend: str, steps: int, args, failures: list) -> dict:
    """``run_once``, run again after a failure (up to ``args.retries`` times); every
    failure's message is appended to ``failures``."""
    for attempt in range(args.retries + 1):
        try:
            return run_once(backend, steps, args)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            failures.append(str(exc))
            print(f"[mainjob] {backend} --steps {steps} failed (attempt {attempt + 1} of "
                  f"{args.retries + 1}): {str(exc).splitlines()[0]}", file=sys.stderr,
                  flush=True)
            if attempt == args.retries:
                raise


def measure(args) -> dict:
    """Every backend's rounds; per backend the medians of tokens/s and CPU per step, and
    the failed runs that were retried."""
    short, long_ = args.steps
    rounds: dict = {b: [] for b in args.backends}
    failures: dict = {b: [] for b in args.backends}
    for r in range(args.reps):
        for b in args.backends:
            a = _attempt(b, short, args, failures[b])
            z = _attempt(b, long_, args, failures[b])
            per_step = (z["cpu_s"] - a["cpu_s"]) / (long_ - short)
            rounds[b].append({"tokens_s": z["tokens_s"], "cpu_per_step_s": per_step,
                              "short": a, "long": z})
            print(f"[mainjob] round {r + 1} {b}: {z['tokens_s']} tokens/s, "
                  f"{per_step:.3f} CPU s/step", file=sys.stderr, flush=True)
    out = {}
    for b, rs in rounds.items():
        out[b] = {"tokens_s": statistics.median(x["tokens_s"] for x in rs),
                  "cpu_per_step_s": statistics.median(x["cpu_per_step_s"] for x in rs),
                  "rounds": rs, "failures": failures[b]}
        for key in ("threads", "sockets"):  # rank 0's at the end of the long runs: the most
            held = [x["long"][key] for x in rs if key in x["long"]]
            if held:
                out[b][key] = max(held)
    return out


def report(res: dict, args) -> str:
    cores = len(os.sched_getaffinity(0))
    ranks = args.nodes * args.nproc_per_node
    lines = [f"# python -m bench.mainjob {shlex.join(args.argv)}".rstrip(),
             f"# {args.nodes} netns vnodes x {args.nproc_per_node} ranks on {cores} cores; "
             f"launch/train.py --steps {args.steps[0]} and {args.steps[1]} "
             f"{args.train_args}; {args.reps} round(s), medians; load {os.getloadavg()[0]:.2f}",
             "# CPU/step: user+sys of every process, (long run - short run) / steps between;"
             " comm = CPU/step above null's (null: collectives do nothing = compute alone;"
             " floor: the bytes moved and nothing else);"
             " threads, sockets: what rank 0's process held after the last step (every group open;"
             " the most over rounds)",
             f"{'backend':>13} {'tokens/s':>9} {'vs gloo':>8} {'CPU s/step':>11} {'comm s/step':>12}"
             f" {'threads':>8} {'sockets':>8}"]
    gloo = res.get("gloo", {}).get("tokens_s")
    floor = res.get("null", {}).get("cpu_per_step_s")
    for b, v in res.items():
        vs = f"{v['tokens_s'] / gloo:.2f}x" if gloo else "-"
        comm = f"{v['cpu_per_step_s'] - floor:.3f}" if floor is not None and b != "null" else "-"
        lines.append(f"{b:>13} {v['tokens_s']:>9.0f} {vs:>8} {v['cpu_per_step_s']:>11.3f} "
                     f"{comm:>12} {v.get('threads', '-'):>8} {v.get('sockets', '-'):>8}")
    for b, v in res.items():
        for text in v.get("failures", []):
            lines.append(f"# {b}: a run failed and was run again: {text.splitlines()[0]}")
    if "null" in res and gloo:
        lines.append(f"# with {ranks} ranks on {cores} cores the cores are "
                     f"{'saturated' if ranks > cores else 'not saturated'}; null (no "
                     f"communication at all) reaches {res['null']['tokens_s'] / gloo:.2f}x gloo's "
                     f"tokens/s: no backend can do better here")
    if "floor" in res and gloo:
        lines.append(f"# floor (every collective's bytes moved, nothing else) reaches "
                     f"{res['floor']['tokens_s'] / gloo:.2f}x gloo's tokens/s"
                     + (f"; neuron {res['neuron']['tokens_s'] / res['floor']['tokens_s']:.2f}x "
                        f"the floor's" if "neuron" in res else ""))
    for half, where in (("floor_inside", "inside a node"), ("floor_between", "between nodes")):
        if half in res and "neuron" in res:
            lines.append(f"# {half} (the floor for the groups {where}, neuron for the others): "
                         f"neuron reaches {res['neuron']['tokens_s'] / res[half]['tokens_s']:.2f}x "
                         f"its tokens/s (what neuron's groups {where} cost beyond the floor's)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="neuron,gloo,floor,null",
                   type=lambda s: [x for x in s.split(",") if x])
    p.add_argument("--steps", default="6,30",
                   type=lambda s: tuple(int(x) for x in s.split(",")),
                   help="short,long step counts (CPU/step is their difference)")
    p.add_argument("--reps", type=int, default=1, help="rounds over every backend")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--train-args", default="--dim 128 --layers 4 --force-sum-reduction",
                   help="more arguments for launch/train.py")
    p.add_argument("--timeout", type=float, default=600.0, help="bound per run, seconds")
    p.add_argument("--retries", type=int, default=1,
                   help="times a failed run is run again (each failure is reported)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if len(args.steps) != 2 or not 0 < args.steps[0] < args.steps[1]:
        p.error("--steps needs two counts, short < long")
    if args.retries < 0:
        p.error(f"--retries must be 0 or more, not {args.retries}")
    if os.geteuid() != 0:
        print("mainjob: needs root (network namespaces)", file=sys.stderr)
        return 2
    res = measure(args)
    print(report(res, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": args.argv, "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
