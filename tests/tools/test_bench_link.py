"""The link benchmark (``python -m bench.link``) runs end to end on tiny sizes.

A loopback run and a veth run (two network namespaces; root and iproute2 needed, else
skipped) of 8 MiB per run, tcp and zmq, 1 and 2 streams, one repetition: every cell must
have a positive GB/s and checked data, the JSON its keys, the table its rows. The veth
runs, including one that fails in its set-up and one interrupted by SIGINT, must leave
none of their namespaces or veth devices behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from bench.link import VARIANTS
from helpers.procs import interruptible

CMD = [sys.executable, "-m", "bench.link"]
TINY = ["--bytes", "8M", "--modes", "tcp,zmq", "--streams", "1,2", "--reps", "1", "--timeout", "45"]


def _netns() -> list[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _ours_left(pid: int) -> list[str]:
    ns = [n for n in _netns() if n.startswith(f"ndlink-{pid}-")]
    devs = [d for d in (f"ndl{pid}r", f"ndl{pid}s") if os.path.exists(f"/sys/class/net/{d}")]
    return ns + devs


def _veth_possible() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"ndlink-probe-{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True, timeout=20).returncode == 0
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
    return ok


needs_veth = pytest.mark.skipif(not _veth_possible(), reason="needs root and `ip netns`")


def _run(where, tmp_path, extra=()):
    out = tmp_path / f"link-{where}.json"
    p = subprocess.Popen([*CMD, "--where", where, *TINY, "--json", str(out), *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = p.communicate(timeout=55)
    assert p.returncode == 0, f"exit {p.returncode}\n{stdout}\n{stderr}"
    return p.pid, stdout, json.loads(out.read_text())


def _check(doc, stdout, where):
    assert set(doc) == {"meta", "results", "summary"}
    meta = doc["meta"]
    for key in ("command", "where", "bytes", "chunk", "reps", "streams", "variants", "status",
                "loadavg_before", "sysctl"):
        assert key in meta, key
    assert meta["where"] == where and meta["status"] == 0 and meta["bytes"] == 8 << 20
    cells = {(r["variant"], r["streams"]): r for r in doc["results"]}
    assert set(cells) == {(v, s) for v in VARIANTS for s in (1, 2)}
    for (v, s), r in cells.items():
        assert r["gbps"] > 0 and r["seconds"] > 0 and len(r["gbps_reps"]) == 1, r
        assert r["mode"] == VARIANTS[v][0]
        # every variant that lands the bytes in the destination had them checked
        assert r["verified"] == (r["mode"] == "tcp" or VARIANTS[v][1]["dst"]), r
    summ = doc["summary"]
    for key in ("tcp_best", "zmq_dst_best", "baseline", "zmq_dst_overall"):
        assert key in summ, key
    assert summ["baseline"]["gbps"] > 0 and set(summ["tcp_best"]) == {"1", "2"}
    assert stdout.startswith(f"link benchmark: {where}")
    for v in VARIANTS:
        assert f"\n{v} " in stdout
    assert "tcp best" in stdout and "baseline (best raw TCP)" in stdout


@pytest.mark.timeout(60)
def test_loopback_tiny(tmp_path):
    _, stdout, doc = _run("loopback", tmp_path)
    _check(doc, stdout, "loopback")


@needs_veth
@pytest.mark.timeout(60)
def test_veth_tiny(tmp_path):
    pid, stdout, doc = _run("veth", tmp_path)
    _check(doc, stdout, "veth")
    assert doc["meta"]["env"]["namespaces"] == [f"ndlink-{pid}-recv", f"ndlink-{pid}-send"]
    assert doc["meta"]["env"]["recv_addr"].startswith("10.")
    assert _ours_left(pid) == []


@needs_veth
@pytest.mark.timeout(60)
def test_veth_cleanup_on_setup_failure_and_sigint():
    # A qdisc that cannot exist fails after both namespaces and the veth pair are made.
    p = subprocess.Popen([*CMD, "--where", "veth", *TINY, "--qdisc", "no-such-qdisc"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr = p.communicate(timeout=30)
    assert p.returncode == 2 and "set-up failed" in stderr, stderr
    assert _ours_left(p.pid) == []

    # Ctrl-C in the middle of the runs: exit 130, children and namespaces gone.
    p = subprocess.Popen([*CMD, "--where", "veth", "--bytes", "256M", "--timeout", "45"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=interruptible)
    try:
        line = ""
        while not line.startswith("[rep"):      # the first run has finished: mid-benchmark
            line = p.stderr.readline()
            assert line, "the benchmark ended before its first run"
        assert sorted(_ours_left(p.pid)) == [f"ndlink-{p.pid}-recv", f"ndlink-{p.pid}-send"]
    finally:
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=30)
    assert p.returncode == 130
    time.sleep(0.2)
    assert _ours_left(p.pid) == []

