"""The invariants of deferral.py, one test each, on a real engine and a stand-in channel.

A call here is a function ``fn(seq, rec)`` that, run with its channel's ``defer_once``
set, raises ``StepDeferred`` as a call whose peer is behind does, and otherwise runs to
the end; the tests watch which thread runs what, in which order, and when. (The
``NetCall`` side of invariants 1 and 5, messages posted and withdrawn, is tested in
test_algorithms.py: ``test_a_net_call_not_said_deferrable_defers_before_posting_anything``,
``test_a_deferred_net_call_is_finished_from_what_its_first_run_posted``,
``test_a_deferred_call_that_will_not_be_finished_withdraws_its_messages_first``.)
"""

from __future__ import annotations

import threading
import time

import pytest

from neuron_dist import deferral
from neuron_dist.engine import CollectiveEngine
from neuron_dist.errors import GroupAbortedError
from neuron_dist.flight_recorder import recorder
from neuron_dist.transport.errors import StepDeferred
from neuron_dist.work import NeuronWork

pytestmark = pytest.mark.timeout(30)


class _Channel:
    """A ``Deferrable``: the flag, whether the peers have published, and what was withdrawn."""

    def __init__(self, published: bool = False):
        self.defer_once = False
        self.published = published
        self.withdrawn: list = []

    def peers_published(self) -> bool:
        return self.published

    def withdraw(self, error) -> None:
        self.withdrawn.append(error)


class _Call:
    """A call that defers its first run (``last``, ``resumes``: as ``StepDeferred``'s) and
    logs each run as (what, the name of the thread that ran it)."""

    def __init__(self, channel: _Channel, log: list, name: str, last: bool = True,
                 resumes: bool = False, algo: str = "tree", meanwhile=None):
        self.channel, self.log, self.name = channel, log, name
        self.last, self.resumes, self.algo = last, resumes, algo
        self.meanwhile = meanwhile  # called in the first run, before it defers

    def __call__(self, seq: int, rec) -> None:
        if rec is not None and rec.algo is None:
            rec.algo = self.algo
        if self.channel.defer_once:
            self.log.append((f"{self.name} first", threading.current_thread().name))
            if self.meanwhile is not None:
                self.meanwhile()
            raise StepDeferred(seq, last=self.last, resumes=self.resumes)
        self.log.append((f"{self.name} rest", threading.current_thread().name))


def _engine() -> CollectiveEngine:
    return CollectiveEngine("test", lambda exc, what: (exc, True))


def _until(condition, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def test_1_a_call_that_resumes_only_finishes_what_its_first_run_left():
    """``finish_deferred`` numbers every run; only a first run that deferred after posting
    everything is finished by ``resume``, and then nothing else of the call runs."""
    class NetCallLike:
        def __init__(self, deferred: bool):
            self.was_deferred, self.calls = deferred, []

        def again(self, seq, deadline):
            self.calls.append(("again", seq, deadline))

        def deferred(self):
            return self.was_deferred

        def resume(self):
            self.calls.append(("resume",))

    left = NetCallLike(deferred=True)
    assert deferral.finish_deferred(left, 7, 1.5)  # type: ignore[arg-type]
    assert left.calls == [("again", 7, 1.5), ("resume",)]
    fresh = NetCallLike(deferred=False)
    assert not deferral.finish_deferred(fresh, 8, 2.5)  # type: ignore[arg-type]
    assert fresh.calls == [("again", 8, 2.5)]


def test_2_a_deferred_call_runs_before_anything_its_group_issued_later():
    """Also what another thread issued while the first run was under way."""
    engine, channel, log = _engine(), _Channel(), []
    try:
        first = NeuronWork([], "first")
        meanwhile = NeuronWork([], "meanwhile")
        issue = threading.Thread(target=engine.submit, args=(
            lambda seq, rec: log.append(("b", "")), meanwhile, True, "b"))
        call = _Call(channel, log, "a", meanwhile=lambda: (issue.start(), issue.join(10)))
        assert engine.try_now(call, first, "a", channel)
        assert not first.finished and not channel.defer_once  # (the flag is cleared)
        later = NeuronWork([], "later")
        engine.submit(lambda seq, rec: log.append(("c", "")), later, True, "c")
        later.wait()
        assert [what for what, _ in log] == ["a first", "a rest", "b", "c"]
        assert first.finished and meanwhile.finished
    finally:
        engine.stop()


def test_3_the_rest_runs_once_in_the_thread_that_looks_first():
    engine, channel, log = _engine(), _Channel(), []
    try:
        work = NeuronWork([], "a")
        assert engine.try_now(_Call(channel, log, "a"), work, "a", channel)
        assert isinstance(work.op, deferral.Deferred)
        waiters = [threading.Thread(target=work.wait) for _ in range(4)]
        for w in waiters:
            w.start()
        work.wait()
        for w in waiters:
            w.join(10)
        rests = [t for what, t in log if what == "a rest"]
        assert len(rests) == 1, log
        assert not rests[0].startswith("neuron-engine"), rests  # a waiter ran it
    finally:
        engine.stop()


def test_4_a_call_of_more_steps_goes_on_by_itself_a_one_step_call_waits_to_be_looked_at():
    engine, log = _engine(), []
    try:
        more = _Channel()
        work = NeuronWork([], "more steps")
        assert engine.try_now(_Call(more, log, "more", last=False), work, "more", more)
        assert _until(lambda: work.finished), "the engine thread did not finish it"
        one = _Channel()
        alone = NeuronWork([], "one step")
        assert engine.try_now(_Call(one, log, "one", last=True), alone, "one", one)
        time.sleep(0.2)
        assert not alone.finished  # nobody looked: the peers need nothing more from us
        one.published = True  # the peers have published: looking finishes it here
        assert alone.is_completed()
        assert [what for what, _ in log] == ["more first", "more rest", "one first",
                                             "one rest"]
    finally:
        engine.stop()


def test_5_a_deferred_call_that_will_not_run_again_withdraws_before_its_work_fails():
    engine, channel, log = _engine(), _Channel(), []
    work = NeuronWork([], "a")
    seen = []
    withdraw = channel.withdraw

    def watched(error):
        seen.append(work.finished)
        withdraw(error)

    channel.withdraw = watched  # type: ignore[method-assign]
    assert engine.try_now(_Call(channel, log, "a"), work, "a", channel)
    engine.stop()
    assert seen == [False] and len(channel.withdrawn) == 1
    with pytest.raises(GroupAbortedError):
        work.wait()
    assert [what for what, _ in log] == ["a first"]  # never run again


@pytest.mark.parametrize("resumes", [False, True])
def test_6_the_record_names_the_algorithm_again_unless_the_call_resumes(monkeypatch, resumes):
    monkeypatch.setattr(recorder, "size", 8)
    engine, channel, log = _engine(), _Channel(), []
    try:
        work = NeuronWork([], "a")
        call = _Call(channel, log, "a", resumes=resumes, algo="first-run")
        assert engine.try_now(call, work, "a", channel)
        rec = recorder._ring[-1]
        assert rec.algo == ("first-run" if resumes else None)
        call.algo = "second-run"
        work.wait()
        assert rec.algo == ("first-run" if resumes else "second-run")
    finally:
        engine.stop()
