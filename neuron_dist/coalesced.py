"""The coalesced collectives of c10d's face: several tensors in one collective.

How it works
------------
``all_reduce`` (``allreduce_coalesced``) checks that the tensors share one dtype and
all-reduces their concatenation, then copies each part back; ``all_gather``
(``allgather_coalesced``: ``output_lists[r][i]`` receives rank r's ``input_list[i]``)
all-gathers the concatenated inputs as one block per rank and copies each rank's parts
out. Each is one collective of the group (one call number, one cross-rank check: the
call's extra word is a digest of the tensors' sizes, so ranks that coalesce different
tensors fail with a mismatch), run by the group's algorithms (``algos``: its flat or
across-nodes set) through ``submit(name, call, algo, outputs, nbytes)``.
"""

from __future__ import annotations

import torch

from . import checks
from .collectives.descriptor import Call, digest
from .collectives.reduce_ops import ReduceSpec, check_supported


def all_reduce(tensors, spec: ReduceSpec, algos, submit):
    """All-reduce of several tensors of one dtype, as one all-reduce of their concatenation."""
    for i, t in enumerate(tensors):
        checks.tensor(t, f"allreduce_coalesced tensor {i}")
        checks.same_dtype(t, tensors[0], f"allreduce_coalesced tensor {i}")
        check_supported(spec, t.dtype)
    dtype = tensors[0].dtype if tensors else torch.float32
    counts = [t.numel() for t in tensors]
    call = Call("all_reduce", dtype, sum(counts), reduce=spec.kind, extra=digest(counts))

    def algo(ctx):
        flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else \
            torch.empty(0, dtype=dtype)
        algos.all_reduce(ctx, flat, flat, spec)
        o = 0
        for t in tensors:
            t.detach().copy_(flat[o:o + t.numel()].view(t.shape))
            o += t.numel()

    return submit("allreduce_coalesced", call, algo, list(tensors),
                  sum(t.numel() * t.element_size() for t in tensors))


def all_gather(output_lists, input_list, size: int, algos, submit):
    """All-gather of several tensors as one (one list per rank in ``output_lists``, each
    holding one tensor per input): the inputs travel concatenated, in one all_gather."""
    for i, t in enumerate(input_list):
        checks.tensor(t, f"all_gather_coalesced input {i}")
        checks.same_dtype(t, input_list[0], f"all_gather_coalesced input {i}")
    checks.length(output_lists, size, "all_gather_coalesced output list of lists")
    for r, outs in enumerate(output_lists):
        if len(outs) != len(input_list):
            raise ValueError(f"all_gather_coalesced: output list {r} has {len(outs)} tensors, "
                             f"expected one per input ({len(input_list)})")
        for i, (o, t) in enumerate(zip(outs, input_list)):
            what = f"all_gather_coalesced output[{r}][{i}]"
            checks.tensor(o, what)
            checks.same_dtype(o, t, what)
            checks.numel(o, t.numel(), f"{what} (vs input {i})")
    dtype = input_list[0].dtype if input_list else torch.uint8
    counts = [t.numel() for t in input_list]
    total = sum(counts)
    call = Call("all_gather", dtype, total * size, extra=digest(counts))

    def algo(ctx):
        mine = torch.cat([t.detach().reshape(-1) for t in input_list]) if input_list else \
            torch.empty(0, dtype=dtype)
        gathered = torch.empty(total * size, dtype=dtype)
        n = mine.numel() * mine.element_size()
        gb = gathered.view(torch.uint8)
        algos.all_gather(ctx, [gb[k * n:(k + 1) * n] for k in range(size)],
                         mine.view(torch.uint8))
        for r, outs in enumerate(output_lists):
            o = r * total
            for t in outs:
                t.detach().copy_(gathered[o:o + t.numel()].view(t.shape))
                o += t.numel()

    return submit("all_gather_coalesced", call, algo, output_lists, total * dtype.itemsize)
