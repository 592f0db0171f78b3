"""One rank of the soak (``python -m bench.soak``): the main job, then what the rank still holds.

Run by path under torchrun on every rank: ``bench/soak_rank.py DIR train-args...``. Before
the process group exists it writes ``DIR/pid-R`` (so the soak can send it signals and find
its network namespace) and notes its open sockets. Then it runs ``neuron_dist.launch.train``
unchanged (which destroys the group at its end) and writes ``DIR/report-R.json``:

* ``threads``: the names of the threads still alive besides the main one;
* ``sockets``: socket descriptors open now that were not open before the group existed,
  apart from torch's client of the rendezvous store (it outlives the group);
* ``shm``: on each node's first rank, once every rank of the node has reported, the
  ``/dev/shm`` entries of the backend (``neuron*``) still there.
"""

import json
import os
import sys
import threading
import time


def _sockets() -> set:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


def _store_sockets(sockets: set) -> set:
    """Those of ``sockets`` connected to the job's store (``MASTER_ADDR:MASTER_PORT``):
    torch's client of the rendezvous store, which outlives the process group."""
    port = int(os.environ.get("MASTER_PORT", "0"))
    inodes = {s[len("socket:["):-1] for s in sockets}
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[9] in inodes and int(f[2].rsplit(":", 1)[1], 16) == port:
                found.add(f"socket:[{f[9]}]")
    return found


def _shm_left(out: str, node_ranks: list) -> list:
    """On a node's first rank: wait (bounded) for the node's other ranks to report, then
    list the backend's shared-memory files left on this node."""
    end = time.monotonic() + 60
    while time.monotonic() < end and not all(
            os.path.exists(os.path.join(out, f"report-{r}.json")) for r in node_ranks):
        time.sleep(0.1)
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("neuron"))


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    with open(os.path.join(out, f"pid-{rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    before = _sockets()
    from neuron_dist.launch import train
    train.main(argv)
    report = {"rank": rank, "pid": os.getpid(),
              "threads": sorted(t.name for t in threading.enumerate()
                                if t is not threading.main_thread() and t.is_alive()),
              "sockets": len(_sockets() - before - _store_sockets(_sockets()))}
    name = os.path.join(out, f"report-{rank}.json")
    with open(name + ".tmp", "w") as fh:
        json.dump(report, fh)
    os.replace(name + ".tmp", name)
    if local == 0:  # (ranks of a node are numbered together: rank - local is its first)
        report["shm"] = _shm_left(out, [rank + i for i in range(1, per_node)])
        with open(name + ".tmp", "w") as fh:
            json.dump(report, fh)
        os.replace(name + ".tmp", name)


if __name__ == "__main__":
    # Run by path, this folder is first on sys.path; the lab is imported from its parent.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    main()
