# Link benchmark: one-directional bulk throughput between two processes.
# ``python -m bench.link --where loopback|veth [--bytes 1G] [--json FILE]``
#
# Why: to choose the driver of the inter-node transport (raw sockets or pyzmq) and to
# fix the baseline it has to reach (goal: >= 90% of several parallel raw TCP streams).
#
# Method
#   * Three processes. The orchestrator (this command) starts a receiver and a sender.
#     Both run this file as a plain script (``python -P link.py --role recv|send``), so they
#     import only the standard library and pyzmq (not torch). The orchestrator drives
#     them over their stdin/stdout with one JSON object per line; no control traffic
#     crosses the link under test. Both live for the whole benchmark, so every run below
#     reuses warm processes and preallocated buffers.
#   * --where loopback: both in this network namespace, over 127.0.0.1.
#     --where veth: two fresh network namespaces joined by a veth pair
#     (``ndlink-<pid>-recv`` / ``ndlink-<pid>-send``, devices ``ndl<pid>r`` / ``ndl<pid>s``,
#     10.R.X.1 (receiver) and 10.R.X.2 (sender) /30 with R, X taken from the pid); the
#     receiver runs under ``ip netns exec`` in one, the sender in the other. ``--netem``
#     puts ``tc qdisc ... netem ARGS`` on the sender's end (the data direction), ``--qdisc``
#     any other root qdisc there (e.g. tbf, when the kernel has no netem).
#     The namespaces are deleted on every exit path: try/finally, atexit, and SIGINT /
#     SIGTERM / SIGHUP turned into exceptions; namespaces left by a run that was
#     SIGKILLed (their pid is dead) are swept at the next veth run's start. Everything is
#     bounded by --timeout: on expiry the children are killed (their process groups) and
#     the namespaces removed; children also carry PR_SET_PDEATHSIG and a watchdog.
#   * One run = one mode variant at one stream count S, moving --bytes in total, split
#     evenly over S streams; each stream is its own TCP connection and has one thread
#     on each side. Connections (and zmq handshakes, proven by a 1-byte warm-up message
#     per socket) are set up before the clock starts. Data comes from, and lands in,
#     preallocated buffers of --window bytes (256 MiB by default, larger than any cache;
#     one disjoint region per stream, used cyclically), chunks of --chunk (1 MiB).
#   * Clock: the sender takes t0 = CLOCK_MONOTONIC just before releasing its threads;
#     the receiver takes t1 = CLOCK_MONOTONIC when its last thread has its last byte.
#     Both processes share the kernel's monotonic clock (same host; network namespaces
#     do not change clocks), so GB/s = bytes / (t1 - t0), GB = 1e9 bytes. Process CPU
#     (user+sys from getrusage, all threads incl. zmq I/O threads) is reported per GB
#     moved; it is approximate (softirq work is not always charged to a process).
#   * Repetitions: --reps rounds, each round running every (variant, S) once, in
#     order; the best of the rounds is reported (interleaving spreads any background
#     load over all cells instead of hitting one).
#   * Data is checked after each run (outside the timed window) unless --no-verify: the
#     source holds a byte pattern (i % 251), the destination is reset to 0xFF before
#     each run, and every region written must equal the source region.
#
# Variants
#   tcp-def / tcp-4m : socket.sendall(memoryview slice) of the source; receiver
#       sock.recv_into(destination slice, n, MSG_WAITALL), i.e. straight into the
#       destination (one kernel->user copy). TCP_NODELAY on both ends. tcp-def keeps the
#       kernel's buffer autotuning, tcp-4m sets SO_SNDBUF/SO_RCVBUF = 4 MiB (before
#       connect / listen; the kernel doubles it and caps at net.core.[wr]mem_max, and a
#       fixed size turns autotuning off). "tcp best" is the better of the two per S.
#   zmq-{push,pair}-{copy,zc}[-dst] : pyzmq, one PUSH->PULL (or PAIR<->PAIR) socket pair
#       per stream, one message per chunk. send(copy=True) copies into a zmq message;
#       send(copy=False) hands zmq the memoryview (zero-copy; note a real transport must
#       then track=True and wait before reusing the buffer, which this benchmark skips as
#       its source never changes). Receiver: recv(copy=False) and, for -dst, copy the
#       frame into the destination (what a transport landing in tensors must do; zmq
#       itself has already read the bytes into its own message), without -dst the frame
#       is dropped (an upper bound no real receiver reaches). One zmq context per side and
#       run, io_threads = S unless --zmq-io-threads; SNDHWM/RCVHWM = --zmq-hwm.

