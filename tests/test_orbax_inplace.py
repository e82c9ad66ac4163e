"""Orbax checkpoints read in place onto a changed mesh: every layout Orbax writes, against Orbax's restore.

Real checkpoints written by ``orbax.checkpoint`` from a 2x4 mesh (OCDBT or plain
directories, zarr v2 or v3, zstd or uncompressed) are loaded onto a 4x2 mesh by
``ckptbridge.adapters.jax.load`` and by Orbax's own restore: same values, same
shardings. Uncompressed chunks are read as plain file regions, zstd ones are decoded
by ckptbridge once per chunk (no TensorStore on the data path); TensorStore is the
fallback for anything else. All read no more than the target shards need. A deleted,
truncated or damaged chunk file is an error naming the file.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # conftest sets it first

import glob

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from _orbax_layouts import LAYOUTS, mesh, save_layouts, sharded_on_2x4
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ckptbridge as cbopen
from ckptbridge import CheckpointError, FormatError, MissingShardError, TruncatedError
from ckptbridge.adapters import jax as cbjax
from ckptbridge.adapters.orbax import TensorStoreRegion, ZstdChunk
from ckptbridge.plugin import FileRegion

pytestmark = pytest.mark.filterwarnings("ignore")

def _ref():
    rng = np.random.default_rng(7)
    return {"w": rng.standard_normal((64, 96), dtype=np.float32),
            "h": rng.standard_normal((32, 128)).astype(ml_dtypes.bfloat16),
            "b": rng.standard_normal((512,), dtype=np.float32)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("orbax_layouts")
    ref = _ref()
    save_layouts(root, sharded_on_2x4(ref, {"w": ("x", "y"), "h": (None, "y"), "b": ()}))
    return str(root), ref


def _target():
    sh = NamedSharding(mesh((4, 2), ("a", "b")), P(None, ("a", "b")))
    ref = _ref()
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh if v.ndim == 2 else
                                    NamedSharding(mesh((4, 2), ("a", "b")), P(("a", "b"))))
            for k, v in ref.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_in_place_equals_orbax_restore(saved, layout):
    root, ref = saved
    path = os.path.join(root, layout)
    target = _target()
    theirs = ocp.StandardCheckpointer().restore(path, target)
    with cbopen.open(path) as ckpt:
        ours = cbjax.load(ckpt, target)
        locs = {n: {type(f.location) for f in ckpt.index.tensors[n].state().fragments} for n in ref}
        counted = ckpt.stats.bytes_read
    for k in ref:
        assert ours[k].sharding == target[k].sharding and ours[k].dtype == ref[k].dtype
        np.testing.assert_array_equal(np.asarray(ours[k]), np.asarray(theirs[k]))
        np.testing.assert_array_equal(np.asarray(ours[k]), ref[k])
    raw = not LAYOUTS[layout][2]
    # the data path: uncompressed chunks are file regions, zstd chunks decoded by us (no TensorStore)
    assert locs["w"] == ({FileRegion} if raw else {ZstdChunk})
    need = sum(v.nbytes for v in ref.values())
    if raw:
        assert need <= counted <= 1.1 * need
    else:  # compressed bytes, each chunk read once although two devices need parts of it
        assert 0.5 * need <= counted <= 1.1 * need


def test_tensorstore_fallback_equals(saved, monkeypatch):
    """With ckptbridge's own chunk reading off, TensorStore batches give the same arrays."""
    from ckptbridge.adapters.orbax import _reader

    monkeypatch.setattr(_reader, "raw_fragments", lambda *a, **k: None)
    root, ref = saved
    target = _target()
    for layout in ("ocdbt-zarr2-zstd", "ocdbt-zarr3-raw"):
        with cbopen.open(os.path.join(root, layout)) as ckpt:
            assert {type(f.location) for f in ckpt.index.tensors["w"].state().fragments} == {TensorStoreRegion}
            ours = cbjax.load(ckpt, target)
            need = sum(v.nbytes for v in ref.values())
            assert need <= ckpt.stats.bytes_read <= 1.1 * need
        for k in ref:
            np.testing.assert_array_equal(np.asarray(ours[k]), ref[k])


