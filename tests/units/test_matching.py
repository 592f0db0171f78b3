"""transport/matching.py through fakes: which posted receive a message takes, in what order,
how receives leave the queues, and which kept (unexpected) message a receive takes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from neuron_dist.transport.errors import Claimed
from neuron_dist.transport.matching import PostedReceives, Unexpected


class Recv:
    """A fake posted receive: its tag, an optional claim, and how it ended."""

    def __init__(self, name: str, tag: int = 7, claim=None):
        self.name, self.tag, self.claim = name, tag, claim
        self.ended: list[Exception | None] = []

    def finish(self, error: Exception | None = None) -> None:
        self.ended.append(error)

    def __repr__(self) -> str:
        return self.name


def test_named_receives_match_their_stream_in_post_order():
    p: PostedReceives[Recv] = PostedReceives()
    a1, a2, b1 = Recv("a1"), Recv("a2"), Recv("b1")
    p.post(a1, 1, 7)
    p.post(b1, 2, 7)
    p.post(a2, 1, 7)
    assert p.next_for(2, 7) is b1
    assert p.next_for(1, 7) is a1
    assert p.next_for(1, 7) is a2
    assert p.next_for(1, 7) is None and not p and len(p) == 0
    assert p.named == {}  # (emptied queues are dropped)


def test_tags_are_separate_streams():
    p: PostedReceives[Recv] = PostedReceives()
    x, y = Recv("x", tag=1), Recv("y", tag=2)
    p.post(x, 0, 1)
    p.post(y, 0, 2)
    assert p.next_for(0, 2) is y and p.next_for(0, 2) is None
    assert p.next_for(0, 1) is x


def test_a_named_receive_goes_before_an_older_receive_from_any_rank():
    p: PostedReceives[Recv] = PostedReceives()
    anyone, named = Recv("any"), Recv("named")
    p.post_any(anyone, 7)
    p.post(named, 3, 7)
    assert p.next_for(3, 7) is named  # the source's own receive first
    assert p.next_for(4, 7) is anyone  # a source nobody named: the oldest from any rank
    assert p.next_for(3, 7) is None


def test_receives_from_any_rank_take_messages_in_post_order_per_tag():
    p: PostedReceives[Recv] = PostedReceives()
    r = [Recv(f"r{k}", tag=7 if k % 2 else 8) for k in range(4)]
    for req in r:
        p.post_any(req, req.tag)
    assert [p.next_for(0, 7), p.next_for(5, 8), p.next_for(1, 7), p.next_for(2, 8)] == \
        [r[1], r[0], r[3], r[2]]
    assert p.any == {} and p.next_any(7) is None


def test_a_receive_whose_claim_fails_ends_claimed_and_the_message_goes_on():
    p: PostedReceives[Recv] = PostedReceives()
    calls = []
    lost = Recv("lost", claim=lambda: calls.append("lost") or False)
    won = Recv("won", claim=lambda: calls.append("won") or True)
    plain = Recv("plain")
    for req in (lost, won, plain):
        p.post_any(req, 7)
    assert p.next_any(7) is won
    assert calls == ["lost", "won"]
    assert len(lost.ended) == 1 and isinstance(lost.ended[0], Claimed)
    assert won.ended == [] and p.next_any(7) is plain and plain.ended == []


def test_claims_that_all_fail_leave_no_receive_and_no_queue():
    p: PostedReceives[Recv] = PostedReceives()
    reqs = [Recv(f"c{k}", claim=lambda: False) for k in range(3)]
    for req in reqs:
        p.post_any(req, 7)
    assert p.next_for(1, 7) is None
    assert all(isinstance(r.ended[0], Claimed) for r in reqs) and p.any == {}


@pytest.mark.parametrize("named", [True, False])
def test_withdraw_takes_a_receive_out_once(named):
    p: PostedReceives[Recv] = PostedReceives()
    first, second = Recv("first"), Recv("second")
    for req in (first, second):
        p.post(req, 2, 7) if named else p.post_any(req, 7)
    src = 2 if named else None
    assert p.withdraw(first, src)
    assert not p.withdraw(first, src)  # (gone: matched or withdrawn already)
    assert p.next_for(2, 7) is second
    assert not p.withdraw(second, src) and not p
    assert first.ended == second.ended == []  # (the transport ends them, not the queues)


def test_withdraw_looks_only_where_the_receive_was_posted():
    p: PostedReceives[Recv] = PostedReceives()
    req = Recv("r")
    p.post(req, 2, 7)
    assert not p.withdraw(req, None) and not p.withdraw(req, 3)
    assert p.withdraw(req, 2)


def test_take_peer_takes_only_that_peers_named_receives():
    p: PostedReceives[Recv] = PostedReceives()
    a, b, c, anyone = Recv("a", tag=1), Recv("b", tag=2), Recv("c", tag=1), Recv("any")
    p.post(a, 4, 1)
    p.post(b, 4, 2)
    p.post(c, 5, 1)
    p.post_any(anyone, 7)
    assert p.waits_for(4)
    assert sorted(p.take_peer(4), key=repr) == [a, b]
    assert not p.waits_for(4) and p.waits_for(5)
    assert p.take_any() == [anyone] and p.take_all() == [c]
    assert not p and p.take_all() == []


def test_an_emptied_queue_left_by_a_hot_path_counts_as_nothing():
    p: PostedReceives[Recv] = PostedReceives()
    req = Recv("r")
    p.post(req, 1, 7).popleft()  # (the rdm transport completes a whole message so)
    assert (1, 7) in p.named and not p and len(p) == 0 and not p.waits_for(1)
    assert list(p) == [] and p.next_for(1, 7) is None


def test_iteration_sees_every_posted_receive():
    p: PostedReceives[Recv] = PostedReceives()
    reqs = [Recv("n1"), Recv("n2"), Recv("a1")]
    p.post(reqs[0], 1, 7)
    p.post(reqs[1], 2, 9)
    p.post_any(reqs[2], 7)
    assert sorted(p, key=repr) == sorted(reqs, key=repr) and len(p) == 3


# ---------------------------------------------------------------------- Unexpected


def test_a_named_receive_takes_the_oldest_kept_message_of_its_stream():
    u: Unexpected[str] = Unexpected()
    u.add(1, 7, "a1")
    u.add(2, 7, "b1")
    u.add(1, 7, "a2")
    u.add(1, 8, "a-other-tag")
    assert u.take(1, 7) == "a1"
    assert u.take(1, 7) == "a2"
    assert u.take(1, 7) is None
    assert u.take(2, 8) is None
    assert sorted(u) == ["a-other-tag", "b1"]


def test_a_receive_from_any_rank_takes_the_earliest_arrival_of_its_tag():
    u: Unexpected[str] = Unexpected()
    u.add(2, 7, "b1")
    u.add(1, 8, "a-other-tag")
    u.add(1, 7, "a1")
    u.add(2, 7, "b2")
    assert u.peek_any(7) == 2
    assert u.take_any(7) == (2, "b1")
    assert u.take_any(7) == (1, "a1")
    assert u.take_any(7) == (2, "b2")
    assert u.take_any(7) is None and u.peek_any(7) is None
    assert u.take_any(8) == (1, "a-other-tag")
    assert not u and u.kept == {}


def test_what_a_named_receive_took_is_not_taken_again_by_any():
    u: Unexpected[str] = Unexpected()
    u.add(1, 7, "a1")
    u.add(2, 7, "b1")
    u.add(1, 7, "a2")
    assert u.take(1, 7) == "a1"  # (its entry in the arrival order is now stale)
    assert u.take_any(7) == (2, "b1")
    assert u.take(1, 7) == "a2"
    assert u.peek_any(7) is None and not u
    assert u._arrived == {}  # (stale entries and emptied orders are dropped)


def test_what_named_receives_take_leaves_no_trace_behind():
    """Collectives take every message by name: the order kept for receives from any rank
    must not grow with the messages taken, even behind one message kept for ever."""
    u: Unexpected[int] = Unexpected()
    u.add(9, 7, -1)  # (never taken)
    for n in range(10_000):
        u.add(n % 3, 7, n)
        if n % 2:
            assert u.take((n - 1) % 3, 7) == n - 1
            assert u.take(n % 3, 7) == n
    assert len(u._arrived[7]) <= 2 * 1 + 9 and u._live == {7: 1}
    assert u.take_any(7) == (9, -1) and u._arrived == {} and u._live == {}


def test_the_messages_of_one_source():
    u: Unexpected[str] = Unexpected()
    u.add(1, 7, "a1")
    u.add(2, 7, "b1")
    u.add(1, 9, "a2")
    assert sorted(u.of(1)) == ["a1", "a2"] and u.of(3) == []
    assert len(list(u)) == 3  # (they stay kept)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "take", "any", "peek"]),
                          st.integers(0, 3), st.integers(0, 2)), max_size=80))
def test_unexpected_matches_the_arrival_order_model(ops):
    """Against the plainest model: one list in arrival order, scanned from the front."""
    u: Unexpected[int] = Unexpected()
    model: list[tuple[int, int, int]] = []  # (src, tag, message)
    for n, (op, src, tag) in enumerate(ops):
        if op == "add":
            u.add(src, tag, n)
            model.append((src, tag, n))
            continue
        hit = next((i for i, (s, t, _) in enumerate(model)
                    if t == tag and (op != "take" or s == src)), None)
        if op == "peek":
            assert u.peek_any(tag) == (None if hit is None else model[hit][0])
        elif op == "take":
            assert u.take(src, tag) == (None if hit is None else model.pop(hit)[2])
        else:
            want = None if hit is None else model.pop(hit)
            assert u.take_any(tag) == (None if want is None else (want[0], want[2]))
        assert sorted(u) == sorted(m for _, _, m in model)
        assert bool(u) == bool(model)
        live = {t: sum(1 for _, t2, _ in model if t2 == t) for _, t, _ in model}
        assert u._live == live and set(u._arrived) == set(live)
        assert all(len(order) <= 2 * live[t] + 9 for t, order in u._arrived.items())
