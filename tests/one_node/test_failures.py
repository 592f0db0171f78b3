"""Bad input and failing peers: clear errors everywhere, never a hang or a wrong answer."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

from helpers.harness import error_of, run_ranks


def mismatched_calls(rank, world, case):
    calls = {
        "op": (lambda: dist.all_reduce(torch.ones(4)),
               lambda: dist.all_gather_into_tensor(torch.empty(4 * world), torch.ones(4))),
        "dtype": (lambda: dist.all_reduce(torch.ones(4)),
                  lambda: dist.all_reduce(torch.ones(4, dtype=torch.float64))),
        "count": (lambda: dist.all_reduce(torch.ones(4)), lambda: dist.all_reduce(torch.ones(5))),
        "root": (lambda: dist.broadcast(torch.ones(4), src=0), lambda: dist.broadcast(torch.ones(4), src=1)),
        "reduce_op": (lambda: dist.all_reduce(torch.ones(4)),
                      lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.MAX)),
        "big_vs_small": (lambda: dist.all_reduce(torch.ones(300_000)), lambda: dist.all_reduce(torch.ones(3))),
    }[case]
    err = error_of(calls[0] if rank != world - 1 else calls[1])
    # the group stays usable after a mismatch
    t = torch.ones(3)
    dist.all_reduce(t)
    return err, t.tolist()


@pytest.mark.parametrize("case", ["op", "dtype", "count", "root", "reduce_op", "big_vs_small"])
def test_mismatch_fails_on_every_rank_naming_both_calls(case):
    world = 3
    res = run_ranks(mismatched_calls, world, case, timeout=60, pg_timeout=20)
    for rank, (err, after) in res.items():
        assert err is not None and "CollectiveMismatchError" in err, (rank, err)
        # every rank names its own call and one of the other side (the last rank called the
        # other one), and the two differ
        calls = dict(re.findall(r"rank (\d+) called #1 ([^;]+)", err))
        other = "0" if rank == world - 1 else str(world - 1)
        assert str(rank) in calls and other in calls, (rank, err)
        assert calls[str(rank)] != calls[other], (rank, err)
        assert after == [3.0] * 3, after
    print(res[0][0])


def alltoall_split_disagreement(rank, world):
    inp = torch.ones(4)
    out = torch.empty(4)
    splits = [2, 2] if rank == 0 else [1, 3]
    err = error_of(lambda: dist.all_to_all_single(out, inp, output_split_sizes=[2, 2], input_split_sizes=splits))
    return err


def test_all_to_all_split_disagreement_fails_everywhere():
    res = run_ranks(alltoall_split_disagreement, 2, timeout=60)
    for err in res.values():
        assert err and "split sizes disagree" in err and "rank 1 sends 1 elements to rank 0" in err, err


def missing_peer(rank, world):
    if rank == world - 1:
        time.sleep(4)  # never joins collective #2 in time
        return error_of(lambda: dist.all_reduce(torch.ones(2)))
    t0 = time.monotonic()
    err = error_of(lambda: dist.all_reduce(torch.ones(2)))
    return err, time.monotonic() - t0


def test_missing_peer_times_out_naming_rank_and_sequence():
    res = run_ranks(missing_peer, 3, timeout=60, pg_timeout=1.5)
    for rank in (0, 1):
        err, took = res[rank]
        assert err and "PeerTimeoutError" in err, err
        assert "rank 2 never arrived" in err and "all_reduce #1" in err, err
        assert "it has not entered any collective of this group" in err, err
        assert 1.4 < took < 3.5, took
    late = res[2]
    assert late and ("GroupAbortedError" in late or "PeerTimeoutError" in late), late


def peer_late_after_one_call(rank, world):
    t = torch.ones(2)
    dist.broadcast(t, 0)  # #1, on every rank
    if rank == world - 1:
        time.sleep(4)  # never joins #2 in time
        return error_of(lambda: dist.all_reduce(t))
    return error_of(lambda: dist.all_reduce(t))


def test_a_timeout_names_what_the_late_rank_last_called():
    """The late rank's last call is read back from the descriptor it posted (its head, in
    the step counter's line, decoded): the error names it."""
    res = run_ranks(peer_late_after_one_call, 3, timeout=60, pg_timeout=1.5)
    for rank in (0, 1):
        err = res[rank]
        assert err and "PeerTimeoutError" in err, err
        assert ("rank 2 never arrived (its last collective was #1 "
                "broadcast(float32, 2 elements, root=0))") in err, err


# docs/operations.md: a dead peer is reported within 1 s of its death (waits look at
# peers' pids every 0.2 s, transport/shm/channel.py's LIVENESS_PERIOD). Measured from the SIGKILL to each survivor's error on the 2-core machine
# this was written on (shared with other engineers' test runs), 10 runs x 2 survivors
# each: idle 0.123-0.134 s; with 2 busy loops competing 0.127-0.193 s; with 4, 0.125-0.177 s.
# 1 s is 5x the worst of those 60 and still fails if the pid watch slows to a second or
# stops (the next thing to notice the death would be the 60 s group timeout).
KILL_DETECTION_BOUND = 1.0


