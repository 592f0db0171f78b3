"""Firewalled clusters and IPv6: rails listen in ``NEURON_DIST_PORT_RANGE``, a full range
fails at init saying so, and a job whose rendezvous host is ``::1`` runs over IPv6 rails.

Each job is two processes, each its own node (``NEURON_DIST_NODE_NAME``), so their traffic
takes the network transport; a process's listener is made once, by its first group, so
these need processes of their own.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys

import pytest

from neuron_dist.transport.rdm.listener import bind

pytestmark = pytest.mark.timeout(120)

JOB = r"""
import json, os, sys
import torch, torch.distributed as dist
rank, host, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
os.environ["NEURON_DIST_NODE_NAME"] = f"node{rank}"
store = dist.TCPStore(host, port, 2, is_master=rank == 0)
dist.init_process_group("neuron", store=store, rank=rank, world_size=2)
t = torch.full((1000,), float(rank + 1))
dist.all_reduce(t)
assert t.eq(3.0).all(), t
x = torch.arange(5.0) if rank == 0 else torch.zeros(5)
(dist.send if rank == 0 else dist.recv)(x, 1 - rank)
assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0], x
net = dist.group.WORLD._get_backend(torch.device("cpu"))._net
rails = [r for rs in net._rails.values() for r in rs if r is not None]
print(json.dumps({"address": net.address,
                  "rail_families": sorted({r.sock.family.name for r in rails})}), flush=True)
dist.destroy_process_group()
"""


def _job(tmp_path, host: str, env: dict) -> list[dict]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    script = tmp_path / "job.py"
    script.write_text(JOB)
    full = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    full.update(env, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), host, str(port)],
                              env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    reports = []
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed:\n{out}\n{err[-3000:]}"
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def _free_range(n: int = 40) -> tuple[int, int]:
    """``n`` ports below the kernel's ephemeral range (so no test's port 0 lands there), at
    a random place: parallel runs pick different ones, and bind() skips taken ports."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    first = random.randrange(max(1024, low - 8000), low - n)
    return first, first + n - 1


def test_rails_listen_in_the_port_range(tmp_path):
    first, last = _free_range()
    reports = _job(tmp_path, "127.0.0.1", {"NEURON_DIST_PORT_RANGE": f"{first}-{last}"})
    for report in reports:
        port = int(report["address"].rpartition(":")[2])
        assert first <= port <= last, (report, first, last)


def test_a_port_range_with_every_port_taken_fails_saying_so():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(OSError, match=f"NEURON_DIST_PORT_RANGE={port}-{port}: all 1 ports "
                                          f"are in use on 127.0.0.1"):
            bind("127.0.0.1", (port, port))
    with bind("127.0.0.1", (port, port)) as s:  # free again: taken
        assert s.getsockname()[1] == port


def test_a_bad_port_range_is_refused_by_name():
    from neuron_dist.config import Settings
    for bad in ("40000", "40100-40000", "0-10", "a-b", "40000-70000"):
        with pytest.raises(ValueError, match="NEURON_DIST_PORT_RANGE must be FIRST-LAST"):
            Settings.from_env({"NEURON_DIST_PORT_RANGE": bad})
    assert Settings.from_env({"NEURON_DIST_PORT_RANGE": " 40000-40100 "}).port_range == \
        (40000, 40100)
    assert Settings.from_env({}).port_range is None


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_a_job_whose_rendezvous_host_is_ipv6_runs_over_ipv6_rails(tmp_path):
    if not _ipv6_loopback():
        pytest.skip("this host has no IPv6 loopback (::1)")
    reports = _job(tmp_path, "::1", {})
    for report in reports:
        assert report["address"].startswith("[::1]:"), report
        assert report["rail_families"] == ["AF_INET6"], report
