"""The main job under injected faults: ``python -m bench.soak`` (root: network namespaces).

How it works
------------
The main job (``launch/train.py``, through ``bench/soak_rank.py``) runs twice on the same
virtual nodes (``launch/vnodes.py --netns``: each node a network namespace), with the same
seed: once undisturbed, once while this process injects faults, one at a time, in turn:

Every other fault is a cut; the others come in turn between them.

* **cut**: one rail (a TCP connection between two ranks' processes, found with ``ss`` in a
  rank's namespace: it ends at a rank's listening port) is destroyed with ``ss -K``, which
  resets it at both ends. Only one rail is cut at a time, so every pair keeps the others,
  and the next fault waits until the rails are back (the rank that dialed the lost one
  dials it again: transport/rdm/dialing.py, ``Healer``); a rail not back in ``HEAL_SECONDS``
  fails the soak.
* **flood**: from inside one node's namespace, a stranger opens connections to every
  rank's listener at a high rate for a moment, bounded in count: a third send garbage, a
  third a forged handshake opening, a third nothing.
* **stop**: one rank is stopped with SIGSTOP for ``STOP_SECONDS`` (far below the group's
  timeout), then continued.
* **usr1**: every rank gets SIGUSR1 (the flight recorder dumps; the job goes on).

The soak passes when the faulted run's losses equal the undisturbed run's bit for bit, every
cut healed, every fault was injected at least once, and after each run no rank holds a
thread, a socket or a ``/dev/shm`` file the backend made (bench/soak_rank.py reports them).

Command line::

    python -m bench.soak [--nodes 4] [--nproc-per-node 1] [--steps 300] [--json FILE]
                         [-- extra launch/train.py arguments]

Traffic goes only to the namespaces' own addresses (and the strangers come from inside
them); everything the soak starts is stopped, and the namespaces are removed, whatever
happens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from bench import ROOT
from launch import vnodes
from neuron_dist.transport.shm import procid

HEAL_SECONDS = 30.0  # a cut rail must be back within this
STOP_SECONDS = 2.0  # how long a stopped rank stays stopped
PAUSE_SECONDS = 0.5  # between two faults
FLOOD_CONNECTIONS, FLOOD_SECONDS = 300, 2.0  # a stranger's flood, at most
FAULTS = ("cut", "flood", "stop", "usr1")
OTHERS = FAULTS[1:]  # (taken in turn between cuts)
TRAIN_ARGS = ["--dim", "64", "--layers", "2", "--seq-len", "32", "--batch-size", "4",
              "--force-sum-reduction"]

# Run inside a node's namespace: connect to each ``host:port`` in argv over and over.
_FLOOD = r"""
import os, random, socket, sys, time
targets = [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in sys.argv[3:]]
total, seconds = int(sys.argv[1]), float(sys.argv[2])
end, opened, held = time.monotonic() + seconds, 0, []
while opened < total and time.monotonic() < end:
    kind = opened % 3
    try:
        s = socket.create_connection(random.choice(targets), timeout=0.5)
        if kind == 0:
            s.sendall(os.urandom(64))
        elif kind == 1:
            s.sendall(b"NRHS" + os.urandom(60))
        held.append(s)
    except OSError:
        pass
    opened += 1
    if len(held) > 40:
        held.pop(0).close()
    time.sleep(seconds / total)
for s in held:
    s.close()
print(opened)
"""


def _ns(pid: int, *cmd: str, check: bool = True) -> str:
    """Run ``cmd`` in the network namespace of process ``pid``; its stdout."""
    done = subprocess.run(["nsenter", "-t", str(pid), "-n", *cmd], capture_output=True,
                          text=True, timeout=30)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} in the namespace of pid {pid} failed: "
                           f"{done.stderr.strip()}")
    return done.stdout


_ENTRY = re.compile(r"(\S+):(\d+)\s+(\S+):(\d+|\*)\s.*?pid=(\d+),")


def _entries(pid: int, listening: bool) -> list:
    """``(local addr, local port, peer addr, peer port, owner pid)`` of the TCP sockets in
    ``pid``'s namespace (listening ones, or established ones)."""
    state = ["-l"] if listening else ["state", "established"]
    out = _ns(pid, "ss", "-Htnp", *state)
    found = []
    for line in out.splitlines():
        m = _ENTRY.search(line)
        if m:
            peer_port = 0 if m[4] == "*" else int(m[4])
            found.append((m[1].strip("[]"), int(m[2]), m[3].strip("[]"), peer_port, int(m[5])))
    return found


