"""ckptbridge.adapters.jax: save from one mesh, load onto another (8 fake CPU devices)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # conftest sets it first

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptbridge as cbopen
from ckptbridge import ShapeMismatchError, TensorNotFoundError
from ckptbridge.adapters import jax as cbjax

SHAPE = (48, 40)


def mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def ref_array(seed=0, shape=SHAPE):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def expected_bytes(sharding, shape, itemsize=4):
    boxes = {cbjax.box_of_index(i, shape) for i in sharding.addressable_devices_indices_map(shape).values()}
    return sum(b.size for b in boxes) * itemsize


# (source mesh, axes, spec) -> (target mesh, axes, spec)
CASES = [
    (((1, 8), ("a", "b"), P("a", "b")), ((8, 1), ("x", "y"), P("x", None))),
    (((2, 4), ("data", "model"), P("data", "model")), ((4, 2), ("data", "model"), P("model", "data"))),
    (((4, 2), ("x", "y"), P(None, "y")), ((2, 4), ("p", "q"), P("p", "q"))),
    (((8, 1), ("x", "y"), P("x")), ((1, 8), ("x", "y"), P(None, "y"))),
    (((2, 2, 2), ("a", "b", "c"), P(("a", "b"), "c")), ((2, 4), ("d", "e"), P())),
    (((2, 4), ("x", "y"), P()), ((2, 2, 2), ("i", "j", "k"), P("k", ("i", "j")))),
    (((2, 2, 2), ("a", "b", "c"), P("c", None)), ((4, 2), ("r", "s"), P(None, "r"))),
    (((1, 8), ("u", "v"), P("v", None)), ((2, 4), ("x", "y"), P(("x", "y"), None))),
]


@pytest.mark.parametrize(("src", "dst"), CASES, ids=[f"{s[0]}{s[2]}->{d[0]}{d[2]}" for s, d in CASES])
def test_reshard_between_meshes(tmp_path, src, dst):
    ref = ref_array()
    bias = ref_array(1, (SHAPE[1],))
    src_sh = NamedSharding(mesh(src[0], src[1]), src[2])
    tree = {"layer": {"kernel": jax.device_put(ref, src_sh),
                      "bias": jax.device_put(bias, NamedSharding(src_sh.mesh, P()))}}
    path = str(tmp_path / "ckpt")
    cbjax.save(path, tree, step=7)
    ckpt = cbopen.open(path)
    assert ckpt.step == 7 and sorted(ckpt) == ["layer/bias", "layer/kernel"]
    # the distributed representation was kept: one fragment per distinct saved shard
    n_src = len({cbjax.box_of_index(i, SHAPE) for i in src_sh.devices_indices_map(SHAPE).values()})
    assert len(ckpt["layer/kernel"].fragments) == n_src
    assert len(ckpt["layer/bias"].fragments) == 1

    dst_sh = NamedSharding(mesh(dst[0], dst[1]), dst[2])
    out = cbjax.load(ckpt, {"layer": {"kernel": dst_sh}})
    arr = out["layer"]["kernel"]
    assert arr.sharding == dst_sh
    np.testing.assert_array_equal(np.asarray(arr), ref)
    for shard in arr.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), ref[shard.index])
    want = expected_bytes(dst_sh, SHAPE)
    assert abs(ckpt.stats.bytes_read - want) <= 0.1 * want, (ckpt.stats.bytes_read, want)


def test_replicated_reads_once_and_casts(tmp_path):
    ref = ref_array(3)
    m = mesh((2, 4), ("x", "y"))
    path = str(tmp_path / "c")
    cbjax.save(path, {"w": jax.device_put(ref, NamedSharding(m, P("x", "y"))),
                      "count": np.int32(5)})
    ckpt = cbopen.open(path)
    out = cbjax.load(ckpt, NamedSharding(mesh((4, 2), ("a", "b")), P()), dtype="bfloat16")
    assert out["w"].dtype == jax.numpy.bfloat16
    assert out["count"].dtype == np.int32 and int(out["count"]) == 5  # integers are not cast
    np.testing.assert_array_equal(np.asarray(out["w"]), ref.astype(jax.numpy.bfloat16))
    assert ckpt.stats.bytes_read == ref.nbytes + 4  # 8 replicas, one read


def test_pytree_targets_shape_dtype_struct(tmp_path):
    ref = ref_array(4)
    m = mesh((2, 4), ("x", "y"))
    path = str(tmp_path / "c")
    cbjax.save(path, {"params": {"w": jax.device_put(ref, NamedSharding(m, P(None, "y")))}})
    sh = NamedSharding(mesh((8,), ("d",)), P("d"))
    target = {"params": {"w": jax.ShapeDtypeStruct(SHAPE, jax.numpy.bfloat16, sharding=sh)}, "skip": None}
    out = cbjax.load(path, target)
    assert out["skip"] is None
    assert out["params"]["w"].dtype == jax.numpy.bfloat16 and out["params"]["w"].sharding == sh
    np.testing.assert_array_equal(np.asarray(out["params"]["w"]), ref.astype(jax.numpy.bfloat16))
    # a callable picks shardings per tensor
    got = cbjax.load(path, lambda name, shape: sh if len(shape) == 2 else None)
    assert list(got) == ["params/w"]


def test_errors_name_tensor(tmp_path):
    m = mesh((2, 4), ("x", "y"))
    path = str(tmp_path / "c")
    cbjax.save(path, {"w": jax.device_put(ref_array(), NamedSharding(m, P("x")))})
    with pytest.raises(TensorNotFoundError, match="'nope'"):
        cbjax.load(path, {"nope": NamedSharding(m, P())})
    bad = jax.ShapeDtypeStruct((4, 4), np.float32, sharding=NamedSharding(m, P()))
    with pytest.raises(ShapeMismatchError, match="'w'"):
        cbjax.load(path, {"w": bad})
    # uneven splits: jax 0.10 NamedSharding refuses them; the error names the tensor
    cbjax.save(str(tmp_path / "odd"), {"odd": np.zeros((10, 3), np.float32)})
    with pytest.raises(ShapeMismatchError, match="'odd'"):
        cbjax.load(str(tmp_path / "odd"), {"odd": NamedSharding(mesh((4, 2), ("a", "b")), P("a"))})
    with pytest.raises(FileExistsError):
        cbjax.save(path, {"w": np.zeros(3, np.float32)})


def test_save_bf16_state_and_scalars(tmp_path):
    m = mesh((4, 2), ("x", "y"))
    w = jax.device_put(ref_array(5).astype(jax.numpy.bfloat16), NamedSharding(m, P("x", "y")))
    path = str(tmp_path / "c")
    cbjax.save(path, {"w": w}, extra={"lr": 0.1}, scalars={"w": {"step": 2}})
    ckpt = cbopen.open(path)
    assert ckpt["w"].states == ("param",) and ckpt["w"].dtype == "bfloat16"
    assert ckpt["w"].scalars == {"step": 2} and ckpt.extra == {"lr": 0.1}
    assert ckpt.provenance["layout"]["w"]["mesh"] == {"x": 4, "y": 2}
    np.testing.assert_array_equal(ckpt["w"].read(), np.asarray(w))
