"""Single-copy transfers between processes of one node: Linux cross-memory attach (CMA).

``process_vm_readv(pid, local, remote)`` copies straight from another process's memory into
ours, one copy instead of the two a shared-memory staging buffer costs (in, then out). The
kernel allows it when we may ptrace the peer: same user, and Yama's ptrace_scope (if
present) 0, or the right capability. Collectives use it for large messages (see
allgather.py, reduce_scatter.py, allreduce.py): ranks publish the addresses of their
tensors in the call descriptor, read each other's directly, and step once more so nobody
returns while a peer still reads its memory.

Whether a node's ranks may use it is settled once per group by ``probe``: every rank reads a
word from every peer and says through the store whether that worked; CMA is used only if
it worked for every pair, so all ranks choose the same algorithms.
``NEURON_DIST_CMA=0`` turns it off (the group passes ``enabled=False``).
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Protocol


class _Store(Protocol):
    """What ``probe`` needs of the store (neuron_dist/store_auth.py's ``StoreAuth``)."""

    def set(self, name: str, value: str) -> None: ...

    def get(self, name: str, writer: int) -> bytes: ...

_libc = ctypes.CDLL(None, use_errno=True)
_readv = getattr(_libc, "process_vm_readv", None)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


if _readv is not None:
    _readv.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                       ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    _readv.restype = ctypes.c_ssize_t

# The kernel caps one call at MAX_RW_COUNT (just under 2 GiB); stay well below.
_MAX_CALL = 1 << 30


def read(pid: int, local: int, remote: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``remote`` of process ``pid`` to our address ``local``.

    Raises OSError (ESRCH: the process is gone; EPERM: not allowed; EFAULT: bad address).
    The GIL is released during the copy.
    """
    done = 0
    while done < nbytes:
        n = min(nbytes - done, _MAX_CALL)
        lo, re = _Iovec(local + done, n), _Iovec(remote + done, n)
        # (not None: only a group whose probe found it reads)
        got = _readv(pid, ctypes.byref(lo), 1, ctypes.byref(re), 1, 0)  # type: ignore[misc]
        if got < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"process_vm_readv from pid {pid}: {os.strerror(e)}")
        if got == 0:
            raise OSError(errno.EFAULT, f"process_vm_readv from pid {pid} made no progress")
        done += got


def probe(store: _Store, key: str, rank: int, size: int, pid_word_address: int,
          enabled: bool = True) -> bool:
    """Agree through ``store`` whether every rank of the node can read every other's memory.

    ``store`` has ``set(name, value)`` (written by this rank) and ``get(name, writer)``
    (checked to come from the node's rank ``writer``: neuron_dist/store_auth.py's
    ``StoreAuth``, which authenticates the values when the job has a key).

    ``pid_word_address`` is the address, in this process, of an 8-byte word holding our
    pid; every peer tries to read it back. ``enabled`` False (this rank's settings forbid
    CMA) makes the answer False. Returns the same answer on every rank.
    """
    ok = enabled and _readv is not None
    store.set(f"{key}/cma/addr/{rank}", f"{os.getpid()}:{pid_word_address}")
    for k in range(size):
        if k == rank or not ok:
            continue
        pid, addr = map(int, store.get(f"{key}/cma/addr/{k}", k).decode().split(":"))
        buf = ctypes.c_int64(0)
        try:
            read(pid, ctypes.addressof(buf), addr, 8)
        except OSError:
            ok = False
        else:
            ok = buf.value == pid
    store.set(f"{key}/cma/ok/{rank}", "1" if ok else "0")
    return all(store.get(f"{key}/cma/ok/{k}", k) == b"1" for k in range(size))
