"""A shared-memory segment private to one job.

Lifecycle, chosen so that nothing can accumulate in /dev/shm:

1. The creator makes ``<dir>/neuron-<uid>-<creator pid>-<random token>`` with
   O_CREAT|O_EXCL and mode 0600, sized with ftruncate (sparse), and reserves the pages that
   are used at once with posix_fallocate; other ranges (send/recv mailboxes) are reserved
   by ``reserve`` on first use. Either way a too-small /dev/shm fails with a clear error
   instead of a SIGBUS on first touch.
2. Peers open it by name (they learn the name through the c10d store) and map it.
3. Once every rank has mapped it, the creator unlinks the name. The mapping lives on until
   the last process unmaps it or dies, so a SIGKILL leaves nothing behind.

Only the short window between 1 and 3 can leak a name (if the creator dies inside it).
``sweep_leftovers`` removes such names whose creator pid no longer runs; every new group
calls it.
"""

from __future__ import annotations

import mmap
import os
import secrets

PREFIX = "neuron-"


class ShmSetupError(RuntimeError):
    """The segment could not be created or opened."""


def shm_dir() -> str:
    return os.environ.get("NEURON_DIST_SHM_DIR", "/dev/shm")


def new_segment_name() -> str:
    """A name no other job can guess: uid, creator pid and 64 random bits."""
    return f"{PREFIX}{os.getuid()}-{os.getpid()}-{secrets.token_hex(8)}"


class Segment:
    """A mapped segment. Use ``create`` or ``attach``; ``unlink`` after all peers attached."""

    def __init__(self, name: str, fd: int, size: int, owner: bool):
        self.name = name
        self.size = size
        self.owner = owner
        self._path = os.path.join(shm_dir(), name)
        try:
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd  # kept for ``reserve``; works after the name is unlinked
        self._unlinked = False

    @classmethod
    def create(cls, name: str, size: int, reserve=((0, None),)) -> "Segment":
        """Create ``size`` bytes; ``reserve`` lists (offset, length) ranges to allocate now
        (length None: to the end)."""
        path = os.path.join(shm_dir(), name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise ShmSetupError(f"cannot create shared-memory segment {path}: {exc}") from exc
        try:
            os.ftruncate(fd, size)
            for off, length in reserve:
                _fallocate(fd, off, size - off if length is None else length)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(name, fd, size, owner=True)

    def reserve(self, offset: int, length: int) -> None:
        """Allocate the pages of a range before first use (ShmSetupError if no space)."""
        _fallocate(self._fd, offset, length)

    @classmethod
    def attach(cls, name: str, size: int) -> "Segment":
        path = os.path.join(shm_dir(), name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ShmSetupError(f"cannot open shared-memory segment {path}: {exc}") from exc
        actual = os.fstat(fd).st_size
        if actual != size:
            os.close(fd)
            raise ShmSetupError(f"segment {path} has {actual} bytes, expected {size}")
        return cls(name, fd, size, owner=False)

    def unlink(self) -> None:
        """Remove the name; the mapping stays valid for everyone who has it."""
        if not self._unlinked:
            self._unlinked = True
            try:
                os.unlink(self._path)
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


def _fallocate(fd: int, offset: int, length: int) -> None:
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        raise ShmSetupError(
            f"cannot reserve {length / 2**20:.1f} MiB in {shm_dir()} ({exc.strerror}); "
            "free space there (e.g. docker --shm-size) or lower NEURON_DIST_SHM_SLOT_BYTES / "
            "NEURON_DIST_SHM_MAILBOX_BYTES") from exc


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` runs. A zombie (killed, not yet reaped by its parent) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] not in (b"Z", b"X")
    except (OSError, ValueError):
        return True


def sweep_leftovers() -> list[str]:
    """Unlink this user's segments whose creator process is gone. Returns the names removed."""
    removed = []
    prefix = f"{PREFIX}{os.getuid()}-"
    try:
        names = os.listdir(shm_dir())
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        try:
            pid = int(name[len(prefix):].split("-", 1)[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            try:
                os.unlink(os.path.join(shm_dir(), name))
                removed.append(name)
            except OSError:
                pass
    return removed