"""Link benchmark (raw TCP streams vs pyzmq): ``python -m bench.link``.

See the comment block above for the method. Exit status: 0 when every run worked, 1 when
a run failed or the time limit passed, 2 for bad arguments or a failed namespace set-up,
130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import os
import platform
import re
import resource
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

# ----------------------------------------------------------------------------- variants

VARIANTS = {
    # name: (mode, parameters, table label)
    "tcp-def": ("tcp", {"bufsize": 0}, "sendall -> recv_into dst, socket buffers default"),
    "tcp-4m": ("tcp", {"bufsize": 4 << 20}, "sendall -> recv_into dst, SO_SNDBUF/RCVBUF 4 MiB"),
    "zmq-push-copy-dst": ("zmq", {"kind": "push", "copy": True, "dst": True},
                          "PUSH send(copy=True)  -> recv(copy=False) + copy into dst"),
    "zmq-push-zc-dst": ("zmq", {"kind": "push", "copy": False, "dst": True},
                        "PUSH send(copy=False) -> recv(copy=False) + copy into dst"),
    "zmq-pair-zc-dst": ("zmq", {"kind": "pair", "copy": False, "dst": True},
                        "PAIR send(copy=False) -> recv(copy=False) + copy into dst"),
    "zmq-push-copy": ("zmq", {"kind": "push", "copy": True, "dst": False},
                      "PUSH send(copy=True)  -> recv(copy=False), no copy (bound)"),
    "zmq-push-zc": ("zmq", {"kind": "push", "copy": False, "dst": False},
                    "PUSH send(copy=False) -> recv(copy=False), no copy (bound)"),
}
MODES = ("tcp", "zmq")
NS_PREFIX = "ndlink-"
_NS_RE = re.compile(r"^ndlink-(\d+)-(recv|send)$")
_DEV_RE = re.compile(r"^ndl(\d+)[rs]$")

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``"256M"`` -> 268435456 (K, M, G are powers of 1024). (As ``sweep.parse_size``: this
    file also runs as a standalone script inside network namespaces, without its package.)"""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 8M, 256M, 1G)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def human_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{n} B"


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _sysctls() -> dict:
    out = {}
    for key in ("net/core/wmem_max", "net/core/rmem_max", "net/ipv4/tcp_wmem", "net/ipv4/tcp_rmem",
                "net/ipv4/tcp_congestion_control"):
        try:
            with open(f"/proc/sys/{key}") as f:
                out[key.replace("/", ".")] = " ".join(f.read().split())
        except OSError:
            pass
    return out


