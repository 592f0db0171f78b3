"""Which processes are alive: for tests that check a launcher left nothing behind."""

from __future__ import annotations

import os


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
