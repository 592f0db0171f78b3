"""Rank side of the scale benchmark (``bench.scale``): one backend per process.

Started once per backend and rank: under torchrun by ``launch/vnodes.py`` for the torch
backends (``--backend neuron|gloo|floor``; torchrun's env:// variables ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), or by MPICH's hydra
``mpiexec`` for ``--backend mpich`` (mpi4py, ``MPI_THREAD_SINGLE``) and ``--backend neuron-mpi``
(neuron with ``NEURON_DIST_TRANSPORT=mpi``, the rendezvous variables from MPI). A process measures one
backend only, so its sockets, threads and memory are that backend's (plus torch's own).

Set-up: the default process group *is* the backend under test
(``dist.init_process_group(backend)``; ``floor`` = ``neuron_floor`` of ``bench/floor_pg.py``
with one connection per pair). There is no control group: every rank appends its own
results, one JSON object per line, to ``OUT/<backend>-rank<R>.jsonl`` (a directory the
parent created under /tmp, which every node shares; only /dev/shm and /etc/hosts are
private to a node), and the parent combines the ranks' files. Lines are flushed at once,
so a run cut short still leaves what was measured.

Init time: from just before ``init_process_group`` (mpich: just before ``from mpi4py
import MPI``, which calls ``MPI_Init_thread``) to the return of the first barrier, on
each rank (the parent reports the max over ranks). Just before the clock starts, every
backend's process runs one full garbage collection: a process that has imported torch
owes one (some 75 ms of CPU per rank here, at 32 ranks on 2 cores), paid by whatever code
next makes enough Python objects: a set-up written in Python if it runs first (neuron's),
the training loop otherwise (gloo's set-up is C++). Paid before the clock, the time is
each backend's set-up alone.

Ops, in this order (sizes in bytes, float32, SUM; mpich: Allreduce(IN_PLACE), Allgather,
Reduce_scatter_block, Bcast, Barrier on arrays that are torch tensors' memory, as in
``bench/mpi_runner.py``):

* ``all_reduce`` 8, 64 KiB, 1 MiB (in place);
* ``all_gather`` (``all_gather_into_tensor``): 1 MiB of output in all, 1 MiB / world each;
* ``reduce_scatter`` (``reduce_scatter_tensor``): 1 MiB of input in all;
* ``broadcast`` 64 KiB from rank 0;
* ``barrier``.

(``floor`` has no all_gather or reduce_scatter: those rows are n/a.)

Per op: ``--warmup`` untimed iterations, a check, ``--iters`` timed iterations, and the
check again. One timed iteration = refill the buffer if the op reduces in place (outside the
clock), a barrier of the backend under test, then ``batch`` ops back to back
(``sweep.ops_per_sample``: 16 up to 256 KiB, 4 at 1 MiB) timed with ``perf_counter``;
sample = their mean. ``cpu_s``: ``getrusage(RUSAGE_SELF)`` user + system of the whole
process (every thread) summed over the timed batches only (not the barriers or refills);
the parent divides by the number of ops.

Checks compare every element with the exact expected value (inputs are small integers,
so float32 sums are exact in any order): all_reduce input ``rank + 1 + i % 7`` -> ``n(n+1)/2
+ n (i % 7)``; all_gather input ``1000 rank + i % 997`` -> the concatenation;
reduce_scatter input ``rank + 1 + i % 7`` -> this rank's share of the all_reduce result;
broadcast rank 0 ``i % 1009``, the others ``-1`` -> ``i % 1009`` everywhere. A wrong
result is written as ``"check": "FAIL: ..."``, printed on stderr, and makes the parent
fail; the rank goes on with the next op (the other ranks would otherwise wait in it).

After the ops: open sockets (``/proc/self/fd`` entries that are ``socket:[...]``),
threads (``threading.active_count()`` and ``Threads`` of ``/proc/self/status``, taken
while this worker's own watchdog thread is stopped, so they are torch's, the backend's
and the main thread), ``VmRSS``
and ``VmHWM``, and the bytes this node's ``eth0`` sent since before init
(``/sys/class/net/eth0/statistics/tx_bytes``: the node's, whichever rank sent them).

Bounded: every op (warm-up, checks and iterations together) and the init run under a
watchdog thread that, after ``--op-timeout`` seconds, writes an ``error`` line and ends the
process (exit 124); torch groups also get it as their own per-collective timeout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import socket
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta

import torch

from neuron_dist.config import Settings
from .sweep import ops_per_sample

#: (op, bytes) in the order they run; bytes = buffer (all_reduce, broadcast), gathered
#: output (all_gather), reduce_scatter's input.
CASES = (("all_reduce", 8), ("all_reduce", 64 << 10), ("all_reduce", 1 << 20),
         ("all_gather", 1 << 20), ("reduce_scatter", 1 << 20), ("broadcast", 64 << 10),
         ("barrier", 0))
FLOOR_OPS = ("all_reduce", "barrier", "broadcast")
TORCH_BACKENDS = {"neuron": "neuron", "gloo": "gloo", "floor": "neuron_floor",
                  "neuron-mpi": "neuron"}


def _cpu() -> float:
    """CPU seconds of this whole process so far (every thread, user and system)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _err(exc: BaseException) -> str:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"[:400]


