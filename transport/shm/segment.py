"""A shared-memory segment private to one job.

Lifecycle, chosen so that nothing can accumulate in /dev/shm:

1. The creator makes ``<dir>/neuron-<uid>-<pid>-<pid namespace>-<start time>-<random
   token>`` (the creator's identity: procid.py) with
   O_CREAT|O_EXCL and mode 0600, sized with ftruncate (sparse), and reserves the pages that
   are used at once with posix_fallocate; other ranges (send/recv mailboxes) are reserved
   by ``reserve`` on first use. Either way a too-small /dev/shm fails with a clear error
   instead of a SIGBUS on first touch.
2. Peers open it by name (they learn the name through the c10d store) and map it, after
   checking what they opened (``attach``): the name must be one ``new_segment_name`` makes
   (no ``/``, so no other directory), the file is opened without following a symbolic link,
   and it must be a regular file owned by this user with mode 0600 (checked on the opened
   descriptor, so it cannot change in between). Anything else is refused by name: a store
   that someone else can write must not make every rank map a file of the writer's choice.
3. Once every rank has mapped it, the creator unlinks the name. The mapping lives on until
   the last process unmaps it or dies, so a SIGKILL leaves nothing behind.

Only the short window between 1 and 3 can leak a name (if the creator dies inside it).
``sweep_leftovers`` removes such names whose creator no longer runs (only names created in
this PID namespace, with the creator's start time checked against pid reuse); every new
group calls it.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import stat
from typing import Iterable

from . import procid

PREFIX = "neuron-"
# what new_segment_name makes: neuron-<uid>-<pid>-<pid namespace>-<start time>-<16 hex digits>
_NAME = re.compile(r"neuron-[0-9]+-[0-9]+-[0-9]+-[0-9]+-[0-9a-f]{16}")


class ShmSetupError(RuntimeError):
    """The segment could not be created or opened."""


def new_segment_name() -> str:
    """A name no other job can guess: uid, the creator's identity (pid, PID namespace,
    start time: see procid.py) and 64 random bits."""
    pid = os.getpid()
    return (f"{PREFIX}{os.getuid()}-{pid}-{procid.pid_namespace()}-{procid.start_time(pid)}-"
            f"{secrets.token_hex(8)}")


class Segment:
    """A mapped segment. Use ``create`` or ``attach``; ``unlink`` after all peers attached.

    ``directory`` is where segments live (``NEURON_DIST_SHM_DIR``, normally /dev/shm: the
    group passes its setting; this layer reads no environment)."""

    def __init__(self, name: str, fd: int, size: int, owner: bool, path: str):
        self.name = name
        self.size = size
        self.owner = owner
        self.path = path
        try:
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd  # kept for ``reserve``; works after the name is unlinked
        self._unlinked = False

    @classmethod
    def create(cls, name: str, size: int,
               reserve: Iterable[tuple[int, int | None]] = ((0, None),), *,
               directory: str) -> Segment:
        """Create ``size`` bytes in ``directory``; ``reserve`` lists (offset, length) ranges
        to allocate now (length None: to the end)."""
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
        except OSError as exc:
            raise ShmSetupError(f"cannot create shared-memory segment {path}: {exc}") from exc
        try:
            os.fchmod(fd, 0o600)  # whatever the umask: attach checks for exactly 0600
            os.ftruncate(fd, size)
            for off, length in reserve:
                _fallocate(fd, off, size - off if length is None else length, directory)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(name, fd, size, owner=True, path=path)

    def reserve(self, offset: int, length: int) -> None:
        """Allocate the pages of a range before first use (ShmSetupError if no space)."""
        _fallocate(self._fd, offset, length, os.path.dirname(self.path))

    @classmethod
    def attach(cls, name: str, size: int, *, directory: str) -> "Segment":
        """Map the segment ``name`` another rank created in ``directory`` (ShmSetupError
        naming what is wrong:
        a name ``new_segment_name`` would not make, a symbolic link, a file that is not a
        regular file of this user with mode 0600, or one of another size)."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ShmSetupError(f"refusing to attach shared-memory segment {name!r}: not a name "
                                f"this backend makes ({PREFIX}<uid>-<pid>-<pid namespace>-<start "
                                f"time>-<16 hex digits>, no '/'); the store held something else")
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            what = "it is a symbolic link" if exc.errno == errno.ELOOP else exc
            raise ShmSetupError(f"cannot open shared-memory segment {path}: {what}") from exc
        try:
            _check_private(fd, path, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, size, owner=False, path=path)

    def unlink(self) -> None:
        """Remove the name; the mapping stays valid for everyone who has it."""
        if not self._unlinked:
            self._unlinked = True
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        if self.owner:
            self.unlink()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self.map.close()
        except BufferError:
            # A tensor view still references the mapping; it is unmapped when that view dies.
            pass


def _check_private(fd: int, path: str, size: int) -> None:
    """The opened file is a regular file of this user, mode 0600, of ``size`` bytes."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ShmSetupError(f"refusing shared-memory segment {path}: not a regular file")
    if st.st_uid != os.geteuid():
        raise ShmSetupError(f"refusing shared-memory segment {path}: owned by uid {st.st_uid}, "
                            f"not by this process's uid {os.geteuid()}")
    if stat.S_IMODE(st.st_mode) != 0o600:
        raise ShmSetupError(f"refusing shared-memory segment {path}: mode "
                            f"{stat.S_IMODE(st.st_mode):04o}, expected 0600 (readable or "
                            f"writable by others)")
    if st.st_size != size:
        raise ShmSetupError(f"segment {path} has {st.st_size} bytes, expected {size}")


def _fallocate(fd: int, offset: int, length: int, directory: str) -> None:
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        raise ShmSetupError(
            f"cannot reserve {length / 2**20:.1f} MiB in {directory} ({exc.strerror}); "
            "free space there (e.g. docker --shm-size) or lower NEURON_DIST_SHM_SLOT_BYTES / "
            "NEURON_DIST_SHM_MAILBOX_BYTES") from exc


def sweep_leftovers(directory: str) -> list[str]:
    """Unlink this user's segments in ``directory`` whose creator is gone; returns the names
    removed.

    Only segments created in this PID namespace are judged (another namespace's pids
    mean nothing here: a creator that runs there would look dead), and a creator is the
    pid *and* its start time, so a pid handed out again does not keep a dead job's
    segment alive."""
    removed: list[str] = []
    prefix = f"{PREFIX}{os.getuid()}-"
    ns = procid.pid_namespace()
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix) or not _NAME.fullmatch(name):
            continue
        pid, pidns, started = (int(f) for f in name[len(prefix):].split("-")[:3])
        if pidns != ns or procid.alive(pid, started):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    return removed
