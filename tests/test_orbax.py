"""Orbax in and out: real Orbax checkpoints open in ckptbridge; ours restore with Orbax."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # conftest sets it first

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptbridge as cbopen
from ckptbridge import reshard
from ckptbridge.adapters import jax as cbjax
from ckptbridge.adapters import orbax as cborbax
from ckptbridge.plugin import Stack, Transpose, apply_rules

pytestmark = pytest.mark.filterwarnings("ignore")


def mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def rnd(seed, shape, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.fixture(scope="module")
def orbax_2x4(tmp_path_factory):
    """A real Orbax StandardCheckpointer checkpoint (OCDBT + zarr) written from a 2x4 mesh."""
    m = mesh((2, 4), ("data", "model"))
    ref = {"dense": {"kernel": rnd(0, (64, 32)), "bias": rnd(1, (32,)).astype(jax.numpy.bfloat16)},
           "emb": rnd(2, (16, 24))}
    tree = {"params": {
        "dense": {"kernel": jax.device_put(ref["dense"]["kernel"], NamedSharding(m, P("data", "model"))),
                  "bias": jax.device_put(ref["dense"]["bias"], NamedSharding(m, P()))},
        "emb": jax.device_put(ref["emb"], NamedSharding(m, P(None, "model")))}, "step": 3}
    path = str(tmp_path_factory.mktemp("orbax") / "ckpt")
    ck = ocp.StandardCheckpointer()
    ck.save(path, tree)
    ck.wait_until_finished()
    return path, ref


def test_orbax_checkpoint_from_2x4_mesh_opens(orbax_2x4):
    path, ref = orbax_2x4
    assert cborbax.detect(path) and not cborbax.detect(os.path.dirname(path) + "/nothing")
    ckpt = cbopen.open(path)
    assert ckpt.format == "orbax" and ckpt.step == 3  # the tree's own step counter
    layout = ckpt.provenance["options"]["."]["layout"]
    assert layout["params/dense/kernel"] == {"sharding": "NamedSharding", "mesh": {"data": 2, "model": 4},
                                             "spec": ["data", "model"]}
    assert sorted(ckpt) == ["dense/bias", "dense/kernel", "emb"]  # the step counter is ckpt.step
    assert ckpt["dense/kernel"].dtype == "float32" and ckpt["dense/bias"].dtype == "bfloat16"
    assert ckpt["dense/bias"].states == ("param",)
    assert len(ckpt["dense/kernel"].fragments) == 8  # one Zarr chunk per saved shard
    np.testing.assert_array_equal(ckpt["dense/kernel"].read(), ref["dense"]["kernel"])
    np.testing.assert_array_equal(ckpt["dense/bias"].read(), ref["dense"]["bias"])
    np.testing.assert_array_equal(ckpt["emb"][3:5, 7:20], ref["emb"][3:5, 7:20])
    assert int(cbopen.open(path, layout="raw")["step"].read()) == 3  # raw keeps Orbax's own tree


@pytest.mark.parametrize("spec", [P("b", "a"), P(None, ("a", "b")), P()])
def test_orbax_loads_onto_4x2_mesh(orbax_2x4, spec):
    path, ref = orbax_2x4
    ckpt = cbopen.open(path)
    sh = NamedSharding(mesh((4, 2), ("a", "b")), spec)
    out = cbjax.load(ckpt, {"dense": {"kernel": sh}})
    arr = out["dense"]["kernel"]
    np.testing.assert_array_equal(np.asarray(arr), ref["dense"]["kernel"])
    boxes = {cbjax.box_of_index(i, (64, 32)) for i in sh.addressable_devices_indices_map((64, 32)).values()}
    want = sum(b.size for b in boxes) * 4
    assert abs(ckpt.stats.bytes_read - want) <= 0.1 * want


def test_tensorstore_region_transforms(orbax_2x4):
    path, ref = orbax_2x4
    ckpt = cbopen.open(path)
    k = ref["dense"]["kernel"]
    tensors = apply_rules(ckpt.tensors, [
        Transpose(r"^dense/kernel$", (1, 0)),
    ])
    from ckptbridge import Checkpoint, CheckpointIndex
    view = Checkpoint(CheckpointIndex("orbax", path, tensors), ckpt.files)
    np.testing.assert_array_equal(view["dense/kernel"].read(), k.T)
    np.testing.assert_array_equal(view["dense/kernel"][5:9, 30:40], k.T[5:9, 30:40])
    # stacking two tensors of one shape and reading a slab reads through composed transforms
    two = {"l/0/w": ckpt.tensors["dense/kernel"], "l/1/w": tensors["dense/kernel"]}
    two["l/1/w"] = apply_rules({"x": two["l/1/w"]}, [Transpose("x", (1, 0))])["x"]
    stacked = apply_rules(two, [Stack(r"^l/(\d+)/w$", "l/w")])
    view = Checkpoint(CheckpointIndex("orbax", path, stacked), ckpt.files)
    np.testing.assert_array_equal(view["l/w"][:, 10:12, 3:5], np.stack([k, k])[:, 10:12, 3:5])


def test_manager_root_zarr3_without_ocdbt(tmp_path):
    root = str(tmp_path / "mgr")
    handlers = {"state": ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True),
                "metrics": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(root, item_handlers=handlers) as mngr:
        for step in (1, 2):
            mngr.save(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeSave({"w": rnd(step, (6, 10)), "tag": "run-a"}),
                metrics=ocp.args.JsonSave({"loss": 1.0 / step})))
        mngr.wait_until_finished()
    assert cborbax.detect(root) and cborbax.detect(os.path.join(root, "1"))
    latest = cbopen.open(root)
    assert latest.step == 2 and list(latest) == ["w"]
    np.testing.assert_array_equal(latest["w"].read(), rnd(2, (6, 10)))
    assert latest.extra["tag"] == "run-a" and latest.extra["metrics"]["metrics"] == {"loss": 0.5}
    first = cbopen.open(root, step=1)
    np.testing.assert_array_equal(first["w"][2:4], rnd(1, (6, 10))[2:4])
    assert cbopen.open(os.path.join(root, "1", "state"))["w"].shape == (6, 10)


def test_orbax_train_state_groups_adam(tmp_path):
    params = {"dense": {"kernel": rnd(0, (8, 4)), "bias": rnd(1, (4,))}}
    tx = optax.adamw(1e-2)
    opt = tx.init(params)
    grads = jax.tree.map(lambda p: p * 0.5, params)
    for _ in range(2):
        upd, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, upd)
    path = str(tmp_path / "ts")
    ck = ocp.StandardCheckpointer()
    ck.save(path, {"params": params, "opt_state": opt, "step": 2})
    ck.wait_until_finished()
    ckpt = cbopen.open(path)
    assert set(ckpt) == {"dense/kernel", "dense/bias"} and ckpt.step == 2
    t = ckpt["dense/kernel"]
    assert set(t.states) == {"fp32", "exp_avg", "exp_avg_sq"} and t.scalars == {"step": 2}
    np.testing.assert_array_equal(t.read(), np.asarray(params["dense"]["kernel"]))
    np.testing.assert_array_equal(t.state("exp_avg").read(), np.asarray(opt[0].mu["dense"]["kernel"]))
    np.testing.assert_array_equal(t.state("exp_avg_sq").read(), np.asarray(opt[0].nu["dense"]["kernel"]))
    assert any(r.get("state") == "exp_avg" for r in ckpt.rules)
    raw = cbopen.open(path, layout="raw")
    assert "opt_state/0/mu/dense/kernel" in raw


def test_written_orbax_restores_with_orbax_onto_4x2(tmp_path):
    # a universal checkpoint saved from a 2x4 mesh, with Adam moments
    m24 = mesh((2, 4), ("x", "y"))
    w, mu, nu = rnd(0, (32, 16)), rnd(1, (32, 16)), np.abs(rnd(2, (32, 16)))
    src = str(tmp_path / "uni")
    sh = NamedSharding(m24, P("x", "y"))
    from ckptbridge.plugin import Box, Piece
    pieces, _ = cbjax.tree_pieces({"blk/w": jax.device_put(w, sh)})
    for arr, st in ((mu, "exp_avg"), (nu, "exp_avg_sq")):
        more, _ = cbjax.tree_pieces({"blk/w": jax.device_put(arr, sh)}, st)
        pieces += more
    pieces.append(Piece("b", "fp32", "float32", (16,), Box.full((16,)), w[0]))
    cbjax.save_pieces(src, pieces, step=5, scalars={"blk/w": {"step": 5}})

    dst = str(tmp_path / "orbax_out")
    reshard(src, dst, to="orbax", chunk_bytes=1024)  # small chunks: several per array
    with pytest.raises(FileExistsError):
        reshard(src, dst, to="orbax")

    m42 = mesh((4, 2), ("a", "b"))

    def abstract(shape, spec, dtype=np.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(m42, spec))

    target = {"params": {"blk": {"w": abstract((32, 16), P("b", "a"))}, "b": abstract((16,), P("a"))},
              "opt_state": {"count": abstract((), P(), np.int32),
                            "mu": {"blk": {"w": abstract((32, 16), P("a", None))}},
                            "nu": {"blk": {"w": abstract((32, 16), P(None, "a"))}}},
              "step": abstract((), P(), np.int64)}
    restored = ocp.StandardCheckpointer().restore(dst, target)
    np.testing.assert_array_equal(np.asarray(restored["params"]["blk"]["w"]), w)
    assert restored["params"]["blk"]["w"].sharding == target["params"]["blk"]["w"].sharding
    np.testing.assert_array_equal(np.asarray(restored["params"]["b"]), w[0])
    np.testing.assert_array_equal(np.asarray(restored["opt_state"]["mu"]["blk"]["w"]), mu)
    np.testing.assert_array_equal(np.asarray(restored["opt_state"]["nu"]["blk"]["w"]), nu)
    assert int(restored["opt_state"]["count"]) == 5 and int(restored["step"]) == 5

    back = cbopen.open(dst)  # and ckptbridge reads its own Orbax output as the same train state
    assert set(back["blk/w"].states) == {"fp32", "exp_avg", "exp_avg_sq"}
    assert back["blk/w"].scalars == {"step": 5}
    np.testing.assert_array_equal(back["blk/w"].state("exp_avg_sq").read(), nu)


@pytest.mark.parametrize("options", [{"zarr3": True}, {"ocdbt": False, "compression": False},
                                     {"ocdbt": False, "zarr3": True, "layout": "flat"}])
def test_written_orbax_variants_restore(tmp_path, options):
    w, b = rnd(7, (24, 16)), rnd(8, (16,)).astype(jax.numpy.bfloat16)
    src = str(tmp_path / "uni")
    m = mesh((2, 4), ("x", "y"))
    cbjax.save(src, {"enc": {"w": jax.device_put(w, NamedSharding(m, P("y", "x"))), "b": b}}, step=9)
    dst = str(tmp_path / "out")
    reshard(src, dst, to="orbax", chunk_bytes=512, **options)
    sh = NamedSharding(mesh((4, 2), ("a", "b")), P("a", "b"))
    params = {"enc": {"w": jax.ShapeDtypeStruct((24, 16), np.float32, sharding=sh),
                      "b": jax.ShapeDtypeStruct((16,), jax.numpy.bfloat16, sharding=NamedSharding(sh.mesh, P()))}}
    target = params if options.get("layout") == "flat" else {
        "params": params, "step": jax.ShapeDtypeStruct((), np.int64, sharding=NamedSharding(sh.mesh, P()))}
    restored = ocp.StandardCheckpointer().restore(dst, target)
    got = restored if options.get("layout") == "flat" else restored["params"]
    np.testing.assert_array_equal(np.asarray(got["enc"]["w"]), w)
    np.testing.assert_array_equal(np.asarray(got["enc"]["b"]), b)
    back = cbopen.open(dst)
    np.testing.assert_array_equal(back["enc/w"][3:9, 2:5], w[3:9, 2:5])
    assert len(back["enc/w"].fragments) > 1  # the chunks written


def test_writer_refuses_unknown_options(tmp_path):
    src = str(tmp_path / "uni")
    cbjax.save(src, {"w": np.ones((2, 2), np.float32)})
    with pytest.raises(ValueError, match="has no option"):
        reshard(src, str(tmp_path / "o"), to="orbax", tp=2)
    assert not os.path.exists(str(tmp_path / "o")) and not os.path.exists(str(tmp_path / "o.partial"))
