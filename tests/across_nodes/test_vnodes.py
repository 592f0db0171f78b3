"""Virtual nodes on one machine (launch/vnodes.py): real multi-node torchrun rendezvous.

Every test runs tests/across_nodes/vnode_job.py over the neuron backend (``JOB_BACKEND``)
under several torchrun agents, so shared memory joins the ranks of a node and rdm rails
join nodes, and then checks that nothing is left: no process carrying the test's tag, no
live member in any agent's process group, no network namespace of this process, no new
interface in the root namespace. The ``--netns`` tests need root; they skip cleanly elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from launch import vnodes  # noqa: E402
from helpers.procs import interruptible, processes_with  # noqa: E402

JOB = os.path.join(REPO, "tests", "across_nodes", "vnode_job.py")
JOB_BACKEND = "neuron"

needs_netns = pytest.mark.skipif(not vnodes.netns_available(),
                                 reason="needs root and working ip netns/veth/bridge")


# ----------------------------------------------------------------------------- helpers

def _tag() -> str:
    return f"vnodetest-{uuid.uuid4().hex[:12]}"


def _job(tag: str, *extra: str) -> list[str]:
    return [JOB, "--backend", JOB_BACKEND, "--tag", tag, *extra]


def _reports(res: vnodes.Result) -> list[dict]:
    """The VNODE_JOB lines of every node, each with the node that printed it."""
    out = []
    for node, text in enumerate(res.outputs):
        for line in text.splitlines():
            if line.startswith("VNODE_JOB "):
                rep = json.loads(line[len("VNODE_JOB "):])
                rep["printed_by"] = node
                out.append(rep)
    return sorted(out, key=lambda r: r["rank"])


def _root_links() -> set[str]:
    try:
        out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()
            if line.count(":") >= 2}


def _our_namespaces() -> list[str]:
    if not vnodes.netns_available():
        return []
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                         timeout=30).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.startswith(f"nd{os.getpid()}_")]


@pytest.fixture
def clean():
    """Yields a fresh tag; afterwards asserts that the run left nothing behind."""
    links_before = _root_links()
    tag = _tag()
    state = {"tag": tag, "results": []}
    yield state
    deadline = time.monotonic() + 5  # processes of an aborted test may take a moment
    while processes_with(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_with(tag), f"processes left running: {processes_with(tag)}"
    for res in state["results"]:
        left = {g: vnodes._group_members(g) for g in res.pgids}
        assert not any(left.values()), f"agent process groups not empty: {left}"
    assert not _our_namespaces(), f"namespaces left behind: {_our_namespaces()}"
    new_links = _root_links() - links_before
    ours = {l for l in new_links if l in ("br0", "eth0") or re.fullmatch(r"vn\d+", l)}
    assert not ours, f"interfaces left in the root namespace: {sorted(ours)}"
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("vnodejob-")]


def _check_layout(reports: list[dict], nodes: int, nproc) -> None:
    """Ranks numbered node by node; ``nproc`` is ranks per node, or a list (uneven)."""
    counts = [nproc] * nodes if isinstance(nproc, int) else list(nproc)
    world = sum(counts)
    node_of = [n for n, c in enumerate(counts) for _ in range(c)]
    first = [sum(counts[:n]) for n in range(nodes)]
    assert [r["rank"] for r in reports] == list(range(world)), reports
    for r in reports:
        node = node_of[r["rank"]]
        assert r["world"] == world
        assert r["sum"] == world * (world + 1) / 2
        assert r["group_rank"] == node and r["local_rank"] == r["rank"] - first[node]
        assert r["printed_by"] == node
        assert r["node_name"] == f"vnode{node}"


def _netns_matrix(clean, nodes: int, nproc, timeout: float):
    """Run the collective matrix on ``nodes`` isolated nodes (small slots and segments, so
    every size takes several steps); returns the run and its checked-layout reports."""
    res = vnodes.run(nodes, nproc, _job(clean["tag"], "--matrix"), netns=True, timeout=timeout,
                     env={"NEURON_DIST_SHM_SLOT_BYTES": "64K", "NEURON_DIST_SMALL_BYTES": "4K",
                          "NEURON_DIST_NET_SEGMENT_BYTES": "64K"})
    clean["results"].append(res)
    assert res.ok, f"exit codes {res.node_returncodes}\n" + "\n".join(res.outputs)
    assert len(res.namespaces) == nodes + 1  # the nodes + the bridge
    reports = _reports(res)
    _check_layout(reports, nodes, nproc)
    return res, reports


# ----------------------------------------------------------------------------- tests

@pytest.mark.timeout(120)
def test_loopback_two_nodes(clean):
    """2 nodes x 2 ranks on 127.0.0.1: a real 2-agent static rendezvous."""
    res = vnodes.run(2, 2, _job(clean["tag"]), timeout=90)
    clean["results"].append(res)
    assert res.ok, f"exit codes {res.node_returncodes}\n" + "\n".join(res.outputs)
    assert res.master_addr == "127.0.0.1" and not res.namespaces and res.shaping is None
    reports = _reports(res)
    _check_layout(reports, 2, 2)
    host_shm = os.stat("/dev/shm").st_dev
    for r in reports:
        assert r["ip"] == "127.0.0.1" and r["socket_ifname"] == "lo"
        assert r["shm_dev"] == host_shm
        assert r["shm_peers"] == [0, 1, 2, 3]  # loopback nodes do share /dev/shm
    assert res.duration < 60


@needs_netns
@pytest.mark.timeout(200)
def test_netns_two_nodes_are_isolated(clean):
    """2 nodes x 2 ranks, one namespace each: own hostname, /dev/shm and 10.x address; every
    collective x dtype x reduce op is exact across the nodes."""
    res, reports = _netns_matrix(clean, 2, 2, timeout=150)
    host_shm = os.stat("/dev/shm").st_dev
    by_node = {n: [r for r in reports if r["group_rank"] == n] for n in (0, 1)}
    for node, reps in by_node.items():
        assert {r["hostname"] for r in reps} == {f"vnode{node}"}
        assert len({r["shm_dev"] for r in reps}) == 1
        assert len({r["ip"] for r in reps}) == 1
        for r in reps:
            assert re.fullmatch(r"10\.\d+\.0\.%d" % (node + 1), r["ip"]), r["ip"]
            assert r["master_addr"] == res.master_addr == by_node[0][0]["ip"]
            assert r["socket_ifname"] == vnodes.NODE_IFNAME
            assert r["shm_dev"] != host_shm
            # Shared memory does not cross nodes: a rank sees only its own node's files.
            assert r["shm_peers"] == [node * 2, node * 2 + 1]
    assert by_node[0][0]["shm_dev"] != by_node[1][0]["shm_dev"]
    assert by_node[0][0]["ip"] != by_node[1][0]["ip"]
    for r in reports:
        assert r["matrix_fails"] == [], r["matrix_fails"]
    assert res.duration < 140


@needs_netns
@pytest.mark.timeout(240)
def test_netns_uneven_three_nodes(clean):
    """3 isolated nodes with 2 + 1 + 1 ranks (torchrun agents with different
    --nproc-per-node): every collective x dtype x reduce op is exact, and each rank's
    /dev/shm holds only its own node's ranks."""
    counts = [2, 1, 1]
    res, reports = _netns_matrix(clean, 3, counts, timeout=200)
    node_ranks = {0: [0, 1], 1: [2], 2: [3]}
    for r in reports:
        assert r["hostname"] == f"vnode{r['group_rank']}"
        assert r["shm_peers"] == node_ranks[r["group_rank"]]
        assert r["matrix_fails"] == [], r["matrix_fails"]
    assert len({r["ip"] for r in reports}) == 3
    assert len({r["shm_dev"] for r in reports}) == 3


