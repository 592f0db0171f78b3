"""Sleeping on a shared-memory word until a peer changes it: Linux futexes through ctypes.

``wait(addr, expected, timeout)`` sleeps only while the 32-bit word at ``addr`` still holds
``expected`` (the kernel checks atomically), so a change that lands before the call is
never missed. ``wake(addr)`` wakes every sleeper on the word. The futexes are "shared"
(not FUTEX_PRIVATE) because the word lives in memory mapped by several processes.
ctypes releases the GIL for the call, so a sleeping waiter does not block its process's
other threads.

Waking costs a system call, so publishers only call ``wake`` when a waiter has said it is
going to sleep (a flag in shared memory). The flag and the counter are separate words, so a
waiter that sets its flag just as the publisher checks it can miss its wake-up; every sleep
therefore has a short timeout, after which the waiter looks again.
"""

from __future__ import annotations

import ctypes
import platform

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


available = _SYS_FUTEX is not None  # elsewhere waiters sleep in growing naps (../backoff.py)


def wait(addr: int, expected: int, timeout: float) -> None:
    """Sleep while the int32 at ``addr`` equals ``expected`` (low 32 bits), at most ``timeout`` s."""
    ts = _Timespec(int(timeout), int((timeout % 1.0) * 1e9))
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT,
             ctypes.c_int(expected & 0xFFFFFFFF), ctypes.byref(ts), None, 0)


def wake(addr: int) -> None:
    """Wake every process sleeping on the int32 at ``addr``."""
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, ctypes.c_int(2**31 - 1), None, None, 0)
