"""Ranks for the torch backends: neuron, gloo, null and shmfloor measured in the same processes,
interleaved.

The parent forks one process per rank *before* any TCPStore exists (it never starts one:
forking a process that runs threads can copy a lock some thread holds into the child, see
tests/helpers/harness.py), so the parent stays thread-free across several world sizes. Rank 0
binds a TCPStore on 127.0.0.1 port 0 and sends the port up its pipe; the parent relays it
to the other ranks. The world group is ``init_process_group("neuron")``; gloo is
``dist.new_group(backend="gloo")`` and null (``null_pg``: a group that does nothing, the
dispatch floor) ``dist.new_group(backend="null")`` over the same ranks, and shmfloor
(``shm_floor_pg``: the bytes through shared memory with nothing else, the floor of a
Python backend on one node) likewise; every op gets ``group=``. null's outputs are never written, so ``--check`` and
``--overlap`` skip it; shmfloor does no overlap.

For each op and size the ranks build the buffers once, then measure the backends one after
the other, alternating which goes first from one size to the next, so machine noise hits
both alike. A backend that cannot run an op (an exception on any rank during warm-up) gets
an ``n/a`` row instead of stopping the sweep. Agreement (did every rank succeed?) and the
per-rank timings travel through the TCPStore, so they never depend on a backend under test.

Bounded in time: group timeout ``--pg-timeout``; the parent SIGKILLs every rank when the
whole run exceeds ``--timeout``, when nothing was reported for ``--stall-timeout`` seconds,
or a few seconds after any rank failed. Rank 0 relays each (op, size) result as it completes.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from . import null_pg, overlap as overlap_mod, shm_floor_pg
from .patterns import fill, mismatch, pattern
from .sweep import (OPS, DTYPE_BYTES, combine, make_row, ops_per_sample, plan,
                    time_iterations)

SHMFLOOR = "shmfloor"
TORCH_BACKENDS = ("neuron", "gloo", null_pg.BACKEND_NAME, SHMFLOOR)
_CTX = mp.get_context("fork")
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ----------------------------------------------------------------------------- rank side
class Exchange:
    """Every rank contributes a JSON value and gets everyone's, through the TCPStore."""

    def __init__(self, store, rank: int, world: int):
        self.store, self.rank, self.world, self.seq = store, rank, world, 0

    def all(self, value):
        self.seq += 1
        key = f"neuron-bench/{self.seq}/"
        self.store.set(key + str(self.rank), json.dumps(value))
        return [json.loads(self.store.get(key + str(r))) for r in range(self.world)]


class Case:
    """Buffers of one (op, element count) on this rank, shared by all backends."""

    def __init__(self, op: str, count: int, rank: int, world: int, dtype: torch.dtype):
        self.op, self.rank = op, rank
        self.p = pattern(op, count, rank, world)
        self.inp = torch.empty(self.p.in_count, dtype=dtype)
        fill(self._filler(self.inp), self.p.in_fill)
        self.out = torch.empty(self.p.out_count, dtype=dtype) if self.p.out_count else None

    @staticmethod
    def _filler(t):
        return lambda a, b, v: t[a:b].fill_(v)

    def reset(self) -> None:
        """Before a backend's turn: poison the output."""
        if self.out is not None:
            self.out.fill_(-1)

    def prepare(self) -> None:
        """Before every iteration of an in-place op: restore the input."""
        fill(self._filler(self.inp), self.p.in_fill)

    def runner(self, group):
        op, inp, out = self.op, self.inp, self.out
        if op == "all_reduce":
            return lambda: dist.all_reduce(inp, group=group)
        if op == "all_gather":
            return lambda: _all_gather(out, inp, group=group)
        if op == "reduce_scatter":
            return lambda: _reduce_scatter(out, inp, group=group)
        if op == "broadcast":
            return lambda: dist.broadcast(inp, src=0, group=group)
        if op == "all_to_all":
            return lambda: dist.all_to_all_single(out, inp, group=group)
        if op == "send_recv":
            if self.rank == 0:
                return lambda: (dist.send(inp, 1, group=group), dist.recv(out, 1, group=group))
            if self.rank == 1:
                return lambda: (dist.recv(out, 0, group=group), dist.send(inp, 0, group=group))
            return lambda: None
        raise ValueError(op)

    def check(self) -> str | None:
        t = self.out if self.out is not None else self.inp

        def first_bad(a, b, v):
            bad = (t[a:b] != v).nonzero()
            i = a + int(bad[0, 0])
            return i, t[i].item()

        return mismatch(self.p.expect, lambda a, b, v: bool((t[a:b] == v).all()), first_bad)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def _measure(case: Case, op: str, count: int, backend: str, group, ex: Exchange, cfg) -> dict:
    world, dtype = cfg["world"], cfg["dtype"]
    checked = cfg["check"] and backend != null_pg.BACKEND_NAME
    barrier = lambda: dist.barrier(group=group)  # noqa: E731
    prepare = case.prepare if case.p.refill else None
    run = case.runner(group)
    batch = ops_per_sample(count * DTYPE_BYTES[dtype], cfg["batch"])
    err = None
    try:
        case.reset()
        time_iterations(run, barrier, max(1, cfg["warmup"]), prepare)
    except Exception as exc:  # noqa: BLE001 - an unsupported op must not stop the sweep
        err = _error_text(exc)
    errors = [(r, e) for r, e in enumerate(ex.all(err)) if e]
    if errors:
        return make_row(op, world, backend, count, dtype, cfg["iters"],
                        note=f"rank {errors[0][0]}: {errors[0][1]}")
    samples, err = [], None
    try:
        samples = time_iterations(run, barrier, cfg["iters"], prepare, batch)
        if checked and prepare is not None and batch > 1:
            time_iterations(run, barrier, 1, prepare)  # check one operation on fresh inputs
    except Exception as exc:  # noqa: BLE001
        err = _error_text(exc)
    bad = case.check() if checked and err is None else None
    shared = ex.all([samples, err, bad])
    errors = [(r, s[1]) for r, s in enumerate(shared) if s[1]]
    if errors:
        return make_row(op, world, backend, count, dtype, cfg["iters"],
                        note=f"rank {errors[0][0]}: {errors[0][1]}")
    check, note = "-", ""
    if checked:
        fails = [(r, s[2]) for r, s in enumerate(shared) if s[2]]
        check = "FAIL" if fails else "OK"
        note = "; ".join(f"rank {r}: {m}" for r, m in fails[:2])
    return make_row(op, world, backend, count, dtype, cfg["iters"],
                    times=combine([s[0] for s in shared], op), check=check, note=note,
                    batch=batch)