def _pattern(n: int) -> bytearray:
    """n bytes of i % 251 (no period aligned with any power-of-two region or chunk)."""
    base = bytes(range(251))
    buf = bytearray(base * (n // 251 + 1))
    del buf[n:]
    return buf


def _fill(buf: bytearray, value: int) -> None:
    ctypes.memset((ctypes.c_char * len(buf)).from_buffer(buf), value, len(buf))


# ----------------------------------------------------------------------------- children

def _close_sockets(side) -> None:
    """Close a sender's or receiver's sockets (raw or zmq) and its zmq context, if any."""
    for sock in side.socks:
        try:
            sock.close()
        except Exception:  # noqa: BLE001
            pass
    side.socks = []
    if getattr(side, "ctx", None) is not None:
        side.ctx.term()
        side.ctx = None


class _Threads:
    """Worker threads that record their first exception; ``join`` re-raises it."""

    def __init__(self):
        self.threads, self.errors = [], []

    def start(self, fn, *args):
        def body():
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - reported to the orchestrator
                self.errors.append(f"{type(e).__name__}: {e}")
        t = threading.Thread(target=body, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self, timeout: float):
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise TimeoutError("a worker thread did not finish in time")
        if self.errors:
            raise RuntimeError(self.errors[0])


class _Receiver:
    def __init__(self, args):
        self.addr, self.timeout = args.addr, args.timeout
        self.dst = bytearray(args.window)
        _fill(self.dst, 0xFF)
        self.expected = _pattern(args.window) if args.verify else None
        self.run = None

    def setup(self, cfg):
        self.cfg = cfg
        self.threads = _Threads()
        self.connected = threading.Semaphore(0)
        self.t_end = [0.0] * cfg["streams"]
        self.got = [0] * cfg["streams"]
        self.bufs = [None] * cfg["streams"]
        self.socks = []
        ports = []
        if cfg["mode"] == "tcp":
            for i in range(cfg["streams"]):
                ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if cfg["bufsize"]:  # before listen(): the window scale is fixed at the handshake
                    ls.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, cfg["bufsize"])
                ls.bind((self.addr, 0))
                ls.listen(1)
                ls.settimeout(self.timeout)
                self.socks.append(ls)
                ports.append(ls.getsockname()[1])
                self.threads.start(self._tcp_stream, i, ls)
        else:
            import zmq
            self.ctx = zmq.Context(io_threads=cfg["io_threads"])
            kind = zmq.PULL if cfg["kind"] == "push" else zmq.PAIR
            for i in range(cfg["streams"]):
                s = self.ctx.socket(kind)
                s.setsockopt(zmq.RCVHWM, cfg["hwm"])
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.RCVTIMEO, int(self.timeout * 1000))
                ports.append(s.bind_to_random_port(f"tcp://{self.addr}"))
                self.socks.append(s)
                self.threads.start(self._zmq_stream, i, s)
        return {"ports": ports}

    def _region(self, i):
        cfg = self.cfg
        lo = i * cfg["region"]
        return memoryview(self.dst)[lo:lo + cfg["region"]], cfg["per_stream"][i]

    def _tcp_stream(self, i, ls):
        conn, _ = ls.accept()
        ls.close()
        self.socks.append(conn)
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connected.release()
        mv, left = self._region(i)
        region, chunk, pos = len(mv), self.cfg["chunk"], 0
        while left:
            n = min(chunk, left, region - pos)
            got = conn.recv_into(mv[pos:pos + n], n, socket.MSG_WAITALL)
            if not got:
                raise ConnectionError(f"stream {i}: sender closed with {left} bytes missing")
            pos += got
            left -= got
            if pos == region:
                pos = 0
        self.t_end[i] = time.monotonic()
        self.got[i] = self.cfg["per_stream"][i]
        self.bufs[i] = conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)

    def _zmq_stream(self, i, s):
        w = s.recv(copy=False)
        if len(w.buffer) != 1:
            raise RuntimeError(f"stream {i}: expected the 1-byte warm-up message")
        self.connected.release()
        mv, left = self._region(i)
        region, pos, dst = len(mv), 0, self.cfg["dst"]
        total = left
        while left:
            f = s.recv(copy=False)
            b = f.buffer
            n = len(b)
            if n > left:
                raise RuntimeError(f"stream {i}: {n}-byte message with {left} bytes left")
            if dst:
                mv[pos:pos + n] = b
                pos += n
                if pos == region:
                    pos = 0
            left -= n
        self.t_end[i] = time.monotonic()
        self.got[i] = total

    def wait_connected(self, _cfg):
        deadline = time.monotonic() + self.timeout
        for _ in range(self.cfg["streams"]):
            while not self.connected.acquire(timeout=0.2):
                if self.threads.errors:
                    raise RuntimeError(self.threads.errors[0])
                if time.monotonic() > deadline:
                    raise TimeoutError("senders did not connect in time")
        self.cpu0 = _cpu_seconds()
        return {}

    def wait_done(self, _cfg):
        try:
            self.threads.join(self.timeout)
        finally:
            cpu = _cpu_seconds() - self.cpu0
            self._close()
        out = {"t_end": max(self.t_end), "bytes": sum(self.got), "cpu_s": cpu,
               "rcvbuf": [b for b in self.bufs if b is not None]}
        cfg = self.cfg
        if self.expected is not None and (cfg["mode"] == "tcp" or cfg["dst"]):
            bad = []
            for i in range(cfg["streams"]):
                lo = i * cfg["region"]
                hi = lo + min(cfg["region"], cfg["per_stream"][i])
                if self.dst[lo:hi] != self.expected[lo:hi]:
                    bad.append(i)
            if bad:
                raise RuntimeError(f"data check failed on stream(s) {bad}")
            out["verified"] = True
            _fill(self.dst, 0xFF)
        return out

    def _close(self):
        _close_sockets(self)


