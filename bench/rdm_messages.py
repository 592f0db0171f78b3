"""CPU and Python calls per message of the rdm transport: ``python -m bench.rdm_messages``.

How it works
------------
Two ``RdmTransport`` endpoints of one group live in this process, joined by their rails
over loopback, and play ping-pong from one thread: ``isend`` on one, ``irecv`` + ``wait``
on the other, and back. Every message therefore pays the whole path once at each end (the
send, the progress engine's poll and read, the protocol's landing and acknowledgement,
the request's completion), and nothing waits for another process to be scheduled, so the
process's CPU time per message is the transport's own cost, both ends together. With
``--calls`` the timed loop runs again under ``cProfile`` and the Python function calls per
message are counted too (the profiler slows the loop: its CPU figure is not reported).

This is the figure that decides small collectives between nodes when ranks outnumber
cores (docs/performance.md, "Many nodes"): a log-depth all_reduce costs about one message
sent and one received per round and rank. The raw-socket line is the floor in the same
run: the same ping-pong with ``sendall`` and ``recv_into`` on one blocking TCP connection.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

from neuron_dist.transport.rdm.driver import RdmTransport


def _pair(rails: int):
    key, group = os.urandom(32), b"bench-rdm-messages"
    ts = [RdmTransport(r, 2, host="127.0.0.1", rails=rails, key=key, group=group)
          for r in range(2)]
    addrs = {r: t.address for r, t in enumerate(ts)}
    for t in ts:
        t.connect(addrs, time.monotonic() + 10)
    return ts  # (the rails open at the first send: the warm-up's)


def _rdm_loop(ts, nbytes: int):
    a, b = ts
    msg, into_a, into_b = bytes(nbytes), bytearray(nbytes), bytearray(nbytes)

    def round_trip():
        a.isend(1, 5, msg)
        b.irecv(0, 5, into_b).wait(time.monotonic() + 10)
        b.isend(0, 5, msg)
        a.irecv(1, 5, into_a).wait(time.monotonic() + 10)
    return round_trip


def _raw_loop(nbytes: int):
    listener = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    listener.close()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg, into = bytes(nbytes), memoryview(bytearray(nbytes))

    def read(sock):
        got = 0
        while got < nbytes:
            got += sock.recv_into(into[got:])

    def round_trip():
        a.sendall(msg)
        read(b)
        b.sendall(msg)
        read(a)
    return round_trip, (a, b)


def _cpu_per_message(loop, messages: int) -> float:
    for _ in range(max(1, messages // 20)):  # warm up
        loop()
    c0 = time.process_time()
    for _ in range(messages // 2):
        loop()
    return (time.process_time() - c0) / (messages // 2 * 2)


def _calls_per_message(loop, messages: int) -> float:
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(messages // 2):
        loop()
    prof.disable()
    return pstats.Stats(prof).total_calls / (messages // 2 * 2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rdm_messages", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="8,4096,65536", help="message sizes in bytes")
    p.add_argument("--rails", default="1,4", help="rails per pair of ranks")
    p.add_argument("--messages", type=int, default=20000, help="timed messages per cell")
    p.add_argument("--calls", action="store_true", help="count Python calls per message")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"# python -m bench.rdm_messages {' '.join(argv if argv is not None else sys.argv[1:])}")
    print("# ping-pong in one process over loopback; CPU per message = both ends")
    print(f"{'path':>10} {'bytes':>7} {'CPU us/msg':>11}" + (f" {'calls/msg':>10}" if args.calls else ""))
    for size in sizes:
        loop, socks = _raw_loop(size)
        try:
            line = f"{'raw TCP':>10} {size:>7} {_cpu_per_message(loop, args.messages) * 1e6:>11.1f}"
            if args.calls:
                line += f" {_calls_per_message(loop, args.messages // 4):>10.1f}"
            print(line, flush=True)
        finally:
            for s in socks:
                s.close()
        for rails in (int(r) for r in args.rails.split(",")):
            ts = _pair(rails)
            try:
                loop = _rdm_loop(ts, size)
                line = (f"{f'rdm x{rails}':>10} {size:>7} "
                        f"{_cpu_per_message(loop, args.messages) * 1e6:>11.1f}")
                if args.calls:
                    line += f" {_calls_per_message(loop, args.messages // 4):>10.1f}"
                print(line, flush=True)
            finally:
                for t in ts:
                    t.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