def killed_peer(rank, world, killed_at):
    if rank == 1:
        time.sleep(0.3)  # the others are waiting in the all_reduce by now
        with open(killed_at, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    err = error_of(lambda: dist.all_reduce(torch.ones(1000)))
    return err, time.time()


def test_sigkilled_peer_is_reported_quickly_and_nothing_leaks(tmp_path):
    killed_at = str(tmp_path / "killed_at")
    pids = {}
    res = run_ranks(killed_peer, 3, killed_at, timeout=60, pg_timeout=60, expect_errors=True,
                    hooks=lambda procs: pids.update(enumerate(p.pid for p in procs)))
    assert res[1][0] == "error" and res[1][1] == "Died"
    with open(killed_at) as f:
        t_kill = float(f.read())
    for rank in (0, 2):
        status, (err, t_err) = res[rank]
        assert status == "ok"
        assert err and "PeerDiedError" in err, err
        assert f"rank 1 (pid {pids[1]}) died" in err, err
        took = t_err - t_kill
        assert took < KILL_DETECTION_BOUND, f"rank {rank} heard of the death after {took:.2f} s"
    # nothing of the job's shared memory is left (names carry the creator's pid)
    left = [n for n in os.listdir(os.environ.get("NEURON_DIST_SHM_DIR", "/dev/shm"))
            if any(n.startswith(f"neuron-{os.getuid()}-{pid}-") for pid in pids.values())]
    assert not left, left


def bad_arguments(rank, world):
    checks = {
        "out size": lambda: dist.all_gather_into_tensor(torch.empty(3), torch.ones(2)),
        "dtype": lambda: dist.all_gather_into_tensor(torch.empty(2 * world, dtype=torch.int32), torch.ones(2)),
        "root range": lambda: dist.broadcast(torch.ones(2), src=world + 5),
        "rs size": lambda: dist.reduce_scatter_tensor(torch.empty(3), torch.ones(2 * world)),
        "a2a splits": lambda: dist.all_to_all_single(torch.empty(4), torch.ones(4), [1, 1], [3, 3]),
        "band float": lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND),
        "avg bool": lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool), op=dist.ReduceOp.AVG),
        "list len": lambda: dist.all_gather([torch.empty(2)], torch.ones(2)),
        "not tensor": lambda: dist.all_reduce([1, 2]),
    }
    errs = {name: error_of(fn) for name, fn in checks.items()}
    t = torch.ones(2)
    dist.all_reduce(t)  # nothing was sent: the group is still aligned
    return errs, t.tolist()


def test_bad_arguments_raise_locally_and_leave_the_group_usable():
    res = run_ranks(bad_arguments, 2, timeout=60)
    for errs, after in res.values():
        missing = [k for k, v in errs.items() if not v]
        assert not missing, errs
        assert after == [2.0, 2.0]
        assert "expected" in errs["out size"] and "dtypes differ" in errs["dtype"], errs
        assert "out of range" in errs["root range"] or "Invalid" in errs["root range"], errs


def work_api_errors(rank, world):
    w = dist.all_reduce(torch.ones(2), async_op=True)
    assert w.wait() is True
    assert w.is_completed() and w.is_success() and w.exception() is None
    fut = w.get_future()
    assert fut.wait()[0].tolist() == [float(world)] * 2
    # a failing async op surfaces through wait, exception() and the future
    if rank == 0:
        w = dist.all_reduce(torch.ones(2), async_op=True)
    else:
        w = dist.all_reduce(torch.ones(3), async_op=True)
    err = error_of(w.wait)
    return err, w.is_completed(), w.is_success(), w.exception() is not None, error_of(w.get_future().wait) is not None


def test_async_failure_surfaces_everywhere():
    res = run_ranks(work_api_errors, 2, timeout=60)
    for err, done, ok, has_exc, fut_err in res.values():
        assert err and "mismatch" in err and done and not ok and has_exc and fut_err


def destroyed_while_pending(rank, world):
    if rank == 0:
        w = dist.all_reduce(torch.ones(2), async_op=True)  # rank 1 never joins
        time.sleep(0.5)
        dist.destroy_process_group()
        err = error_of(w.wait)
        return err
    time.sleep(1.0)
    return None


def test_destroy_unblocks_pending_work():
    res = run_ranks(destroyed_while_pending, 2, timeout=60, pg_timeout=30)
    assert res[0] and ("GroupAbortedError" in res[0] or "destroyed" in res[0]), res[0]


def stopped_peer(rank, world, victim):
    time.sleep(1.0)  # the victim is SIGSTOPped meanwhile
    t0 = time.monotonic()
    err = error_of(lambda: dist.all_reduce(torch.ones(1000)))
    return err, time.monotonic() - t0


def _stop_then_kill(victim, timeout):
    def hook(procs):
        import threading

        def act():
            time.sleep(0.5)
            os.kill(procs[victim].pid, signal.SIGSTOP)
            time.sleep(timeout)
            os.kill(procs[victim].pid, signal.SIGKILL)
        threading.Thread(target=act, daemon=True).start()
    return hook


@pytest.mark.parametrize("nodes", [1, 2], ids=["one-node", "two-nodes"])
def test_sigstopped_peer_is_reported_as_stalled_by_the_timeout(nodes):
    world, victim, pg_timeout = 4, 2, 2.0
    env = (lambda r: {"NEURON_DIST_NODE_NAME": "ab"[r // 2]}) if nodes == 2 else None
    res = run_ranks(stopped_peer, world, victim, timeout=60, pg_timeout=pg_timeout, env=env,
                    expect_errors=True, hooks=_stop_then_kill(victim, pg_timeout + 8))
    for rank in range(world):
        if rank == victim:
            continue
        status, (err, took) = res[rank]
        assert status == "ok" and err and "PeerTimeoutError" in err, (rank, err)
        assert "rank 2 " in err, (rank, err)
        assert took < pg_timeout + 3, (rank, took)
