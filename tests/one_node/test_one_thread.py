"""A collective's own torch work runs on the thread that does it, not on torch's pool
(collectives/one_thread.py), and the caller's thread count is given back afterwards.

Ranks run with two torch threads each (torch's default on a 2-core machine). Every call of
the reduction kernel records the thread count of the thread it runs on: 1 means the
kernel could not hand its work to torch's OpenMP pool. Without the scope every record
would be 2, and the all_reduces below ran up to 170x slower with two ranks on two cores.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.distributed as dist

from helpers.harness import run_ranks
from neuron_dist.collectives import one_thread, reduce_ops


def _recording_kernels():
    """Wrap the SUM kernel so each call records ``torch.get_num_threads()`` where it runs."""
    seen = []
    add = reduce_ops._KERNELS[reduce_ops.SUM]

    def recording_add(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return add(*args, **kwargs)

    reduce_ops._KERNELS[reduce_ops.SUM] = recording_add
    return seen


def reductions(rank, world):
    torch.set_num_threads(2)
    seen = _recording_kernels()
    out = {}
    for name, numel, mode in (("small sync", 2, "sync"), ("256 KiB sync", 1 << 16, "sync"),
                              ("8 MiB sync", 1 << 21, "sync"),
                              ("256 KiB async", 1 << 16, "async"),
                              ("8 MiB async", 1 << 21, "async"),
                              ("256 KiB from another thread", 1 << 16, "thread")):
        del seen[:]
        x = torch.full((numel,), float(rank + 1))
        if mode == "sync":
            dist.all_reduce(x)
        elif mode == "async":
            dist.all_reduce(x, async_op=True).wait()
        else:
            t = threading.Thread(target=dist.all_reduce, args=(x,))
            t.start()
            t.join(30)
        out[name] = (sorted(set(seen)), bool((x == world * (world + 1) / 2).all()),
                     torch.get_num_threads())
    return out


def noncontiguous_send_recv(rank, world):
    """A send from and a receive into a transposed (non-contiguous) 256 x 256 tensor: its
    copy to and from a flat buffer is neuron's work too."""
    torch.set_num_threads(2)
    seen = []
    copy = torch.Tensor.copy_

    def recording_copy(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return copy(self, *args, **kwargs)

    torch.Tensor.copy_ = recording_copy
    try:
        x = torch.arange(65536, dtype=torch.float32).reshape(256, 256)
        if rank == 0:
            dist.send(x.t(), 1)
            right = True
        else:
            y = torch.zeros(256, 256)
            dist.recv(y.t(), 0)
            right = torch.equal(y.t(), x.t())
    finally:
        torch.Tensor.copy_ = copy
    return sorted(set(seen)), right, torch.get_num_threads()


@pytest.mark.timeout(90)
def test_a_noncontiguous_send_and_receive_copy_on_one_thread_too():
    for nodes in (1, 2):
        res = run_ranks(noncontiguous_send_recv, 2, timeout=80,
                        env=lambda rank: {"NEURON_DIST_NODE_NAME": f"node{rank * nodes // 2}"})
        for rank, (seen, right, after) in res.items():
            assert right and after == 2, (nodes, rank, res)
            assert not seen or set(seen) == {1}, (nodes, rank, seen)
        assert res[1][0] == [1], (nodes, res)  # (the receive copied back: one_thread's scope)


def _check(res):
    for rank, cases in res.items():
        for name, (seen, right, after) in cases.items():
            assert right, f"rank {rank}, {name}: wrong sum"
            assert after == 2, f"rank {rank}, {name}: the caller's thread count became {after}"
            if name != "small sync":  # (2 elements: nothing could go to the pool anyway)
                assert seen and set(seen) == {1}, (
                    f"rank {rank}, {name}: the reduction ran with thread counts {seen}")


@pytest.mark.timeout(90)
def test_a_collective_keeps_its_torch_work_on_one_thread_and_gives_the_count_back():
    _check(run_ranks(reductions, 2, timeout=80))


@pytest.mark.timeout(90)
def test_between_nodes_too():
    _check(run_ranks(reductions, 2, timeout=80,
                     env=lambda rank: {"NEURON_DIST_NODE_NAME": f"node{rank}"}))


def test_enter_sets_only_the_calling_thread_and_leave_restores_it():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = {}
        count = one_thread.enter()
        try:
            seen["inside"] = torch.get_num_threads()
            t = threading.Thread(target=lambda: seen.update(other=torch.get_num_threads()))
            t.start()
            t.join(10)
        finally:
            one_thread.leave(count)
        assert count == 2
        assert seen == {"inside": 1, "other": 2}
        assert torch.get_num_threads() == 2
        assert one_thread.enter() == 2 and torch.get_num_threads() == 1
        one_thread.leave(2)
    finally:
        torch.set_num_threads(before)


def test_a_new_thread_keeps_the_count_torch_was_told():
    # A thread that never ran a torch op before: torch sets its count on first use, from
    # what set_num_threads said last. The scope must neither be undone by that nor leave
    # the thread with OpenMP's default afterwards (its own process: set_num_threads is
    # process-wide for threads started later).
    script = textwrap.dedent("""
        import threading, torch
        from neuron_dist.collectives import one_thread
        torch.set_num_threads(1 if torch.get_num_threads() > 1 else 2)
        want = torch.get_num_threads()
        x = torch.ones(1 << 20)
        seen = {}
        def run():
            count = one_thread.enter()
            seen["inside"] = torch.get_num_threads()
            x.add_(1)
            seen["after op"] = torch.get_num_threads()
            one_thread.leave(count)
            seen["after"] = torch.get_num_threads()
        t = threading.Thread(target=run)
        t.start()
        t.join(10)
        assert seen == {"inside": 1, "after op": 1, "after": want}, (seen, want)
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
