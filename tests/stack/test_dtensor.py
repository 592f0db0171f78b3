"""DeviceMesh and DTensor run unchanged over ``neuron``.

Every DTensor result is compared with the plain tensor it stands for, which each rank can
compute alone (same seed). Values returned from ranks are plain Python data: a rank leaves
with ``os._exit`` right after reporting, so it cannot serve shared tensor storage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.harness import run_ranks


def _close(a, b, tol=1e-5):
    return a.shape == b.shape and torch.allclose(a, b, rtol=tol, atol=tol)


# ------------------------------------------------------------------------ DeviceMesh
def meshes(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    out = {}
    m1 = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    out["1d"] = (m1.size(), m1.get_local_rank(), dist.get_process_group_ranks(m1.get_group()))

    m2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    dp, tp = m2["dp"], m2["tp"]
    out["2d"] = {
        "shape": tuple(m2.shape),
        "dp_ranks": dist.get_process_group_ranks(dp.get_group()),
        "tp_ranks": dist.get_process_group_ranks(tp.get_group()),
        "by_name": dist.get_process_group_ranks(m2.get_group("tp")),
        "by_index": dist.get_process_group_ranks(m2.get_group(1)),
        "local": (m2.get_local_rank("dp"), m2.get_local_rank("tp")),
        "coord": list(m2.get_coordinate()),
        "backend": dist.get_backend(tp.get_group()),
    }
    # A collective on each sub-mesh group reduces over exactly that row / column.
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=tp.get_group())
    u = torch.tensor([float(rank)])
    dist.all_reduce(u, group=dp.get_group())
    out["2d"]["tp_sum"], out["2d"]["dp_sum"] = t.item(), u.item()
    flat = m2["dp", "tp"]._flatten("dp_tp")
    out["2d"]["flat_ranks"] = dist.get_process_group_ranks(flat.get_group())

    res3 = {}
    for shape in ((2, 1, 2), (1, 2, 2)):
        m3 = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))
        sub = m3["dp", "tp"]
        groups = {n: dist.get_process_group_ranks(m3.get_group(n)) for n in ("pp", "dp", "tp")}
        s = torch.tensor([1.0 + rank])
        dist.all_reduce(s, group=m3.get_group("pp"))
        res3[shape] = {"groups": groups, "sub_shape": tuple(sub.shape),
                       "sub_names": sub.mesh_dim_names, "coord": list(m3.get_coordinate()),
                       "pp_sum": s.item()}
    out["3d"] = res3
    return out


def test_device_mesh_1d_2d_3d_and_submeshes():
    res = run_ranks(meshes, 4, timeout=120)
    for rank, r in res.items():
        assert r["1d"] == (4, rank, [0, 1, 2, 3])
        d2 = r["2d"]
        row, col = divmod(rank, 2)  # mesh [[0, 1], [2, 3]]
        assert d2["shape"] == (2, 2) and d2["backend"] == "neuron"
        assert d2["dp_ranks"] == [col, col + 2], d2
        assert d2["tp_ranks"] == d2["by_name"] == d2["by_index"] == [2 * row, 2 * row + 1]
        assert d2["local"] == (row, col) and d2["coord"] == [row, col]
        assert d2["tp_sum"] == 4 * row + 1 and d2["dp_sum"] == 2 * col + 2
        assert d2["flat_ranks"] == [0, 1, 2, 3]
        a = r["3d"][(2, 1, 2)]  # mesh [[[0, 1]], [[2, 3]]]
        assert a["groups"] == {"pp": [col, col + 2], "dp": [rank], "tp": [2 * row, 2 * row + 1]}
        assert a["sub_shape"] == (1, 2) and a["sub_names"] == ("dp", "tp")
        assert a["coord"] == [row, 0, col] and a["pp_sum"] == 2 + 2 * col + 2
        b = r["3d"][(1, 2, 2)]  # mesh [[[0, 1], [2, 3]]]
        assert b["groups"] == {"pp": [rank], "dp": [col, col + 2], "tp": [2 * row, 2 * row + 1]}
        assert b["sub_shape"] == (2, 2) and b["coord"] == [0, row, col]
        assert b["pp_sum"] == 1.0 + rank


# --------------------------------------------------------------------------- DTensor
def dtensor_1d(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    fails = []
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))

    def check(what, got, want):
        if not _close(got, want):
            fails.append(f"{what}: {got} != {want}")

    d0 = distribute_tensor(x, mesh, [Shard(0)])
    check("Shard(0) local", d0.to_local(), x.chunk(world, 0)[rank])
    d1 = d0.redistribute(mesh, [Shard(1)])  # all_to_all
    check("S0->S1 local", d1.to_local(), x.chunk(world, 1)[rank])
    dr = d1.redistribute(mesh, [Replicate()])  # all_gather on dim 1
    check("S1->R", dr.to_local(), x)
    back = dr.redistribute(mesh, [Shard(0)])  # local chunk, no comm
    check("R->S0", back.to_local(), x.chunk(world, 0)[rank])
    check("full_tensor", d1.full_tensor(), x)
    check("distribute Replicate", distribute_tensor(x, mesh, [Replicate()]).to_local(), x)

    # Uneven sharding: 10 rows over 4 ranks are padded internally by DTensor.
    y = torch.arange(30.0).reshape(10, 3)
    du = distribute_tensor(y, mesh, [Shard(0)])
    check("uneven Shard(0) local", du.to_local(), y.chunk(world, 0)[rank])  # 3, 3, 3, 1 rows
    check("uneven full_tensor", du.full_tensor(), y)
    check("uneven S0->S1->R", du.redistribute(mesh, [Shard(1)]).full_tensor(), y)

    # Partial: every rank contributes its own local value.
    local = torch.arange(16.0).reshape(4, 4) * (rank + 1)
    total = torch.arange(16.0).reshape(4, 4) * sum(k + 1 for k in range(world))
    ps = DTensor.from_local(local, mesh, [Partial("sum")])
    check("Partial(sum)->R", ps.redistribute(mesh, [Replicate()]).to_local(), total)
    check("Partial(sum)->S0 (reduce_scatter)", ps.redistribute(mesh, [Shard(0)]).to_local(),
          total.chunk(world, 0)[rank])
    check("Partial(sum).full_tensor", ps.full_tensor(), total)
    pa = DTensor.from_local(local, mesh, [Partial("avg")])
    check("Partial(avg)->R", pa.redistribute(mesh, [Replicate()]).to_local(), total / world)
    check("Partial(avg)->S1", pa.redistribute(mesh, [Shard(1)]).to_local(),
          (total / world).chunk(world, 1)[rank])
    pm = DTensor.from_local(local, mesh, [Partial("max")])
    check("Partial(max)->R", pm.full_tensor(), torch.arange(16.0).reshape(4, 4) * world)

    # from_local with Shard: the global tensor is the concatenation.
    piece = torch.full((2, 3), float(rank))
    cat = torch.cat([torch.full((2, 3), float(k)) for k in range(world)])
    fl = DTensor.from_local(piece, mesh, [Shard(0)])
    if tuple(fl.shape) != (2 * world, 3):
        fails.append(f"from_local global shape {tuple(fl.shape)}")
    check("from_local Shard(0) full", fl.full_tensor(), cat)

    # Ops with autograd through DTensor: a sharded matmul equals the plain one.
    a = torch.randn(6, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    b = torch.randn(8, 4, generator=torch.Generator().manual_seed(2), requires_grad=True)
    da = distribute_tensor(a.detach(), mesh, [Shard(1)]).requires_grad_()
    db = distribute_tensor(b.detach(), mesh, [Shard(0)]).requires_grad_()
    dc = da @ db  # Partial(sum)
    if not dc.placements[0].is_partial():
        fails.append(f"S1 @ S0 placement {dc.placements}")
    ref = a @ b
    check("sharded matmul", dc.full_tensor(), ref)
    (dc.full_tensor() ** 2).sum().backward()
    (ref ** 2).sum().backward()
    check("grad a", da.grad.full_tensor(), a.grad)
    check("grad b", db.grad.full_tensor(), b.grad)
    return fails


def test_dtensor_1d_redistribute_partial_from_local():
    res = run_ranks(dtensor_1d, 4, timeout=120)
    assert not any(res.values()), res


def dtensor_nd(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    fails = []
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))

    def check(what, got, want):
        if not _close(got, want):
            fails.append(f"{what}: {got} != {want}")

    m2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    row, col = divmod(rank, 2)
    d = distribute_tensor(x, m2, [Shard(0), Shard(1)])
    check("[S0,S1] local", d.to_local(), x.chunk(2, 0)[row].chunk(2, 1)[col])
    check("[S0,S1] full", d.full_tensor(), x)
    check("[S0,S1]->[R,S0]", d.redistribute(m2, [Replicate(), Shard(0)]).to_local(),
          x.chunk(2, 0)[col])
    check("[S0,S1]->[S1,R]", d.redistribute(m2, [Shard(1), Replicate()]).to_local(),
          x.chunk(2, 1)[row])
    check("[S0,S1]->[R,R]", d.redistribute(m2, [Replicate(), Replicate()]).to_local(), x)
    # Partial on one mesh dim only: sum over dp, replicate over tp.
    p = DTensor.from_local(torch.full((2, 2), float(rank)), m2, [Partial("sum"), Replicate()])
    check("[P(sum),R] full", p.full_tensor(), torch.full((2, 2), float(col + col + 2)))
    q = DTensor.from_local(torch.full((4, 2), float(rank)), m2, [Shard(0), Partial("avg")])
    want = torch.cat([torch.full((4, 2), 0.5), torch.full((4, 2), 2.5)])
    check("[S0,P(avg)] full", q.full_tensor(), want)
    # Sub-mesh DTensor.
    s = distribute_tensor(x, m2["tp"], [Shard(0)])
    check("sub-mesh tp Shard(0)", s.to_local(), x.chunk(2, 0)[col])

    for shape in ((2, 1, 2), (1, 2, 2)):
        m3 = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))
        d3 = distribute_tensor(x, m3, [Shard(0), Replicate(), Shard(1)])
        check(f"3d {shape} full", d3.full_tensor(), x)
        r3 = d3.redistribute(m3, [Replicate(), Shard(0), Shard(1)])
        check(f"3d {shape} redistribute", r3.full_tensor(), x)
        pp = DTensor.from_local(torch.ones(2) * rank, m3,
                                [Partial("sum"), Partial("sum"), Partial("sum")])
        check(f"3d {shape} Partial everywhere", pp.full_tensor(), torch.ones(2) * 6)
    return fails


def test_dtensor_2d_and_3d_meshes():
    res = run_ranks(dtensor_nd, 4, timeout=120)
    assert not any(res.values()), res
