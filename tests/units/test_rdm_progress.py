"""The rdm progress engine's wait (transport/rdm/progress.py, "Waiting"): a waiting thread
polls without sleeping first, yields, and only then sleeps in epoll; a background thread,
and a waiter that may not spin (ranks outnumber cores), sleeps at once. The engine's real
``poll`` is replaced by one that records its timeouts."""

from __future__ import annotations

import threading
import time

import pytest

from neuron_dist.transport.rdm import progress
from neuron_dist.transport.backoff import set_background_thread


@pytest.fixture
def engine():
    eng = progress.Progress()
    me = threading.get_ident()
    polls = []  # (seconds since the first poll, timeout) of the test's own thread

    def poll(timeout, done=None):
        if threading.get_ident() in eng.recorded:
            polls.append((time.monotonic(), timeout))
        if timeout > 0:
            time.sleep(min(timeout, 0.001))

    eng.recorded = {me}
    eng.poll = poll
    eng.polls = polls
    yield eng
    eng._shutdown()


def test_a_waiter_polls_without_sleeping_while_its_request_is_about_to_complete(engine):
    deadline = time.monotonic() + 5.0
    assert engine.drive(lambda: len(engine.polls) >= 20, deadline, spin=500)
    assert [t for _, t in engine.polls] == [0.0] * 20


def test_a_waiter_sleeps_in_epoll_only_after_polling_and_yielding(engine):
    start = time.monotonic()
    done = lambda: any(t > 0 for _, t in engine.polls) and len(engine.polls) > 3  # noqa: E731
    assert engine.drive(done, start + 5.0, spin=500)
    first_sleep = next(i for i, (_, t) in enumerate(engine.polls) if t > 0)
    assert first_sleep > 0
    assert all(t == 0.0 for _, t in engine.polls[:first_sleep])
    assert engine.polls[first_sleep][0] - start >= progress._YIELD_SECONDS
    assert all(t > 0 for _, t in engine.polls[first_sleep:])  # and it stays asleep


def test_without_spinning_a_waiter_sleeps_in_epoll_at_once(engine):
    """spin 0: ranks outnumber the cores they share (rendezvous._spin), where a yield only
    hands the core to another rank and takes it back, a poll's CPU each turn."""
    start = time.monotonic()
    done = lambda: len(engine.polls) >= 3  # noqa: E731
    assert engine.drive(done, start + 5.0, spin=0)
    assert all(t > 0 for _, t in engine.polls), engine.polls
    assert engine.drive(lambda: True, start + 5.0, spin=0)  # (done at once: no poll at all)
    assert len(engine.polls) == 3


def test_a_background_thread_sleeps_in_epoll_at_once(engine):
    result = []

    def background():
        set_background_thread()
        engine.recorded.add(threading.get_ident())
        result.append(engine.drive(lambda: len(engine.polls) >= 2, time.monotonic() + 5.0,
                                   spin=500))

    t = threading.Thread(target=background)
    t.start()
    t.join(10)
    assert result == [True]
    assert all(timeout > 0 for _, timeout in engine.polls)


def test_the_deadline_ends_a_wait_in_any_phase(engine):
    start = time.monotonic()
    assert not engine.drive(lambda: False, start + 0.0002, spin=500)  # while polling
    assert not engine.drive(lambda: False, time.monotonic() + 0.05, spin=500)  # asleep
    assert time.monotonic() - start < 2.0


def test_shutdown_never_closes_epoll_under_a_polling_thread():
    """Finding: ``Progress._shutdown`` closed epoll without holding ``_poll``: a thread
    waiting in ``drive`` then polled a closed epoll and raised."""
    eng = progress.Progress()
    errors = []

    def wait():
        try:
            eng.drive(lambda: False, time.monotonic() + 1.0)
        except Exception as e:  # noqa: BLE001 - what the test looks for
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.2)  # (it polls, in epoll by now)
    eng._shutdown()
    t.join(5)
    assert not t.is_alive()
    assert not errors, errors
