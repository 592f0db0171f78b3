"""The floor of a Python backend inside a node: messages through shared memory, and
nothing else.

How it works
------------
``neuron_shm_floor`` is a ``torch.distributed`` backend for benchmarks only. Rank 0 creates
one shared-memory segment for the group and names it in the store; every rank maps it, and
rank 0 unlinks it once all have (nothing stays in /dev/shm). Each rank owns a counter
(its own 64-byte line) and two slots of ``SLOT_BYTES``, used by turns (the counter's parity).

* Collectives: copy the input into this rank's slot (one torch copy), store the call's
  number in the counter, wait until every peer's counter has reached it (spinning, then
  yielding), and make the output from the slots with one torch call where one does:
  ``all_reduce`` (SUM) adds the peers' slots into the tensor in rank order (with two ranks
  ``a + b`` and ``b + a`` are the same bits); ``all_gather`` concatenates every slot;
  ``reduce_scatter`` (SUM) adds block r of every slot; ``all_to_all`` concatenates block r
  of every slot; ``broadcast``: the root copies into its slot and stores its counter, the
  others wait for it and copy out.
* A slot is written again two calls later, once every peer has reached the call in
  between: none of them still reads it.
* ``send``/``recv``: one mailbox of ``SLOT_BYTES`` per ordered pair of ranks and two
  counters (its own lines): messages written by the sender, messages read by the receiver.
  The sender waits until its previous message was read, copies in and counts; the
  receiver waits for a message, copies out and counts. Tags are not matched.

No call descriptors, checks, timeouts, flight recorder, statistics, engine or Work
bookkeeping: what neuron costs above this is neuron's own overhead, and what this costs
above ``null`` (null_pg.py) is what moving bytes between two Python processes through
shared memory and torch costs on the machine. It only takes what fits a slot (a rank's
whole input, ``fits``): the sweep (``--backends ...,shmfloor``) measures it up to there,
``bench.hotloop --backend neuron_shm_floor`` and ``bench.instructions`` (``shmfloor``) run
it too. Not for training: it never notices a dead peer, sums only, and waits without a
deadline (bounded by ``WAIT_SECONDS``).
"""

from __future__ import annotations

import mmap
import os
import secrets
import time

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .null_pg import CompletedWork, Named

BACKEND_NAME = "neuron_shm_floor"
SLOT_BYTES = 1 << 20  # largest input it moves (all_reduce: the tensor)
LINE = 64
WAIT_SECONDS = 60.0  # a peer that never arrives fails the wait after this
_SPINS = 2000  # polls before each yield