@needs_netns
@pytest.mark.timeout(120)
def test_netns_nodes_whose_hostname_does_not_resolve(clean):
    """2 isolated nodes x 2 ranks named ``nohost-nodeI.invalid`` (in no hosts file, no DNS),
    without NEURON_DIST_NODE_NAME: the backend groups ranks into nodes by itself and finds
    its address without resolving its own name."""
    res = vnodes.run(2, 2, _job(clean["tag"], "--unresolvable-hostname"), netns=True,
                     timeout=90)
    clean["results"].append(res)
    assert res.ok, f"exit codes {res.node_returncodes}\n" + "\n".join(res.outputs)
    reports = _reports(res)
    assert [r["rank"] for r in reports] == [0, 1, 2, 3]
    for r in reports:
        node = r["group_rank"]
        assert r["hostname"] == f"nohost-node{node}.invalid" and r["node_name"] is None
        assert r["sum"] == 10 and r["shm_peers"] == [2 * node, 2 * node + 1]
        assert r["neuron_nodes"] == [[0, 1], [2, 3]], r


@pytest.mark.timeout(10)
def test_rank_counts_per_node():
    """--nproc-per-node takes one count or one per node; bad lists are refused by name."""
    assert vnodes._ranks_per_node(3, 2) == [2, 2, 2]
    assert vnodes._ranks_per_node(3, [2, 1, 1]) == [2, 1, 1]
    assert vnodes._parse(["--nodes", "3", "--nproc-per-node", "2,1,1", "--", "x.py"]) \
        .nproc_per_node == [2, 1, 1]
    with pytest.raises(ValueError, match="2 rank counts given for 3 nodes"):
        vnodes.run(3, [2, 1], [JOB])
    with pytest.raises(ValueError, match="at least 1 rank"):
        vnodes.run(2, [2, 0], [JOB])


