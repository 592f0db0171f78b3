"""Run a function on N ranks over the neuron backend, bounded in time, leaving nothing behind.

Ranks are forked from the test process (fast: no re-import of torch) and rendezvous on a
TCPStore that the test process hosts on an ephemeral port (port 0), so tests can run in
parallel. The ranks are forked *before* the store starts its server thread, and learn the
port through a queue: forking a process that runs threads can copy a lock held by one of
them into the child, where nobody will ever release it. Each rank reports ``("ok", value)`` or ``("error", type name, message,
traceback)`` through a queue. If any rank has not reported by the deadline, every rank is
SIGKILLed and the test fails naming the ranks that hung.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import time
import traceback
from datetime import timedelta

import torch.distributed as dist

_CTX = mp.get_context("fork")


class RankFailure(AssertionError):
    def __init__(self, results):
        self.results = results
        lines = []
        for rank, res in sorted(results.items()):
            if res[0] != "ok":
                lines.append(f"--- rank {rank}: {res[1]}: {res[2]}\n{res[3] if len(res) > 3 else ''}")
        super().__init__("\n".join(lines))


def _entry(fn, rank, world, ports, queue, args, env, pg_timeout, init, timeout):
    os.environ.update(env(rank) if callable(env) else env)
    port = ports.get()
    # If this rank hangs, show where before the test kills it.
    faulthandler.dump_traceback_later(max(1.0, timeout - 3), exit=False)
    try:
        if init:
            store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                                  timeout=timedelta(seconds=30))
            dist.init_process_group("neuron", store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=pg_timeout))
        try:
            value = fn(rank, world, *args)
        finally:
            if init and dist.is_initialized():
                dist.destroy_process_group()
        queue.put((rank, ("ok", value)))
    except BaseException as exc:  # noqa: BLE001
        queue.put((rank, ("error", type(exc).__name__, str(exc), traceback.format_exc())))
    finally:
        os._exit(0)


def error_of(fn):
    """``"ErrorType: message"`` of what ``fn()`` raised, or None if it returned."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def cma_expected() -> bool:
    """Can a process read a sibling's memory here (root, or Yama absent / scope 0)?"""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read())
    except OSError:
        scope = 0
    return os.geteuid() == 0 or scope == 0


def run_ranks(fn, world: int, *args, timeout: float = 60.0, env: dict | None = None,
              pg_timeout: float = 30.0, init: bool = True, expect_errors: bool = False,
              hooks=None):
    """Run ``fn(rank, world, *args)`` on ``world`` forked ranks; return {rank: value}.

    ``env`` is a dict of environment variables for every rank, or ``env(rank) -> dict``.
    With ``expect_errors`` the raw per-rank results are returned instead of raising.
    ``hooks(procs)`` is called right after start (e.g. to kill a rank).
    """
    queue, ports = _CTX.SimpleQueue(), _CTX.SimpleQueue()
    procs = [_CTX.Process(target=_entry, args=(fn, r, world, ports, queue, args,
                                               env or {}, pg_timeout, init, timeout), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True,
                          timeout=timedelta(seconds=30), wait_for_workers=False)
    for _ in procs:
        ports.put(store.port)
    if hooks:
        hooks(procs)
    results = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            if not queue.empty():
                rank, res = queue.get()
                results[rank] = res
                continue
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(results))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout} s "
                                   f"(results so far: {results})")
            if all(not p.is_alive() for p in procs) and queue.empty():
                for r in range(world):
                    results.setdefault(r, ("error", "Died", f"exit code {procs[r].exitcode}", ""))
                break
            time.sleep(0.005)
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=max(0.1, deadline - time.monotonic()) if len(results) == world else 0)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join()
        del store
    if expect_errors:
        return results
    if any(res[0] != "ok" for res in results.values()):
        raise RankFailure(results)
    return {r: res[1] for r, res in results.items()}
