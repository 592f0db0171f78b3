"""Send/recv between ranks of one node in a group that spans nodes goes through shared
memory, and a receive from any rank takes each message exactly once from either path.

Two virtual nodes of two ranks (``NEURON_DIST_NODE_NAME``: ranks 0, 1 on "a", 2, 3 on "b")
on loopback; the world group spans both.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from helpers.harness import run_ranks

def _env(rank):
    return {"NEURON_DIST_NODE_NAME": "ab"[rank // 2]}


def _pg():
    return dist.group.WORLD._get_backend(torch.device("cpu"))


def same_node_pairs(rank, world):
    """0 <-> 1 and 2 <-> 3 (same node) exchange messages from 8 bytes to more than a ring
    holds, contiguous or not, then 0 <-> 2 (across); same-node traffic opens no connection."""
    peer = rank ^ 1
    fails = []
    for i, n in enumerate([2, 16_384, 3_000_000]):  # 8 B, 64 KiB, 12 MB (> the 4 MiB ring)
        out = torch.arange(n, dtype=torch.float32) + 1000 * rank
        got = torch.empty(n)
        works = [dist.isend(out, peer, tag=i), dist.irecv(got, peer, tag=i)]
        for w in works:
            w.wait()
        if not torch.equal(got, torch.arange(n, dtype=torch.float32) + 1000 * peer):
            fails.append(f"{n} elements from {peer}")
    cols = torch.arange(600, dtype=torch.float32).view(20, 30).t()  # non-contiguous both ways
    got = torch.empty(20, 30).t()
    if rank % 2 == 0:
        dist.send(cols + rank, peer, tag=9)
        dist.recv(got, peer, tag=9)
    else:
        dist.recv(got, peer, tag=9)
        dist.send(cols + rank, peer, tag=9)
    if not torch.equal(got, cols + peer):
        fails.append("non-contiguous")
    pg = _pg()
    if getattr(pg._net, "_rails", {}).get(peer):
        fails.append(f"a network connection to rank {peer} on this node")
    if pg._p2p._shm is None:
        fails.append("shared memory was not used")
    across = (rank + 2) % world
    got = torch.empty(5)
    works = [dist.isend(torch.full((5,), float(rank)), across, tag=11),
             dist.irecv(got, across, tag=11)]
    for w in works:
        w.wait()
    if not torch.equal(got, torch.full((5,), float(across))):
        fails.append("across nodes")
    return fails


def test_ranks_of_one_node_exchange_through_shared_memory():
    res = run_ranks(same_node_pairs, 4, env=_env, timeout=120)
    assert res == {r: [] for r in range(4)}, res


@pytest.mark.timeout(120)
def test_a_receive_from_any_rank_takes_each_message_once_from_either_path():
    res = run_ranks(any_source_from_both_paths, 4, env=_env, timeout=100)
    assert res == {r: [] for r in range(4)}, res


def any_source_from_both_paths(rank, world):
    """Rank 0 posts 2 x N receives from any rank at once; rank 1 (its node: shared memory)
    and rank 2 (the other node: the network) each send N messages at once. Every message
    must be taken exactly once, each source's in the order it sent them, with the right
    source reported; then blocking receives from any rank, one message from each node."""
    n = 40
    size = 4096  # 16 KiB
    if rank == 0:
        bufs = [torch.full((size,), -1.0) for _ in range(2 * n)]
        works = [dist.irecv(b, tag=7) for b in bufs]
        got = []
        for w, b in zip(works, bufs):
            w.wait()
            got.append((w._source_rank(), int(b[0].item()), int(b[1].item())))
        fails = []
        for src in (1, 2):
            seq = [i for s, _, i in got if s == src]
            if seq != list(range(n)):
                fails.append(f"from rank {src}: {seq}")
        if any(s != s2 for s, s2, _ in got):
            fails.append(f"wrong source reported: {got}")
        # and blocking ones, one message from each node
        for _ in range(2):
            b = torch.empty(3)
            src = dist.recv(b, tag=8)
            if b[0].item() != src:
                fails.append(f"blocking receive: {src} {b}")
        return fails
    if rank in (1, 2):
        works = []
        for i in range(n):
            t = torch.zeros(size)
            t[0], t[1] = rank, i
            works.append(dist.isend(t, 0, tag=7))
        for w in works:
            w.wait()
        dist.send(torch.full((3,), float(rank)), 0, tag=8)
    return []


def withdrawn_any_source(rank, world):
    """A receive from any rank that times out takes nothing: the messages sent afterwards
    (one from each node) reach the receives posted for them."""
    short = dist.new_group(list(range(world)), timeout=timedelta(seconds=1.5))
    out = []
    if rank == 0:
        try:
            dist.recv(torch.empty(4), tag=3, group=short)
            out.append("no time-out")
        except Exception as e:  # noqa: BLE001
            if "Timed out" not in str(e):
                out.append(f"{type(e).__name__}: {e}")
    dist.barrier()  # (the world group: 30 s)
    if rank in (1, 2):
        dist.send(torch.full((4,), float(rank)), 0, tag=3, group=short)
    if rank == 0:
        for src in (1, 2):
            b = torch.empty(4)
            dist.recv(b, src, tag=3, group=short)
            if not torch.equal(b, torch.full((4,), float(src))):
                out.append(f"from {src}: {b}")
    dist.barrier()
    return out


def test_a_receive_from_any_rank_that_timed_out_takes_nothing():
    res = run_ranks(withdrawn_any_source, 4, env=_env, timeout=100)
    assert res == {r: [] for r in range(4)}, res


def size_mismatch_names_group_ranks(rank, world):
    if rank == 2:
        dist.send(torch.ones(8), 3, tag=4)
    if rank == 3:
        try:
            dist.recv(torch.empty(4), 2, tag=4)
        except Exception as e:  # noqa: BLE001
            return str(e)
        return "no error"
    return ""


def test_a_size_mismatch_between_ranks_of_one_node_names_their_group_ranks():
    res = run_ranks(size_mismatch_names_group_ranks, 4, env=_env, timeout=100)
    assert "recv from rank 2" in res[3] and "rank 2 sent 32 bytes" in res[3], res[3]


def this_node_leaves(rank, world):
    """Rank 0's other rank on its node finishes at once, without sending; a receive from any
    rank must still get the message that a rank of the other node sends later (that no
    rank of this node is left is no reason to fail while the network may deliver)."""
    import time
    if rank in (1, 3):
        return "gone"
    if rank == 2:
        time.sleep(1.5)  # rank 1 has left by now
        dist.send(torch.full((3,), 2.0), 0, tag=4)
        return "sent"
    got = torch.empty(3)
    try:
        src = dist.recv(got, tag=4)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "ok" if src == 2 and torch.equal(got, torch.full((3,), 2.0)) else f"{got} from {src}"


def test_a_receive_from_any_rank_outlives_this_nodes_other_ranks():
    res = run_ranks(this_node_leaves, 4, env=_env, timeout=100)
    assert res == {0: "ok", 1: "gone", 2: "sent", 3: "gone"}, res
