"""The floor of a Python backend inside a node: the bytes moved, and nothing else.

How it works
------------
``neuron_shm_floor`` is a ``torch.distributed`` backend for benchmarks only. Rank 0 creates
one shared-memory segment for the group and names it in the store; every rank maps it, and
rank 0 unlinks it once all have (nothing stays in /dev/shm). Each rank owns a counter line
(word 0: the call it is in; 1: the address of its tensor; 2 and 3: phases it is through)
and two slots of ``SLOT_BYTES``, used by turns (the call's parity).

* Up to ``SLOT_BYTES`` of input, through the slots: copy the input into this rank's slot
  (one torch copy), store the call's number, wait until every peer's has reached it
  (spinning, then yielding), and make the output from the slots with one torch call where
  one does: ``all_reduce`` (SUM) adds the peers' slots into the tensor in rank order (with
  two ranks ``a + b`` and ``b + a`` are the same bits); ``all_gather`` concatenates every
  slot; ``reduce_scatter`` (SUM) adds block r of every slot; ``all_to_all`` concatenates
  block r of every slot; ``broadcast``: the root copies into its slot and stores its
  counter, the others wait for it and copy out. A slot is written again two calls later,
  once every peer has reached the call in between: none of them still reads it.
* Beyond that, by single copy (transport/shm/cma.py, ``process_vm_readv``) as MPICH does:
  every rank publishes its tensor's address, reads what it needs straight from its peers'
  tensors into its output (its own part with one torch copy), and says when it is through
  so nobody returns while a peer still reads its memory. ``all_reduce``: rank r adds block
  r of every peer into its own tensor, then (a second phase) reads every other block from
  its owner. ``reduce_scatter`` reads block r of each peer into a buffer and adds it.
* ``send``/``recv``: per ordered pair of ranks, a mailbox of ``SLOT_BYTES`` and two
  counters (lines of their own): messages written by the sender, messages read by the
  receiver. The sender waits until its previous message was read and copies in; beyond a
  mailbox it publishes the address and waits until the receiver has read it. Tags are not
  matched.

No call descriptors, checks, timeouts, flight recorder, statistics, engine or Work
bookkeeping: what neuron costs above this is neuron's own overhead, and what this costs
above ``null`` (null_pg.py) is what moving bytes between two Python processes costs on the
machine. The sweep measures it (``--backends ...,shmfloor``), ``bench.hotloop --backend
neuron_shm_floor`` and ``bench.instructions`` (``shmfloor``) run it too. Not for training:
it never notices a dead peer, sums only, takes contiguous tensors and equal all_to_all
blocks, and waits without a deadline (bounded by ``WAIT_SECONDS``).
"""

from __future__ import annotations

import mmap
import os
import secrets
import time

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from neuron_dist.transport.shm import cma
from .null_pg import CompletedWork, Named

BACKEND_NAME = "neuron_shm_floor"
SLOT_BYTES = 1 << 20  # largest input it moves (all_reduce: the tensor)
LINE = 64
WAIT_SECONDS = 60.0  # a peer that never arrives fails the wait after this
_SPINS = 2000  # polls before each yield
_STRIDE = LINE // 8  # words per line


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _flat(t: torch.Tensor, who: str = BACKEND_NAME) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{who}: contiguous tensors only")
    return t.view(-1)