class Out:
    """This rank's result file (one JSON object per line, flushed at once)."""

    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1)
        self.lock = threading.Lock()

    def emit(self, obj: dict) -> None:
        with self.lock:
            self.f.write(json.dumps(obj) + "\n")
            self.f.flush()


class Watchdog:
    """``with dog.arm(label):`` ends the process (exit 124) if the block outlasts ``seconds``."""

    def __init__(self, seconds: float, out: Out, rank: int):
        self.seconds, self.out, self.rank = seconds, out, rank
        self.label = None
        self.deadline = None
        self.stopped = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True, name="scale-watchdog")
        self.thread.start()

    def stop(self) -> None:
        """End the watchdog thread (so that it is not counted with the backend's threads)."""
        with self.cond:
            self.stopped = True
            self.cond.notify()
        self.thread.join()

    def _run(self) -> None:
        with self.cond:
            while not self.stopped:
                if self.deadline is None:
                    self.cond.wait()
                    continue
                left = self.deadline - time.monotonic()
                if left > 0:
                    self.cond.wait(left)
                    continue
                msg = (f"rank {self.rank}: {self.label} did not finish within "
                       f"--op-timeout {self.seconds:g} s")
                try:
                    self.out.emit({"kind": "error", "op": self.label, "error": msg})
                    print(f"scale_worker: {msg}", file=sys.stderr, flush=True)
                finally:
                    os._exit(124)

    def arm(self, label: str):
        dog = self

        class _Armed:
            def __enter__(self):
                with dog.cond:
                    dog.label, dog.deadline = label, time.monotonic() + dog.seconds
                    dog.cond.notify()

            def __exit__(self, *exc):
                with dog.cond:
                    dog.deadline = None
                    dog.cond.notify()
                return False

        return _Armed()


# ----------------------------------------------------------------------------- backends

