"""N virtual nodes on one machine: a launcher for users and a fixture for tests.

How it works
------------
The launcher starts one ``torchrun`` agent per virtual node (``python -m
torch.distributed.run``), exactly as a real N-node job would, and each agent does a real
multi-node *static* rendezvous::

    torchrun --nnodes N --node-rank i --nproc-per-node P \\
             --master-addr ADDR --master-port PORT --local-addr ADDR_i script.py args...

Node 0's agent hosts the c10d TCPStore on ``PORT``; ``PORT`` is picked by binding port 0
on ``ADDR`` (the address the agents will reach) and closing the socket again. Every agent
gets ``NEURON_DIST_NODE_NAME=vnode{i}`` (the backend groups ranks into nodes by it), so
even on loopback ranks of different virtual nodes never share memory on purpose.

Two flavours:

* loopback (default, works without root): every node is on 127.0.0.1, in the same network
  and IPC world. Node boundaries exist only in ``NEURON_DIST_NODE_NAME``.

* ``--netns`` (root; Linux network namespaces): every node is isolated like a host::

      ns nd{id}_{k}n0               ns nd{id}_{k}br              ns nd{id}_{k}n1
      eth0 10.R.0.1/24 <--veth--> vn0 -[br0]- vn1 <--veth--> eth0 10.R.0.2/24

  (``{id}`` is the launcher's identity, ``{pid}_{pid namespace}_{start time}``: see
  ``cleanup_stale``.)

  One namespace per node holds ``lo`` and ``eth0`` (one end of a veth pair); the other end
  of each veth is a port of bridge ``br0``, which lives in a namespace of its own, so no
  interface is ever created in the root namespace and deleting the namespaces deletes
  everything. ``R`` is derived from the launcher's pid (the namespaces isolate routing
  anyway, so parallel runs cannot collide even with equal ``R``); ``k`` counts runs within
  one launcher process. Each agent runs as::

      ip netns exec NS unshare --mount --uts sh -c \\
          'mount -t tmpfs tmpfs /dev/shm; mount --bind HOSTS /etc/hosts;
           hostname vnodeI; exec torchrun ...'

  so each node has its own hostname, its own empty ``/dev/shm`` (shared memory cannot
  cross nodes) and an ``/etc/hosts`` naming every node ``vnodeJ -> 10.R.0.(J+1)``. The
  master address is node 0's ``10.R.0.1``. Agents get ``NEURON_DIST_SOCKET_IFNAME=eth0``
  and ``GLOO_SOCKET_IFNAME=eth0`` (``lo`` in loopback mode); ``env`` / ``--env`` override.

  Optional traffic shaping on each node's ``eth0`` (egress, so a message between two
  nodes sees the delay once and a round trip sees it twice)::

      tc qdisc add dev eth0 root netem delay D rate R loss L

  Kernels built without ``sch_netem`` (this project's 2-core dev VM is one) cannot delay
  or drop: asking for ``delay``/``loss`` there raises :class:`NetemUnavailable` before any
  agent starts; a ``rate``-only request falls back to a ``tbf`` token bucket.

Lifetime and cleanup
--------------------
Agents start in their own sessions (``start_new_session=True``), so the agent and every
worker it forks share one process group. A reader thread per stream copies each agent's
stdout/stderr, line by line, into the result (and, with ``echo``, to our own
stdout/stderr with a ``[vnodeI]`` prefix). Ranks' stdout is a pipe, so Python buffers
it: output shows up when a rank flushes (``print(..., flush=True)``) or exits. The
launcher does not set ``PYTHONUNBUFFERED``: unbuffered, ``print`` writes the text and its
newline with two system calls, and lines of ranks sharing a node can then interleave
mid-line (``--env PYTHONUNBUFFERED=1`` if you prefer that anyway).

The launcher polls the agents; when one exits non-zero it names the node, gives the
others ``grace`` seconds to finish on their own, then stops them. Whatever happens --
success, failure, ``timeout`` (default 600 s for the whole run), Ctrl-C, SIGTERM, or an
error while building the network -- a ``finally`` block sends SIGTERM and then SIGKILL to
every agent's process group until no live process is left in it, then deletes the
namespaces (which removes the veths and the bridge) and the temporary directory.
Namespaces left behind by a launcher that was SIGKILLed (its pid is gone) are removed by
the next ``--netns`` run; its agents, in their own sessions, are not (nothing can run
after SIGKILL).

Exit status: 0 if every agent exits 0, else the first non-zero code observed (a failed
worker makes torchrun exit 1, whatever the worker's own code), 124 on timeout, 130 on
Ctrl-C. Agents killed by a signal count as 128 + signal number on the command line.

Command line::

    python -m neuron_dist.launch.vnodes --nodes N --nproc-per-node P|P0,P1,.. [--netns]
        [--delay 1ms] [--rate 10gbit] [--loss 0.1%] [--timeout S] [--grace S]
        [--env K=V ...] [--no-prefix] -- script.py args...

(also ``python launch/vnodes.py ...`` from the repository; ``-- -m pkg.mod args`` runs a
module, as with torchrun).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable, Mapping, Optional, Sequence, Union

__all__ = ["Netem", "NetemUnavailable", "Result", "run", "netns_available",
           "netem_available", "cleanup_stale", "main"]

#: Interface name of each node's veth end inside its namespace.
NODE_IFNAME = "eth0"
#: Bridge name inside the bridge namespace.
BRIDGE_NAME = "br0"

_NS_PREFIX = "nd"
_NS_RE = re.compile(rf"^{_NS_PREFIX}(\d+)_(\d+)_(\d+)_(\d+)(?:n\d+|br)$")
_RUN_COUNTER = itertools.count()
_PRINT_LOCK = threading.Lock()

# Run inside each node's fresh mount + UTS namespace, then become the agent (same pid, so
# the process group started by Popen is the agent's and its workers').
_NODE_SH = (
    'set -e; mount -t tmpfs -o mode=1777 vnode-shm /dev/shm; '
    'if [ -n "$2" ]; then mount --bind "$2" /etc/hosts; fi; '
    'hostname "$1"; shift 2; exec "$@"'
)


class NetemUnavailable(RuntimeError):
    """The kernel has no ``netem`` queueing discipline, so delay or loss cannot be emulated."""


@dataclass
class Netem:
    """Traffic shaping applied to every node's ``eth0`` (egress), with ``tc`` syntax.

    Parameters
    ----------
    delay : str, optional
        One-way added latency, e.g. ``"1ms"`` or ``"1ms 200us"`` (with jitter).
    rate : str, optional
        Egress bandwidth, e.g. ``"10gbit"``.
    loss : str, optional
        Random loss, e.g. ``"0.1%"``.
    """

    delay: Optional[str] = None
    rate: Optional[str] = None
    loss: Optional[str] = None

    def __bool__(self) -> bool:
        return bool(self.delay or self.rate or self.loss)

    def tc_args(self, use_netem: bool = True) -> list[str]:
        """The ``tc qdisc add dev IF root ...`` tail for these settings.

        With ``use_netem=False`` (``rate`` only), a ``tbf`` token bucket whose burst holds
        4 ms of traffic (at least 64 KiB), enough for any kernel tick rate.
        """
        if not use_netem:
            burst = max(64 * 1024, int(_rate_bytes_per_s(self.rate) * 0.004))
            return ["tbf", "rate", self.rate, "burst", str(burst), "latency", "100ms"]
        args = ["netem"]
        for key in ("delay", "loss", "rate"):
            value = getattr(self, key)
            if value:
                args += [key, *str(value).split()]
        return args


@dataclass
class Result:
    """What a virtual-node run produced.

    Attributes
    ----------
    returncode : int
        0 if every agent exited 0; else the first non-zero agent code observed (negative:
        killed by that signal); 124 if the run timed out with no earlier failure.
    node_returncodes : list of int or None
        Each agent's exit code (negative if the launcher or someone else killed it).
    failed_node : int or None
        Index of the first node whose agent failed.
    timed_out : bool
        Whether the ``timeout`` ran out.
    outputs : list of str
        Per node, its stdout and stderr lines interleaved in arrival order (unprefixed).
    stdout, stderr : list of str
        Per node, each stream alone.
    duration : float
        Seconds from the call to the end of cleanup (network set-up included).
    master_addr : str
    master_port : int
    namespaces : list of str
        Network namespaces that were used (all deleted by now); empty in loopback mode.
    pgids : list of int
        Process group ids of the agents (all empty by now).
    shaping : str or None
        ``"netem"``, ``"tbf"`` or ``None``: which qdisc shaped the traffic.
    """

    returncode: int
    node_returncodes: list
    failed_node: Optional[int]
    timed_out: bool
    outputs: list
    stdout: list
    stderr: list
    duration: float
    master_addr: str
    master_port: int
    namespaces: list = field(default_factory=list)
    pgids: list = field(default_factory=list)
    shaping: Optional[str] = None

    @property
    def ok(self) -> bool:
        """``True`` if every agent exited 0."""
        return self.returncode == 0


# ----------------------------------------------------------------------------- helpers

_RATE_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
               "tbit": 1e12 / 8, "kibit": 1024 / 8, "mibit": 1024 ** 2 / 8,
               "gibit": 1024 ** 3 / 8, "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9,
               "kibps": 1024, "mibps": 1024 ** 2, "gibps": 1024 ** 3}


def _rate_bytes_per_s(rate: str) -> float:
    """``tc`` rate syntax (``10gbit``, ``100mbps``...) in bytes per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(rate))
    if not m:
        raise ValueError(f"cannot parse rate {rate!r}")
    unit = m.group(2).lower() or "bit"
    if unit not in _RATE_UNITS:
        raise ValueError(f"unknown rate unit in {rate!r}")
    return float(m.group(1)) * _RATE_UNITS[unit]


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a short system command, capturing output; raise with its stderr on failure."""
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=60)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)!r} failed ({proc.returncode}): "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _log(msg: str) -> None:
    with _PRINT_LOCK:
        print(f"[vnodes] {msg}", file=sys.stderr, flush=True)


def _free_port(addr: str) -> int:
    """A port that was free on ``addr`` a moment ago (bind port 0, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _free_port_in_ns(ns: str, addr: str) -> int:
    """Same as :func:`_free_port`, inside network namespace ``ns``."""
    code = ("import socket; s = socket.socket(); s.bind((%r, 0)); "
            "print(s.getsockname()[1])" % addr)
    out = _sh("ip", "netns", "exec", ns, sys.executable, "-S", "-c", code).stdout
    return int(out.strip())


# _pid_namespace, _start_time and _process_alive are transport/shm/procid.py's identity,
# written out here: the launcher imports nothing of the package (that would import torch
# and register the backend in every launcher process).
def _pid_namespace() -> int:
    """Inode of this process's PID namespace (0 if /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> int:
    """Start of process ``pid`` in clock ticks since boot (stat(5) field 22); 0 if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def _launcher_tag(seq: int) -> str:
    """``nd{pid}_{pid namespace}_{start time}_{seq}``: names this launcher's namespaces
    with an identity a pid alone is not (see ``cleanup_stale``)."""
    pid = os.getpid()
    return f"{_NS_PREFIX}{pid}_{_pid_namespace()}_{_start_time(pid)}_{seq}"


def _process_alive(pid: int, started: int) -> bool:
    """True if ``pid`` runs (in this PID namespace) and is the process that started at
    ``started`` (not a later one given the same pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return _start_time(pid) in (0, started)


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    members = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:  # no procfs: fall back to "is anyone in the group at all"
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except ProcessLookupError:
            return []
        except PermissionError:
            return [pgid]
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may contain spaces and parentheses.
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(pid)
    return members


def _list_netns() -> list[str]:
    proc = _sh("ip", "netns", "list", check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _delete_netns(names: Sequence[str]) -> list[str]:
    """Delete namespaces (nodes first, the bridge last); return those that could not be."""
    failed = []
    existing = set(_list_netns())
    for ns in names:
        if ns in existing:
            if _sh("ip", "netns", "del", ns, check=False).returncode != 0:
                failed.append(ns)
    return failed


# ----------------------------------------------------------------------------- probes

_PROBES: dict = {}


def netns_available() -> bool:
    """Whether ``--netns`` can work here.

    True when running as root, ``ip``, ``unshare``, ``mount`` and ``hostname`` exist, and
    a throw-away namespace with a veth pair, a bridge, a private tmpfs ``/dev/shm`` and
    its own hostname can be built and removed. The answer is cached per process.

    Returns
    -------
    bool
    """
    if "netns" not in _PROBES:
        _PROBES["netns"] = _probe_netns()
    return _PROBES["netns"]


def _probe_netns() -> bool:
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return False
    if not all(shutil.which(c) for c in ("ip", "unshare", "mount", "hostname")):
        return False
    ns = f"{_launcher_tag(next(_RUN_COUNTER))}br"
    try:
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        _sh("ip", "-n", ns, "link", "add", BRIDGE_NAME, "type", "bridge")
        _sh("ip", "netns", "exec", ns, "unshare", "--mount", "--uts", "sh", "-c",
            _NODE_SH, "sh", "vnode-probe", "", "true")
        return True
    except (RuntimeError, OSError, subprocess.SubprocessError):
        return False
    finally:
        _delete_netns([ns])


def netem_available() -> bool:
    """Whether the kernel offers the ``netem`` qdisc (needed for delay and loss).

    Requires :func:`netns_available`; probes on a veth in a throw-away namespace. Cached.

    Returns
    -------
    bool
    """
    if "netem" not in _PROBES:
        ok = False
        if netns_available():
            ns = f"{_launcher_tag(next(_RUN_COUNTER))}n0"
            try:
                _sh("ip", "netns", "add", ns)
                _sh("ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
                ok = _sh("tc", "-n", ns, "qdisc", "add", "dev", "p0", "root", "netem",
                         "delay", "1ms", check=False).returncode == 0
            except (RuntimeError, OSError, subprocess.SubprocessError):
                ok = False
            finally:
                _delete_netns([ns])
        _PROBES["netem"] = ok
    return _PROBES["netem"]


def cleanup_stale() -> list[str]:
    """Delete namespaces left by launchers that died without cleaning up.

    A namespace is a launcher's if its name is ``nd{pid}_{pidns}_{start}_{k}n{i}`` or
    ``...br`` (``_launcher_tag``). It is judged only by launchers of the same PID
    namespace (another namespace's pids mean nothing here: its live launchers would look
    dead), and it is stale if that pid no longer runs or runs a later process (its start
    time differs: the pid was reused). Deleting a namespace removes its veths and bridge.

    Returns
    -------
    list of str
        The namespaces deleted.
    """
    stale = []
    me = _pid_namespace()
    for ns in _list_netns():
        m = _NS_RE.match(ns)
        if not m:
            continue
        pid, pidns, started = (int(g) for g in m.groups()[:3])
        if pidns == me and not _process_alive(pid, started):
            stale.append(ns)
    stale.sort(key=lambda n: n.endswith("br"))  # nodes before bridges
    _delete_netns(stale)
    return stale


# ----------------------------------------------------------------------------- network

def _subnet_octet(pid: int, seq: int) -> int:
    return (pid * 7 + seq) % 250 + 1


def _build_network(nodes: int, tag: str, octet: int, netem: Optional[Netem],
                   created: list, links: int = 1) -> tuple[list[str], Optional[str]]:
    """Create bridge and node namespaces; append every namespace to ``created`` first.

    With ``links`` > 1 every node gets ``eth0``, ``eth1``, ... on bridges ``br0``, ``br1``,
    ... with addresses ``10.R.J.(I+1)/24`` (J: the link), like a host with several NICs."""
    br_ns = f"{tag}br"
    created.append(br_ns)
    _sh("ip", "netns", "add", br_ns)
    for j in range(links):
        _sh("ip", "-n", br_ns, "link", "add", f"br{j}", "type", "bridge", "forward_delay", "0")
        _sh("ip", "-n", br_ns, "link", "set", f"br{j}", "up")
    use_netem = None
    if netem:
        needs_netem = bool(netem.delay or netem.loss)
        use_netem = netem_available()
        if needs_netem and not use_netem:
            raise NetemUnavailable(
                "the kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so --delay/--loss "
                "cannot be emulated here; --rate alone works (tbf)")
    node_ns = []
    for i in range(nodes):
        ns = f"{tag}n{i}"
        created.insert(len(created) - 1, ns)  # keep the bridge namespace last
        node_ns.append(ns)
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        for j in range(links):
            dev, port = f"eth{j}", f"vn{i}" if j == 0 else f"vn{i}l{j}"
            _sh("ip", "-n", ns, "link", "add", dev, "type", "veth",
                "peer", "name", port, "netns", br_ns)
            _sh("ip", "-n", ns, "addr", "add", f"10.{octet}.{j}.{i + 1}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", br_ns, "link", "set", port, "master", f"br{j}")
            _sh("ip", "-n", br_ns, "link", "set", port, "up")
            if netem:
                _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root",
                    *netem.tc_args(use_netem))
    return node_ns, (None if not netem else "netem" if use_netem else "tbf")


# ----------------------------------------------------------------------------- agents

class _Agent:
    """One torchrun agent: its process, and threads collecting its output."""

    def __init__(self, index: int, cmd: list[str], env: dict, cwd: Optional[str],
                 echo: bool, prefix: bool):
        self.index = index
        self.lines: list[str] = []
        self.out: list[str] = []
        self.err: list[str] = []
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        self.pgid = self.proc.pid  # session leader == group leader
        tag = f"[vnode{index}] " if prefix else ""
        self.threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.out,
                                                      "stdout", tag, echo), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.err,
                                                      "stderr", tag, echo), daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _pump(self, stream: IO[bytes], sink: list, name: str, tag: str, echo: bool) -> None:
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", "replace")
                with self._lock:
                    sink.append(line)
                    self.lines.append(line)
                if echo:
                    target = getattr(sys, name)
                    with _PRINT_LOCK:
                        target.write(tag + (line if line.endswith("\n") else line + "\n"))
                        target.flush()
        except (OSError, ValueError):
            pass
        finally:
            try:
                stream.close()
            except OSError:
                pass


def _stop_groups(agents: Sequence[_Agent], term_grace: float = 3.0,
                 kill_grace: float = 5.0) -> list[int]:
    """SIGTERM, then SIGKILL, every agent's process group; return pgids still alive."""
    pgids = [a.pgid for a in agents]

    def alive() -> list[int]:
        for a in agents:
            a.proc.poll()  # reap the leader so it does not linger as a zombie
        return [g for g in pgids if _group_members(g)]

    for sig, grace in ((signal.SIGTERM, term_grace), (signal.SIGKILL, kill_grace)):
        left = alive()
        if not left:
            return []
        for g in left:
            try:
                os.killpg(g, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not alive():
                return []
            time.sleep(0.02)
    return alive()


def _cleanup(agents: Sequence[_Agent], codes: list, created: Sequence[str],
             tmpdir: Optional[str]) -> None:
    """Stop every agent's process group, reap, then delete namespaces and ``tmpdir``."""
    left = _stop_groups(agents)
    for a in agents:
        try:
            a.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if codes[a.index] is None:
            codes[a.index] = a.proc.returncode
        for t in a.threads:
            t.join(timeout=2)
    if left:
        _log(f"process groups still alive after SIGKILL: {left}")
    stuck = _delete_netns(created)
    if stuck:
        _log(f"could not delete network namespaces: {stuck}")
    if tmpdir:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _torchrun_cmd(nodes: int, nproc: int, rank: int, master_addr: str, master_port: int,
                  local_addr: str, argv: Sequence[str],
                  torchrun_args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(nodes), "--node-rank", str(rank),
            "--nproc-per-node", str(nproc),
            "--rdzv-backend", "static",
            "--master-addr", master_addr, "--master-port", str(master_port),
            "--local-addr", local_addr, "--max-restarts", "0",
            *torchrun_args, *argv]


def _as_netem(netem: Union[Netem, Mapping, None]) -> Optional[Netem]:
    if netem is None or isinstance(netem, Netem):
        return netem or None
    return Netem(**dict(netem)) or None


def _ranks_per_node(nodes: int, nproc_per_node: Union[int, Sequence[int]]) -> list[int]:
    """One rank count per node: an int means the same on every node."""
    counts = ([nproc_per_node] * nodes if isinstance(nproc_per_node, int)
              else [int(c) for c in nproc_per_node])
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if len(counts) != nodes:
        raise ValueError(f"{len(counts)} rank counts given for {nodes} nodes: {counts}")
    if min(counts) < 1:
        raise ValueError(f"every node needs at least 1 rank, got {counts}")
    return counts


def run(nodes: int, nproc_per_node: Union[int, Sequence[int]], argv: Sequence[str],
        netns: bool = False,
        netem: Union[Netem, Mapping, None] = None, timeout: float = 600.0,
        env: Optional[Mapping[str, str]] = None, echo: bool = False, prefix: bool = True,
        grace: float = 5.0, cwd: Optional[str] = None,
        torchrun_args: Sequence[str] = (), links: int = 1,
        stop_when: Optional[Callable[[], bool]] = None) -> Result:
    """Run ``argv`` under torchrun on ``nodes`` virtual nodes; wait, clean up, report.

    Parameters
    ----------
    nodes : int
        Number of virtual nodes (torchrun agents), at least 1.
    nproc_per_node : int or sequence of int
        Ranks per node: one count for all, or one per node (``[2, 1, 1]``: uneven nodes;
        torchrun's rendezvous numbers ranks node by node).
    argv : sequence of str
        What torchrun runs: ``["script.py", *args]`` or ``["-m", "pkg.mod", *args]``.
    netns : bool
        Give every node its own network namespace, hostname and ``/dev/shm`` (root
        only; see :func:`netns_available`). Otherwise everything is on 127.0.0.1.
    netem : Netem or mapping, optional
        Traffic shaping per node (``delay``, ``rate``, ``loss``); needs ``netns``.
    timeout : float
        Bound on the whole run, in seconds; on expiry every agent is killed.
    env : mapping, optional
        Extra environment for every agent, applied last (overrides the launcher's own
        ``GLOO_SOCKET_IFNAME`` etc.; ``NEURON_DIST_NODE_NAME`` is always ``vnode{i}``).
    echo : bool
        Copy agents' output to this process's stdout/stderr as it arrives.
    prefix : bool
        With ``echo``, prefix each line with ``[vnode{i}] ``.
    grace : float
        After the first agent fails, seconds the others get to exit on their own.
    cwd : str, optional
        Working directory of the agents.
    torchrun_args : sequence of str
        Extra torchrun options, placed before ``argv``.
    stop_when : callable, optional
        Polled with the agents; once it returns True every agent is stopped and the run
        reported (e.g. when the survivors of a deliberately killed node have written their
        results: torchrun's agents would wait in their exit barrier for the lost node).
    links : int
        Network links per node (needs ``netns``): ``eth0``, ``eth1``, ... on separate
        bridges and subnets, and ``NEURON_DIST_SOCKET_IFNAME=eth0,eth1,...`` so the rails
        alternate between them (gloo and the store use ``eth0``).

    Returns
    -------
    Result
        Exit codes and output per node. Nothing is left running and, with ``netns``, no
        namespace, veth or bridge is left when this returns or raises.

    Raises
    ------
    NetemUnavailable
        ``netem`` asks for delay or loss and the kernel has no netem qdisc.
    RuntimeError
        ``netns`` without root/support, or the network could not be built.
    KeyboardInterrupt
        Re-raised after cleanup.
    """
    counts = _ranks_per_node(nodes, nproc_per_node)
    if not argv:
        raise ValueError("argv is empty: nothing to run")
    netem = _as_netem(netem)
    if netem and not netns:
        raise ValueError("traffic shaping (netem) needs netns=True")
    if links != 1 and not netns:
        raise ValueError("several links per node need netns=True")
    if not 1 <= links <= 8:
        raise ValueError(f"links must be 1..8, not {links}")
    if netns and not netns_available():
        raise RuntimeError("--netns needs root and working `ip netns`, veth, bridge, "
                           "`unshare --mount --uts` (see netns_available())")

    pid = os.getpid()
    seq = next(_RUN_COUNTER)
    tag = _launcher_tag(seq)
    octet = _subnet_octet(pid, seq)
    created: list[str] = []
    agents: list[_Agent] = []
    tmpdir = None
    start = time.monotonic()
    deadline = start + timeout
    codes: list[Optional[int]] = [None] * nodes
    failed_node: Optional[int] = None
    first_code = 0
    timed_out = False
    shaping = None
    master_addr, master_port = "127.0.0.1", 0
    try:
        if netns:
            cleanup_stale()
            node_ns, shaping = _build_network(nodes, tag, octet, netem, created, links)
            addrs = [f"10.{octet}.0.{i + 1}" for i in range(nodes)]
            master_addr = addrs[0]
            master_port = _free_port_in_ns(node_ns[0], master_addr)
            tmpdir = tempfile.mkdtemp(prefix=f"{tag}-")
            hosts = os.path.join(tmpdir, "hosts")
            with open(hosts, "w") as f:
                f.write("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n")
                f.writelines(f"{a}\tvnode{i}\n" for i, a in enumerate(addrs))
                # c10d's TCPStore server is dual-stack and reverse-resolves its peers as
                # ::ffff:10.R.0.x; without these it warns on every connection.
                f.writelines(f"::ffff:{a}\tvnode{i}\n" for i, a in enumerate(addrs))
            if not os.path.exists("/etc/hosts"):
                hosts = ""
            ifname = ",".join(f"eth{j}" for j in range(links))
        else:
            node_ns = []
            addrs = ["127.0.0.1"] * nodes
            master_port = _free_port(master_addr)
            ifname = "lo"

        for i in range(nodes):
            agent_env = dict(os.environ)
            agent_env.update({
                "NEURON_DIST_SOCKET_IFNAME": ifname,
                "GLOO_SOCKET_IFNAME": ifname.split(",")[0],
            })
            agent_env.update(env or {})
            agent_env["NEURON_DIST_NODE_NAME"] = f"vnode{i}"
            cmd = _torchrun_cmd(nodes, counts[i], i, master_addr, master_port,
                                addrs[i], argv, torchrun_args)
            if netns:
                cmd = ["ip", "netns", "exec", node_ns[i], "unshare", "--mount", "--uts",
                       "sh", "-c", _NODE_SH, "sh", f"vnode{i}", hosts, *cmd]
            agents.append(_Agent(i, cmd, agent_env, cwd, echo, prefix))

        kill_at: Optional[float] = None
        while True:
            for a in agents:
                if codes[a.index] is None:
                    rc = a.proc.poll()
                    if rc is not None:
                        codes[a.index] = rc
                        if rc != 0 and failed_node is None:
                            failed_node, first_code = a.index, rc
                            _log(f"vnode{a.index} failed with exit code {rc}; stopping "
                                 f"the other nodes in {grace:g} s")
                            kill_at = time.monotonic() + grace
            if all(c is not None for c in codes):
                break
            if stop_when is not None and stop_when():
                _log("stop condition met; stopping the nodes")
                break
            now = time.monotonic()
            if kill_at is not None and now >= kill_at:
                break
            if now >= deadline:
                timed_out = True
                running = [f"vnode{i}" for i, c in enumerate(codes) if c is None]
                _log(f"timeout after {timeout:g} s; killing {', '.join(running)}")
                break
            time.sleep(0.05)
    except BaseException as e:
        if agents:
            what = "interrupted" if isinstance(e, (KeyboardInterrupt, _Terminated)) \
                else f"{type(e).__name__}: {e}"
            _log(f"{what}; stopping all nodes")
        raise
    finally:
        # A second Ctrl-C (or SIGTERM) must not abort the cleanup half-way.
        saved = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                saved[sig] = signal.signal(sig, signal.SIG_IGN)
        try:
            _cleanup(agents, codes, created, tmpdir)
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)

    if failed_node is not None:
        returncode = first_code
    elif timed_out:
        returncode = 124
    else:
        returncode = next((c for c in codes if c), 0) or 0
    return Result(returncode=returncode, node_returncodes=codes, failed_node=failed_node,
                  timed_out=timed_out, outputs=["".join(a.lines) for a in agents],
                  stdout=["".join(a.out) for a in agents],
                  stderr=["".join(a.err) for a in agents],
                  duration=time.monotonic() - start, master_addr=master_addr,
                  master_port=master_port, namespaces=list(created),
                  pgids=[a.pgid for a in agents], shaping=shaping)


# ----------------------------------------------------------------------------- CLI

def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        cut = argv.index("--")
        ours, job = argv[:cut], argv[cut + 1:]
    else:
        ours, job = argv, []
    p = argparse.ArgumentParser(
        prog="python -m neuron_dist.launch.vnodes",
        description="Run a torchrun job on N virtual nodes on this machine.",
        epilog="Example: python -m neuron_dist.launch.vnodes --nodes 2 "
               "--nproc-per-node 2 --netns --delay 1ms -- train.py --steps 5")
    p.add_argument("--nodes", type=int, required=True, help="number of virtual nodes")
    p.add_argument("--nproc-per-node", required=True, type=_counts,
                   help="ranks per node: one number, or one per node (2,1,1)")
    p.add_argument("--netns", action="store_true",
                   help="one network namespace, hostname and /dev/shm per node (root)")
    p.add_argument("--delay", help="netem one-way delay per node, e.g. 1ms (needs --netns)")
    p.add_argument("--rate", help="egress rate per node, e.g. 10gbit (needs --netns)")
    p.add_argument("--loss", help="netem random loss, e.g. 0.1%% (needs --netns)")
    p.add_argument("--links", type=int, default=1,
                   help="network links (NICs) per node: eth0, eth1, ... (needs --netns)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="bound on the whole run in seconds (default 600)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds the other nodes get after one fails (default 5)")
    p.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="extra environment for every agent (repeatable)")
    p.add_argument("--no-prefix", action="store_true",
                   help="do not prefix output lines with [vnodeI]")
    args = p.parse_args(ours)
    if not job:
        p.error("nothing to run: put the script and its arguments after --")
    args.job = job
    for kv in args.env:
        if "=" not in kv:
            p.error(f"--env wants K=V, got {kv!r}")
    return args


def _counts(text: str) -> Union[int, list[int]]:
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rank count or a list of them: {text!r}")
    return counts[0] if len(counts) == 1 else counts


class _Terminated(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum, frame):
    raise _Terminated(signum)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status (see the module docstring)."""
    args = _parse(argv)
    netem = Netem(delay=args.delay, rate=args.rate, loss=args.loss) or None
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_terminated)
    try:
        res = run(args.nodes, args.nproc_per_node, args.job, netns=args.netns, netem=netem,
                  timeout=args.timeout, env=dict(kv.split("=", 1) for kv in args.env),
                  echo=True, prefix=not args.no_prefix, grace=args.grace, links=args.links)
    except KeyboardInterrupt:
        return 130
    except _Terminated as e:
        return 128 + e.signum
    except (NetemUnavailable, RuntimeError, ValueError) as e:
        _log(f"error: {e}")
        return 2
    summary = ", ".join(f"vnode{i}={c}" for i, c in enumerate(res.node_returncodes))
    if res.returncode != 0:
        what = (f"vnode{res.failed_node} failed first" if res.failed_node is not None
                else "timed out" if res.timed_out else "failed")
        _log(f"{what}; exit codes: {summary} ({res.duration:.1f} s)")
    else:
        _log(f"all {args.nodes} nodes exited 0 ({res.duration:.1f} s)")
    rc = res.returncode
    return 128 - rc if rc < 0 else rc


if __name__ == "__main__":
    sys.exit(main())