def sum_only(opts, what: str, who: str = BACKEND_NAME) -> None:
    """Refuse any reduce op but SUM (the floors add, nothing else)."""
    if opts is not None and opts.reduceOp != dist.ReduceOp.SUM:
        raise ValueError(f"{who}: {what} sums only")


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
        store.set(f"shm_floor/pid/{rank}", str(os.getpid()))  # for cross-memory reads
        self._pids = [int(store.get(f"shm_floor/pid/{k}")) for k in range(size)]
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
            view = self._views[key] = self._bytes[off:off + _nbytes(like)].view(like.dtype)
        return view

    def _slot(self, rank: int, parity: int, like: torch.Tensor) -> torch.Tensor:
        return self._view(self._slots_at + (2 * rank + parity) * SLOT_BYTES, like)

    # ------------------------------------------------------------------ counters
    def _set(self, word: int, value: int) -> None:
        """Word ``word`` of this rank's counter line (0: call, 1: address, 2-3: phases)."""
        self._words[self._rank * _STRIDE + word] = value

    def _get(self, rank: int, word: int) -> int:
        return self._words[rank * _STRIDE + word]

    def _wait(self, peers, seq: int, word: int = 0) -> None:
        """Until word ``word`` of every peer's counter line has reached ``seq``."""
        for k in peers:
            self._wait_at(k * _STRIDE + word, seq, k)

    def _wait_at(self, index: int, value: int, peer: int) -> None:
        """Until word ``index`` of the segment (written by ``peer``) reaches ``value``."""
        words = self._words
        deadline, spins = None, 0
        while words[index] < value:
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
        self._set(0, seq)
        self._wait(self._peers, seq)
        return parity

    def _publish(self, t: torch.Tensor) -> int:
        """Single copy: say where ``t`` is and wait for every peer to have said it too."""
        seq = self._begin()
        self._set(1, t.data_ptr())
        self._set(0, seq)
        self._wait(self._peers, seq)
        return seq

    def _read(self, peer: int, dst: torch.Tensor, offset: int = 0) -> None:
        """Copy ``peer``'s published tensor from byte ``offset`` into ``dst`` (one copy)."""
        cma.read(self._pids[peer], dst.data_ptr(), self._get(peer, 1) + offset, _nbytes(dst))

    def _phase(self, seq: int, word: int) -> None:
        """Say this rank is through phase ``word`` of call ``seq``; wait for the peers."""
        self._set(word, seq)
        self._wait(self._peers, seq, word)

    def _sum_only(self, opts, what: str) -> None:
        sum_only(opts, what, self.BACKEND)

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        key = ("scratch", like.dtype, like.numel())
        buf = self._views.get(key)
        if buf is None:
            buf = self._views[key] = torch.empty_like(like)
        return buf

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors, opts=None):
        self._sum_only(opts, "all_reduce")
        t = _flat(tensors[0])
        if _nbytes(t) > SLOT_BYTES:
            return self._allreduce_single_copy(t)
        parity = self._exchange(t)
        if self._size == 2:
            t.add_(self._slot(1 - self._rank, parity, t))
        else:
            t.copy_(self._slot(0, parity, t))
            for k in range(1, self._size):
                t.add_(self._slot(k, parity, t))
        return self._done

    def _allreduce_single_copy(self, t: torch.Tensor):
        """Rank r sums block r from every peer's tensor into its own, then reads every
        other block from its owner: reads of a block never meet writes to it."""
        r, size = self._rank, self._size
        es = t.element_size()
        cut = [t.numel() * k // size for k in range(size + 1)]
        mine = t[cut[r]:cut[r + 1]]
        seq = self._publish(t)
        tmp = self._scratch(mine)
        for k in self._peers:  # (in rank order: the same sum on every rank)
            self._read(k, tmp, cut[r] * es)
            mine.add_(tmp)
        self._phase(seq, 2)  # every block is reduced
        for k in self._peers:
            self._read(k, t[cut[k]:cut[k + 1]], cut[k] * es)
        self._phase(seq, 3)  # nobody reads this rank's tensor any more
        return self._done

    def all_gather_single(self, output, input, opts=None):
        inp, out = _flat(input), _flat(output)
        n = inp.numel()
        if _nbytes(inp) > SLOT_BYTES:
            seq = self._publish(inp)
            for k in self._peers:
                self._read(k, out[k * n:(k + 1) * n])
            out[self._rank * n:(self._rank + 1) * n].copy_(inp)
            self._phase(seq, 3)
            return self._done
        parity = self._exchange(inp)
        torch.cat([self._slot(k, parity, inp) for k in range(self._size)], out=out)
        return self._done

    def _blocks(self, parity: int, inp: torch.Tensor) -> list:
        """Block ``rank`` of every rank's slot (the slot holding an input like ``inp``)."""
        n = inp.numel() // self._size
        return [self._slot(k, parity, inp)[self._rank * n:(self._rank + 1) * n]
                for k in range(self._size)]

    def reduce_scatter_single(self, output, input, opts=None):
        self._sum_only(opts, "reduce_scatter")
        inp, out = _flat(input), _flat(output)
        r, n = self._rank, out.numel()
        if _nbytes(inp) > SLOT_BYTES:
            seq = self._publish(inp)
            tmp = self._scratch(out)
            out.copy_(inp[r * n:(r + 1) * n])
            for k in self._peers:
                self._read(k, tmp, r * _nbytes(out))
                out.add_(tmp)
            self._phase(seq, 3)
            return self._done
        blocks = self._blocks(self._exchange(inp), inp)
        torch.add(blocks[0], blocks[1], out=out)
        for b in blocks[2:]:
            out.add_(b)
        return self._done

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        if output_split_sizes or input_split_sizes:
            raise ValueError(f"{BACKEND_NAME}: all_to_all of equal blocks only")
        inp, out = _flat(input), _flat(output)
        r, n = self._rank, inp.numel() // self._size
        if _nbytes(inp) > SLOT_BYTES:
            seq = self._publish(inp)
            for k in self._peers:
                self._read(k, out[k * n:(k + 1) * n], r * n * inp.element_size())
            out[r * n:(r + 1) * n].copy_(inp[r * n:(r + 1) * n])
            self._phase(seq, 3)
            return self._done
        torch.cat(self._blocks(self._exchange(inp), inp), out=out)
        return self._done

    def broadcast(self, tensors, opts=None):
        t = _flat(tensors[0])
        root = opts.rootRank if opts is not None else 0
        if _nbytes(t) > SLOT_BYTES:
            seq = self._begin()
            if self._rank == root:
                self._set(1, t.data_ptr())
                self._set(0, seq)
                self._wait(self._peers, seq, 3)  # every peer has read it
            else:
                self._wait((root,), seq)
                self._read(root, t)
                self._set(0, seq)
                self._set(3, seq)
            return self._done
        seq = self._begin()
        parity = seq & 1
        if self._rank == root:
            self._slot(root, parity, t).copy_(t)
            self._set(0, seq)
        else:
            self._wait((root,), seq)
            t.copy_(self._slot(root, parity, t))
            self._set(0, seq)
        return self._done

    # ------------------------------------------------------------------ send/recv
    def _box(self, src: int, dst: int, like: torch.Tensor) -> torch.Tensor:
        return self._view(self._boxes_at + (src * self._size + dst) * SLOT_BYTES, like)

    def send(self, tensors, dst: int, tag: int = 0):
        t = _flat(tensors[0])
        pair = self._rank * self._size + dst
        at = (self._sent_at + pair) * _STRIDE
        read_at = (self._read_at + pair) * _STRIDE
        sent = self._words[at]
        self._wait_at(read_at, sent, dst)  # the previous message was read
        if _nbytes(t) > SLOT_BYTES:  # the receiver reads it from here: wait until it has
            self._words[at + 1] = t.data_ptr()
            self._words[at] = sent + 1
            self._wait_at(read_at, sent + 1, dst)
            return self._done
        self._box(self._rank, dst, t).copy_(t)
        self._words[at] = sent + 1
        return self._done

    def recv(self, tensors, src: int, tag: int = 0):
        t = _flat(tensors[0])
        pair = src * self._size + self._rank
        sent_at = (self._sent_at + pair) * _STRIDE
        at = (self._read_at + pair) * _STRIDE
        read = self._words[at]
        self._wait_at(sent_at, read + 1, src)
        if _nbytes(t) > SLOT_BYTES:
            cma.read(self._pids[src], t.data_ptr(), self._words[sent_at + 1], _nbytes(t))
        else:
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


def register() -> None:
    """Register ``neuron_shm_floor`` with torch.distributed (idempotent)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, lambda o, pg_options=None: ShmFloorProcessGroup(o.store, o.group_rank,
                                                                      o.group_size),
        extended_api=True, devices=["cpu"])
