"""all_reduce of sparse COO tensors (SUM), built on the group's dense all_gather.

How it works: each rank coalesces its tensor (duplicate indices summed), then two
all_gathers run in the group, one after the other:

1. five int64 words per rank: nnz, sparse_dim, dtype, number of dims and a digest of the
   shape. Every rank compares them (all ranks read the same words, so all raise the same
   error when tensors disagree, and nothing more is sent) and learns how many bytes each
   rank sends next;
2. every rank's indices and values as bytes (an all_gather of uneven sizes).

Every rank then adds the ranks' tensors in rank order, ``((t0 + t1) + t2) + ...``: adding
two coalesced sparse tensors adds matching entries one by one, so every rank computes the
same additions in the same order and holds a bit-identical result, which replaces the
input's contents (its nnz may change; a complex tensor, which torch passes as a
real view, is updated itself). float16/bfloat16 values are added in float32 and
rounded once, as the dense all_reduce does. Like gloo, only ``ReduceOp.SUM`` is supported.
Works in any group (one node or across nodes): it only uses all_gather.

The call runs to completion before it returns, also with ``async_op=True``.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.distributed_c10d import AllgatherOptions  # not re-exported by dist

from .collectives.descriptor import digest, dtype_code
from .work import NeuronWork

_META_WORDS = 5


def all_reduce(pg, t: torch.Tensor, opts) -> NeuronWork:
    """Sum the sparse COO tensor ``t`` over the ranks of ``pg``, in place.

    Parameters
    ----------
    pg : ProcessGroupNeuron
    t : torch.Tensor
        A sparse COO CPU tensor of the same shape, sparse_dim and dtype on every rank.
    opts : AllreduceOptions
        Its ``reduceOp`` must be SUM; its ``timeout`` applies to each step.
    """
    op = str(getattr(opts.reduceOp, "op", opts.reduceOp)).rsplit(".", 1)[-1]
    if op != "SUM":
        raise ValueError(f"all_reduce of a sparse COO tensor supports ReduceOp.SUM only, not {op}")
    if t.device.type != "cpu":
        raise ValueError(f"all_reduce tensor is on {t.device}; the neuron backend takes CPU tensors")
    view, t = t, _owner(t)
    dtype_code(t.dtype)  # a clear error for a dtype neuron does not carry
    mine = t.detach().coalesce()
    idx, vals = mine.indices().contiguous(), mine.values().contiguous()
    nnz, sparse_dim = mine._nnz(), mine.sparse_dim()
    meta = torch.tensor([nnz, sparse_dim, dtype_code(t.dtype), t.dim(), digest(t.shape)],
                        dtype=torch.int64)
    size = pg.size()
    metas = [torch.empty(_META_WORDS, dtype=torch.int64) for _ in range(size)]
    gather_opts = AllgatherOptions()
    gather_opts.timeout = opts.timeout
    pg.allgather([metas], [meta], gather_opts).wait()
    _check_agree(metas, pg.rank())

    dense_shape = tuple(t.shape[sparse_dim:])
    row = math.prod(dense_shape)
    index_bytes = [8 * sparse_dim * int(m[0]) for m in metas]
    value_bytes = [int(m[0]) * row * t.element_size() for m in metas]
    payload = torch.cat([_bytes(idx), _bytes(vals)])
    outs = [torch.empty(i + v, dtype=torch.uint8) for i, v in zip(index_bytes, value_bytes)]
    pg.allgather([outs], [payload], gather_opts).wait()

    wide = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype
    total = None
    for k, buf in enumerate(outs):
        n = int(metas[k][0])
        # clone: a view as a wider dtype needs its own, aligned storage
        ki = buf[:index_bytes[k]].clone().view(torch.int64).view(sparse_dim, n)
        kv = buf[index_bytes[k]:].clone().view(t.dtype).view((n,) + dense_shape).to(wide)
        part = torch.sparse_coo_tensor(ki, kv, t.shape, is_coalesced=True)
        total = part if total is None else total + part
    result = total.coalesce().to(t.dtype) if wide != t.dtype else total.coalesce()
    with torch.no_grad():
        t.copy_(result)
        if view is not t:
            view.copy_(torch.view_as_real(result))
    work = NeuronWork([view], f"sparse all_reduce in group {pg.label()}")
    work.complete()
    return work


def _owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose contents the result replaces.

    torch's ``all_reduce`` hands a complex tensor to the backend as ``view_as_real(t)``.
    Replacing a sparse view's contents (its nnz may change) would not reach ``t``, so the
    sum is computed on, and written to, ``t`` itself.
    """
    base = t._base
    if base is None:
        return t
    if base.is_sparse and base.is_complex() and t.shape == base.shape + (2,):
        return base
    raise ValueError("all_reduce of a sparse tensor that is a view of another sparse tensor: "
                     "the result (whose number of entries may differ) could not replace the "
                     "original's contents; pass the original tensor")


def _check_agree(metas, rank: int) -> None:
    """Every rank's tensor must have the same sparse_dim, dtype and shape."""
    first = metas[0][1:].tolist()
    bad = [k for k, m in enumerate(metas) if m[1:].tolist() != first]
    if bad:
        what = ", ".join(f"rank {k}: sparse_dim {m[1]}, {m[3]} dims, dtype code {m[2]}, "
                         f"shape digest {m[4]:#x}" for k, m in
                         ((k, [int(x) for x in metas[k]]) for k in [0] + bad))
        raise ValueError(f"sparse all_reduce: the ranks' tensors differ in shape, sparse_dim "
                         f"or dtype (seen by rank {rank}): {what}")


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.uint8)
