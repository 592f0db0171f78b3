"""Single-copy collectives for large messages: ranks read each other's tensors directly.

With cross-memory attach (transport/shm/cma.py, ``channel.read_peer``) a rank can copy straight out of a peer's
tensor, so a byte crosses memory once instead of twice (into a shared slot, then out).
Every algorithm here has the same shape:

1. Each rank posts the addresses of its tensors: with the call's first step in its call
   descriptor (after the words that are checked for a matching call), or, in a later
   phase of a call (the all_gather of a two-level all_reduce), in its slot of the next
   step. Either way one step, so every phase of a call may choose single copy itself.
2. Each rank reads what it needs from its peers' memory, each into a part of its own output
   that no peer reads at the same time.
3. A last step: nobody returns (and lets its caller change or free the tensors) while a
   peer may still be reading them.

* all_gather: read every peer's input into its block of the output (2 steps).
* reduce_scatter: rank r reads block r of every peer's input, a chunk at a time into a
  scratch buffer, and reduces it with its own block into its output (2 steps).
* all_reduce (in place or not): reduce-scatter as above into block r of the output, a step,
  then read every peer's reduced block k into block k (3 steps). Peers only ever read blocks
  their owner is not writing at that moment, so the in-place form is safe.

Reductions run in rank order, like the slot algorithms, so results do not depend on the
path. Used when the node's ranks agreed CMA works and the message is large: selection.py
(``SINGLE_COPY_BYTES``; at most ``MAX_ADDRESSES`` addresses fit a call descriptor).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Sequence

from .context import ALIGN_BYTES, Context, partition
from .reduce_ops import PREMUL_SUM, ReduceSpec, reduce_into

if TYPE_CHECKING:
    import torch

# Reduce this much at a time (read from each peer into scratch, then one torch call): fewer,
# larger reads cost less than cache-sized ones (docs/design.md, "Thresholds and why").
CHUNK_BYTES = 1 << 20


# n -> ctypes.c_int64 * n, kept: ctypes holds an array type only weakly, and one made per
# call would be left for the cycle collector
_WORDS: dict[int, type[ctypes.Array[ctypes.c_int64]]] = {}


def _publish(ctx: Context, addresses: Sequence[int]) -> list[tuple[int, ...]]:
    """Post our addresses with the next step; return every rank's (ours included)."""
    n = len(addresses)
    if not ctx.checked:  # the call's first step: in the call descriptor
        ctx.step(tuple(addresses))
        return [tuple(addresses) if k == ctx.rank else ctx.peer_extra(k, n)
                for k in range(ctx.size)]
    # A later step: in our slot (the descriptor is posted with the first step only). Every
    # rank of the call runs the same phases, so all publish the same way.
    words = _WORDS.get(n) or _WORDS.setdefault(n, ctypes.c_int64 * n)
    # (typeshed lets a ctypes array's slice take a list only; any sequence does)
    words.from_address(ctx.my_slot().data_ptr())[:] = addresses  # type: ignore[call-overload]
    ctx.step()
    return [tuple(addresses) if k == ctx.rank
            else tuple(words.from_address(ctx.peer_slot(k).data_ptr()))
            for k in range(ctx.size)]


def _read(ctx: Context, k: int, local: int, remote: int, nbytes: int) -> None:
    if nbytes > 0:
        ctx.channel.read_peer(k, local, remote, nbytes)


def all_gather(ctx: Context, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
    """``outs[k]`` (contiguous uint8) = rank k's ``inp`` on every rank."""
    addrs = _publish(ctx, (inp.data_ptr(),))
    r = ctx.rank
    for k, out in enumerate(outs):
        if k != r:
            _read(ctx, k, out.data_ptr(), addrs[k][0], out.numel())
    if outs[r].numel() and outs[r].data_ptr() != inp.data_ptr():
        outs[r].copy_(inp)
    ctx.step()


def _reduce_block(ctx: Context, out: torch.Tensor, mine: torch.Tensor, remote: Sequence[int],
                  spec: ReduceSpec) -> None:
    """``out`` = reduction over ranks (in rank order) of their block; ``mine`` is ours,
    ``remote[k]`` the address of peer k's. ``out`` may alias ``mine``.

    Unless it aliases ``mine``, ``out`` receives the lowest-ranked peer's chunk itself, and
    the reduction then reads and writes two buffers instead of three: a core's 2 MiB L2 holds
    two 1 MiB chunks, not three (``docs/performance.md``, "Single copy reduces into the output
    from the first peer's chunk")."""
    n, es, r = out.numel(), out.element_size(), ctx.rank
    chunk = max(1, CHUNK_BYTES // es)
    premul = spec.kind == PREMUL_SUM
    # the peer whose chunk lands in ``out`` (reduce_into's output may alias only its
    # first two inputs: rank 0 or 1)
    first = (1 if r == 0 else 0) if not premul and out.data_ptr() != mine.data_ptr() else -1
    # Otherwise, from rank 2 on, our own chunk is copied aside first (``out`` may be it;
    # it is in cache; PREMUL_SUM must scale it anyway).
    own_aside = first < 0 and (premul or r >= 2)
    scratch = ctx.scratch.get(chunk * (ctx.size - (first >= 0) - (not own_aside)) or 1,
                              out.dtype, which=1)
    sum_spec = ReduceSpec("SUM") if premul else spec
    for o in range(0, n, chunk):
        m = min(chunk, n - o)
        part = out[o:o + m]
        views, j = [], 0
        for k in range(ctx.size):
            if k == r and not own_aside:
                views.append(mine[o:o + m])
                continue
            if k == first:
                _read(ctx, k, part.data_ptr(), remote[k] + o * es, m * es)
                views.append(part)
                continue
            buf = scratch[j * chunk:j * chunk + m]
            j += 1
            if k == r:
                buf.copy_(mine[o:o + m])
            else:
                _read(ctx, k, buf.data_ptr(), remote[k] + o * es, m * es)
            if premul:
                buf.mul_(spec.factor)  # type: ignore[arg-type]  # (PREMUL_SUM has one)
            views.append(buf)
        reduce_into(part, views, sum_spec, ctx.size, ctx.scratch)


def reduce_scatter(ctx: Context, out: torch.Tensor, inputs: Sequence[torch.Tensor],
                   spec: ReduceSpec) -> None:
    """``out`` = reduction over ranks of their ``inputs[rank]`` (typed, flat, contiguous)."""
    addrs = _publish(ctx, [t.data_ptr() for t in inputs])
    r = ctx.rank
    _reduce_block(ctx, out, inputs[r], [a[r] for a in addrs], spec)
    ctx.step()


def all_reduce(ctx: Context, out: torch.Tensor, inp: torch.Tensor, spec: ReduceSpec) -> None:
    """``out`` = reduction over ranks of ``inp`` (flat, contiguous; may alias ``inp``)."""
    es = inp.element_size()
    blocks = partition(inp.numel(), ctx.size, max(1, ALIGN_BYTES // es))
    addrs = _publish(ctx, (inp.data_ptr(), out.data_ptr()))
    r = ctx.rank
    s, length = blocks[r]
    if length:
        _reduce_block(ctx, out[s:s + length], inp[s:s + length],
                      [a[0] + s * es for a in addrs], spec)
    ctx.step()  # every block is reduced
    for k, (s, length) in enumerate(blocks):
        if k != r and length:
            _read(ctx, k, out[s:].data_ptr(), addrs[k][1] + s * es, length * es)
    ctx.step()  # nobody reads our memory any more
