"""The fake step channel (helpers/fake_channel.py) catches what a real channel may hide.

The algorithm tests (test_algorithms.py) are only as strict as the channel under them:
here, deliberately wrong "algorithms" must fail the run, naming the rank and the step.
"""

from __future__ import annotations

import time

import pytest
import torch

from neuron_dist.transport.errors import PeerTimeout

from helpers.fake_channel import FakeChannelError, FakeGroup


def test_ranks_exchange_their_slots_step_by_step():
    def body(ch):
        seen = []
        for i in range(4):  # more steps than slots: double buffering
            ch.my_slot(torch.int64)[0] = 10 * i + ch.rank
            ch.step(time.monotonic() + 10)
            seen.append([int(ch.peer_slot(k, torch.int64)[0]) for k in range(ch.size)])
        return seen

    results = FakeGroup(3, 64).run(body)
    assert results == [[[10 * i + k for k in range(3)] for i in range(4)]] * 3


def test_a_slot_not_staged_this_step_reads_as_garbage():
    def body(ch):
        ch.my_slot(torch.float32)[0] = 1.0
        ch.step(time.monotonic() + 10)
        ch.step(time.monotonic() + 10)  # stages nothing
        ch.step(time.monotonic() + 10)  # the slot of the first step again, unstaged
        return ch.peer_slot(1 - ch.rank, torch.float32)[0].item()

    assert all(v != v for v in FakeGroup(2, 64).run(body))  # NaN, not the stale 1.0


def test_writing_a_slot_peers_may_still_read_fails():
    def body(ch):
        slot = ch.my_slot()
        slot.fill_(1)
        ch.step(time.monotonic() + 10)
        if ch.rank == 0:
            slot.fill_(2)  # a view kept from before the step: peers may be reading it
        ch.step(time.monotonic() + 10)

    with pytest.raises(FakeChannelError, match="rank 0's slot of step 1 was written"):
        FakeGroup(2, 64).run(body)


def test_a_rank_taking_fewer_steps_fails_its_peers_at_once():
    def body(ch):
        for _ in range(1 if ch.rank == 1 else 2):
            ch.step(time.monotonic() + 30)

    started = time.monotonic()
    with pytest.raises(FakeChannelError, match="waits for step 2, but rank 1 returned"):
        FakeGroup(3, 64).run(body)
    assert time.monotonic() - started < 5


def test_a_late_rank_makes_its_peers_time_out_naming_it():
    def body(ch):
        if ch.rank == 2:  # arrives only once the others have given up
            until = time.monotonic() + 20
            while len(ch.group.gone) < 2 and time.monotonic() < until:
                time.sleep(0.01)
        ch.step(time.monotonic() + 0.1)

    with pytest.raises(PeerTimeout) as info:
        FakeGroup(3, 64).run(body)
    assert info.value.ranks == [2]


def test_reading_a_peers_memory_needs_cma():
    def body(ch):
        buf = torch.zeros(4, dtype=torch.uint8)
        ch.read_peer(1 - ch.rank, buf.data_ptr(), buf.data_ptr(), 4)

    with pytest.raises(FakeChannelError, match="without cma"):
        FakeGroup(2, 64).run(body)
