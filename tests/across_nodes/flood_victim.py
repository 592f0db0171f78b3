"""A rank under a flood of stranger connections, at a 1024 file-descriptor limit.

Run by test_rdm_driver.py: two rdm transports (a group of 2) in this process, whose
rank 0 listener the test floods with idle, garbage and trickling connections. On "go"
from stdin (the flood is still open), it checks a transfer, then opens a new group and
checks a transfer there; prints one JSON line with what it saw.
"""

import json
import os
import resource
import sys
import threading
import time

import numpy as np

_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))

from neuron_dist.transport.rdm import driver as D  # noqa: E402


KEY = os.urandom(32)


def pair(group: bytes):
    ts = [D.RdmTransport(r, 2, host="127.0.0.1", rails=2, key=KEY, group=group, rto=0.5)
          for r in range(2)]
    addrs = {r: t.address for r, t in enumerate(ts)}
    threads = [threading.Thread(target=t.connect, args=(addrs, time.monotonic() + 20))
               for t in ts]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return ts


def transfer(ts, n=3 << 20) -> bool:
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    r = ts[1].irecv(0, 1, dst)
    ts[0].isend(1, 1, src).wait(time.monotonic() + 20)
    r.wait(time.monotonic() + 20)
    return bool(np.array_equal(src, dst))


first = pair(b"group-1")
print(json.dumps({"address": first[0].address}), flush=True)
sys.stdin.readline()  # the flood is on
report = {"first_ok": transfer(first), "threads": threading.active_count(),
          "fds": len(os.listdir("/proc/self/fd"))}
second = pair(b"group-2")
report["second_ok"] = transfer(second)
report["first_again_ok"] = transfer(first)
for t in first + second:
    t.close()
print(json.dumps(report), flush=True)
