"""One rank of the check that ``MpiTransport.cancel`` never hands back a buffer MPI still
owns (issue 53, finding 9), run by tests/across_nodes/test_mpi_transport.py as
``mpiexec -n 2 python tests/across_nodes/mpi_job_withdraw.py CASE`` (one case a job: two
of them end it).

MPI cannot withdraw a receive it has matched nor a send it has started (``MPI_Cancel``
cannot). ``cancel`` gives such a request ``CANCEL_GRACE`` to complete; if MPI still owns
the buffer then, it must end the job (``MPI_Abort``, after a critical message on stderr)
instead of returning, since its caller would take the buffer back while MPI writes into it
(a receive) or reads it (a send: the peer's receive could complete with bytes written after
the withdrawal). To hold a message in the middle deterministically, the rank MPI needs to
move it stops itself (SIGSTOP) once MPI has started it. MPICH's cross-memory attach is
switched off (``MPIR_CVAR_CH4_CMA_ENABLE=0``): with it, a receiver copies a large message
out of a stopped sender's memory by itself; across nodes a rendezvous needs both sides, as
here.

* ``receive``: rank 0 posts a 64 MiB send to rank 1 and stops. Rank 1's receive is matched;
  rank 1 cancels it. The job must end in ``cancel`` (MPI_Abort, rank 0 still stopped).
* ``send``: rank 1's receive of a 64 MiB message is matched, and rank 1 stops. Rank 0
  cancels its send. The job must end in ``cancel``.
* ``resume``: as ``receive`` with 8 MiB, but rank 0 is let go on 0.05 s into the cancel:
  ``cancel`` returns False (the receive completed within the grace) and the buffer holds
  exactly what was sent.

* ``close``: as ``receive``, but rank 1 closes its transport with an error instead of
  cancelling (``close(error)`` fails pending requests): the job must end in ``close``.
* ``notice``: rank 0 posts an 8 MiB send to rank 1 and stops; rank 1's receive is matched,
  and rank 1 fails rank 0 as an abort notice from it does (``fail_peer``: a real notice
  cannot overtake the message's data on one node), and lets rank 0 go on 0.1 s later. The
  receive fails with ``PeerAborted`` only once MPI has finished with its buffer: a
  sentinel rank 1 writes into it after the failure stays intact.

Every rank prints ``@@pid RANK PID`` first (the test checks none is left). If ``cancel``
returns in ``receive`` or ``send`` (the old driver: True), rank 1 / rank 0 prints
``@@cancel-returned CASE VALUE`` and, as the old test did, reuses the buffer, lets the peer
go on and measures the damage (``@@mpi-withdraw {json}`` from rank 0 at the end).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

# Before MPI is initialised (by the import below): a large message then needs the
# sender's progress, as between nodes.
os.environ.setdefault("MPIR_CVAR_CH4_CMA_ENABLE", "0")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from transport.errors import PeerAborted, PeerTimeout, TransportError  # noqa: E402
from transport.mpi import MpiTransport, mpi_lock  # noqa: E402
from transport.mpi import orphans  # noqa: E402

import mpi_job_common as common  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
assert SIZE == 2, SIZE
N = 64 << 20
N_RESUME = 8 << 20  # moves in ~0.15 s here without cross-memory attach (64 MiB: ~1 s)
LOCK = mpi_lock()
report: dict = {}


def deadline(seconds: float = 20.0) -> float:
    return time.monotonic() + seconds


def barrier() -> None:
    common.barrier(LOCK)


def pattern(n: int = N) -> np.ndarray:
    return np.random.default_rng(53).integers(0, 256, n, dtype=np.uint8)


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def wait_until(what: str, cond, seconds: float = 10.0, pause: float = 0.001) -> None:
    end = deadline(seconds)
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"rank {RANK}: {what} did not happen in {seconds} s")
        if pause:
            time.sleep(pause)
        else:
            os.sched_yield()


def matched(t: MpiTransport, peer: int, tag: int):
    """A condition: MPI has matched the receive posted on ``(peer, tag)``."""
    def cond() -> bool:
        with t.lock:
            t.poll()
            return (peer, tag) not in t.matcher.recvq
    return cond


def drain(t: MpiTransport) -> None:
    """Drive MPI until it has completed every request the transport gave up (both ranks
    do this at once: the message moves on only while both make MPI calls)."""
    def done() -> bool:
        with t.lock:
            t.poll()
            orphans.sweep(MPI)
            return not orphans.ORPHANS and not t.active.reqs
    wait_until("MPI's completion of the withdrawn requests", done, 30.0, pause=0)


def returned(case: str, value) -> None:
    """cancel returned although MPI owned the buffer: say so (the test fails on it)."""
    print(f"@@cancel-returned {case} {value!r}", flush=True)
    report[f"{case}_cancel_returned"] = repr(value)


def withdrawal(peer: int) -> PeerTimeout:
    return PeerTimeout([peer], 0.0, "withdrawn by the test", network=True)


def case_receive(t: MpiTransport, pids: list) -> None:
    tag = 5
    if RANK == 1:
        buf = np.zeros(N, np.uint8)
        req = t.irecv(0, tag, buf)
    barrier()
    if RANK == 0:
        send = t.isend(1, tag, pattern())
        os.kill(os.getpid(), signal.SIGSTOP)  # (the old driver: rank 1 lets us go on)
        try:
            send.wait(deadline())
        except (PeerAborted, PeerTimeout, TransportError):
            pass
        drain(t)
    else:
        try:
            wait_until("the match of the receive", matched(t, 0, tag))
            wait_until("rank 0's stop", lambda: stopped(pids[0]))
            assert not req.done(), "the receive completed without its sender"
            withdrawn = t.cancel(req, withdrawal(0))  # must end the job
            returned("receive", withdrawn)
            buf[:] = 0xAB  # the caller takes its buffer back
        finally:
            os.kill(pids[0], signal.SIGCONT)
        drain(t)
        written = int(np.count_nonzero(buf != 0xAB))
        report["receive_bytes_written_after_cancel"] = written
    barrier()


def case_send(t: MpiTransport, pids: list) -> None:
    tag = 6
    sent = pattern()
    if RANK == 1:
        buf = np.zeros(N, np.uint8)
        req = t.irecv(0, tag, buf)
    barrier()
    if RANK == 0:
        data = sent.copy()
        send = t.isend(1, tag, data)
        try:
            wait_until("rank 1's stop", lambda: stopped(pids[1]))
            assert not send.done(), "the send completed without its receiver"
            withdrawn = t.cancel(send, withdrawal(1))  # must end the job
            returned("send", withdrawn)
            data[:] = 0xCD  # the caller takes its tensor back and changes it
        finally:
            os.kill(pids[1], signal.SIGCONT)
        drain(t)
    else:
        wait_until("the match of the receive", matched(t, 0, tag))
        os.kill(os.getpid(), signal.SIGSTOP)  # (the old driver: rank 0 lets us go on)
        try:
            req.wait(deadline())
        except (PeerAborted, PeerTimeout, TransportError) as e:
            report["send_case_receive"] = f"failed: {type(e).__name__}"
            drain(t)
        else:
            report["send_case_receive"] = "completed"
            report["send_case_wrong_bytes"] = int(np.count_nonzero(buf != sent))
            drain(t)
    barrier()


def case_resume(t: MpiTransport, pids: list) -> None:
    tag = 7
    sent = pattern(N_RESUME)
    if RANK == 1:
        buf = np.zeros(N_RESUME, np.uint8)
        req = t.irecv(0, tag, buf)
    barrier()
    if RANK == 0:
        send = t.isend(1, tag, sent)
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 1 lets us go on 0.05 s into its cancel
        send.wait(deadline())
    else:
        wait_until("the match of the receive", matched(t, 0, tag))
        wait_until("rank 0's stop", lambda: stopped(pids[0]))
        assert not req.done(), "the receive completed without its sender"
        go_on = threading.Timer(0.05, os.kill, (pids[0], signal.SIGCONT))
        go_on.start()
        start = time.monotonic()
        withdrawn = t.cancel(req, withdrawal(0))
        go_on.join()
        report["resume_cancel"] = withdrawn
        report["resume_cancel_seconds"] = round(time.monotonic() - start, 3)
        report["resume_error"] = repr(req.error)
        report["resume_wrong_bytes"] = int(np.count_nonzero(buf != sent))
        assert withdrawn is False and req.error is None, report
        assert report["resume_wrong_bytes"] == 0, report
    barrier()


def case_close(t: MpiTransport, pids: list) -> None:
    tag = 8
    if RANK == 1:
        buf = np.zeros(N, np.uint8)
        req = t.irecv(0, tag, buf)
    barrier()
    if RANK == 0:
        send = t.isend(1, tag, pattern())
        os.kill(os.getpid(), signal.SIGSTOP)  # (the old driver: rank 1 lets us go on)
        try:
            send.wait(deadline())
        except (PeerAborted, PeerTimeout, TransportError):
            pass
        drain(t)
    else:
        try:
            wait_until("the match of the receive", matched(t, 0, tag))
            wait_until("rank 0's stop", lambda: stopped(pids[0]))
            t.close(TransportError("closed by the test"))  # must end the job
            returned("close", req.error)
            buf[:] = 0xAB  # the failed receive's buffer is the caller's again
        finally:
            os.kill(pids[0], signal.SIGCONT)
        drain(t)
        report["close_bytes_written_after_failure"] = int(np.count_nonzero(buf != 0xAB))
    barrier()


def case_notice(t: MpiTransport, pids: list) -> None:
    tag = 9
    sent = pattern(N_RESUME)
    if RANK == 1:
        buf = np.zeros(N_RESUME, np.uint8)
        req = t.irecv(0, tag, buf)
    barrier()
    if RANK == 0:
        send = t.isend(1, tag, sent)
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 1 lets us go on 0.1 s after the notice
        send.wait(deadline())
    else:
        wait_until("the match of the receive", matched(t, 0, tag))
        wait_until("rank 0's stop", lambda: stopped(pids[0]))
        go_on = threading.Timer(0.1, os.kill, (pids[0], signal.SIGCONT))
        go_on.start()
        # What reading rank 0's abort notice does (_read_control). A real notice cannot
        # overtake the message here: on one node MPICH queues it behind the message's data.
        with t.lock:
            t.fail_peer(0, PeerAborted(0, "rank 0 gave up (the test)", network=True))
        try:
            req.wait(deadline())
        except PeerAborted as e:
            report["notice_receive"] = f"failed: {type(e).__name__}"
        else:
            report["notice_receive"] = "completed"
        buf[:] = 0xAB  # the request ended: its buffer is the caller's again
        go_on.join()
        drain(t)
        report["notice_bytes_written_after_failure"] = int(np.count_nonzero(buf != 0xAB))
    barrier()


CASES = {"receive": case_receive, "send": case_send, "resume": case_resume,
         "close": case_close, "notice": case_notice}


def main() -> None:
    print(f"@@pid {RANK} {os.getpid()}", flush=True)
    with LOCK:
        pids = WORLD.allgather(os.getpid())
    (name,) = sys.argv[1:]
    barrier()
    start = time.monotonic()
    t = MpiTransport(RANK, SIZE, [0, 1], label=f"withdraw-{name}", deadline=deadline())
    t.connect(range(SIZE), deadline())
    try:
        CASES[name](t, pids)
    finally:
        t.close()
    report[f"{name}_seconds_rank{RANK}"] = round(time.monotonic() - start, 2)
    with LOCK:
        parts = WORLD.gather(report, root=0)
    if RANK == 0:
        merged = {k: v for part in parts for k, v in part.items()}
        print("@@mpi-withdraw " + json.dumps(merged), flush=True)


if __name__ == "__main__":
    common.run(main)
