"""The MPI baseline: an mpi4py worker started by ``mpiexec``, and the launcher that starts it.

The parent runs ``mpiexec -n N python -m bench.mpi_runner CONFIG_JSON`` in a
new session (so a timeout can kill mpiexec, its proxies and all ranks as one process group),
after the torch ranks of the same world size are gone. The worker measures the same ops,
sizes, patterns and timing rules as the torch ranks (see ``sweep`` and ``patterns``) with
mpi4py: Allreduce (in place, like torch's all_reduce), Allgather, Reduce_scatter_block,
Bcast, Alltoall and a Send/Recv ping-pong, each iteration after ``Barrier``.

The buffers are torch tensors' memory, seen as numpy arrays (``torch.empty(...).numpy()``),
as a torch user's tensors would be under an MPI backend. numpy's own allocator asks for
transparent huge pages (``madvise``) for arrays of 4 MiB and more; torch's does not (unless
``THP_MEM_ALLOC_ENABLE=1``). Huge pages make the copies, and above all the cross-memory
reads that MPICH and neuron both use for large messages, cheaper: MPICH's 2 x 4 MiB
Allgather took 661-794 µs on numpy buffers against 716-1111 µs on torch's, in 4 of 5
alternating pairs (median 712 against 1057), so numpy buffers gave MPI an advantage that
no torch backend has. MPI is initialised single-threaded (``MPI_THREAD_SINGLE``). Rank 0 prints one
``@@neuron-bench {json}`` line per (op, size) on stdout; the launcher turns those into rows
and forwards anything else to stderr. If mpiexec or mpi4py is missing the launcher says so
and MPI is skipped. bfloat16 has no numpy/MPI type: those rows are n/a.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time

from .patterns import fill, mismatch, pattern
from .sweep import (DTYPE_BYTES, OPS, combine, make_row, ops_per_sample, plan,
                    time_iterations)

PREFIX = "@@neuron-bench "


# ----------------------------------------------------------------------------- launcher
def find_mpiexec(explicit: str | None = None) -> str | None:
    """``--mpiexec``, else the one next to this python (the mpich wheel), else PATH."""
    if explicit:
        return explicit if shutil.which(explicit) else None
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("mpiexec")


def unavailable_reason(explicit: str | None = None) -> str | None:
    """None if MPI can run, else why not (for the 'skipping MPI' note)."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install 'neuron-dist[bench]')"
    if find_mpiexec(explicit) is None:
        where = f"{explicit!r} not found" if explicit else "no mpiexec next to python or on PATH"
        return f"{where} (pip install mpich, or pass --mpiexec)"
    return None


def run_world(world: int, cfg: dict, on_rows, log, timeout: float, stall_timeout: float,
              mpiexec: str | None = None) -> dict:
    """Run the MPI sweep on ``world`` ranks; same return shape as ``torch_runner.run_world``."""
    out = {"results": [], "overlap": [], "shm": [], "errors": [], "meta": {}}
    exe = find_mpiexec(mpiexec)
    cmd = [exe, "-n", str(world), sys.executable, "-m", "bench.mpi_runner",
           json.dumps(dict(cfg, world=world))]
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg["threads"]))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    fd, buf, done = proc.stdout.fileno(), b"", False
    start = last = time.monotonic()

    def handle(line: str) -> None:
        nonlocal done
        if not line.startswith(PREFIX):
            if line.strip():
                log(f"mpi: {line}")
            return
        kind, payload = json.loads(line[len(PREFIX):])
        if kind == "rows":
            out["results"].extend(payload)
            on_rows(payload)
        elif kind == "meta":
            out["meta"] = payload
        elif kind == "done":
            done = True

    try:
        eof = False
        while not eof:
            now = time.monotonic()
            if now - start > timeout:
                out["errors"].append(f"mpi n={world}: run exceeded --timeout {timeout:.0f} s; killed")
                break
            if now - last > stall_timeout:
                out["errors"].append(f"mpi n={world}: nothing reported for {stall_timeout:.0f} s; killed")
                break
            if not sel.select(timeout=0.5):
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                eof = True
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                last = time.monotonic()
                handle(line.decode(errors="replace"))
        if buf:
            handle(buf.decode(errors="replace"))
        if eof:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
    finally:
        sel.close()
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        proc.stdout.close()
    if not done and not out["errors"]:
        out["errors"].append(f"mpi n={world}: mpiexec exited with code {proc.returncode} "
                             f"before finishing")
    return out


# ----------------------------------------------------------------------------- worker
def _empty(count: int, dtype: str):
    """An uninitialised array of ``count`` elements in memory torch allocated (see the
    module docstring)."""
    import torch
    return torch.empty(count, dtype=getattr(torch, dtype)).numpy()


