"""Orbax checkpoints read in place from object stores: moto's S3 server and fake-gcs-server.

Checkpoints written by ``orbax.checkpoint`` (OCDBT with zstd, its default; OCDBT and plain
directories uncompressed, zarr v2 and v3; a CheckpointManager root) are uploaded unchanged
to a real S3 server (moto, over HTTP) and a GCS emulator (fake-gcs-server), then opened by
URL. The chunk bytes travel through ckptbridge's storage layer (fsspec: ranged, concurrent);
TensorStore reads the OCDBT index through its own ``s3``/``gcs`` kvstore drivers, configured
from the same endpoint. Results equal the local read bitwise, a JAX load onto a changed mesh
equals Orbax's own values, and a column slice of uncompressed chunks fetches only its ranges.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # conftest sets it first
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # no gRPC probe of the emulator

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from _common import same_checkpoint
from _orbax_layouts import mesh, save_layouts, sharded_on_2x4
from _servers import S3_KEY, S3_SECRET, gcs_server, make_bucket, s3_options, s3_server
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ckptbridge
from ckptbridge import MissingShardError, OptionError, StorageError
from ckptbridge import _storage as storage
from ckptbridge.adapters import jax as cbjax

pytestmark = pytest.mark.filterwarnings("ignore")

LAYOUTS = ("ocdbt-zarr2-zstd", "ocdbt-zarr3-raw", "dir-zarr2-raw")  # Orbax's default, and both raw kinds


def _ref() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {"w": rng.standard_normal((64, 256), dtype=np.float32),
            "b": rng.standard_normal((512,), dtype=np.float32)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Local Orbax checkpoints: one per layout, and a CheckpointManager root with steps 1 and 2."""
    root = tmp_path_factory.mktemp("orbax_remote")
    ref = _ref()
    tree = sharded_on_2x4(ref, {"w": ("x", "y"), "b": ()})
    save_layouts(root, tree, LAYOUTS)
    with ocp.CheckpointManager(str(root / "manager")) as mgr:
        for step in (1, 2):
            mgr.save(step, args=ocp.args.StandardSave(jax.tree.map(lambda a, s=step: a * s, tree)))
        mgr.wait_until_finished()
    return str(root), ref


@pytest.fixture(scope="module")
def s3_env():
    """moto's S3 server with bucket ``obkt``; credentials in the environment, as TensorStore reads them."""
    with pytest.MonkeyPatch.context() as mp, s3_server() as ep:
        mp.setenv("AWS_ACCESS_KEY_ID", S3_KEY)
        mp.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
        make_bucket(ep, "obkt")
        storage.configure("s3://obkt/", **s3_options(ep))
        try:
            yield ep
        finally:
            storage.unconfigure("s3://obkt/")


def _upload(local: str, url: str) -> None:
    storage.upload_tree(local, url)


def _target():
    m = mesh((4, 2), ("a", "b"))
    return {"w": jax.ShapeDtypeStruct((64, 256), np.float32, sharding=NamedSharding(m, P(None, ("a", "b")))),
            "b": jax.ShapeDtypeStruct((512,), np.float32, sharding=NamedSharding(m, P(("a", "b"))))}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_orbax_at_s3_equals_the_local_read(saved, s3_env, layout):
    root, ref = saved
    url = f"s3://obkt/{layout}"
    _upload(os.path.join(root, layout), url)
    assert ckptbridge.detect_format(url) == "orbax"
    remote, local = ckptbridge.open(url), ckptbridge.open(os.path.join(root, layout))
    same_checkpoint(remote, local, ordered=False)
    got = cbjax.load(url, _target())
    for name, arr in got.items():
        np.testing.assert_array_equal(np.asarray(arr), ref[name])
        assert arr.sharding == _target()[name].sharding