class TorchComm:
    """The default torch.distributed group of ``backend`` (env:// from torchrun)."""

    def __init__(self, name: str, timeout: float):
        self.name = name
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.timeout = timeout
        self.dist = None

    def init(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        if self.name == "floor":
            from . import floor_pg
            floor_pg.register(1)
        dist.init_process_group(TORCH_BACKENDS[self.name],
                                timeout=timedelta(seconds=self.timeout))

    def barrier(self) -> None:
        self.dist.barrier()

    def runner(self, op: str, inp, out):
        d = self.dist
        if op == "all_reduce":
            return lambda: d.all_reduce(inp)
        if op == "all_gather":
            return lambda: d.all_gather_into_tensor(out, inp)
        if op == "reduce_scatter":
            return lambda: d.reduce_scatter_tensor(out, inp)
        if op == "broadcast":
            return lambda: d.broadcast(inp, 0)
        if op == "barrier":
            return d.barrier
        raise ValueError(op)

    def info(self) -> dict:
        import neuron_dist
        return {"torch": torch.__version__, "neuron_dist": neuron_dist.__version__,
                "pg_backend": TORCH_BACKENDS[self.name]}

    def finish(self) -> None:
        self.dist.destroy_process_group()


class MpiComm:
    """MPI_COMM_WORLD of mpi4py (MPICH), single-threaded."""

    def __init__(self, nproc_per_node: int):
        self.name = "mpich"
        self.nproc_per_node = nproc_per_node
        self.MPI = self.comm = None
        self.rank = self.world = self.local_rank = None

    def init(self) -> None:
        import mpi4py

        mpi4py.rc.thread_level = "single"
        from mpi4py import MPI  # MPI_Init_thread happens here

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()
        self.local_rank = int(os.environ.get("MPI_LOCALRANKID", self.rank % self.nproc_per_node))

    def barrier(self) -> None:
        self.comm.Barrier()

    def runner(self, op: str, inp, out):
        c, MPI = self.comm, self.MPI
        a = inp.numpy() if inp is not None else None
        b = out.numpy() if out is not None else None
        if op == "all_reduce":
            return lambda: c.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
        if op == "all_gather":
            return lambda: c.Allgather(a, b)
        if op == "reduce_scatter":
            return lambda: c.Reduce_scatter_block(a, b, op=MPI.SUM)
        if op == "broadcast":
            return lambda: c.Bcast(a, root=0)
        if op == "barrier":
            return c.Barrier
        raise ValueError(op)

    def info(self) -> dict:
        import mpi4py
        return {"torch": torch.__version__, "mpi4py": mpi4py.__version__,
                "mpi_library": " ".join(self.MPI.Get_library_version().split("\n")[0].split()),
                "thread_level": "single"}

    def finish(self) -> None:
        self.comm.Barrier()


# ----------------------------------------------------------------------------- one op

class Case:
    """Buffers, the op's closure, its refill and its check for one (op, bytes)."""

    def __init__(self, comm, op: str, nbytes: int):
        self.op, self.comm = op, comm
        rank, world = comm.rank, comm.world
        count = max(1, nbytes // 4)
        self.inp = self.out = None
        self.refill = None
        if op == "all_reduce":
            self.inp = torch.empty(count)
            self.refill = lambda: self.inp.fill_(1.0)  # x world per op: exact, no overflow
        elif op in ("all_gather", "reduce_scatter"):
            count = max(world, count // world * world)
            big, small = torch.empty(count), torch.empty(count // world)
            self.inp, self.out = (small, big) if op == "all_gather" else (big, small)
        elif op == "broadcast":
            self.inp = torch.empty(count)
        self.nbytes = 0 if op == "barrier" else count * 4
        self.run = comm.runner(op, self.inp, self.out)

    def check(self) -> str:
        """Run the op once on fresh inputs; "OK" or "FAIL: what was wrong"."""
        op, rank, world = self.op, self.comm.rank, self.comm.world
        if op == "barrier":
            self.run()
            return "OK"
        n = self.inp.numel()
        i7 = torch.arange(n) % 7
        if op == "all_reduce":
            self.inp.copy_(rank + 1 + i7)
            self.run()
            got, want = self.inp, world * (world + 1) / 2 + world * i7.float()
        elif op == "all_gather":
            self.inp.copy_(1000 * rank + torch.arange(n) % 997)
            self.out.fill_(-1.0)
            self.run()
            got = self.out
            want = (1000 * torch.arange(world).repeat_interleave(n)
                    + torch.arange(n).repeat(world) % 997).float()
        elif op == "reduce_scatter":
            self.inp.copy_(rank + 1 + i7)
            self.out.fill_(-1.0)
            self.run()
            m = self.out.numel()
            got = self.out
            want = world * (world + 1) / 2 + world * (torch.arange(rank * m, (rank + 1) * m) % 7).float()
        else:  # broadcast
            self.inp.copy_(torch.arange(n) % 1009 if rank == 0 else torch.full((n,), -1))
            self.run()
            got, want = self.inp, (torch.arange(n) % 1009).float()
        if torch.equal(got, want):
            return "OK"
        bad = int((got != want).nonzero()[0][0])
        return (f"FAIL: rank {rank}: {op} of {self.nbytes} B: element {bad} is "
                f"{got[bad].item()!r}, expected {want[bad].item()!r}")

    def timed(self, iters: int, batch: int, barrier) -> tuple[list[float], float]:
        """``iters`` samples (mean seconds per op of a batch after a barrier) and the CPU
        seconds of the batches alone."""
        samples, cpu = [], 0.0
        clock, run, refill = time.perf_counter, self.run, self.refill
        for _ in range(iters):
            if refill is not None:
                refill()
            barrier()
            c0 = _cpu()
            t0 = clock()
            for _ in range(batch):
                run()
            t1 = clock()
            cpu += _cpu() - c0
            samples.append((t1 - t0) / batch)
        return samples, cpu


# ----------------------------------------------------------------------------- resources

def _status() -> dict:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key in ("Threads", "VmRSS", "VmHWM"):
                    out[key] = int(val.split()[0])
    except OSError:
        pass
    return out


def _sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                n += 1
        except OSError:
            pass
    return n


def _tx_bytes(ifname: str = "eth0"):
    try:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def resources() -> dict:
    st = _status()
    return {"sockets": _sockets(), "py_threads": threading.active_count(),
            "os_threads": st.get("Threads"), "rss_kib": st.get("VmRSS"),
            "hwm_kib": st.get("VmHWM")}


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", required=True, choices=(*TORCH_BACKENDS, "mpich"))
    p.add_argument("--out", required=True, help="directory for <backend>-rank<R>.jsonl")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--op-timeout", type=float, default=300.0)
    p.add_argument("--nproc-per-node", type=int, default=1, help="mpich: ranks per node")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    # torch 2.13 calls all_gather_into_tensor / reduce_scatter_tensor deprecated on every call
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    tx0 = _tx_bytes()
    if args.backend == "neuron-mpi":
        # neuron under mpiexec with the MPI transport: the rendezvous comes from MPI, the
        # network phases are MPI's own collectives (collectives/net_mpi.py)
        os.environ["NEURON_DIST_TRANSPORT"] = "mpi"
        from neuron_dist import mpi_launch
        mpi_launch.env_from_mpi()
    if args.backend == "mpich":
        comm = MpiComm(args.nproc_per_node)
        # the rank is known only after MPI_Init; PMI_RANK is hydra's
        rank0 = int(os.environ.get("PMI_RANK", os.environ.get("MPI_LOCALRANKID", "0")))
    else:
        comm = TorchComm(args.backend, args.op_timeout)
        rank0 = comm.rank
    out = Out(os.path.join(args.out, f"{args.backend}-rank{rank0}.jsonl"))
    dog = Watchdog(args.op_timeout, out, rank0)

    try:
        with dog.arm("init"):
            gc.collect()  # (the collection torch's import left owing: see the docstring)
            t0 = time.perf_counter()
            comm.init()
            comm.barrier()
            init_s = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001
        out.emit({"kind": "error", "op": "init", "error": _err(exc)})
        traceback.print_exc(file=sys.stderr)
        return 1
    out.emit({"kind": "init", "rank": comm.rank, "world": comm.world,
              "local_rank": comm.local_rank, "hostname": socket.gethostname(),
              "node_name": Settings.from_env().node_name, "init_s": init_s,
              **comm.info()})

    failed = False
    for op, nbytes in CASES:
        if args.backend == "floor" and op not in FLOOR_OPS:
            continue
        label = f"{op} {nbytes} B"
        try:
            with dog.arm(label):
                t_cell = time.monotonic()
                case = Case(comm, op, nbytes)
                batch = ops_per_sample(max(case.nbytes, 1))
                for _ in range(max(0, args.warmup)):
                    if case.refill is not None:
                        case.refill()
                    comm.barrier()
                    case.run()
                before = case.check()
                samples, cpu = case.timed(args.iters, batch, comm.barrier)
                after = case.check()
                comm.barrier()
        except Exception as exc:  # noqa: BLE001 - a raising backend has broken its group
            out.emit({"kind": "error", "op": label, "error": _err(exc)})
            traceback.print_exc(file=sys.stderr)
            return 1
        check = before if before != "OK" else after
        if check != "OK":
            failed = True
            print(f"scale_worker: CHECK FAILED ({args.backend}): {check}", file=sys.stderr,
                  flush=True)
        out.emit({"kind": "op", "op": op, "bytes": case.nbytes, "batch": batch,
                  "iters": args.iters, "warmup": args.warmup, "samples": samples,
                  "cpu_s": cpu, "nops": args.iters * batch, "check": check,
                  "cell_s": round(time.monotonic() - t_cell, 3)})
        del case

    dog.stop()  # not the backend's thread: measure without it
    res = resources()
    dog = Watchdog(args.op_timeout, out, comm.rank)
    tx1 = _tx_bytes()
    res["node_tx_bytes"] = (tx1 - tx0) if tx0 is not None and tx1 is not None else None
    out.emit({"kind": "resources", "rank": comm.rank, "local_rank": comm.local_rank, **res})
    with dog.arm("shutdown"):
        comm.finish()
    out.emit({"kind": "done", "rank": comm.rank, "failed_check": failed})
    return 0


if __name__ == "__main__":
    sys.exit(main())
