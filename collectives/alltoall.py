"""All-to-all with arbitrary (uneven, possibly empty) splits over a step channel.

Step 0 exchanges sizes: every rank writes the bytes it will send to each rank and expects
from each rank (2N int64 words) into its slot. Every rank then checks every pair
(what i sends to j == what j expects from i), so all ranks agree on success or on the
same error, and on the number of data steps (from the largest block anywhere).
Data steps cut the slot into N blocks; block k of rank r's slot carries the next piece
of r's data for rank k, which rank k copies out after the step. A rank's block for itself
is copied directly, outside shared memory.
"""

from __future__ import annotations

import torch

from .context import Context, steps_for
from .descriptor import CollectiveMismatch

ALIGN_BYTES = 64


def all_to_all(ctx: Context, outs: list, ins: list, element_size: int) -> None:
    """Send uint8 ``ins[k]`` to rank k and receive rank k's block into ``outs[k]``."""
    n = ctx.size
    r = ctx.rank
    sizes = ctx.my_slot().view(torch.int64)
    for k in range(n):
        sizes[k] = ins[k].numel()
        sizes[n + k] = outs[k].numel()
    ctx.step()
    table = [ctx.peer_slot(k).view(torch.int64)[:2 * n].tolist() for k in range(n)]
    _check_splits(table, n, element_size, ctx)
    if outs[r].numel():
        outs[r].copy_(ins[r])  # my block to myself never touches shared memory
    per = (ctx.channel.slot_bytes // n) // ALIGN_BYTES * ALIGN_BYTES
    largest = max((table[i][j] for i in range(n) for j in range(n) if i != j), default=0)
    if largest == 0:
        return
    for i in range(steps_for(largest, per)):
        o = i * per
        slot = ctx.my_slot()
        for k, src in enumerate(ins):
            m = max(0, min(per, src.numel() - o))
            if m and k != r:
                slot[k * per:k * per + m].copy_(src[o:o + m])
        ctx.step()
        for k, dst in enumerate(outs):
            m = max(0, min(per, dst.numel() - o))
            if m and k != r:
                dst[o:o + m].copy_(ctx.peer_slot(k)[r * per:r * per + m])


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