class ShmFloorProcessGroup(Named, ProcessGroup):
    """See the module docstring."""

    BACKEND = BACKEND_NAME

    def __init__(self, store, rank: int, size: int):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._done = CompletedWork()
        self._peers = [k for k in range(size) if k != rank]
        # lines: a counter per rank, then per ordered pair (sender, receiver) messages
        # written and messages read; then two slots per rank, then a mailbox per pair
        self._sent_at = size
        self._read_at = size + size * size
        self._slots_at = (size + 2 * size * size) * LINE
        self._boxes_at = self._slots_at + size * 2 * SLOT_BYTES
        nbytes = self._boxes_at + size * size * SLOT_BYTES  # (tmpfs: pages only once used)
        if rank == 0:
            name = f"/neuron-shmfloor-{os.getpid()}-{secrets.token_hex(8)}"  # (pid third, as ours)
            fd = os.open(f"/dev/shm{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)  # (sized before anyone is told its name)
            except OSError:
                os.close(fd)
                os.unlink(f"/dev/shm{name}")
                raise
            store.set("shm_floor/name", name)
        else:
            name = store.get("shm_floor/name").decode()
            fd = os.open(f"/dev/shm{name}", os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        store.add("shm_floor/mapped", 1)
        if rank == 0:  # unlinked once everyone has it mapped
            deadline = time.monotonic() + WAIT_SECONDS
            while store.add("shm_floor/mapped", 0) < size:
                if time.monotonic() > deadline:
                    os.unlink(f"/dev/shm{name}")
                    raise RuntimeError(f"{BACKEND_NAME}: ranks did not map the segment")
                time.sleep(0.001)
            os.unlink(f"/dev/shm{name}")
        self._words = memoryview(self._map).cast("q")
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._views: dict = {}
        self._seq = 0

    def _view(self, off: int, like: torch.Tensor) -> torch.Tensor:
        """The shared bytes at ``off`` viewed like ``like`` (1-D), at most a slot."""
        key = (off, like.dtype, like.numel())
        view = self._views.get(key)
        if view is None:
            n = like.numel() * like.element_size()
            if n > SLOT_BYTES:
                raise ValueError(f"{BACKEND_NAME}: {n} bytes exceed its {SLOT_BYTES}-byte slot")
            view = self._views[key] = self._bytes[off:off + n].view(like.dtype)
        return view

    def _slot(self, rank: int, parity: int, like: torch.Tensor) -> torch.Tensor:
        return self._view(self._slots_at + (2 * rank + parity) * SLOT_BYTES, like)

    def _wait(self, peers, seq: int) -> None:
        """Until every peer's counter has reached ``seq``."""
        for k in peers:
            self._wait_line(k, seq, k)

    def _wait_line(self, line: int, value: int, peer: int) -> None:
        """Until the word at the start of line ``line`` (written by ``peer``) reaches ``value``."""
        words, at = self._words, line * (LINE // 8)
        deadline, spins = None, 0
        while words[at] < value:
            spins += 1
            if spins % _SPINS == 0:
                os.sched_yield()
                if deadline is None:
                    deadline = time.monotonic() + WAIT_SECONDS
                elif time.monotonic() > deadline:
                    raise RuntimeError(f"{BACKEND_NAME}: rank {peer} did not arrive")

    def _begin(self) -> int:
        seq = self._seq = self._seq + 1
        self._wait(self._peers, seq - 1)  # they left the call that last used this slot
        return seq

    def _exchange(self, t: torch.Tensor) -> int:
        """Stage ``t`` in this rank's slot and wait for every peer's: the call's parity."""
        seq = self._begin()
        parity = seq & 1
        self._slot(self._rank, parity, t).copy_(t)
        self._words[self._rank * (LINE // 8)] = seq
        self._wait(self._peers, seq)
        return parity

    @staticmethod
    def _sum_only(opts, what: str) -> None:
        if opts is not None and opts.reduceOp != dist.ReduceOp.SUM:
            raise ValueError(f"{BACKEND_NAME}: {what} sums only")

    def allreduce(self, tensors, opts=None):
        self._sum_only(opts, "all_reduce")
        t = tensors[0].view(-1)
        parity = self._exchange(t)
        if self._size == 2:
            t.add_(self._slot(1 - self._rank, parity, t))
        else:
            t.copy_(self._slot(0, parity, t))
            for k in range(1, self._size):
                t.add_(self._slot(k, parity, t))
        return self._done

    def all_gather_single(self, output, input, opts=None):
        inp = input.view(-1)
        parity = self._exchange(inp)
        torch.cat([self._slot(k, parity, inp) for k in range(self._size)], out=output.view(-1))
        return self._done

    def _blocks(self, parity: int, inp: torch.Tensor) -> list:
        """Block ``rank`` of every rank's slot (the slot holding an input like ``inp``)."""
        n = inp.numel() // self._size
        return [self._slot(k, parity, inp)[self._rank * n:(self._rank + 1) * n]
                for k in range(self._size)]

    def reduce_scatter_single(self, output, input, opts=None):
        self._sum_only(opts, "reduce_scatter")
        inp, out = input.view(-1), output.view(-1)
        blocks = self._blocks(self._exchange(inp), inp)
        torch.add(blocks[0], blocks[1], out=out)
        for b in blocks[2:]:
            out.add_(b)
        return self._done

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        if output_split_sizes or input_split_sizes:
            raise ValueError(f"{BACKEND_NAME}: all_to_all of equal blocks only")
        inp = input.view(-1)
        torch.cat(self._blocks(self._exchange(inp), inp), out=output.view(-1))
        return self._done

    def broadcast(self, tensors, opts=None):
        t = tensors[0].view(-1)
        root = opts.rootRank if opts is not None else 0
        seq = self._begin()
        parity = seq & 1
        if self._rank == root:
            self._slot(root, parity, t).copy_(t)
            self._words[root * (LINE // 8)] = seq
        else:
            self._wait((root,), seq)
            t.copy_(self._slot(root, parity, t))
            self._words[self._rank * (LINE // 8)] = seq
        return self._done

    def _box(self, src: int, dst: int, like: torch.Tensor) -> torch.Tensor:
        return self._view(self._boxes_at + (src * self._size + dst) * SLOT_BYTES, like)

    def send(self, tensors, dst: int, tag: int = 0):
        t = tensors[0].view(-1)
        pair = self._rank * self._size + dst
        at = (self._sent_at + pair) * (LINE // 8)
        sent = self._words[at]
        self._wait_line(self._read_at + pair, sent, dst)  # the previous message was read
        self._box(self._rank, dst, t).copy_(t)
        self._words[at] = sent + 1
        return self._done

    def recv(self, tensors, src: int, tag: int = 0):
        t = tensors[0].view(-1)
        pair = src * self._size + self._rank
        at = (self._read_at + pair) * (LINE // 8)
        read = self._words[at]
        self._wait_line(self._sent_at + pair, read + 1, src)
        t.copy_(self._box(src, self._rank, t))
        self._words[at] = read + 1
        return self._done

    def barrier(self, opts=None):
        self.allreduce([torch.zeros(1, dtype=torch.uint8)])
        return self._done

    def shutdown(self) -> None:
        self._views.clear()
        self._words.release()
        del self._bytes
        try:
            self._map.close()
        except BufferError:  # a tensor view still refers to it: the mapping goes with it
            pass


def fits(op: str, in_bytes: int, out_bytes: int) -> bool:
    """Can the floor run ``op`` with these per-rank input and output sizes (a slot holds a
    rank's whole input, or a broadcast's or a received message)?"""
    return max(in_bytes, out_bytes if op in ("broadcast", "send_recv") else 0) <= SLOT_BYTES


def register() -> None:
    """Register ``neuron_shm_floor`` with torch.distributed (idempotent)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, lambda o, pg_options=None: ShmFloorProcessGroup(o.store, o.group_rank,
                                                                      o.group_size),
        extended_api=True, devices=["cpu"])
