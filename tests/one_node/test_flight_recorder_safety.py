"""The flight recorder's dump path is safe: a SIGUSR1 that arrives during a failure dump
does not deadlock the main thread, and the dump never writes through a planted symlink."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from neuron_dist import flight_recorder as fr

REPO = Path(__file__).resolve().parents[2]

_SIGNAL_DURING_DUMP = textwrap.dedent("""
    import json, os, signal, sys, threading
    os.environ["NEURON_DIST_FR_DIR"] = sys.argv[1]
    from neuron_dist import flight_recorder as fr
    fr.install_signal_handler()
    fr.recorder.issue("g", 0, 1, 1, "all_reduce", None)
    plain = fr.Record.as_dict
    def as_dict(self):  # the signal comes while the failure dump holds the recorder's lock
        os.kill(os.getpid(), signal.SIGUSR1)
        return plain(self)
    fr.Record.as_dict = as_dict
    assert fr.recorder.dump("failure") == fr.recorder.path()
    fr.Record.as_dict = plain
    for t in threading.enumerate():
        if t.name == "neuron-fr-dump":
            t.join(20)
    print(json.load(open(fr.recorder.path()))["reason"], fr.recorder.dumps)
""")


def test_sigusr1_during_a_failure_dump_does_not_deadlock(tmp_path):
    """Finding: ``mark_broken`` -> ``recorder.dump`` holds a non-reentrant lock and the
    SIGUSR1 handler took the same lock on the main thread."""
    proc = subprocess.run([sys.executable, "-c", _SIGNAL_DURING_DUMP, str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=str(REPO),
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["SIGUSR1", "2"], proc.stdout  # both dumps, the signal's last


def test_the_dump_never_writes_through_a_planted_symlink(tmp_path, monkeypatch):
    """Finding: the dump's ``*.json.tmp`` had a predictable name in the shared temp
    directory and was opened without O_EXCL / O_NOFOLLOW."""
    monkeypatch.setenv("NEURON_DIST_FR_DIR", str(tmp_path))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = fr.recorder.path()
    os.symlink(victim, path + ".tmp")
    os.symlink(victim, path)
    assert fr.recorder.dump("test") == path
    assert victim.read_text() == "precious"
    assert not os.path.islink(path)
    with open(path) as f:
        assert json.load(f)["reason"] == "test"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["victim", os.path.basename(path), os.path.basename(path) + ".tmp"])