@pytest.mark.parametrize("layout", ["ocdbt-zarr2-raw", "ocdbt-zarr3-zstd", "dir-zarr2-raw"])
def test_cast_on_load(saved, layout):
    root, ref = saved
    sh = NamedSharding(mesh((4, 2), ("a", "b")), P("b", "a"))
    with cbopen.open(os.path.join(root, layout)) as ckpt:
        out = cbjax.load(ckpt, {"w": sh}, dtype="bfloat16")
    assert out["w"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(np.asarray(out["w"]), ref["w"].astype(ml_dtypes.bfloat16))


def _chunk_files(path: str) -> list[str]:
    files = [f for f in glob.glob(os.path.join(path, "**", "d", "*"), recursive=True) if os.path.isfile(f)]
    return sorted(files, key=os.path.getsize)


@pytest.mark.parametrize("layout", ["ocdbt-zarr2-raw", "ocdbt-zarr2-zstd"])
def test_deleted_chunk_file_names_it(saved, tmp_path, layout):
    import shutil

    root, _ = saved
    path = str(tmp_path / layout)
    shutil.copytree(os.path.join(root, layout), path)
    ckpt = cbopen.open(path)
    victim = _chunk_files(path)[-1]  # the largest data file holds array chunks
    os.remove(victim)
    with pytest.raises(CheckpointError) as err:
        cbjax.load(ckpt, {"w": NamedSharding(mesh((4, 2), ("a", "b")), P())})
    msg = str(err.value)
    assert isinstance(err.value, MissingShardError) and victim in msg  # the missing data file itself


@pytest.mark.parametrize("layout", ["ocdbt-zarr2-raw", "ocdbt-zarr2-zstd"])
def test_truncated_chunk_file_names_it(saved, tmp_path, layout):
    import shutil

    root, _ = saved
    path = str(tmp_path / "t")
    shutil.copytree(os.path.join(root, layout), path)
    ckpt = cbopen.open(path)
    victim = _chunk_files(path)[-1]
    with open(victim, "r+b") as fh:
        fh.truncate(os.path.getsize(victim) // 3)
    with pytest.raises(TruncatedError, match=os.path.basename(victim)):
        cbjax.load(ckpt, {"w": NamedSharding(mesh((4, 2), ("a", "b")), P())})


def test_replicas_get_their_own_device_buffers(saved):
    """Replicated boxes are read once, but no two devices share one host buffer (JAX adopts
    page-aligned host arrays as CPU device buffers without copying)."""
    root, ref = saved
    with cbopen.open(os.path.join(root, "ocdbt-zarr2-raw")) as ckpt:
        out = cbjax.load(ckpt, {"w": NamedSharding(mesh((4, 2), ("a", "b")), P(None, "b"))})
        assert ckpt.stats.bytes_read == ref["w"].nbytes  # 2 distinct boxes, each read once
    shards = out["w"].addressable_shards
    assert len({s.data.unsafe_buffer_pointer() for s in shards}) == len(shards) == 8
    for s in shards:
        np.testing.assert_array_equal(np.asarray(s.data), ref["w"][s.index])


def test_damaged_zstd_chunk_names_the_file(saved, tmp_path):
    import shutil

    root, _ = saved
    path = str(tmp_path / "z")
    shutil.copytree(os.path.join(root, "ocdbt-zarr2-zstd"), path)
    ckpt = cbopen.open(path)
    loc = ckpt.index.tensors["w"].state().fragments[0].location
    with open(loc.file, "r+b") as fh:  # the zstd frame's magic number
        fh.seek(loc.offset)
        fh.write(b"\0\0\0\0")
    with pytest.raises(FormatError, match=f"{loc.file}@{loc.offset}: zstd chunk does not decode"):
        cbjax.load(ckpt, {"w": NamedSharding(mesh((4, 2), ("a", "b")), P())})