class _Case:
    """Buffers of one (op, count) on this rank, and the MPI call that moves them."""

    def __init__(self, MPI, comm, op, count, rank, world, dtype):
        self.op, self.rank, self.comm, self.MPI = op, rank, comm, MPI
        self.p = pattern(op, count, rank, world)
        self.inp = _empty(self.p.in_count, dtype)
        self.prepare()
        self.out = _empty(self.p.out_count, dtype) if self.p.out_count else None

    def prepare(self):
        fill(lambda a, b, v: self.inp[a:b].fill(v), self.p.in_fill)

    def reset(self):
        if self.out is not None:
            self.out.fill(-1)

    def runner(self):
        c, MPI, inp, out = self.comm, self.MPI, self.inp, self.out
        op = self.op
        if op == "all_reduce":
            return lambda: c.Allreduce(MPI.IN_PLACE, inp, op=MPI.SUM)
        if op == "all_gather":
            return lambda: c.Allgather(inp, out)
        if op == "reduce_scatter":
            return lambda: c.Reduce_scatter_block(inp, out, op=MPI.SUM)
        if op == "broadcast":
            return lambda: c.Bcast(inp, root=0)
        if op == "all_to_all":
            return lambda: c.Alltoall(inp, out)
        if op == "send_recv":
            if self.rank == 0:
                return lambda: (c.Send(inp, dest=1, tag=7), c.Recv(out, source=1, tag=7))
            if self.rank == 1:
                return lambda: (c.Recv(out, source=0, tag=7), c.Send(inp, dest=0, tag=7))
            return lambda: None
        raise ValueError(op)

    def check(self):
        t = self.out if self.out is not None else self.inp

        def first_bad(a, b, v):
            i = a + int((t[a:b] != v).nonzero()[0][0])
            return i, t[i].item()

        return mismatch(self.p.expect, lambda a, b, v: bool((t[a:b] == v).all()), first_bad)


def _err(exc) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def worker(cfg: dict) -> None:
    import mpi4py

    mpi4py.rc.thread_level = "single"
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()

    def emit(kind, payload=None):
        if rank == 0:
            print(PREFIX + json.dumps([kind, payload]), flush=True)

    emit("meta", {"mpi4py": mpi4py.__version__, "world": world,
                  "mpi_library": " ".join(MPI.Get_library_version().split("\n")[0].split())})
    dtype = cfg["dtype"]
    np_dtype = None if dtype == "bfloat16" else getattr(np, dtype)
    iters, warmup = cfg["iters"], cfg["warmup"]
    barrier = comm.Barrier
    for op in cfg["ops"]:
        for count in plan(op, cfg["sizes"], DTYPE_BYTES[dtype], world):
            if world < OPS[op].min_world or np_dtype is None:
                why = f"needs {OPS[op].min_world}+ ranks" if np_dtype else "no bfloat16 in numpy/MPI"
                emit("rows", [make_row(op, world, "mpi", count, dtype, iters, note=why)])
                continue
            err = None
            try:
                case = _Case(MPI, comm, op, count, rank, world, dtype)
                run = case.runner()
                prepare = case.prepare if case.p.refill else None
                batch = ops_per_sample(count * DTYPE_BYTES[dtype], cfg["batch"])
                case.reset()
                time_iterations(run, barrier, max(1, warmup), prepare)
            except Exception as exc:  # noqa: BLE001 - unsupported: n/a, keep going
                err = _err(exc)
            errors = [(r, e) for r, e in enumerate(comm.allgather(err)) if e]
            if errors:
                emit("rows", [make_row(op, world, "mpi", count, dtype, iters,
                                       note=f"rank {errors[0][0]}: {errors[0][1]}")])
                continue
            samples, err = [], None
            try:
                samples = time_iterations(run, barrier, iters, prepare, batch)
                if cfg["check"] and prepare is not None and batch > 1:
                    time_iterations(run, barrier, 1, prepare)  # check fresh inputs' result
            except Exception as exc:  # noqa: BLE001
                err = _err(exc)
            bad = case.check() if cfg["check"] and err is None else None
            shared = comm.gather([samples, err, bad], root=0)
            del case
            if rank != 0:
                continue
            errors = [(r, s[1]) for r, s in enumerate(shared) if s[1]]
            if errors:
                row = make_row(op, world, "mpi", count, dtype, iters,
                               note=f"rank {errors[0][0]}: {errors[0][1]}")
            else:
                check, note = "-", ""
                if cfg["check"]:
                    fails = [(r, s[2]) for r, s in enumerate(shared) if s[2]]
                    check = "FAIL" if fails else "OK"
                    note = "; ".join(f"rank {r}: {m}" for r, m in fails[:2])
                row = make_row(op, world, "mpi", count, dtype, iters,
                               times=combine([s[0] for s in shared], op), check=check, note=note,
                               batch=batch)
            emit("rows", [row])
    comm.Barrier()
    emit("done")


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
