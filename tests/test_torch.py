"""torch side: save DTensor state dicts from 2 gloo ranks, load them onto other meshes.

One 2-rank job saves (ckptbridge ``save`` of DTensors, and a real FSDP2 model
with AdamW through both ``ckptbridge.save`` and ``torch.distributed.checkpoint.save``);
one 4-rank job loads every layout below (each with its own open checkpoint,
so bytes read are per layout and rank); the parametrized tests check the
results bitwise against the tensors that were saved.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch
from _dist import run
from torch.distributed.tensor import Replicate, Shard

import ckptbridge
import ckptbridge as cb_open
from ckptbridge.adapters import torch as cbt

SHAPES = {"w": ((9, 6), torch.float32), "b": ((5,), torch.float32), "e": ((7, 4), torch.bfloat16),
          "r": ((3, 3), torch.float32)}
# mesh shape, placements: (4,) Shard(1); (2, 2) [Shard(0), Shard(1)]; Replicate; a 1-rank mesh
LAYOUTS = {
    "4_shard1": ((4,), ("x",), [Shard(1)]),
    "2x2_shard0_shard1": ((2, 2), ("x", "y"), [Shard(0), Shard(1)]),
    "4_replicate": ((4,), ("x",), [Replicate()]),
    "world1": ((4, 1), ("x", "y"), None),  # the size-1 mesh dim "y": each rank alone
}


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g).to(dt) for k, (s, dt) in SHAPES.items()}


def _fsdp_model(mesh, shapes=(6, 10, 3)):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    a, b, c = shapes
    model = torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.ReLU(), torch.nn.Linear(b, c))
    fully_shard(model, mesh=mesh)
    return model


def _save_job(rank: int, world: int, out: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = full_tensors()
    sd = {k: distribute_tensor(v, mesh, [Replicate() if k == "r" else Shard(0)]) for k, v in full.items()}
    cbt.save(os.path.join(out, "uni"), sd, step=7, extra={"note": "x"})

    model = _fsdp_model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))).sum().backward()
        opt.step()
        opt.zero_grad()
    cbt.save(os.path.join(out, "fsdp_uni"), model.state_dict(), optimizer=opt, module=model, step=2)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "fsdp_dcp"))
    ref = {n: p.full_tensor().numpy() for n, p in model.state_dict().items()}
    for n, p in model.named_parameters():
        st = opt.state[p]
        ref[f"{n}/exp_avg"] = st["exp_avg"].full_tensor().numpy()
        ref[f"{n}/exp_avg_sq"] = st["exp_avg_sq"].full_tensor().numpy()
        ref[f"{n}/step"] = float(st["step"])
    return ref


def _load_job(rank: int, world: int, out: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    results: dict = {}
    for key, (mesh_shape, dims, placements) in LAYOUTS.items():
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=dims)
        if placements is None:
            mesh, placements = mesh["y"], [Replicate()]
        ckpt = cb_open.open(os.path.join(out, "uni"))
        per_name = {k: _fit(placements, len(s)) for k, (s, _) in SHAPES.items()}
        loaded = cbt.load(ckpt, mesh, per_name)
        local = {}
        for name, t in loaded.items():
            assert isinstance(t, DTensor) and list(t.placements) == per_name[name]
            local[name] = (cbt.numpy_view(t.to_local()).copy(), _offset(t))
        shard_bytes = sum(t.to_local().numel() * t.to_local().element_size() for t in loaded.values())
        results[key] = {"local": local, "bytes_read": ckpt.stats.bytes_read, "shard_bytes": shard_bytes}
        if key == "2x2_shard0_shard1":  # the DTensors are usable: collectives give the full tensor back
            results["full_w"] = loaded["w"].full_tensor().numpy()

    # plain local tensors on request, and a mapping with per-tensor placements
    mesh = init_device_mesh("cpu", (4,))
    plain = cbt.load(os.path.join(out, "uni"), mesh, {"w": [Shard(0)], "b": [Replicate()]}, as_dtensor=False)
    results["plain"] = {k: v.numpy().copy() for k, v in plain.items()}

    # a ckptbridge-written DCP checkpoint (3 chunks per tensor) loads with dcp.load onto (4,) Shard(1)
    target = {}
    for k, (s, dt) in SHAPES.items():
        pl = _fit([Shard(1)], len(s))
        local_shape = cbt.local_boxes(s, (4,), mesh.get_coordinate(), pl)[0]
        target[k] = DTensor.from_local(torch.zeros(local_shape, dtype=dt), mesh, pl, run_check=False,
                                       shape=torch.Size(s), stride=_strides(s))
    dcp.load(target, checkpoint_id=os.path.join(out, "dcp_from_uni"))
    results["dcp_load"] = {k: v.full_tensor().float().numpy() for k, v in target.items()}

    # the FSDP2 run resumes on 4 ranks, from the torch DCP checkpoint and from the universal one
    # (through ckptbridge), and from a ckptbridge-written DCP checkpoint through torch's own dcp.load
    for src in ("fsdp_dcp", "fsdp_uni", "fsdp_dcp_from_uni"):
        model = _fsdp_model(mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if src == "fsdp_dcp_from_uni":
            msd, osd = get_state_dict(model, opt)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, src))
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        else:
            cbt.load_module(model, os.path.join(out, src))
            cbt.load_optimizer(opt, model, os.path.join(out, src))
        got = {n: p.full_tensor().numpy() for n, p in model.state_dict().items()}
        for n, p in model.named_parameters():
            got[f"{n}/exp_avg"] = opt.state[p]["exp_avg"].full_tensor().numpy()
            got[f"{n}/exp_avg_sq"] = opt.state[p]["exp_avg_sq"].full_tensor().numpy()
            got[f"{n}/step"] = float(opt.state[p]["step"])
        # and it keeps training (the optimizer accepts the state)
        model(torch.randn(2, 6)).sum().backward()
        opt.step()
        results[src] = got

    # saving from a 2-D mesh: HSDP-like [Replicate(), Shard(0)] and [Shard(0), Shard(1)]
    from torch.distributed.tensor import distribute_tensor

    mesh2 = init_device_mesh("cpu", (2, 2))
    full = full_tensors()
    cbt.save(os.path.join(out, "uni2d"), {
        "w": distribute_tensor(full["w"], mesh2, [Replicate(), Shard(0)]),
        "e": distribute_tensor(full["e"], mesh2, [Shard(0), Shard(1)]),
    }, step=1)

    # FSDP2 over tensor parallelism (parameters with _StridedShard placements): save, then
    # load into plain FSDP2 on 4 ranks and back into FSDP2 + TP
    tp = _tp_fsdp_model(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    results["tp_placements"] = sorted({str(p.placements) for p in tp.parameters()})
    results["tp_full"] = {n: p.detach().full_tensor().numpy() for n, p in tp.named_parameters()}
    cbt.save(os.path.join(out, "uni_tp"), tp.state_dict())
    plain = _fsdp_model(mesh, shapes=(6, 10, 6))
    cbt.load_module(plain, os.path.join(out, "uni_tp"))
    results["tp_to_fsdp"] = {n: p.detach().full_tensor().numpy() for n, p in plain.named_parameters()}
    tp2 = _tp_fsdp_model(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), seed=1)
    cbt.load_module(tp2, os.path.join(out, "uni_tp"))
    results["tp_to_tp"] = {n: p.detach().full_tensor().numpy() for n, p in tp2.named_parameters()}
    return results


def _tp_fsdp_model(mesh, seed: int = 0):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 6))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def _fit(placements, ndim):
    """``Shard(d)`` for a tensor with fewer dims becomes ``Shard(0)``."""
    return [Shard(0) if isinstance(p, Shard) and p.dim >= ndim else p for p in placements]


def _strides(shape):
    from ckptbridge.plugin import c_strides

    return c_strides(shape)


def _offset(t):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("torch"))
    saved = run(_save_job, 2, out)

    ckptbridge.reshard(os.path.join(out, "uni"), os.path.join(out, "dcp_from_uni"), to="dcp", world_size=3)
    ckptbridge.reshard(os.path.join(out, "fsdp_uni"), os.path.join(out, "fsdp_dcp_from_uni"), to="dcp")
    loaded = run(_load_job, 4, out)
    return out, saved[0], loaded


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_load_layout_bitwise_and_reads_only_the_shard(jobs, layout):
    _, _, loaded = jobs
    full = {k: cbt.numpy_view(v) for k, v in full_tensors().items()}
    for rank, res in enumerate(loaded):
        r = res[layout]
        for name, (local, offset) in r["local"].items():
            box = tuple(slice(o, o + s) for o, s in zip(offset, local.shape))
            np.testing.assert_array_equal(local, full[name][box], err_msg=f"{layout} rank {rank} {name}")
            assert local.dtype == full[name].dtype
        assert r["shard_bytes"] > 0
        assert abs(r["bytes_read"] - r["shard_bytes"]) <= 0.1 * r["shard_bytes"], (layout, rank, r)


def test_full_tensor_plain_tensors_and_mapping(jobs):
    _, _, loaded = jobs
    full = full_tensors()
    np.testing.assert_array_equal(loaded[0]["full_w"], full["w"].numpy())
    for rank, res in enumerate(loaded):
        np.testing.assert_array_equal(res["plain"]["b"], full["b"].numpy())
        rows = np.arange(9)[3 * rank: 3 * rank + 3]  # torch.chunk of 9 rows: 3, 3, 3, 0
        np.testing.assert_array_equal(res["plain"]["w"], full["w"].numpy()[rows])


def test_saved_universal_checkpoint(jobs):
    out, _, _ = jobs
    ckpt = cb_open.open(os.path.join(out, "uni"))
    assert ckpt.format == "universal" and ckpt.step == 7 and ckpt.extra == {"note": "x"}
    full = full_tensors()
    for name, t in full.items():
        view = ckpt[name]
        assert view.states == (("fp32",) if t.dtype == torch.float32 else ("param",))
        np.testing.assert_array_equal(view.read(), cbt.numpy_view(t))
    # one logical tensor per parameter; replicas written once; uneven shards (9 rows -> 5 + 4)
    assert [f.box.shape for f in ckpt["w"].fragments] == [(5, 6), (4, 6)]
    assert len(ckpt["r"].fragments) == 1


def test_ckptbridge_written_dcp_loads_with_dcp_load(jobs):
    out, _, loaded = jobs
    full = full_tensors()
    for res in loaded:
        for name, t in full.items():
            np.testing.assert_array_equal(res["dcp_load"][name], t.float().numpy())
    # and reads back in ckptbridge too
    ckpt = cb_open.open(os.path.join(out, "dcp_from_uni"))
    assert ckpt.format == "dcp"
    for name, t in full.items():
        np.testing.assert_array_equal(ckpt[name].read(), cbt.numpy_view(t))


def test_torch_dcp_of_fsdp2_model_opens_in_ckptbridge(jobs):
    out, ref, _ = jobs
    ckpt = cb_open.open(os.path.join(out, "fsdp_dcp"))
    assert ckpt.format == "dcp" and ckpt.step == 2
    assert set(ckpt) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert ckpt.rules and ckpt.rules[0]["rule"] == "Rename"
    assert ckpt.extra["optim"]["param_groups"]["0"]["lr"] == 0.01
    for name in ckpt:
        np.testing.assert_array_equal(ckpt[name].read(), ref[name])
        np.testing.assert_array_equal(ckpt[name].state("exp_avg").read(), ref[f"{name}/exp_avg"])
        np.testing.assert_array_equal(ckpt[name].state("exp_avg_sq").read(), ref[f"{name}/exp_avg_sq"])
        assert ckpt[name].scalars == {"step": 2}
    # a slice reads only its bytes, from inside the .distcp files
    ckpt.stats.reset()
    ckpt["0.weight"][7:9]
    assert ckpt.stats.bytes_read == 2 * 6 * 4


@pytest.mark.parametrize("src", ["fsdp_dcp", "fsdp_uni", "fsdp_dcp_from_uni"])
def test_fsdp2_model_and_adamw_resume_on_4_ranks(jobs, src):
    _, ref, loaded = jobs
    for res in loaded:
        got = res[src]
        assert set(got) == set(ref)
        for k, v in ref.items():
            np.testing.assert_array_equal(got[k], v, err_msg=f"{src} {k}")


def test_local_boxes_match_torch():
    from torch.distributed.tensor._utils import (
        _compute_local_shape_and_global_offset as torch_layout,
    )

    for shape, mesh in itertools.product([(7, 5), (3,), (1, 9), (0, 4), (5, 3, 2)], [(2,), (4,), (3,), (2, 2), (2, 3)]):
        options = [Replicate()] + [Shard(d) for d in range(len(shape))]
        for placements in itertools.product(options, repeat=len(mesh)):
            for coord in itertools.product(*[range(m) for m in mesh]):
                local, offset = torch_layout(shape, mesh, list(coord), list(placements))
                got, pairs = cbt.local_boxes(shape, mesh, coord, placements)
                assert got == tuple(local)
                if pairs:
                    assert len(pairs) == 1 and pairs[0][0].offset == tuple(offset)
                    assert pairs[0][0].shape == got


def test_single_process_save_without_process_group(tmp_path):
    full = full_tensors()
    cbt.save(tmp_path / "one", {"w": full["w"], "m": {"fp32": full["b"], "exp_avg": full["b"] * 2, "step": 3}})
    ckpt = cb_open.open(tmp_path / "one")
    np.testing.assert_array_equal(ckpt["w"].read(), full["w"].numpy())
    np.testing.assert_array_equal(ckpt["m"].state("exp_avg").read(), (full["b"] * 2).numpy())
    assert ckpt["m"].scalars == {"step": 3}
    with pytest.raises(FileExistsError):
        cbt.save(tmp_path / "one", {"w": full["w"]})


def test_save_from_2d_mesh_dedupes_replicas(jobs):
    out, _, _ = jobs
    ckpt = cb_open.open(os.path.join(out, "uni2d"))
    full = full_tensors()
    assert sorted(f.box.shape for f in ckpt["w"].fragments) == [(4, 6), (5, 6)]  # one copy of each shard
    assert sorted(f.box.offset for f in ckpt["e"].fragments) == [(0, 0), (0, 2), (4, 0), (4, 2)]
    for name in ("w", "e"):
        np.testing.assert_array_equal(ckpt[name].read(), cbt.numpy_view(full[name]))


def test_fsdp2_over_tp_strided_shards_save_and_load(jobs):
    _, _, loaded = jobs
    assert any("_StridedShard" in p for p in loaded[0]["tp_placements"])
    ref = loaded[0]["tp_full"]
    for res in loaded:
        for key in ("tp_to_fsdp", "tp_to_tp"):
            assert set(res[key]) == set(ref)
            for n, v in ref.items():
                np.testing.assert_array_equal(res[key][n], v, err_msg=f"{key} {n}")


def _save_uncoordinated(rank: int, world: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    full, rep = torch.randn(10, 6, generator=g), torch.randn(7, generator=g)
    sd = {"model": {"w": distribute_tensor(full, mesh, [Shard(0)]), "cols": distribute_tensor(full.t().contiguous(),
                                                                                              mesh, [Shard(1)]),
                    "r": distribute_tensor(rep, mesh, [Replicate()]), "own": torch.full((3,), float(rank))},
          "step": 5}
    dcp.save(sd, checkpoint_id=out, use_collectives=False)


def test_dcp_saved_without_rank_coordination_merges_per_rank_metadata(tmp_path):
    """``dcp.save(use_collectives=False)`` writes ``__<rank>.metadata`` per rank and no global
    ``.metadata``; the ranks' views merge into one checkpoint (chunks several ranks saved come
    from rank 0, like DCP's own dedup), and a missing rank's metadata is named."""
    out = str(tmp_path / "c")
    run(_save_uncoordinated, 3, out)
    assert {".metadata", "__0.metadata", "__2.metadata"} & set(os.listdir(out)) == {"__0.metadata", "__2.metadata"}
    g = torch.Generator().manual_seed(0)
    full, rep = torch.randn(10, 6, generator=g), torch.randn(7, generator=g)
    ckpt = cb_open.open(out)
    assert ckpt.format == "dcp" and ckpt.step == 5
    np.testing.assert_array_equal(ckpt["w"].read(), full.numpy())
    np.testing.assert_array_equal(ckpt["cols"].read(), full.t().numpy())
    np.testing.assert_array_equal(ckpt["r"].read(), rep.numpy())
    np.testing.assert_array_equal(ckpt["own"].read(), np.zeros(3, np.float32))  # rank 0's copy
    assert len(ckpt["w"].fragments) == 3
    os.remove(os.path.join(out, "__1.metadata"))
    with pytest.raises(ckptbridge.MissingShardError, match=r"__1\.metadata"):
        cb_open.open(out)
