"""Which processes are alive: for tests that check a launcher left nothing behind."""

from __future__ import annotations

import os
import signal


def interruptible() -> None:
    """``preexec_fn`` of a process a test interrupts with SIGINT (Ctrl-C): SIGINT at its
    default, as under a terminal. A process started in the background by a shell without
    job control (``cmd &``, as a CI script may run the suite) inherits SIGINT ignored, and
    Python then leaves it ignored, as it should: such a job is not meant to get Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def processes_with(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line contains ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmd and state not in ("Z", "X"):
            found.append(int(pid))
    return found