def test_uncompressed_slice_at_s3_fetches_only_its_ranges(saved, s3_env):
    """A 1/8 column block of ``w`` (rows of 32 floats in chunks of 64x256... as Orbax wrote them):
    the data fetched is the block's own byte runs, not the chunks around it."""
    root, ref = saved
    url = "s3://obkt/slice-ocdbt-zarr3-raw"
    _upload(os.path.join(root, "ocdbt-zarr3-raw"), url)
    ckpt = ckptbridge.open(url)
    store = storage.remote(url)
    store.stats.reset()
    got = ckpt["w"][:, 32:64]
    np.testing.assert_array_equal(got, ref["w"][:, 32:64])
    needed = 64 * 32 * 4
    assert needed <= store.stats.bytes_fetched <= 1.1 * needed, (store.stats.bytes_fetched, needed)
    store.stats.reset()  # negative control: the whole array fetches the whole array
    ckpt["w"].read()
    assert store.stats.bytes_fetched >= 64 * 256 * 4


def test_manager_root_at_s3_latest_and_earlier_step(saved, s3_env):
    root, ref = saved
    url = "s3://obkt/run"
    _upload(os.path.join(root, "manager"), url)
    latest = ckptbridge.open(url)
    assert latest.step == 2
    np.testing.assert_array_equal(latest["w"].read(), ref["w"] * 2)
    first = ckptbridge.open(url, step=1)
    np.testing.assert_array_equal(first["w"].read(), ref["w"])
    same_checkpoint(latest, ckptbridge.open(os.path.join(root, "manager")), ordered=False)


def test_orbax_at_gcs_equals_the_local_read(saved, monkeypatch):
    """fake-gcs-server: fsspec (gcsfs) for the chunks, TensorStore's gcs driver for the OCDBT index
    (its endpoint from TENSORSTORE_GCS_HTTP_URL, which must agree with the storage option)."""
    import fsspec

    root, ref = saved
    with gcs_server() as ep:
        opts = {"endpoint_url": ep, "token": "anon"}
        fsspec.filesystem("gs", **opts, skip_instance_cache=True).mkdir("ogbkt")
        storage.configure("gs://ogbkt/", **opts)
        try:
            url = "gs://ogbkt/ck"
            _upload(os.path.join(root, "ocdbt-zarr2-zstd"), url)
            monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL", raising=False)
            with pytest.raises(OptionError, match="TENSORSTORE_GCS_HTTP_URL"):  # would read another server
                ckptbridge.open(url)
            monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", ep)
            monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
            same_checkpoint(ckptbridge.open(url), ckptbridge.open(os.path.join(root, "ocdbt-zarr2-zstd")), ordered=False)
            got = cbjax.load(url, _target())
            np.testing.assert_array_equal(np.asarray(got["w"]), ref["w"])
        finally:
            storage.unconfigure("gs://ogbkt/")


def test_deleted_chunk_at_s3_names_the_object(saved, s3_env):
    root, _ = saved
    url = "s3://obkt/broken-dir"
    _upload(os.path.join(root, "dir-zarr2-raw"), url)
    ckpt = ckptbridge.open(url)
    fs = storage.remote(url).fs
    chunk = next(p for p in fs.find("obkt/broken-dir/w") if not p.endswith(".zarray"))
    fs.rm(chunk)  # deleted after the open, before the read
    with pytest.raises(MissingShardError, match=chunk.rsplit("/", 1)[-1]):
        ckpt["w"].read()


def test_protocols_without_a_tensorstore_driver(saved):
    """memory://: a plain-directory uncompressed checkpoint needs no TensorStore and reads; an OCDBT
    one needs TensorStore's index reader, which has no memory:// driver: one error naming the URL."""
    root, ref = saved
    _upload(os.path.join(root, "dir-zarr2-raw"), "memory://orbax/dir")
    _upload(os.path.join(root, "ocdbt-zarr2-zstd"), "memory://orbax/ocdbt")
    np.testing.assert_array_equal(ckptbridge.open("memory://orbax/dir")["w"].read(), ref["w"])
    with pytest.raises(StorageError, match="memory://orbax/ocdbt.*TensorStore"):
        ckptbridge.open("memory://orbax/ocdbt")


def test_s3_keys_only_in_storage_options_are_refused_with_the_fix(saved, s3_env, monkeypatch):
    """TensorStore takes S3 credentials from the environment or a profile: keys given only as
    storage options would reach fsspec but not TensorStore, so the open says what to set."""
    root, _ = saved
    url = "s3://obkt/keys-only"
    _upload(os.path.join(root, "ocdbt-zarr2-zstd"), url)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    with pytest.raises(OptionError, match="AWS_ACCESS_KEY_ID"):
        ckptbridge.open(url)
