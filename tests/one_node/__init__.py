"""One node: the backend with ranks forked on this machine, joined by shared memory.

Collectives (every op x dtype x reduce op), send/recv, the express lane, async overlap,
subgroups, memory ordering, failures and timeouts, single-copy (CMA) algorithms, the
flight recorder, cleanup of processes and /dev/shm, a soak run, and the dtype and
shape claims of docs/collectives.md (those also on two virtual nodes over loopback). Ranks are run by
helpers/harness.py.
"""