class _Sender:
    def __init__(self, args):
        self.timeout = args.timeout
        self.src = _pattern(args.window)

    def setup(self, cfg):
        self.cfg = cfg
        self.go = threading.Event()
        self.threads = _Threads()
        self.t_sent = [0.0] * cfg["streams"]
        self.bufs = [None] * cfg["streams"]
        self.socks = []
        host = cfg["host"]
        if cfg["mode"] == "tcp":
            for i, port in enumerate(cfg["ports"]):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                if cfg["bufsize"]:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg["bufsize"])
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, cfg["bufsize"])
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(self.timeout)
                s.connect((host, port))
                s.settimeout(None)
                self.socks.append(s)
                self.threads.start(self._tcp_stream, i, s)
        else:
            import zmq
            self.ctx = zmq.Context(io_threads=cfg["io_threads"])
            kind = zmq.PUSH if cfg["kind"] == "push" else zmq.PAIR
            for i, port in enumerate(cfg["ports"]):
                s = self.ctx.socket(kind)
                s.setsockopt(zmq.SNDHWM, cfg["hwm"])
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SNDTIMEO, int(self.timeout * 1000))
                s.connect(f"tcp://{host}:{port}")
                s.send(b"w")  # warm-up: the receiver sees it only once the handshake is done
                self.socks.append(s)
                self.threads.start(self._zmq_stream, i, s)
        return {}

    def _region(self, i):
        lo = i * self.cfg["region"]
        return memoryview(self.src)[lo:lo + self.cfg["region"]], self.cfg["per_stream"][i]

    def _tcp_stream(self, i, s):
        mv, left = self._region(i)
        region, chunk, pos = len(mv), self.cfg["chunk"], 0
        self.go.wait()
        while left:
            n = min(chunk, left, region - pos)
            s.sendall(mv[pos:pos + n])
            pos += n
            left -= n
            if pos == region:
                pos = 0
        self.t_sent[i] = time.monotonic()
        self.bufs[i] = s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)   # as autotuned by now

    def _zmq_stream(self, i, s):
        mv, left = self._region(i)
        region, chunk, pos, copy = len(mv), self.cfg["chunk"], 0, self.cfg["copy"]
        self.go.wait()
        while left:
            n = min(chunk, left, region - pos)
            s.send(mv[pos:pos + n], copy=copy)
            pos += n
            left -= n
            if pos == region:
                pos = 0
        self.t_sent[i] = time.monotonic()

    def start(self, _cfg):
        self.cpu0 = _cpu_seconds()
        t0 = time.monotonic()
        self.go.set()
        self.threads.join(self.timeout)
        return {"t_start": t0, "t_sent": max(self.t_sent), "sndbuf": [b for b in self.bufs if b]}

    def close(self, _cfg):
        # Called once the receiver has everything: zmq may still have been flushing until then.
        cpu = _cpu_seconds() - self.cpu0 if hasattr(self, "cpu0") else 0.0
        _close_sockets(self)
        return {"cpu_s": cpu}


