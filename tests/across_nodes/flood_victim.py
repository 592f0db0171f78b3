"""A rank under a flood of stranger connections, at a 1024 file-descriptor limit.

Run by test_rdm_driver.py: two rdm transports (a group of 2) in this process, whose
rank 0 listener the test floods with idle, garbage and trickling connections. On "go"
from stdin (the flood is still open), it checks a transfer, then opens a new group and
checks a transfer there; prints one JSON line with what it saw.

With the argument ``midjob`` the flood runs while rails open: on "go" (the flood is on
and goes on), it opens groups one after another, each opening its rails (by its first
send) and checking a transfer, then closing; prints one JSON line with what it saw. Its
dialers take DIAL_DELAY to answer the listener's greeting, as one on a loaded or distant
node does (on loopback an idle process answers before 32 strangers arrive).
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


if sys.argv[1:] == ["midjob"]:
    import time as _time
    real_dial = D.handshake.dial

    def slow_dial(sock, *args, **kwargs):
        _time.sleep(float(os.environ.get("DIAL_DELAY", "0.05")))
        return real_dial(sock, *args, **kwargs)
    D.handshake.dial = slow_dial
    groups = [pair(b"mid-%d" % k) for k in range(int(os.environ.get("FLOOD_ROUNDS", "3")))]
    print(json.dumps({"address": groups[0][0].address}), flush=True)
    sys.stdin.readline()  # the flood is on
    report = {"ok": [], "errors": []}
    start = _time.monotonic()
    for ts in groups:  # one at a time: each dials its own rails (no other group's to join)
        try:
            report["ok"].append(transfer(ts, 100_000))
        except Exception as e:  # noqa: BLE001 - reported
            report["errors"].append(f"{type(e).__name__}: {e}")
        for t in ts:
            t.close()
    report["seconds"] = _time.monotonic() - start
    print(json.dumps(report), flush=True)
    sys.exit(0)

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
