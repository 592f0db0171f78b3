"""Flight recorder: the last collectives of this process, dumped when something goes wrong.

Every collective a group issues gets a ``Record`` (group, sequence number, op, call
descriptor, the algorithm chosen (``algo``, from collectives/selection.py's tables; across
nodes its phases joined by ``+``), state, timestamps, error) in a bounded ring (``NEURON_DIST_FR_SIZE`` entries,
default 2000, 0 disables). The ring is written as JSON to
``$NEURON_DIST_FR_DIR/neuron-fr-rank<rank>-pid<pid>.json`` when a collective fails with a
timeout, a dead peer or an abort, and on SIGUSR1 (if the program has not installed its own
handler). The default directory is the temporary one (``tempfile.gettempdir()``: ``$TMPDIR``
or /tmp), like PyTorch's NCCL flight recorder (/tmp/nccl_trace_rank_<rank>), never the
program's working directory; ``<rank>`` is the process's global rank (its rank in the
default process group, ``rank?`` before there is one), whatever ``RANK`` says.
``python -m neuron_dist.fr_analyze DIR`` reads the dumps of all ranks and says which rank is
behind or called something different.

Recording costs one small object per collective; formatting happens only when dumping.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
from collections import deque

from .config import flight_recorder_dir, flight_recorder_size

QUEUED, RUNNING, COMPLETED, FAILED = "queued", "running", "completed", "failed"


class Record:
    __slots__ = ("group", "rank", "size", "seq", "op", "call", "algo", "state", "t_issue",
                 "t_start", "t_end", "error")

    def __init__(self, group, rank, size, seq, op, call, running: bool = False, algo=None):
        self.group, self.rank, self.size = group, rank, size
        self.seq, self.op, self.call = seq, op, call
        self.algo = algo
        self.state = RUNNING if running else QUEUED
        self.t_issue = time.time()
        self.t_start = self.t_issue if running else None
        self.t_end = None
        self.error = None

    def start(self) -> None:
        self.state = RUNNING
        self.t_start = time.time()

    def finish(self, error=None) -> None:
        self.state = FAILED if error is not None else COMPLETED
        self.t_end = time.time()
        if error is not None:
            self.error = f"{type(error).__name__}: {error}"

    def as_dict(self) -> dict:
        call = self.call
        return {
            "group": self.group, "rank": self.rank, "size": self.size, "seq": self.seq,
            "op": self.op, "call": call.describe() if call is not None else self.op,
            "dtype": str(call.dtype).replace("torch.", "") if call is not None and call.dtype else None,
            "count": call.count if call is not None else None,
            "root": call.root if call is not None else None, "algo": self.algo,
            "state": self.state, "t_issue": self.t_issue, "t_start": self.t_start,
            "t_end": self.t_end, "error": self.error,
        }


class FlightRecorder:
    """Process-wide ring of the most recent collectives."""

    def __init__(self, size: int):
        self.size = size
        self._ring: deque = deque(maxlen=max(1, size))
        self._lock = threading.Lock()
        self.dumps = 0

    def issue(self, group: str, rank: int, size: int, seq: int, op: str, call,
              running: bool = False, algo=None) -> Record | None:
        """Record a collective issued now (``running``: and started at once; ``algo``: the
        algorithm, if known yet)."""
        if not self.size:
            return None
        rec = Record(group, rank, size, seq, op, call, running, algo)
        self._ring.append(rec)
        return rec

    def path(self) -> str:
        """Where ``dump`` writes: ``$NEURON_DIST_FR_DIR`` (default: the temp directory)."""
        directory = flight_recorder_dir()
        rank = global_rank()
        return os.path.join(directory, f"neuron-fr-rank{'?' if rank is None else rank}"
                                       f"-pid{os.getpid()}.json")

    def dump(self, reason: str) -> str | None:
        """Write the ring to ``path()``; returns the path (None if disabled or it failed)."""
        if not self.size:
            return None
        with self._lock:
            return self._write(reason)

    def dump_from_signal(self, reason: str) -> None:
        """``dump`` from a signal handler: now if no dump is under way, else by a thread of
        its own once that one ends. (A handler runs on the main thread between two of its
        bytecodes, possibly inside a dump that holds the lock: waiting for it there would
        wait forever.)"""
        if not self.size:
            return
        if self._lock.acquire(blocking=False):
            try:
                self._write(reason)
            finally:
                self._lock.release()
            return
        threading.Thread(target=self.dump, args=(reason,), daemon=True,
                         name="neuron-fr-dump").start()

    def _write(self, reason: str) -> str | None:
        records = [r.as_dict() for r in list(self._ring)]
        doc = {"pid": os.getpid(), "rank": global_rank(), "reason": reason,
               "time": time.time(), "records": records}
        path = self.path()
        tmp = None
        try:
            directory = os.path.dirname(path) or "."
            os.makedirs(directory, exist_ok=True)
            # A fresh file of a random name (O_EXCL, mode 0600) in the often shared temp
            # directory: a name known in advance could be a planted symlink. The rename
            # replaces whatever is at ``path`` (a symlink itself, never its target).
            fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp",
                                       dir=directory)
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1)
            os.replace(tmp, path)
        except OSError:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            return None
        self.dumps += 1
        return path


def global_rank() -> int | None:
    """This process's rank in the default process group, or None if there is none (yet)."""
    import torch.distributed as dist

    try:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    except (RuntimeError, ValueError):
        return None


recorder = FlightRecorder(flight_recorder_size())


def install_signal_handler() -> None:
    """Dump on SIGUSR1, unless the program handles that signal itself (main thread only)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
        return
    if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
        return
    signal.signal(signal.SIGUSR1, _on_sigusr1)


def _on_sigusr1(signum, frame) -> None:
    recorder.dump_from_signal("SIGUSR1")