def _child_main(args) -> int:
    """--role recv|send: serve the orchestrator's JSON-line requests on stdin/stdout."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                    # a stray print cannot corrupt the protocol
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the orchestrator decides when we stop

    def watchdog():
        time.sleep(args.timeout + 30)
        print(f"link bench {args.role}: watchdog expired, exiting", file=sys.stderr)
        os._exit(124)
    threading.Thread(target=watchdog, daemon=True).start()

    try:
        role = _Receiver(args) if args.role == "recv" else _Sender(args)
        out.write(json.dumps({"ok": True, "pid": os.getpid(), "sysctl": _sysctls()}) + "\n")
    except Exception as e:  # noqa: BLE001
        out.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        os._exit(1)
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        if op == "exit":
            break
        try:
            reply = getattr(role, op)(msg.get("cfg"))
            reply["ok"] = True
        except Exception as e:  # noqa: BLE001
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}",
                     "trace": traceback.format_exc(limit=4)}
        out.write(json.dumps(reply) + "\n")
    os._exit(0)                      # daemon threads and zmq contexts need no goodbye


# ----------------------------------------------------------------------------- orchestrator

def _set_pdeathsig():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001
        pass


class _Child:
    """A receiver or sender process and its line-based JSON conversation."""

    def __init__(self, name, argv):
        self.name = name
        self._buf = b""
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     bufsize=0, start_new_session=True,
                                     preexec_fn=_set_pdeathsig)

    def send(self, op, cfg=None):
        self.proc.stdin.write((json.dumps({"op": op, "cfg": cfg}) + "\n").encode())

    def reply(self, deadline):
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no answer before the time limit (--timeout)")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                data = os.read(fd, 1 << 16)
                if not data:
                    try:
                        rc = self.proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        rc = "?"
                    raise RuntimeError(f"{self.name} exited (status {rc})")
                self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        msg = json.loads(line)
        if not msg.get("ok"):
            raise RuntimeError(f"{self.name}: {msg.get('error')}\n{msg.get('trace', '')}".rstrip())
        return msg

    def call(self, op, cfg, deadline):
        self.send(op, cfg)
        return self.reply(deadline)

    def stop(self):
        """Ask politely (EOF / exit), then kill the child's own process group by its id."""
        p = self.proc
        if p.poll() is None:
            try:
                p.stdin.write(b'{"op": "exit"}\n')
                p.stdin.close()
            except OSError:
                pass
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)   # start_new_session: pgid == pid
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _ip(*args, check=True):
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")
    return r


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_netns() -> list[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def sweep_stale() -> list[str]:
    """Delete namespaces / devices of earlier runs whose orchestrator pid is gone."""
    removed = []
    for ns in list_netns():
        m = _NS_RE.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            if _ip("netns", "del", ns, check=False).returncode == 0:
                removed.append(ns)
    r = _ip("-o", "link", "show", "type", "veth", check=False)
    for line in r.stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        m = _DEV_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            if _ip("link", "del", name, check=False).returncode == 0:
                removed.append(name)
    return removed


class _Env:
    """Where the two processes run; owns the namespaces and the children, undoes both."""

    def __init__(self, args):
        self.args = args
        self.children: list[_Child] = []
        self.namespaces: list[str] = []
        self.devices: list[str] = []
        self.info: dict = {"where": args.where}
        self._closed = False

    def create(self):
        a = self.args
        if a.where == "loopback":
            self.recv_addr = self.send_from = "127.0.0.1"
            self.prefix = {"recv": [], "send": []}
            return
        pid = os.getpid()
        r, x = 1 + pid % 254, (pid // 254) % 64 * 4
        self.recv_addr, self.send_from = f"10.{r}.{x}.1", f"10.{r}.{x}.2"
        ns_r, ns_s = f"{NS_PREFIX}{pid}-recv", f"{NS_PREFIX}{pid}-send"
        dev_r, dev_s = f"ndl{pid}r", f"ndl{pid}s"
        self.namespaces = [ns_r, ns_s]     # registered first: a half-made set-up is undone too
        self.devices = [dev_r, dev_s]
        swept = sweep_stale()
        if swept:
            print(f"link bench: removed leftovers of dead runs: {' '.join(swept)}", file=sys.stderr)
        _ip("netns", "add", ns_r)
        _ip("netns", "add", ns_s)
        _ip("link", "add", dev_r, "netns", ns_r, "type", "veth", "peer", "name", dev_s, "netns", ns_s)
        for ns, dev, addr in ((ns_r, dev_r, self.recv_addr), (ns_s, dev_s, self.send_from)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            if a.mtu:
                _ip("-n", ns, "link", "set", dev, "mtu", str(a.mtu))
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
        qdisc = (["netem", *shlex.split(a.netem)] if a.netem else
                 shlex.split(a.qdisc) if a.qdisc else None)
        if qdisc:
            cmd = ["ip", "netns", "exec", ns_s, "tc", "qdisc", "add", "dev", dev_s, "root", *qdisc]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if res.returncode:
                hint = (" (this kernel may lack sch_netem: CONFIG_NET_SCH_NETEM; --qdisc takes "
                        "another qdisc such as 'tbf rate 10gbit burst 4mb latency 50ms')"
                        if a.netem else "")
                raise RuntimeError(f"`{shlex.join(cmd)}` failed: {res.stderr.strip()}{hint}")
            self.info["qdisc"] = " ".join(qdisc)
        self.prefix = {"recv": ["ip", "netns", "exec", ns_r], "send": ["ip", "netns", "exec", ns_s]}
        self.info.update(namespaces=self.namespaces, devices=self.devices)
        mtu = subprocess.run(["ip", "-n", ns_s, "-o", "link", "show", dev_s], capture_output=True,
                             text=True, timeout=30).stdout
        m = re.search(r"mtu (\d+)", mtu)
        self.info["mtu"] = int(m.group(1)) if m else None

    def spawn(self, role):
        a = self.args
        argv = [*self.prefix[role], sys.executable, "-P", os.path.abspath(__file__), "--role", role,
                "--addr", self.recv_addr, "--window", str(a.window_bytes), "--timeout", str(a.timeout)]
        if a.verify:
            argv.append("--verify-data")
        child = _Child(role, argv)
        self.children.append(child)
        return child

    def close(self):
        if self._closed:
            return
        self._closed = True
        for c in self.children:
            c.stop()
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)       # takes its veth end, and so the pair, along
        for dev in self.devices:                       # in case one was left in this namespace
            if os.path.exists(f"/sys/class/net/{dev}"):
                _ip("link", "del", dev, check=False)


def _plan(args) -> list[tuple[str, int]]:
    return [(v, s) for v in args.variant_list for s in args.stream_list]


def _run_config(args, variant, streams):
    mode, params, _ = VARIANTS[variant]
    total, chunk = args.total_bytes, args.chunk_bytes
    per = [total // streams] * streams
    per[-1] += total - sum(per)
    region = args.window_bytes // streams          # one disjoint region per stream,
    if region >= chunk:                            # a whole number of chunks when it can be
        region -= region % chunk
    return {"mode": mode, "streams": streams, "per_stream": per, "chunk": chunk, "region": region,
            "hwm": args.zmq_hwm, "io_threads": args.zmq_io_threads or streams, **params}


def _loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def _summarize(results: dict, args) -> dict:
    """best-of-reps cells, then tcp best and zmq-into-dst best per S and over all S."""
    cells = {}
    for (v, s), runs in results.items():
        if not runs:
            continue
        best = max(runs, key=lambda x: x["gbps"])
        cells[(v, s)] = {**best, "gbps_reps": [round(x["gbps"], 4) for x in runs]}
    summ = {"tcp_best": {}, "zmq_dst_best": {}, "zmq_nodst_best": {}}
    for (v, s), c in cells.items():
        mode, params, _ = VARIANTS[v]
        key = ("tcp_best" if mode == "tcp" else
               "zmq_dst_best" if params["dst"] else "zmq_nodst_best")
        cur = summ[key].get(s)
        if cur is None or c["gbps"] > cur["gbps"]:
            summ[key][s] = {"gbps": c["gbps"], "variant": v}
    tcp_all = max(summ["tcp_best"].values(), key=lambda x: x["gbps"], default=None)
    if tcp_all:
        s_best = [s for s, x in summ["tcp_best"].items() if x is tcp_all][0]
        summ["baseline"] = {"gbps": tcp_all["gbps"], "variant": tcp_all["variant"], "streams": s_best,
                            "target_90pct_gbps": 0.9 * tcp_all["gbps"]}
        zd = [(x["gbps"], x["variant"], s) for s, x in summ["zmq_dst_best"].items()]
        if zd:
            g, v, s = max(zd)
            summ["zmq_dst_overall"] = {"gbps": g, "variant": v, "streams": s,
                                       "fraction_of_baseline": g / tcp_all["gbps"]}
    return cells, summ


def _table(cells, summ, args, env_info) -> str:
    S = args.stream_list
    w = 62
    lines = []
    where = env_info["where"]
    if where == "veth":
        where += (f" ({env_info.get('recv_addr')} <- {env_info.get('send_from')}, "
                  f"mtu {env_info.get('mtu')}" + (f", qdisc {env_info['qdisc']}" if env_info.get("qdisc")
                                                  else "") + ")")
    else:
        where += " (127.0.0.1)"
    lines.append(f"link benchmark: {where}; {human_size(args.total_bytes)} per run, chunk "
                 f"{human_size(args.chunk_bytes)}, window {human_size(args.window_bytes)}, best of "
                 f"{args.reps}; GB/s = 1e9 B/s")
    hdr = f"{'variant':<18} {'':<{w}}" + "".join(f"{'S=' + str(s):>8}" for s in S)
    lines.append(hdr)
    lines.append("-" * len(hdr))

    def row(name, label, vals):
        return f"{name:<18} {label:<{w}}" + "".join(
            f"{v:>8.3f}" if isinstance(v, float) else f"{v:>8}" for v in vals)
    for v in args.variant_list:
        vals = [cells[(v, s)]["gbps"] if (v, s) in cells else "-" for s in S]
        lines.append(row(v, VARIANTS[v][2], vals))
        if v == "tcp-4m" and "tcp-def" in args.variant_list:
            vals = [summ["tcp_best"][s]["gbps"] if s in summ["tcp_best"] else "-" for s in S]
            lines.append(row("tcp best", "better of tcp-def / tcp-4m", vals))
    if summ["tcp_best"] and summ["zmq_dst_best"]:
        vals = []
        for s in S:
            t, z = summ["tcp_best"].get(s), summ["zmq_dst_best"].get(s)
            vals.append(f"{100 * z['gbps'] / t['gbps']:.0f}%" if t and z else "-")
        lines.append(row("zmq/tcp", "best zmq into dst / tcp best, same S", vals))
    lines.append("")
    lines.append("process CPU seconds per GB moved (sender + receiver, user+sys, approximate):")
    for v in args.variant_list:
        vals = [f"{cells[(v, s)]['send_cpu_s_per_gb']:.2f}+{cells[(v, s)]['recv_cpu_s_per_gb']:.2f}"
                if (v, s) in cells else "-" for s in S]
        lines.append(f"{v:<18} " + "".join(f"{x:>12}" for x in vals))
    b = summ.get("baseline")
    if b:
        lines.append("")
        lines.append(f"baseline (best raw TCP): {b['gbps']:.3f} GB/s ({b['variant']}, S={b['streams']}); "
                     f"90% target: {b['target_90pct_gbps']:.3f} GB/s")
        z = summ.get("zmq_dst_overall")
        if z:
            lines.append(f"best zmq landing in dst: {z['gbps']:.3f} GB/s ({z['variant']}, S={z['streams']}) "
                         f"= {100 * z['fraction_of_baseline']:.0f}% of the baseline")
    return "\n".join(lines)


def _orchestrate(args) -> int:
    env = _Env(args)
    results: dict = {k: [] for k in _plan(args)}
    status, error = 0, None
    started = time.monotonic()
    deadline = started + args.timeout
    load_before = _loadavg()
    side_info = {}

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)
    # SIGINT raises KeyboardInterrupt, TERM / HUP SystemExit; both reach the finally below.
    # A signal the caller set to be ignored (nohup, a shell's background job) stays ignored.
    for sig, handler in ((signal.SIGTERM, on_signal), (signal.SIGHUP, on_signal),
                         (signal.SIGINT, signal.default_int_handler)):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, handler)
    atexit.register(env.close)
    try:
        try:
            env.create()
        except Exception as e:  # noqa: BLE001
            print(f"link bench: set-up failed: {e}", file=sys.stderr)
            return 2
        env.info.update(recv_addr=env.recv_addr, send_from=env.send_from)
        recv, send = env.spawn("recv"), env.spawn("send")
        side_info["recv"] = recv.reply(deadline)
        side_info["send"] = send.reply(deadline)
        plan = _plan(args)
        for rep in range(args.reps):
            for variant, streams in plan:
                cfg = _run_config(args, variant, streams)
                cfg["host"] = env.recv_addr
                r = recv.call("setup", cfg, deadline)
                send.call("setup", {**cfg, "ports": r["ports"]}, deadline)
                recv.call("wait_connected", None, deadline)
                send.send("start")
                recv.send("wait_done")
                s = send.reply(deadline)
                rr = recv.reply(deadline)
                c = send.call("close", None, deadline)
                nbytes = sum(cfg["per_stream"])
                if rr["bytes"] != nbytes:
                    raise RuntimeError(f"{variant} S={streams}: receiver got {rr['bytes']} bytes, "
                                       f"expected {nbytes}")
                seconds = rr["t_end"] - s["t_start"]
                gb = nbytes / 1e9
                run = {"rep": rep, "seconds": seconds, "gbps": gb / seconds,
                       "send_cpu_s_per_gb": c["cpu_s"] / gb, "recv_cpu_s_per_gb": rr["cpu_s"] / gb,
                       "sender_done_s": s["t_sent"] - s["t_start"],
                       "sndbuf": sorted(set(s.get("sndbuf") or [])) or None,
                       "rcvbuf": sorted(set(rr.get("rcvbuf") or [])) or None,
                       "verified": bool(rr.get("verified"))}
                results[(variant, streams)].append(run)
                print(f"[rep {rep + 1}/{args.reps}] {variant:<18} S={streams}: {run['gbps']:7.3f} GB/s "
                      f"({seconds:.3f} s; cpu s/GB send {run['send_cpu_s_per_gb']:.2f} recv "
                      f"{run['recv_cpu_s_per_gb']:.2f})", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        status, error = 130, "interrupted"
    except SystemExit as e:
        status, error = (e.code if isinstance(e.code, int) else 1), "terminated by a signal"
    except Exception as e:  # noqa: BLE001
        status, error = 1, f"{type(e).__name__}: {e}"
    finally:
        # No second Ctrl-C / TERM may cut the clean-up short.
        old = {sig: signal.signal(sig, signal.SIG_IGN)
               for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            env.close()
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)
    if error:
        print(f"link bench: {error}", file=sys.stderr)
    cells, summ = _summarize(results, args)
    if cells:
        print(_table(cells, summ, args, env.info), flush=True)
    if args.json:
        doc = {
            "meta": {
                "command": shlex.join([sys.executable, "-m", "bench.link", *args.argv]),
                "where": args.where, "env": env.info, "bytes": args.total_bytes,
                "chunk": args.chunk_bytes, "window": args.window_bytes, "reps": args.reps,
                "streams": args.stream_list, "variants": {v: VARIANTS[v][2] for v in args.variant_list},
                "zmq_hwm": args.zmq_hwm, "zmq_io_threads": args.zmq_io_threads or "streams",
                "verify": args.verify, "timeout_s": args.timeout,
                "sysctl": {k: v.get("sysctl") for k, v in side_info.items()},
                "kernel": platform.release(), "cpus": os.cpu_count(), "python": platform.python_version(),
                "pyzmq": _zmq_versions(), "loadavg_before": load_before, "loadavg_after": _loadavg(),
                "wall_s": round(time.monotonic() - started, 2),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "status": status, "error": error,
                "units": "gbps = 1e9 bytes/s, best of reps; cpu_s_per_gb = process user+sys per GB",
            },
            "results": [{"variant": v, "mode": VARIANTS[v][0], "label": VARIANTS[v][2], "streams": s,
                         **{k: (round(x, 6) if isinstance(x, float) else x) for k, x in c.items()}}
                        for (v, s), c in sorted(cells.items(),
                                                key=lambda kv: (args.variant_list.index(kv[0][0]), kv[0][1]))],
            "summary": {k: ({str(s): x for s, x in val.items()}
                            if k in ("tcp_best", "zmq_dst_best", "zmq_nodst_best") else val)
                        for k, val in summ.items()},
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return status


def _zmq_versions():
    try:
        import zmq
        return {"pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()}
    except Exception:  # noqa: BLE001
        return None


EPILOG = """\
variants (--variants, default: all of the chosen --modes):
""" + "\n".join(f"  {k:<18} {v[2]}" for k, v in VARIANTS.items()) + """

examples:
  python -m bench.link --where loopback --bytes 1G --json results/link-loopback.json
  python -m bench.link --where veth --bytes 1G --json results/link-veth.json
  python -m bench.link --where veth --mtu 9001 --qdisc 'tbf rate 10gbit burst 4mb latency 50ms'
  python -m bench.link --modes tcp --streams 1,4 --bytes 256M --reps 1
(--where veth needs root and iproute2; it creates and always deletes two network namespaces)
"""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.link", formatter_class=_Formatter,
                                description="One-directional bulk throughput between two processes: "
                                            "S raw TCP streams vs pyzmq.", epilog=EPILOG)
    p.add_argument("--where", choices=("loopback", "veth"), default="loopback")
    p.add_argument("--modes", default="tcp,zmq", help="comma list of: tcp, zmq")
    p.add_argument("--variants", default=None, help="comma list of variant names (overrides --modes)")
    p.add_argument("--streams", default="1,2,4,8", help="stream counts S")
    p.add_argument("--bytes", default="1G", help="bytes per run (all streams together)")
    p.add_argument("--chunk", default="1M", help="send / recv_into chunk and zmq message size")
    p.add_argument("--window", default="256M",
                   help="source and destination buffer size (capped at --bytes), split over streams")
    p.add_argument("--reps", type=int, default=3, help="rounds; the best is reported")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole benchmark")
    p.add_argument("--netem", default=None, metavar="ARGS",
                   help="veth only: `tc qdisc add dev <sender end> root netem ARGS`")
    p.add_argument("--qdisc", default=None, metavar="SPEC",
                   help="veth only: any root qdisc on the sender's end, e.g. 'tbf rate 10gbit burst 4mb "
                        "latency 50ms'")
    p.add_argument("--mtu", type=int, default=0, help="veth only: MTU of both ends (0: kernel default)")
    p.add_argument("--zmq-hwm", type=int, default=32, help="zmq SNDHWM / RCVHWM (messages)")
    p.add_argument("--zmq-io-threads", type=int, default=0, help="zmq I/O threads per side (0: = S)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the data check after each run")
    # internal: the two workers
    p.add_argument("--role", choices=("recv", "send"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--addr", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--verify-data", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.total_bytes = parse_size(args.bytes)
        args.chunk_bytes = parse_size(args.chunk)
        window = parse_size(args.window)
        args.stream_list = [int(x) for x in args.streams.split(",") if x.strip()]
    except ValueError as e:
        p.error(str(e))
    if args.role:
        args.window = window
        args.verify = args.verify_data
        return args
    if args.variants:
        args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    else:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in MODES]
        if bad:
            p.error(f"unknown mode(s) {bad}; choose from {list(MODES)}")
        args.variant_list = [v for v, (m, _, _) in VARIANTS.items() if m in modes]
    bad = [v for v in args.variant_list if v not in VARIANTS]
    if bad or not args.variant_list:
        p.error(f"unknown variant(s) {bad}; choose from {list(VARIANTS)}")
    if not args.stream_list or min(args.stream_list) < 1:
        p.error("--streams needs positive counts")
    if args.total_bytes < max(args.stream_list) or args.chunk_bytes < 1 or args.reps < 1:
        p.error("need --bytes >= streams, --chunk >= 1, --reps >= 1")
    if (args.netem or args.qdisc or args.mtu) and args.where != "veth":
        p.error("--netem, --qdisc and --mtu need --where veth")
    if args.netem and args.qdisc:
        p.error("give --netem or --qdisc, not both")
    if args.where == "veth" and os.geteuid() != 0:
        p.error("--where veth needs root (network namespaces)")
    args.window_bytes = min(window, args.total_bytes)
    if args.window_bytes < max(args.stream_list):
        p.error("--window must hold at least one byte per stream")
    args.argv = list(argv)
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.role:
        return _child_main(args)
    return _orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
