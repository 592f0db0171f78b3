"""The per-group collective-core engine: runs a group's collectives in issue order.

Every collective gets the group's next sequence number when it is issued (ranks must issue
a group's collectives in the same order, as with every c10d backend). Execution:

* async_op=True: the task is queued and the call returns at once; the engine's progress
  thread runs queued tasks one by one, so the caller's compute overlaps communication
  (data movement happens in torch kernels, which release the GIL).
* synchronous, with nothing queued or running: the caller runs the task itself ("inline",
  ``run_now``; the express lane calls it directly). Waking a thread costs 25-55 µs here,
  more than a whole small collective, so the inline path is what makes small synchronous
  collectives fast. Otherwise the task is queued behind the others and the caller waits.
* async_op=True, small, with the engine idle (``try_now``): the caller runs it at once
  with its ``Deferrable`` set to defer once; if a peer is behind, the call is *deferred*:
  put back at the head of the queue, its rest run by whoever looks at its Work first
  (deferral.py: which calls, and the invariants that hold it together). An async
  collective waited for soon after (funcol, DTensor) so costs no thread hand-off; one
  that is not waited for still overlaps, since the peers progress on what was
  published or posted.
* async_op=True with no core spare for the engine thread (``hold``: a one-node group of
  as many ranks as cores or more, rendezvous.py ``_hold``): the task is *held*: queued,
  and left to the caller for up to ``hold`` seconds (5 ms) after the last one was queued,
  unless it is the group's next and every peer has entered it already (in a one-node
  group, ``peers_published``). ``Work.wait`` runs it in the waiting thread;
  ``is_completed``, a future, a hook, a later collective of the group or the time limit
  (whichever comes first) has the engine thread start it (deferral.py's ``Held``). On a
  machine whose cores all compute, the engine thread could only take turns with the
  caller's compute on the same cores, and every step of a collective would wait for the
  peers' engine threads to be scheduled; held, the overlap costs nothing and hides all
  of a late peer's wait (docs/performance.md, "Overlap"; docs/design.md, "Thresholds
  and why"). The time limit keeps a program whose ranks wait for each other by other
  means (another group, a store) from stalling: the held collective starts on its own.
* A waiter on a queued collective runs the queue head itself when the engine thread has
  not started it (``run_for``).
* A ``Work.wait`` issued from the progress thread itself (a future callback that waits on a
  later collective) runs the queue inline instead of deadlocking.

A fatal failure (timeout, dead peer, abort) marks the engine broken: later tasks fail at
once with an error that names the original failure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from . import stats
from .collectives import one_thread
from .deferral import Deferred, Held
from .errors import GroupAbortedError
from .transport.errors import StepDeferred
from .flight_recorder import COMPLETED, Record, recorder

log = logging.getLogger("neuron_dist")
from .transport.backoff import set_background_thread

if TYPE_CHECKING:
    from .transport.base import Deferrable


class CollectiveEngine:
    """Issue-ordered executor of one group's collectives.

    Parameters
    ----------
    label : str
        Group label used in thread names and messages.
    on_error : callable
        ``on_error(exc, what) -> (error, fatal)`` turns a raw failure into the exception the
        user sees and says whether the group is unusable afterwards.
    """

    def __init__(self, label: str, on_error, group_name: str = "", rank: int = 0, size: int = 1,
                 hold: float = 0.0):
        self.label = label
        self.hold = hold  # seconds an async collective is left to its caller ("Held")
        self._due = 0.0  # the engine thread starts nothing queued before this time
        self._idle = False  # the engine thread waits with no time limit
        self.group_name = group_name
        self.rank = rank
        self.size = size
        self._on_error = on_error
        self._mutex = threading.Lock()  # taken directly by run_now: cheaper than the cv
        self._cv = threading.Condition(self._mutex)
        self._queue: deque = deque()
        self._busy = False
        self._thread = None
        self._stopped = False
        self.seq = 0
        self.broken = None

    def submit(self, fn, work, async_op: bool, name: str, call=None, nbytes: int = 0,
               peers_waiting=None) -> None:
        """Issue ``fn(seq, rec)`` as the group's next collective, completing ``work``.

        ``call`` (its descriptor) goes into the flight recorder, ``nbytes`` into the stats;
        ``rec`` is the call's flight-recorder record (or None), where ``fn`` names the
        algorithm it chose (``Context.chose``). ``peers_waiting()``, if given, tells
        whether every peer has entered the group's next collective: an async one that
        would be the next is then not held (the peers wait for it).
        """
        if not async_op and self.run_now(fn, work, name, call, nbytes):
            return
        stats.add_call(nbytes)
        with self._cv:
            if self._stopped:
                raise GroupAbortedError(f"{name} in group {self.label}: the group was destroyed")
            self.seq += 1
            work.what = (name, self.seq, self.label)
            rec = recorder.issue(self.group_name, self.rank, self.size, self.seq, name, call)
            work.engine = self
            self._queue.append((fn, work, self.seq, rec))
            held = async_op and self.hold and not (
                peers_waiting is not None and len(self._queue) == 1 and not self._busy
                and peers_waiting())
            if held:
                work.op = Held(self, work)
                self._due = time.monotonic() + self.hold
                if self._thread is not None and not self._idle:
                    return  # (it will see the new time limit before it starts anything)
        self._start_thread(now=not held)

    def run_now(self, fn, work, name: str, call=None, nbytes: int = 0, algo=None) -> bool:
        """Run ``fn(seq, rec)`` as the group's next collective now, in the caller's thread,
        if the engine is idle (nothing queued or running, not stopped): True once ``work``
        is complete; False, with nothing done, otherwise. ``algo``: the algorithm, when the
        caller knows it already (the express lane's plans).

        This is the small collectives' path (about 100k instructions per call in all), so it
        does ``_execute``'s work itself in the usual case (a healthy group, no DEBUG trace)
        and leaves the rare cases to ``_execute``.
        """
        with self._mutex:
            if self._busy or self._queue or self._stopped:
                return False
            self._busy = True
            self.seq = seq = self.seq + 1
        started = time.monotonic()
        # torch ops of the call run on this thread alone (one_thread.py); a call on fewer
        # bytes than torch's grain, in all, has no op that could go to its thread pool
        threads = one_thread.enter() if nbytes * self.size >= one_thread.GRAIN_BYTES else 0
        try:
            work.description = (name, seq, self.label)  # (NeuronWork.what formats it if read)
            rec = recorder.issue(self.group_name, self.rank, self.size, seq, name, call, True,
                                 algo)
            if self.broken is not None or log.isEnabledFor(logging.DEBUG):
                self._execute(fn, work, seq, rec, True)
            else:
                try:
                    fn(seq, rec)  # algorithms touch only detached tensors: no autograd involved
                except BaseException as exc:  # noqa: BLE001 - every failure must reach the Work
                    self.fail(exc, work, rec)
                else:
                    if rec is not None:  # (Record.finish, written out)
                        rec.state, rec.t_end = COMPLETED, time.time()
                    work.finished = True  # (NeuronWork.complete_unseen, written out: nobody saw it yet)
        finally:
            if threads:
                one_thread.leave(threads)
            # Not busy any more: a submitter that queued meanwhile found us busy and left
            # the waking to us. (Unlocked: _loop re-reads both under the lock before waiting.)
            self._busy = False
            if self._queue:
                with self._cv:
                    self._cv.notify_all()
            stats.add_call(nbytes, time.monotonic() - started)
        return True

    def try_now(self, fn, work, name: str, channel: Deferrable, call=None,
                nbytes: int = 0) -> bool:
        """Run the async collective ``fn(seq, rec)`` now in the caller's thread, deferring
        its first step if a peer is behind (see the module docstring): True once it is
        complete or deferred; False, with nothing done, if the engine is not idle.
        ``channel``: what ``fn`` defers through (``defer_once``, ``peers_published``): the
        group's step channel, or the call's ``NetCall``."""
        with self._mutex:
            if self._busy or self._queue or self._stopped or self.broken is not None:
                return False
            self._busy = True
        deferred = alone = resumes = False
        threads = one_thread.enter() if nbytes * self.size >= one_thread.GRAIN_BYTES else 0
        try:
            self.seq = seq = self.seq + 1
            work.description = (name, seq, self.label)
            rec = recorder.issue(self.group_name, self.rank, self.size, seq, name, call, True)
            stats.add_call(nbytes)
            channel.defer_once = True
            try:
                fn(seq, rec)
            except StepDeferred as exc:
                deferred = True
                # ``last``: a one-step plan, whose rest nobody else needs. If more steps
                # follow, the peers need ours: the engine thread runs the rest now, as it
                # would have run the whole call.
                alone, resumes = exc.last, exc.resumes
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the Work
                self.fail(exc, work, rec)
            else:
                if rec is not None:
                    rec.state, rec.t_end = COMPLETED, time.time()
                work.finished = True  # (nobody has seen the work yet)
            finally:
                channel.defer_once = False
            if deferred:
                if rec is not None and not resumes:
                    rec.algo = None  # named again when the call runs again
                work.engine = self
                work.op = Deferred(self, work, channel)
                with self._cv:
                    self._queue.appendleft((fn, work, seq, rec))
        finally:
            one_thread.leave(threads)
            self._busy = False
            # the rest of a multi-step call, or others queued meanwhile, need the thread
            if len(self._queue) > alone:
                self.wake()
        return True

    def wake(self) -> None:
        """Have the engine thread run what is queued now (started on first use)."""
        self._start_thread(now=True)

    def _start_thread(self, now: bool) -> None:
        """Start the engine thread if it is not running and wake it: ``now``, to run what
        is queued at once (held collectives too), else to see the queue's time limit."""
        with self._cv:
            if now:
                self._due = 0.0
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(
                    target=self._loop, name=f"neuron-engine[{self.label}]", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def run_for(self, work) -> bool:
        """From a thread waiting for queued ``work``: run the queue's head tasks here, up
        to ``work``, unless the engine thread is running one (then False: block instead)."""
        while not work.finished:
            with self._cv:
                if self._busy or not self._queue or self._stopped:
                    return False
                task = self._queue.popleft()
                self._busy = True
            self._run_busy(task)
        return True

    def _loop(self) -> None:
        set_background_thread()
        while True:
            with self._cv:
                while True:
                    if self._stopped:
                        if not self._queue:
                            return
                    elif self._busy or not self._queue:
                        self._idle = True
                        self._cv.wait()
                        self._idle = False
                        continue
                    else:
                        left = self._due - time.monotonic()
                        if left > 0:  # held for the caller: see the module docstring
                            self._cv.wait(left)
                            continue
                    break
                task = self._queue.popleft()
                self._busy = True
            self._run_busy(task)

    def _run_busy(self, task) -> None:
        """Execute ``task`` (the caller has set busy), then let the next one start."""
        try:
            self._execute(*task)
        finally:
            with self._cv:
                self._busy = False
                if self._queue:  # (a waiter that ran its own task must not wake the thread)
                    self._cv.notify_all()

    def _execute(self, fn, work, seq: int, rec, inline: bool = False) -> None:
        """Run a task (``fn``, ``work``, ``seq``, ``rec``). ``inline`` (``run_now``): its
        record was issued running, and its work has not been returned to anyone yet."""
        if self.broken is not None:
            _fail_unrun(work, rec, GroupAbortedError(
                f"{work.what}: the group is unusable after an earlier failure: {self.broken}"))
            return
        if rec is not None and not inline:
            rec.start()
        trace = log.isEnabledFor(logging.DEBUG)
        if trace:
            if rec is None:  # (flight recorder off: a record of its own, for the algorithm)
                rec = Record(self.group_name, self.rank, self.size, seq, "", None, True)
            log.debug("neuron: start %s%s", work.what, f" {rec.call.describe()}" if rec.call else "")
            started = time.monotonic()
        threads = one_thread.enter()  # (given back before the Work's callbacks run)
        try:
            try:
                fn(seq, rec)  # algorithms touch only detached tensors: no autograd involved
            finally:
                one_thread.leave(threads)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the Work
            self.fail(exc, work, rec)
        else:
            if rec is not None:
                rec.finish()
            if trace:
                log.debug("neuron: done  %s in %.1f us, algorithm %s", work.what,
                          (time.monotonic() - started) * 1e6, rec.algo or "-")
            if inline:
                work.complete_unseen()
            else:
                work.complete()

    def fail(self, exc: BaseException, work, rec) -> None:
        """Complete ``work`` with the user-facing form of ``exc``; break the group if fatal."""
        error, fatal = self._on_error(exc, work.what)
        if rec is not None:
            rec.finish(error)
        log.log(logging.WARNING if fatal else logging.INFO, "neuron: %s", error)
        if fatal:
            self.mark_broken(error)
        work.complete(error)

    def mark_broken(self, error: BaseException) -> None:
        """The group failed (``error``, the first such failure, is kept): later tasks fail
        at once naming it. The flight recorder is written then."""
        if self.broken is None:
            self.broken = error
            path = recorder.dump(str(error))
            if path:
                log.warning("neuron: flight recorder written to %s", path)

    def is_engine_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def run_until(self, work) -> None:
        """From the progress thread: run queued tasks until ``work`` is complete."""
        while not work.is_completed():
            with self._cv:
                task = self._queue.popleft() if self._queue else None
            if task is None:
                raise RuntimeError(f"{work.what} is waited on from its own engine thread "
                                   "but is not queued")
            self._execute(*task)

    def stop(self, error=None, join_timeout: float = 5.0) -> None:
        """Fail queued tasks with ``error`` (or a 'destroyed' error) and end the thread."""
        with self._cv:
            self._stopped = True
            pending = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
            thread = self._thread
        for _, work, _, rec in pending:
            failure = error or GroupAbortedError(f"{work.what}: the group was destroyed before this ran")
            _fail_unrun(work, rec, failure)
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_timeout)


def _fail_unrun(work, rec, failure) -> None:
    """Fail a queued task that will not run (again). A deferred call between nodes has
    messages posted into its buffers: they are withdrawn first, so nothing lands in the
    caller's tensors once its Work has failed."""
    op = work.op
    if isinstance(op, Deferred):
        op.abandon(failure)
    if rec is not None:
        rec.finish(failure)
    work.complete(failure)