def _shm_report(groups: dict, world: int) -> list[dict]:
    out = []
    default = dist.distributed_c10d._get_default_group()
    for backend, group in groups.items():
        pg = default if group is None else group
        channel = getattr(pg, "_channel", None)
        name = getattr(pg, "group_name", "") or "?"
        desc = getattr(pg, "group_desc", "")
        desc = "" if desc in ("", "undefined") else desc
        info = {"backend": backend, "world": world,
                "group": f"{name} ({desc})" if desc else name}
        if channel is None:
            info.update(shm_bytes=None, note="not a neuron group: no shared-memory segment")
        else:
            s = pg.settings
            formula = world * (2 * s.slot_bytes + world * s.mailbox_bytes + 4096)
            info.update(shm_bytes=channel.layout.total_bytes, slot_bytes=s.slot_bytes,
                        mailbox_bytes=s.mailbox_bytes, readme_formula_bytes=formula)
        out.append(info)
    return out


def _rank_main(rank: int, world: int, cfg: dict, conn) -> None:
    torch.set_num_threads(cfg["threads"])
    timeout = timedelta(seconds=cfg["pg_timeout"])
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        conn.send(("port", store.port))
    else:
        if not conn.poll(60):
            raise TimeoutError("rank 0 never sent the TCPStore port")
        store = dist.TCPStore("127.0.0.1", conn.recv(), world, is_master=False, timeout=timeout)
    backends = cfg["backends"]
    world_backend = "neuron" if "neuron" in backends else "gloo"
    dist.init_process_group(world_backend, store=store, rank=rank, world_size=world,
                            timeout=timeout)
    groups = {world_backend: None}
    if "gloo" in backends and world_backend != "gloo":
        groups["gloo"] = dist.new_group(backend="gloo", timeout=timeout)
    if null_pg.BACKEND_NAME in backends:
        null_pg.register()
        groups[null_pg.BACKEND_NAME] = dist.new_group(backend=null_pg.BACKEND_NAME, timeout=timeout)
    if SHMFLOOR in backends:
        shm_floor_pg.register()
        groups[SHMFLOOR] = dist.new_group(backend=shm_floor_pg.BACKEND_NAME, timeout=timeout)
    groups = {b: groups[b] for b in backends}
    ex = Exchange(store, rank, world)
    if cfg["report_shm"] and rank == 0:
        conn.send(("shm", _shm_report(groups, world)))

    dtype = getattr(torch, cfg["dtype"])
    elem = DTYPE_BYTES[cfg["dtype"]]
    for op in cfg["ops"]:
        counts = plan(op, cfg["sizes"], elem, world)
        if world < OPS[op].min_world:
            if rank == 0:
                for count in counts:
                    conn.send(("rows", [make_row(op, world, b, count, cfg["dtype"], cfg["iters"],
                                                 note=f"needs {OPS[op].min_world}+ ranks")
                                        for b in backends]))
            continue
        for i, count in enumerate(counts):
            case = Case(op, count, rank, world, dtype)
            order = backends if i % 2 == 0 else backends[::-1]
            rows = {b: _measure(case, op, count, b, groups[b], ex, cfg) for b in order}
            del case
            if rank == 0:
                conn.send(("rows", [rows[b] for b in backends]))

    if cfg["overlap"]:
        for b in (b for b in backends if b not in (null_pg.BACKEND_NAME, SHMFLOOR)):
            o = cfg["overlap"]
            rows = overlap_mod.measure(rank, world, b, groups[b], ex, o["bytes"], o["matmul"],
                                       cfg["iters"], cfg["warmup"])
            if rank == 0:
                conn.send(("overlap", rows))

    dist.destroy_process_group()
    store.set(f"neuron-bench/done/{rank}", "1")
    if rank == 0:  # keep the store up until every rank is through
        store.wait([f"neuron-bench/done/{r}" for r in range(world)])


