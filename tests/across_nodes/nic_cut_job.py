"""Run by test_multinic.py on 2 virtual nodes with two links each (eth0, eth1), 1 rank per
node, 4 rails between them. Reports which local addresses the rails use (once the first
all_reduces have opened them), then runs
all_reduces of 32 MiB and send/recv of 16 MiB; in the middle of one of them rank 1 takes
its eth1 down (its own namespace: one NIC of the node is lost). Every result is checked;
the times around the cut are reported as one JSON line per rank (``NIC_JOB ...``)."""

import json
import os
import subprocess
import threading
import time

import torch
import torch.distributed as dist

dist.init_process_group("neuron")
rank, world = dist.get_rank(), dist.get_world_size()
net = dist.group.WORLD._get_backend(torch.device("cpu"))._net

n = 8 << 20  # float32 elements: 32 MiB
bad = []


def check_all_reduce(i):
    t = torch.full((n,), float(rank + 1 + i))
    dist.all_reduce(t)
    want = float(sum(r + 1 + i for r in range(world)))
    if not bool((t == want).all()):
        bad.append(f"all_reduce {i}: got {t[:4].tolist()} want {want}")


def check_p2p(i):
    x = torch.arange(4 << 20, dtype=torch.float32) + i
    if rank == 0:
        dist.send(x, 1)
    else:
        y = torch.empty_like(x)
        dist.recv(y, 0)
        if not torch.equal(x, y):
            bad.append(f"send/recv {i} differs")


for i in range(2):
    check_all_reduce(i)
dist.barrier()
rails = [r for rs in net._rails.values() for r in rs if r is not None]  # (open on first use)
report = {"rank": rank, "rail_addrs": sorted({r.sock.getsockname()[0] for r in rails}),
          "address": net.address}
cut_at = None
if rank == 1:
    def cut():
        time.sleep(0.05)  # inside the next all_reduce
        subprocess.run(["ip", "link", "set", "dev", "eth1", "down"], check=True)
    cutter = threading.Thread(target=cut)
    cutter.start()
start = time.monotonic()
for i in range(2, 6):
    check_all_reduce(i)
    check_p2p(i)
report["after_cut_seconds"] = time.monotonic() - start
if rank == 1:
    cutter.join()
report["bad"] = bad
dist.barrier()  # (then neither rank has begun to close its rails)
report["rails_left"] = sum(r.alive for r in rails)
dist.barrier()
print("NIC_JOB " + json.dumps(report), flush=True)
dist.destroy_process_group()
