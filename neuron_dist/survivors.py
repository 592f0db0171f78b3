"""How the members of a failed group agree on who is excluded (used by ``shrink_group``).

The agreement runs through the group's rendezvous store, which must outlive the failure
(under torchrun it lives in node 0's agent; in a plain ``TCPStore`` job, in the process that
hosts it). Under ``<key>``:

1. Every member that calls it posts its *report*: the group ranks it wants excluded
   (``<key>/report/<rank>``, JSON). A report may be empty (a rank that only heard about the
   failure through an abort notice does not know who failed).
2. Every member waits until each rank of the group has either posted a report or been
   named in a posted report. A rank that does neither is **not** dropped for being slow:
   after ``timeout`` the agreement fails on every waiting member with a
   ``PeerTimeoutError`` naming it.
3. The first member to see that condition writes the decision, the union of the reports it
   has seen, with ``compare_set`` (``<key>/decision``); every member adopts whatever
   decision is stored, so all of them leave with the same set even if their reports differ.

Every rank that is not excluded posted its report before the decision was taken (the
decider waited for it), so every survivor's report is part of the decision. A rank that was
named although it is alive (someone reported it because it was slow) learns the decision
when it calls ``agree`` itself and fails with ``ExcludedError``; the survivors log it.

With ``NEURON_DIST_AUTH_KEY`` set, ``auth`` (the group's ``StoreAuth``, bound to its set-up
session) tags every report with its writer's rank and the decision with its decider's, and
each is checked before use (``StoreAuthError`` naming the key and rank otherwise), so
someone who can write the store cannot exclude a live rank or keep a dead one.
"""

from __future__ import annotations

import json
import logging
import time

from .errors import ExcludedError, PeerTimeoutError

log = logging.getLogger("neuron_dist")

POLL_SECONDS = 0.005


def agree(store, key: str, rank: int, size: int, report, timeout: float,
          what: str = "shrink_group", auth=None) -> list[int]:
    """Post ``report`` (group ranks to exclude) and return the agreed exclusion list.

    ``auth``: the group's ``store_auth.StoreAuth`` (its values checked when it has a key).

    Raises ``ExcludedError`` if this rank is excluded, ``PeerTimeoutError`` naming the
    ranks that neither joined nor were reported within ``timeout`` seconds.
    """
    auth = auth if auth is not None and auth.enabled else None
    _post(store, auth, f"{key}/report/{rank}", json.dumps(sorted(set(report))))
    decision_key = f"{key}/decision"
    deadline = time.monotonic() + timeout
    reports: dict[int, list[int]] = {}
    while True:
        if store.check([decision_key]):
            decision = _decision(auth, decision_key, store.get(decision_key))
            break
        for k in range(size):
            if k not in reports and store.check([f"{key}/report/{k}"]):
                reports[k] = json.loads(_read(store, auth, f"{key}/report/{k}", k))
        named = sorted({r for rep in reports.values() for r in rep})
        missing = [k for k in range(size) if k not in reports and k not in named]
        if not missing:
            text = json.dumps({"exclude": named,
                               "by": {str(k): v for k, v in sorted(reports.items())}})
            if auth is not None:  # (compare_set takes text: the decider's rank, tagged hex)
                text = f"{rank}:{auth.seal(decision_key, text).hex()}"
            decision = _decision(auth, decision_key, store.compare_set(decision_key, "", text))
            break
        if time.monotonic() > deadline:
            raise PeerTimeoutError(
                f"{what} (group rank {rank}/{size}): rank(s) {missing} neither joined within "
                f"{timeout:g} s nor were reported failed by a rank that did (reports so far: "
                f"{_describe(reports)}). A rank is never excluded for being slow: report it "
                f"explicitly if it must go")
        time.sleep(POLL_SECONDS)
    excluded = decision["exclude"]
    by = {int(k): v for k, v in decision["by"].items()}
    if rank in excluded:
        accusers = sorted(k for k, v in by.items() if rank in v)
        raise ExcludedError(
            f"{what}: this rank (group rank {rank}) was excluded from the group by rank(s) "
            f"{accusers}; the group goes on without it (reports: {_describe(by)})")
    alive = sorted(k for k in excluded if k in by)
    if alive:
        log.warning("neuron: %s excluded rank(s) %s although they joined the agreement "
                    "(alive, reported by others: %s); they are fenced off", what, alive,
                    _describe(by))
    return excluded


def _post(store, auth, name: str, text: str) -> None:
    store.set(name, auth.seal(name, text) if auth is not None else text)


def _read(store, auth, name: str, writer: int) -> bytes:
    raw = store.get(name)
    return auth.open(name, raw, writer) if auth is not None else raw


def _decision(auth, name: str, raw) -> dict:
    """The decision stored under ``name`` (checked to come from its decider with a key)."""
    if auth is None:
        return json.loads(raw)
    decider, _, sealed = bytes(raw).decode("ascii", "replace").partition(":")
    try:
        writer, value = int(decider), bytes.fromhex(sealed)
    except ValueError:
        writer, value = -1, b""
    return json.loads(auth.open(name, value, writer))


def _describe(reports: dict) -> str:
    return "; ".join(f"rank {k}: exclude {v}" for k, v in sorted(reports.items())) or "none"