@needs_netns
@pytest.mark.timeout(120)
def test_netem_delay_three_nodes(clean):
    """3 nodes with 1 ms one-way delay: collectives feel it. On a kernel without netem
    (CONFIG_NET_SCH_NETEM off, as on our CI machines) asking for delay must fail cleanly
    instead: a clear error, nothing started or left behind."""
    if not vnodes.netem_available():
        start = time.monotonic()
        with pytest.raises(vnodes.NetemUnavailable, match="netem"):
            vnodes.run(2, 1, _job(clean["tag"]), netns=True, netem={"delay": "1ms"}, timeout=30)
        assert time.monotonic() - start < 10
        return
    res = vnodes.run(3, 1, _job(clean["tag"], "--latency-iters", "20"), netns=True,
                     netem={"delay": "1ms"}, timeout=90)
    clean["results"].append(res)
    assert res.ok, f"exit codes {res.node_returncodes}\n" + "\n".join(res.outputs)
    assert res.shaping == "netem"
    reports = _reports(res)
    _check_layout(reports, 3, 1)
    assert len({r["hostname"] for r in reports}) == 3
    for r in reports:
        assert r["allreduce_s"] >= 0.001, r  # at least one delayed hop per all_reduce
    assert res.duration < 60


@needs_netns
@pytest.mark.timeout(120)
def test_rate_limited_three_nodes(clean):
    """3 nodes with an egress rate limit (netem, or tbf where the kernel lacks netem) that
    takes effect: a 4 MiB send between two nodes is capped at the limit (200 Mbit/s, 25 MB/s;
    unshaped veth pairs carry it at hundreds of MB/s to GB/s here)."""
    limit_mbps = 25.0
    res = vnodes.run(3, 1, _job(clean["tag"], "--send-bytes", str(4 << 20)), netns=True,
                     netem=vnodes.Netem(rate="200mbit"), timeout=90)
    clean["results"].append(res)
    assert res.ok, f"exit codes {res.node_returncodes}\n" + "\n".join(res.outputs)
    assert res.shaping == ("netem" if vnodes.netem_available() else "tbf")
    reports = _reports(res)
    _check_layout(reports, 3, 1)
    assert len({r["shm_dev"] for r in reports}) == 3
    measured = reports[0]["send_MBps"]
    # the token bucket's burst (100 KB) lets a little more through than the rate at first
    assert measured <= limit_mbps * 1.1, f"{measured:.1f} MB/s through a {limit_mbps} MB/s limit"
    assert measured >= limit_mbps * 0.3, f"{measured:.1f} MB/s: the transfer barely moved"
    print(f"\nrate-limited send: {measured:.1f} MB/s (limit {limit_mbps} MB/s)")
    assert res.duration < 60