class Job:
    """The ranks of one run: their pids (from ``bench/soak_rank.py``) and their rails."""

    def __init__(self, out: str, world: int):
        self.out, self.world = out, world
        self.pids: dict = {}

    def wait_for_ranks(self, done) -> bool:
        while len(self.pids) < self.world and not done():
            for r in range(self.world):
                try:
                    with open(os.path.join(self.out, f"pid-{r}")) as fh:
                        self.pids[r] = int(fh.read())
                except (OSError, ValueError):
                    pass
            time.sleep(0.1)
        return len(self.pids) == self.world

    def finishing(self) -> bool:
        """Has a rank finished training (its report is written, its process exits next:
        a signal then would meet an interpreter that already dropped its handlers)?"""
        return any(n.startswith("report-") for n in os.listdir(self.out))

    def listeners(self) -> set:
        """``(addr, port)`` where the ranks' processes listen for rails."""
        ranks = set(self.pids.values())
        found = set()
        for pid in self.pids.values():
            for la, lp, _, _, owner in _entries(pid, listening=True):
                if owner in ranks:
                    found.add((la, lp))
        return found

    def rails(self, pid: int, listeners: set) -> list:
        """The rails rank process ``pid`` holds: connections to or from a listener."""
        return [e for e in _entries(pid, listening=False) if e[4] == pid
                and ((e[2], e[3]) in listeners or (e[0], e[1]) in listeners)]


def _cut(job: Job, rng: random.Random, log: list) -> None:
    listeners = job.listeners()
    holders = [(pid, job.rails(pid, listeners)) for pid in job.pids.values()]
    holders = [(pid, rails) for pid, rails in holders if rails]
    if not holders:
        return
    pid, rails = rng.choice(holders)
    la, lp, pa, pp, _ = rng.choice(rails)
    had = len(rails)
    _ns(pid, "ss", "-K", "src", la, "sport", "=", f":{lp}", "dst", pa, "dport", "=", f":{pp}")
    started = time.monotonic()
    while True:  # back when the process holds as many rails again, the cut one not among them
        now = [(e[0], e[1], e[2], e[3]) for e in job.rails(pid, listeners)]
        if len(now) >= had and (la, lp, pa, pp) not in now:
            break
        if time.monotonic() - started > HEAL_SECONDS:
            raise RuntimeError(f"rail {la}:{lp} -> {pa}:{pp} of pid {pid} not back after "
                               f"{HEAL_SECONDS:.0f} s ({len(now)} of {had} rails)")
        time.sleep(0.05)
    log.append({"fault": "cut", "pid": pid, "rail": f"{la}:{lp}->{pa}:{pp}",
                "healed_s": round(time.monotonic() - started, 3)})


def _flood(job: Job, rng: random.Random, log: list) -> None:
    targets = [f"{a}:{p}" for a, p in sorted(job.listeners())]
    if not targets:
        return
    pid = rng.choice(list(job.pids.values()))
    opened = _ns(pid, sys.executable, "-c", _FLOOD, str(FLOOD_CONNECTIONS), str(FLOOD_SECONDS),
                 *targets)
    log.append({"fault": "flood", "from_pid": pid, "connections": int(opened.strip() or 0)})


def _stop(job: Job, rng: random.Random, log: list) -> None:
    rank = rng.randrange(job.world)
    pid = job.pids[rank]
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(STOP_SECONDS)
    finally:
        os.kill(pid, signal.SIGCONT)
    log.append({"fault": "stop", "rank": rank, "seconds": STOP_SECONDS})


def _usr1(job: Job, rng: random.Random, log: list) -> None:
    if job.finishing():
        return
    for pid in job.pids.values():
        os.kill(pid, signal.SIGUSR1)
    log.append({"fault": "usr1", "ranks": job.world})


