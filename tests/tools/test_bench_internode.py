"""The inter-node benchmark (``python -m bench.internode``) runs end to end, tiny.

Two network-namespace virtual nodes (root needed, else skipped), 2 sizes per op, one
iteration: every (op, size, backend) cell - neuron 1 rail, neuron 4 rails, gloo and the
raw-TCP floor (4 streams, so its large messages go over all of them at once) - must be ok,
checked and positive; the groups must really use 1 and 4 rails across the two nodes; the
table and the ratios, the floor's among them, must be printed. Afterwards nothing may be left: no namespace of the run, no process carrying
the run's tag, no progress file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from neuron_dist.launch import vnodes
from helpers.procs import processes_with

needs_netns = pytest.mark.skipif(not vnodes.netns_available(),
                                 reason="needs root and working ip netns/veth/bridge")

BACKENDS = ("neuron-1rail", "neuron-4rails", "gloo")


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                         timeout=20).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.startswith(prefix)]


def _progress_files() -> set[str]:
    d = tempfile.gettempdir()
    return {n for n in os.listdir(d) if n.startswith("neuron-internode-")}


@needs_netns
@pytest.mark.timeout(120)
def test_internode_tiny(tmp_path):
    tag = f"internodetest-{uuid.uuid4().hex[:10]}"
    out = tmp_path / "internode.json"
    files_before = _progress_files()
    cmd = [sys.executable, "-m", "bench.internode",
           "--p2p-min", "64K", "--p2p-max", "256K", "--ar-min", "8", "--ar-max", "128K",
           "-f", "4096", "--iters", "1", "--min-iters", "1", "--warmup", "1",
           "--timeout", "90", "--pg-timeout", "30", "--tag", tag,
           "--json", str(out)]
    start = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = p.communicate(timeout=105)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    took = time.monotonic() - start

    # nothing left behind, whatever the outcome
    deadline = time.monotonic() + 5
    while processes_with(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_with(tag), f"processes left running: {processes_with(tag)}"
    assert not _namespaces(f"nd{p.pid}_"), f"namespaces left: {_namespaces(f'nd{p.pid}_')}"
    assert _progress_files() <= files_before, "progress file left behind"

    assert p.returncode == 0, f"exit {p.returncode}\n{stdout}\n{stderr}"
    doc = json.loads(out.read_text())
    assert doc["errors"] == []
    meta = doc["meta"]
    assert meta["p2p_sizes"] == [65536, 262144] and meta["ar_sizes"] == [8, 32768, 131072]
    assert meta["node_returncodes"] == [0, 0] and len(meta["namespaces_used"]) == 3

    ranks = sorted(meta["ranks"], key=lambda r: r["rank"])
    assert [r["hostname"] for r in ranks] == ["vnode0", "vnode1"]
    for r in ranks:
        assert r["socket_ifname"] == "eth0"
        for name, rails in (("neuron-1rail", 1), ("neuron-4rails", 4)):
            g = r["groups"][name]
            assert g["spans_nodes"] and g["settings_rails"] == rails, g
            assert g["transport_rails"] == rails, g
            assert g["address"].startswith("10."), g  # the veth, not loopback
        assert r["groups"]["gloo"]["GLOO_SOCKET_IFNAME"] == "eth0"
        assert "error" not in r["groups"]["floor"], r["groups"]["floor"]
        assert r["groups"]["floor"]["streams"] == 4, r["groups"]["floor"]

    rows = doc["results"]
    cells = {(r["op"], r["bytes"], r["backend"]): r for r in rows}
    want = ([("p2p", s, b) for s in (65536, 262144) for b in (*BACKENDS, "floor")]
            + [("all_reduce", s, b) for s in (8, 32768, 131072) for b in (*BACKENDS, "floor")])
    assert sorted(cells) == sorted(want), sorted(cells)
    for key, r in cells.items():
        assert r["status"] == "ok" and r["check"] == "OK", (key, r)
        assert r["iters"] == 1 and len(r["iter_s"]) == 1, (key, r)
        assert r["time_us"] > 0 and r["busbw_gbs"] > 0, (key, r)
        assert r["busbw_gbs"] < 100, (key, r)  # a veth on one machine: sane bound
        assert len(r["cpu_us"]) == 2 and all(0 < c < 1e6 for c in r["cpu_us"]), (key, r)
        if r["op"] == "p2p":
            assert r["window"] == max(1, min(64, (16 << 20) // r["bytes"]))

    assert "all_reduce: CPU us per operation" in stdout
    for label in ("4r/gloo", "4r/1r", "floor/gloo", "4r/floor"):
        assert label in stdout, label
    assert stdout.startswith("# python -m bench.internode ")
    for op in ("p2p", "all_reduce"):
        assert op in doc["summary"], doc["summary"]
    # progress went to stderr while the run went
    assert "[all_reduce 8 B] neuron-1rail:" in stderr
    assert took < 100