@pytest.mark.parametrize("netns", [
    pytest.param(False, id="loopback"),
    pytest.param(True, id="netns", marks=needs_netns),
])
@pytest.mark.timeout(120)
def test_failing_rank_stops_everything(clean, netns):
    """One rank exits 3: non-zero promptly, the failing node is named, nothing is left."""
    res = vnodes.run(2, 2, _job(clean["tag"], "--fail-rank", "3", "--fail-code", "3"),
                     netns=netns, timeout=90, grace=3)
    clean["results"].append(res)
    assert res.returncode != 0 and not res.timed_out
    assert res.failed_node is not None
    assert res.node_returncodes[res.failed_node] == res.returncode
    # torchrun exits 1 when a worker fails; the worker's own code is in its report.
    assert "failing on purpose with code 3" in res.outputs[1]
    assert "exitcode  : 3" in res.outputs[1]
    assert res.duration < 45


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(REPO, "launch", "vnodes.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, **kw)


@pytest.fixture
def sleeper(tmp_path, clean):
    """A torch-free job that prints a line and then sleeps for ever."""
    script = tmp_path / "sleeper.py"
    script.write_text("import os, sys, time\n"
                      "print('hello from rank', os.environ['RANK'], flush=True)\n"
                      "time.sleep(600)\n")
    return [str(script), clean["tag"]]


@pytest.mark.timeout(90)
def test_cli_timeout_kills_everything(sleeper, clean):
    """``--timeout`` bounds the run: exit 124, prefixed output, nothing left."""
    start = time.monotonic()
    proc = _cli("--nodes", "2", "--nproc-per-node", "1", "--timeout", "12", "--", *sleeper)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 124, (out, err)
    assert time.monotonic() - start < 40
    assert "[vnode0] hello from rank 0" in out and "[vnode1] hello from rank 1" in out
    assert "timeout" in err


@pytest.mark.timeout(90)
def test_cli_ctrl_c_cleans_up(sleeper, clean):
    """SIGINT to the launcher (Ctrl-C): exit 130 and every agent's group is gone."""
    args = ["--nodes", "2", "--nproc-per-node", "1", "--no-prefix"]
    if vnodes.netns_available():
        args.append("--netns")
    proc = _cli(*args, "--", *sleeper, preexec_fn=interruptible)
    seen = 0
    deadline = time.monotonic() + 60
    while seen < 2 and time.monotonic() < deadline:  # both ranks are up
        line = proc.stdout.readline()
        if not line:
            break
        seen += line.startswith("hello from rank")  # --no-prefix: bare lines
    assert seen == 2, proc.stderr.read() if proc.poll() is not None else "ranks did not start"
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert proc.returncode == 130
    # Namespaces of the CLI process (another pid) must be gone too.
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout \
        if vnodes.netns_available() else ""
    assert f"nd{proc.pid}_" not in out


@pytest.mark.timeout(10)
def test_shaping_arguments():
    """The tc command tails: netem gets every setting; the tbf fallback a sane burst."""
    n = vnodes.Netem(delay="1ms 100us", rate="10gbit", loss="0.1%")
    assert n.tc_args() == ["netem", "delay", "1ms", "100us", "loss", "0.1%",
                           "rate", "10gbit"]
    assert vnodes.Netem(rate="10gbit").tc_args(use_netem=False) == [
        "tbf", "rate", "10gbit", "burst", str(int(10e9 / 8 * 0.004)), "latency", "100ms"]
    assert vnodes.Netem(rate="1mbit").tc_args(use_netem=False)[4] == str(64 * 1024)
    assert not vnodes.Netem()
    with pytest.raises(ValueError, match="netns"):
        vnodes.run(2, 1, [JOB], netem={"rate": "1gbit"})


@needs_netns
@pytest.mark.timeout(60)
def test_stale_sweep_judges_launchers_by_identity_not_pid():
    """cleanup_stale deletes the namespaces of a launcher that is gone (dead pid, or a pid
    now running a later process) and keeps a live launcher's and those of another PID
    namespace (whose pids mean nothing here)."""
    p = subprocess.Popen(["true"])
    p.wait()
    dead, me = p.pid, os.getpid()
    ns, started = vnodes._pid_namespace(), vnodes._start_time(me)
    assert ns and started
    names = {
        "dead": f"nd{dead}_{ns}_{started}_0n0",
        "reused": f"nd{me}_{ns}_{started - 1}_0br",
        "alive": f"nd{me}_{ns}_{started}_990n0",
        "foreign": f"nd{dead}_{ns + 1}_{started}_0n0",
    }
    assert vnodes._launcher_tag(990) + "n0" == names["alive"]
    for name in names.values():
        subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        removed = vnodes.cleanup_stale()
        left = set(vnodes._list_netns())
        assert {names["dead"], names["reused"]} <= set(removed), removed
        assert names["dead"] not in left and names["reused"] not in left
        assert names["alive"] in left and names["foreign"] in left, left
    finally:
        for name in names.values():
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