def inject(job: Job, done, log: list, errors: list, seed: int = 1) -> None:
    """Inject faults in turn until ``done()``; a fault that fails goes to ``errors``."""
    rng = random.Random(seed)
    try:
        if not job.wait_for_ranks(done):
            return
        end = time.monotonic() + 120  # until the first rails are up
        while not done() and not any(job.rails(p, job.listeners()) for p in job.pids.values()):
            if time.monotonic() > end:
                raise RuntimeError("no rail came up within 120 s")
            time.sleep(0.2)
        actions = {"cut": _cut, "flood": _flood, "stop": _stop, "usr1": _usr1}
        i = 0
        while not done() and not job.finishing():
            kind = OTHERS[(i // 2) % len(OTHERS)] if i % 2 else "cut"  # every other: a cut
            actions[kind](job, rng, log)
            i += 1
            time.sleep(PAUSE_SECONDS)
    except Exception as e:  # noqa: BLE001 - reported, and the run goes on to its end
        # (not a rank that finished meanwhile: one that has exited but is not reaped yet
        # still has its /proc entry, but no namespace to enter any more)
        if not done() and all(procid.alive(p) for p in job.pids.values()):
            errors.append(f"{type(e).__name__}: {e}")


def _run(args, out: str, faults: bool) -> dict:
    world = args.nodes * args.nproc_per_node
    os.makedirs(out, exist_ok=True)
    fr = os.path.join(out, "flight")
    os.makedirs(fr, exist_ok=True)
    metrics = os.path.join(out, "metrics.json")
    argv = [os.path.join(ROOT, "bench", "soak_rank.py"), out, "--backend", "neuron",
            "--steps", str(args.steps), "--seed", "1", "--metrics-out", metrics,
            *TRAIN_ARGS, *args.train_args]
    finished = threading.Event()
    log, errors = [], []
    injector = None
    if faults:
        job = Job(out, world)
        injector = threading.Thread(target=inject, args=(job, finished.is_set, log, errors),
                                    daemon=True)
        injector.start()
    started = time.monotonic()
    try:
        result = vnodes.run(args.nodes, args.nproc_per_node, argv, netns=True,
                            timeout=args.timeout, env={"NEURON_DIST_FR_DIR": fr,
                                                       "OMP_NUM_THREADS": "1"})
    finally:
        finished.set()
        if injector is not None:
            injector.join(timeout=HEAL_SECONDS + 30)
    reports = {}
    for r in range(world):
        try:
            with open(os.path.join(out, f"report-{r}.json")) as fh:
                reports[r] = json.load(fh)
        except (OSError, ValueError):
            pass
    losses = None
    try:
        with open(metrics) as fh:
            losses = json.load(fh)["losses"]
    except (OSError, ValueError, KeyError):
        pass
    return {"returncode": result.returncode, "seconds": round(time.monotonic() - started, 1),
            "losses": losses, "reports": reports, "faults": log, "errors": errors,
            "dumps": len(os.listdir(fr)),
            "stderr": "" if result.returncode == 0 else "".join(result.stderr)[-4000:]}


def check(calm: dict, faulted: dict, world: int) -> list:
    """What is wrong with the two runs (nothing: an empty list)."""
    problems = []
    for name, run in (("undisturbed", calm), ("faulted", faulted)):
        if run["returncode"] != 0:
            problems.append(f"the {name} run exited {run['returncode']}: {run['stderr']}")
        if len(run["reports"]) != world:
            problems.append(f"the {name} run: {len(run['reports'])} of {world} ranks reported")
        for rank, rep in sorted(run["reports"].items()):
            if rep["threads"] or rep["sockets"] or rep.get("shm"):
                problems.append(f"the {name} run: rank {rank} still holds threads "
                                f"{rep['threads']}, {rep['sockets']} socket(s), /dev/shm "
                                f"{rep.get('shm', [])}")
    problems += [f"a fault failed: {e}" for e in faulted["errors"]]
    if calm["losses"] is None or calm["losses"] != faulted["losses"]:
        problems.append(f"losses differ: undisturbed {calm['losses']}, faulted "
                        f"{faulted['losses']}")
    kinds = {f["fault"] for f in faulted["faults"]}
    if kinds != set(FAULTS):
        problems.append(f"faults injected: {sorted(kinds)}; the job ended before "
                        f"{sorted(set(FAULTS) - kinds)} (more --steps)")
    if "usr1" in kinds and faulted["dumps"] == 0:
        problems.append("SIGUSR1 wrote no flight-recorder dump")
    return problems


def summary(calm: dict, faulted: dict, problems: list) -> str:
    counts = {k: sum(f["fault"] == k for f in faulted["faults"]) for k in FAULTS}
    heals = [f["healed_s"] for f in faulted["faults"] if f["fault"] == "cut"]
    flood = sum(f.get("connections", 0) for f in faulted["faults"])
    lines = [f"undisturbed run: {calm['seconds']} s, faulted run: {faulted['seconds']} s",
             f"faults: {counts['cut']} rails cut (back after {min(heals, default=0):.2f}-"
             f"{max(heals, default=0):.2f} s), {counts['flood']} floods ({flood} stranger "
             f"connections), {counts['stop']} ranks stopped for {STOP_SECONDS:.0f} s, "
             f"{counts['usr1']} SIGUSR1 to every rank ({faulted['dumps']} dump files)",
             f"losses: {len(faulted['losses'] or [])} steps, "
             f"{'equal' if calm['losses'] == faulted['losses'] else 'DIFFERENT'}; last "
             f"{(faulted['losses'] or [None])[-1]}"]
    lines += [f"PROBLEM: {p}" for p in problems] or ["nothing left behind; soak passed"]
    return "\n".join(lines)


def _commit() -> str:
    done = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--steps", type=int, default=300, help="training steps of each run")
    p.add_argument("--timeout", type=float, default=1200.0, help="bound on each run, s")
    p.add_argument("--json", default=None, help="write both runs and the verdict here")
    p.add_argument("train_args", nargs="*", help="more launch/train.py arguments (after --)")
    args = p.parse_args(argv)
    if not vnodes.netns_available():
        print("bench.soak needs network namespaces (root, iproute2) and ss -K", file=sys.stderr)
        return 2
    world = args.nodes * args.nproc_per_node
    tmp = tempfile.mkdtemp(prefix="neuron-soak-")
    try:
        calm = _run(args, os.path.join(tmp, "calm"), faults=False)
        faulted = _run(args, os.path.join(tmp, "faulted"), faults=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    problems = check(calm, faulted, world)
    text = summary(calm, faulted, problems)
    print(f"# python -m bench.soak {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"# commit {_commit()}; {args.nodes} network-namespace virtual nodes x "
          f"{args.nproc_per_node} rank(s), {args.steps} steps per run")
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"command": "python -m bench.soak " + " ".join(
                argv if argv is not None else sys.argv[1:]), "undisturbed": calm,
                "faulted": faulted, "problems": problems}, fh, indent=1)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