def _entry(rank: int, world: int, cfg: dict, conn) -> None:
    code = 0
    try:
        _rank_main(rank, world, cfg, conn)
        conn.send(("done", rank))
    except BaseException as exc:  # noqa: BLE001
        code = 1
        try:
            conn.send(("error", rank, _error_text(exc), traceback.format_exc()))
        except OSError:
            pass
    finally:
        try:
            conn.close()
        finally:
            os._exit(code)


# ----------------------------------------------------------------------------- parent side
def run_world(world: int, cfg: dict, on_rows, log, timeout: float, stall_timeout: float,
              grace: float = 5.0) -> dict:
    """Run the torch sweep on ``world`` forked ranks.

    ``on_rows(rows)`` is called for every completed (op, size); ``log(text)`` for notes.
    Returns ``{"results", "overlap", "shm", "errors"}`` (whatever completed, even on failure).
    """
    cfg = dict(cfg, world=world)
    out = {"results": [], "overlap": [], "shm": [], "errors": []}
    pipes = [_CTX.Pipe() for _ in range(world)]
    procs = [_CTX.Process(target=_entry, args=(r, world, cfg, pipes[r][1]), daemon=True,
                          name=f"neuron-bench-rank{r}") for r in range(world)]
    for p in procs:
        p.start()
    conns = {}
    for r, (parent_end, child_end) in enumerate(pipes):
        child_end.close()
        conns[r] = parent_end
    # A rank's pipe is also inherited by the ranks forked after it, so EOF alone does not
    # tell that a rank died: watch the process sentinels too.
    sentinels = {p.sentinel: r for r, p in enumerate(procs)}
    finished = set()
    start = last = time.monotonic()
    failed_at = None

    def handle(r: int, msg) -> None:
        nonlocal failed_at
        kind = msg[0]
        if kind == "port":
            for rr, other in conns.items():
                if rr != 0:
                    other.send(msg[1])
        elif kind == "rows":
            out["results"].extend(msg[1])
            on_rows(msg[1])
        elif kind == "overlap":
            out["overlap"].extend(msg[1])
        elif kind == "shm":
            out["shm"].extend(msg[1])
        elif kind == "done":
            finished.add(r)
        elif kind == "error":
            finished.add(r)
            out["errors"].append(f"n={world}: rank {r} failed: {msg[2]}")
            log(f"rank {r} failed:\n{msg[3]}")
            failed_at = failed_at or time.monotonic()

    def drain(r: int) -> None:
        """Rank r is gone: read what it left in its pipe, then close it."""
        nonlocal failed_at
        c = conns.pop(r, None)
        try:
            while c is not None and c.poll(0):
                handle(r, c.recv())
        except (EOFError, OSError):
            pass
        if c is not None:
            c.close()
        if r not in finished:
            finished.add(r)
            procs[r].join(1)
            out["errors"].append(f"n={world}: rank {r} exited without reporting "
                                 f"(exit code {procs[r].exitcode})")
            failed_at = failed_at or time.monotonic()

    try:
        while len(finished) < world:
            now = time.monotonic()
            if now - start > timeout:
                out["errors"].append(f"n={world}: run exceeded --timeout {timeout:.0f} s; ranks killed")
                break
            if now - last > stall_timeout:
                out["errors"].append(f"n={world}: nothing reported for {stall_timeout:.0f} s "
                                     f"(--stall-timeout); ranks killed")
                break
            if failed_at is not None and now - failed_at > grace:
                break
            by_conn = {c: r for r, c in conns.items()}
            for obj in wait(list(by_conn) + list(sentinels), timeout=0.5):
                if obj in sentinels:
                    drain(sentinels.pop(obj))
                    continue
                r = by_conn[obj]
                if r not in conns:
                    continue
                try:
                    msg = obj.recv()
                except (EOFError, OSError):
                    drain(r)
                    continue
                last = time.monotonic()
                handle(r, msg)
    finally:
        for p in procs:
            p.join(timeout=2.0 if len(finished) == world and failed_at is None else 0.0)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join()
        for c in conns.values():
            c.close()
    return out
