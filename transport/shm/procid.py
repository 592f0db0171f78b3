"""Process identities that hold across PID namespaces and pid reuse.

A bare pid names a process only inside one PID namespace, and only until the process
exits and the number is handed out again. Where that matters (who created a segment, is a
peer still running) the identity here is (PID namespace, pid, start time): the namespace is
the inode of ``/proc/self/ns/pid``, the start time is field 22 of ``/proc/<pid>/stat``
(clock ticks since boot, fixed for the life of a process). Processes of another PID
namespace cannot be looked up from this one at all, so what they own is never judged here.
"""

from __future__ import annotations

import os


def pid_namespace() -> int:
    """Inode of this process's PID namespace (0 if /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields 3.. of /proc/<pid>/stat (after the command name), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()


def start_time(pid: int) -> int:
    """When process ``pid`` (of this PID namespace) started, in clock ticks since boot; 0 if
    it does not exist (or /proc does not say)."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else 0  # field 22 of stat(5)
    except (IndexError, ValueError):
        return 0


def alive(pid: int, started: int = 0) -> bool:
    """True if ``pid`` runs in this PID namespace and, when ``started`` is given (non-zero),
    is the process that started then (not a later one given the same number). A zombie
    (killed, not reaped yet) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _stat_fields(pid)
    if fields is None:
        return True  # no /proc: os.kill's answer is all there is
    if fields[0] in (b"Z", b"X"):
        return False
    return not started or start_time(pid) in (0, started)
