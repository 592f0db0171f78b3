"""neuron_dist.shrink_group: survivors of a SIGKILLed rank agree, shrink and carry on.

Each test forks its ranks (tests/helpers/harness.py) on one node or on two "nodes" over
loopback (NEURON_DIST_NODE_NAME), so the survivors' groups use shared memory, the rdm transport, or
both. The two-network-namespace case runs in tests/across_nodes/test_recovery.py (the main
job).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import neuron_dist
from helpers.harness import run_ranks

ONE_NODE = None
TWO_NODES = {0: "a", 1: "b", 2: "a", 3: "b"}  # rank -> node name


def _env(layout):
    if layout is None:
        return {}
    return lambda r: {"NEURON_DIST_NODE_NAME": f"shrink-{layout[r]}"}


def _close_wait_sockets() -> int:
    """Sockets of this process whose peer has closed (TCP CLOSE_WAIT) and we have not."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "08" and fields[9] in inodes:
                    count += 1
    return count


def _die_then_shrink(rank, world, victim):
    backend = dist.group.WORLD
    t = torch.ones(8)
    dist.all_reduce(t)
    key = backend.record.key
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(t)
        return "the collective with a dead peer did not fail"
    except neuron_dist.PeerDiedError as exc:
        report, message = list(exc.ranks), str(exc)
    started = time.monotonic()
    new = neuron_dist.shrink_group(report)
    seconds = time.monotonic() - started
    assert new is dist.group.WORLD and dist.get_world_size() == world - 1
    t = torch.full((8,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    pair = dist.new_group([0, 1])  # later groups use the new ranks
    u = torch.ones(3)
    if dist.get_rank() < 2:
        dist.all_reduce(u, group=pair)
    dist.barrier()
    old_keys_left = backend.record.store.check([f"{key}/node/{victim}"])
    return dict(report=report, message=message, rank=dist.get_rank(), sum=t[0].item(),
                pair=u[0].item(), seconds=seconds, old_keys_left=old_keys_left,
                close_wait=_close_wait_sockets())


@pytest.mark.parametrize("layout", [ONE_NODE, TWO_NODES], ids=["one_node", "two_nodes"])
def test_survivors_shrink_the_default_group_after_a_sigkill(layout):
    world, victim = 4, 2
    res = run_ranks(_die_then_shrink, world, victim, env=_env(layout), expect_errors=True,
                    timeout=90, pg_timeout=20)
    assert res[victim][:2] == ("error", "Died"), res[victim]
    survivors = {r: v[1] for r, v in res.items() if r != victim}
    assert all(v[0] == "ok" for r, v in res.items() if r != victim), res
    # the error names the dead rank on the ranks that saw it die themselves
    seen = [r for r, v in survivors.items() if v["report"]]
    assert seen and all(survivors[r]["report"] == [victim] for r in seen), survivors
    assert all(f"rank {victim}" in v["message"] for v in survivors.values()), survivors
    # renumbered in the old order; every survivor takes part in the new world's collectives
    assert [survivors[r]["rank"] for r in (0, 1, 3)] == [0, 1, 2]
    assert all(v["sum"] == 6.0 and v["old_keys_left"] is False for v in survivors.values())
    assert all(v["pair"] == 2.0 for v in survivors.values() if v["rank"] < 2)
    assert all(v["close_wait"] == 0 for v in survivors.values()), survivors
    assert max(v["seconds"] for v in survivors.values()) < 5, survivors


def _two_die_each_survivor_reports_one(rank, world):
    dist.all_reduce(torch.ones(2))
    if rank >= 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)  # both are dead now
    # each survivor only knows of one death: the group excludes the union
    new = neuron_dist.shrink_group([2 + rank])
    t = torch.ones(2)
    dist.all_reduce(t)
    return new.size(), t[0].item()


def test_survivors_may_report_different_ranks_the_group_excludes_the_union():
    res = run_ranks(_two_die_each_survivor_reports_one, 4, expect_errors=True, timeout=60,
                    pg_timeout=20)
    assert [res[r] for r in (0, 1)] == [("ok", (2, 2.0))] * 2, res


def _slow_rank(rank, world):
    if rank == 2:
        time.sleep(4)  # alive, but not in shrink_group
        return "slept"
    try:
        neuron_dist.shrink_group([], timeout=__import__("datetime").timedelta(seconds=1.5))
    except neuron_dist.PeerTimeoutError as exc:
        return str(exc)
    return "shrank without rank 2"


def test_a_slow_rank_is_not_split_off_silently():
    res = run_ranks(_slow_rank, 3, expect_errors=True, timeout=60, pg_timeout=20)
    for r in (0, 1):
        assert res[r][0] == "ok" and "rank(s) [2] neither joined" in res[r][1], res


def _alive_but_excluded(rank, world):
    if rank == 2:
        time.sleep(1.5)  # meanwhile the others exclude it
        t = torch.ones(2)
        try:
            dist.all_reduce(t)
            old = "old group still usable"
        except neuron_dist.NeuronDistError as exc:
            old = f"{type(exc).__name__}: {exc}"
        try:
            neuron_dist.shrink_group([])
            mine = "not excluded"
        except neuron_dist.ExcludedError as exc:
            mine = str(exc)
        dist.destroy_process_group()
        return old, mine
    neuron_dist.shrink_group([2])
    t = torch.ones(2)
    dist.all_reduce(t)
    return t[0].item()


def test_an_excluded_rank_that_is_alive_is_fenced_off():
    res = run_ranks(_alive_but_excluded, 3, expect_errors=True, timeout=60, pg_timeout=20)
    assert res[0] == res[1] == ("ok", 2.0), res
    old, mine = res[2][1]
    assert "GroupAbortedError" in old and "shrunk to its ranks [0, 1]" in old, old
    assert "was excluded from the group by rank(s) [0, 1]" in mine, mine


def _subgroup(rank, world):
    sub = dist.new_group([1, 2, 3])
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        return None
    try:
        dist.all_reduce(torch.ones(2), group=sub)
    except neuron_dist.PeerDiedError as exc:
        report = list(exc.ranks)
    new = neuron_dist.shrink_group(report, group=sub)
    t = torch.ones(2)
    dist.all_reduce(t, group=new)
    return (dist.get_process_group_ranks(new), new.rank(), dist.get_rank(), t[0].item(),
            dist.group.WORLD.size())


def test_shrinking_a_subgroup_keeps_the_default_group_and_global_ranks():
    res = run_ranks(_subgroup, 4, expect_errors=True, timeout=60, pg_timeout=20)
    assert res[1] == ("ok", ([1, 2], 0, 1, 2.0, 4)), res
    assert res[2] == ("ok", ([1, 2], 1, 2, 2.0, 4)), res


def _torch_shrink(rank, world):
    try:
        dist.shrink_group([1])
        refused = None
    except TypeError as exc:
        refused = str(exc)
    t = torch.ones(2)
    dist.all_reduce(t)  # refused up front: the group is intact
    return refused, t[0].item()


def test_torch_shrink_group_refuses_neuron_up_front_and_leaves_the_group_intact():
    res = run_ranks(_torch_shrink, 2, timeout=60)
    for refused, total in res.values():
        assert "does not support shrinking" in refused and total == 2.0
