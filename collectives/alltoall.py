"""All-to-all with arbitrary (uneven, possibly empty) splits over a step channel.

A slot is laid out as [sizes header | block 0 | block 1 | ... | block N-1]. Block k of rank
r's slot carries the next piece of r's data for rank k, which rank k copies out after the
step. The header holds the bytes this rank sends to and expects from every rank (2N int64):
after the first step every rank checks every pair (what i sends to j == what j expects from
i), so all ranks agree on success or on the same error, and on the number of further steps
(from the largest block anywhere). The first step carries data too, so a small all-to-all
takes one step. A rank's block for itself is copied directly, outside shared memory.

Single copy for large blocks: when the node's ranks can read each other's memory (CMA, see
single_copy.py) and there are at most ``single_copy.MAX_ADDRESSES`` ranks, the first step
also posts the address of every input block. Once the sizes are known (after that step,
the same on every rank) and the largest block is at least ``single_copy.MIN_BYTES``, each
rank reads the rest of its blocks (past the piece that came through the slots) straight
out of the senders' inputs, and a last step keeps everyone until its peers are done
reading.
"""

from __future__ import annotations

import ctypes

from . import single_copy
from .context import ALIGN_BYTES, Context, steps_for
from .descriptor import CollectiveMismatch



def all_to_all(ctx: Context, outs: list, ins: list, element_size: int) -> None:
    """Send uint8 ``ins[k]`` to rank k and receive rank k's block into ``outs[k]``."""
    n = ctx.size
    r = ctx.rank
    header = -(-16 * n // ALIGN_BYTES) * ALIGN_BYTES
    per = ((ctx.channel.slot_bytes - header) // n) // ALIGN_BYTES * ALIGN_BYTES
    largest = per  # until the first step tells us the real sizes
    i = 0
    # Bytes move by memmove between data pointers: for the small blocks typical of
    # all_to_all, slicing and copying through torch costs several times the copy itself.
    src_ptr = [t.data_ptr() for t in ins]
    dst_ptr = [t.data_ptr() for t in outs]
    words = ctypes.c_int64 * (2 * n)
    # Posting our blocks' addresses costs nothing; whether they are used is decided from
    # the sizes every rank sees after the first step.
    cma = ctx.channel.cma and 1 < n <= single_copy.MAX_ADDRESSES and not ctx.checked
    while i < steps_for(largest, per):
        o = i * per
        slot = ctx.my_slot().data_ptr()
        if i == 0:
            words.from_address(slot)[:] = [t.numel() for t in ins] + [t.numel() for t in outs]
        for k, src in enumerate(ins):
            m = max(0, min(per, src.numel() - o))
            if m and k != r:
                ctypes.memmove(slot + header + k * per, src_ptr[k] + o, m)
        ctx.step(tuple(src_ptr) if cma and i == 0 else ())
        if i == 0:
            table = [list(words.from_address(ctx.peer_slot(k).data_ptr())) for k in range(n)]
            _check_splits(table, n, element_size, ctx)
            if outs[r].numel():
                outs[r].copy_(ins[r])
            largest = max((table[a][b] for a in range(n) for b in range(n) if a != b), default=0)
        for k, dst in enumerate(outs):
            m = max(0, min(per, dst.numel() - o))
            if m and k != r:
                ctypes.memmove(dst_ptr[k] + o, ctx.peer_slot(k).data_ptr() + header + r * per, m)
        if i == 0 and cma and largest >= single_copy.MIN_BYTES:
            _read_rest(ctx, outs, dst_ptr, per)
            return
        i += 1


def _read_rest(ctx: Context, outs: list, dst_ptr: list, done: int) -> None:
    """Read every block's bytes past ``done`` from its sender's input (whose addresses came
    with the first step), then step so that no rank returns while it is being read."""
    n, r = ctx.size, ctx.rank
    for k in range(n):
        left = outs[k].numel() - done
        if k != r and left > 0:
            ctx.channel.read_peer(k, dst_ptr[k] + done, ctx.peer_extra(k, n)[r] + done, left)
    ctx.step()


def _check_splits(table, n, element_size, ctx) -> None:
    problems = []
    for i in range(n):
        for j in range(n):
            sent, expected = table[i][j], table[j][n + i]
            if sent != expected:
                problems.append(f"rank {i} sends {sent // element_size} elements to rank {j} "
                                f"but rank {j} expects {expected // element_size} from rank {i}")
    if problems:
        raise CollectiveMismatch(f"all_to_all #{ctx.seq} split sizes disagree: "
                                 + "; ".join(problems[:4]), ctx.call, {})
