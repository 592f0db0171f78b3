"""Async collectives left for later, and who finishes them: deferred and held calls.

How it works
------------
Handing an async collective to the engine thread costs a thread hand-off (25-55 µs here)
and a GIL hand-over, more than a whole small collective. Two ways leave part or all of a
call for later instead; each becomes its Work's ``op`` (work.py: ``drive`` when someone
``wait``s, ``poll`` for ``is_completed``, ``arm`` for a future or hook), so whoever looks
at the Work first finishes it:

* **Deferred** (``Deferred``). ``CollectiveEngine.try_now`` runs the call in the caller's
  thread at once with its ``Deferrable`` (transport/base.py) set to defer once: the
  group's step channel in a one-node group, else the call's ``NetCall`` (collectives/
  net.py, "Deferring the wait of an async call"). Which calls: ``deferrable_for``.
  If a peer is behind, the call raises ``StepDeferred`` where it would have waited and
  is put back at the head of its group's queue.
* **Held** (``Held``). With no core to spare for the engine thread, ``CollectiveEngine.
  submit`` queues an async call without waking the thread: the caller's ``wait`` runs it,
  or the engine thread once someone polls, arms it, or the hold's time limit passes.

The invariants that hold these together (tests/units/test_deferral.py checks each):

1. A deferred first run stopped in one of two places. Before posting anything (a
   ``NetCall`` whose algorithm did not say ``deferrable``; a one-node step, whose
   publishing is repeatable: a second run writes the same bytes to this rank's slot and
   does not publish twice): the call then runs again from the start. Or after posting
   every message, keeping the rest of the call (``NetCall.wait_then``): its second run
   only finishes that (``finish_deferred``). No work that is not repeatable runs twice.
2. A deferred call is its group's queue head: nothing the group issued later runs first.
3. It is finished once, by whoever takes the engine first: a thread waiting for its Work
   (``CollectiveEngine.run_for``) or the engine thread.
4. If the peers need more of it from this rank (a call of more than one step), the
   engine thread is woken at once; a one-step call (``StepDeferred.last``) waits for
   someone to look at its Work.
5. A deferred call that will not run again (its group stops or breaks) takes back what
   its first run posted (``Deferrable.withdraw``) before its Work fails: nothing lands in
   the caller's tensors afterwards.
6. The flight recorder names the algorithm again when a call runs again from the start;
   a call that resumes keeps the name its first run gave.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .collectives.net import NetCall

if TYPE_CHECKING:
    from .collectives.descriptor import Call
    from .collectives.net import Topo
    from .engine import CollectiveEngine
    from .transport.base import Deferrable, NetTransport, StepChannel

# Async collectives of a group that spans nodes tried in the caller's thread first: the
# ones whose algorithms say where they may be deferred (``NetCall.deferrable``), up to a
# size where running their local reduction at wait time, instead of overlapped in the
# engine thread, costs little. A deferred call is finished by ``NetCall.resume``, which
# runs only the rest its algorithm handed to ``wait_then`` (and ``finish_deferred``'s
# caller the flats' copies back): a collective whose algorithm does more after it
# returns must not be named here.
NET_DEFERRABLE = frozenset(("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"))
NET_DEFER_BYTES = 1 << 20

_FOREVER = float("inf")


def deferrable_for(name: str, nbytes: int, channel: StepChannel, net: NetTransport | None,
                   topo: Topo, call: Call, scratch: dict) -> Deferrable | None:
    """What the async collective ``name`` of ``nbytes`` defers through when tried in the
    caller's thread: the group's step channel (one node, a first step that fits a slot),
    a ``NetCall`` of its own (a group that spans nodes, this rank alone on its node, a
    collective of ``NET_DEFERRABLE`` up to ``NET_DEFER_BYTES``), or None (queue it)."""
    if net is None:
        return channel if nbytes <= channel.slot_bytes else None
    if nbytes <= NET_DEFER_BYTES and name in NET_DEFERRABLE and len(topo.local) == 1:
        return NetCall(net, topo, call, 0, 0.0, scratch=scratch)
    return None


def finish_deferred(net_call: NetCall, seq: int, deadline: float) -> bool:
    """At the start of every run of a call that defers through ``net_call``: number it
    ``seq`` with ``deadline``, and if its first run deferred after posting everything,
    finish it (``NetCall.resume``). True when that finished the call (the rest of the run
    is skipped: invariant 1)."""
    net_call.again(seq, deadline)
    if net_call.deferred():
        net_call.resume()
        return True
    return False


def _drive(engine: CollectiveEngine, work, deadline: float) -> None:
    """``Work.wait`` on a queued collective: run the queue up to it in the waiting thread
    (which waits for the peers with each call's own timeout); a wait with a timeout of its
    own leaves it to the engine thread, woken now, and blocks."""
    if engine.is_engine_thread():
        engine.run_until(work)
    elif deadline != _FOREVER or not engine.run_for(work):
        engine.wake()


class Held:
    """The progress of an async collective held for its caller (see the module
    docstring), as its Work's ``op``: whoever looks at the Work starts it."""

    __slots__ = ("engine", "work")

    def __init__(self, engine: CollectiveEngine, work):
        self.engine, self.work = engine, work

    def drive(self, deadline: float) -> None:
        """``Work.wait``: run the queue up to it here; a wait with a timeout of its own
        leaves it to the engine thread and blocks."""
        _drive(self.engine, self.work, deadline)

    def poll(self) -> None:
        """``is_completed``: whoever polls wants it to progress: the engine thread, now."""
        self.engine.wake()

    def arm(self) -> None:
        """A future or hook wants it to complete by itself."""
        self.engine.wake()


class Deferred:
    """The rest of a deferred collective, as its Work's ``op``: run by whoever looks
    first, or by the engine thread once armed (invariant 3)."""

    __slots__ = ("engine", "work", "channel")

    def __init__(self, engine: CollectiveEngine, work, channel: Deferrable):
        self.engine, self.work, self.channel = engine, work, channel

    def drive(self, deadline: float) -> None:
        """``Work.wait``: run it here (it waits for the peers with the call's own timeout);
        a wait with a timeout of its own leaves it to the engine thread and blocks."""
        _drive(self.engine, self.work, deadline)

    def poll(self) -> None:
        """``is_completed``: finish it here if that needs no waiting, else let the engine."""
        if self.channel.peers_published() and self.engine.run_for(self.work):
            return
        self.engine.wake()

    def arm(self) -> None:
        """A future or hook wants it to complete by itself."""
        self.engine.wake()

    def abandon(self, error) -> None:
        """It will not run again: withdraw what its first run posted (a ``NetCall``'s
        messages; a step published in shared memory writes into nobody's buffer):
        invariant 5."""
        self.channel.withdraw(error)
