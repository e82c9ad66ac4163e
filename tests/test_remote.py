"""Checkpoints behind URLs, against real servers on 127.0.0.1: moto's S3 server (s3fs over HTTP),
fake-gcs-server (gcsfs), and a plain HTTP range server that fails on purpose (retries).

Every format's reader runs on objects the real libraries wrote (DeepSpeed, Megatron-LM, torch
DCP, torch.save, safetensors), uploaded to the server; results equal the local read bitwise and
only the needed byte ranges travel (bytes fetched counted by the storage layer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # no gRPC probe of the emulator

import numpy as np
import pytest
from _common import free_port, same_checkpoint
from _servers import RangeServer, gcs_server, make_bucket, s3_options, s3_server

import ckptbridge
from ckptbridge import AccessDeniedError, IncompleteCheckpointError, MissingShardError, StorageError
from ckptbridge import _storage as storage
from ckptbridge.plugin import Box, Piece, write_universal

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
DS = os.path.join(FIX, "migration", "ds_zero2_w2", "ckpt")
MEGATRON_DIST = os.path.join(FIX, "megatron", "A", "tp2pp2", "torch_dist")
MEGATRON_LEGACY = os.path.join(FIX, "megatron", "B", "tp1pp2", "torch")


@pytest.fixture(scope="module")
def s3():
    """An S3 endpoint with bucket ``bkt``; ``s3://`` URLs go to it. Yields (endpoint, s3fs)."""
    import fsspec

    with s3_server() as ep:
        make_bucket(ep, "bkt")
        storage.configure("s3://", **s3_options(ep), backoff=0.01)
        fs = fsspec.filesystem("s3", **s3_options(ep), skip_instance_cache=True)
        try:
            yield ep, fs
        finally:
            storage.unconfigure()


@pytest.fixture(scope="module")
def torch_file(tmp_path_factory):
    """A real ``torch.save`` file with two big matrices (the 1/8-slice cases) and small tensors."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    sd = {"big.a": torch.randn(512, 1024, generator=g), "big.b": torch.randn(256, 2048, generator=g),
          "small": torch.randn(7, generator=g), "step": 3}
    path = tmp_path_factory.mktemp("pt") / "model.pt"
    torch.save(sd, path)
    return str(path)


def _upload(fs, local: str, url: str) -> None:
    fs.put(local, url.removeprefix("s3://"), recursive=True)


# ------------------------------------------------------------------ reading every format


def test_every_reader_over_s3_equals_the_local_read(s3, tmp_path, torch_file):
    _, fs = s3
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from safetensors.numpy import save_file

    # a DCP checkpoint (torch's own writer) and an HF-style sharded safetensors folder
    dcp_dir = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.arange(24.0).reshape(4, 6), "b": torch.ones(3)}},
                 checkpoint_id=str(dcp_dir), no_dist=True)
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a": np.arange(12, dtype=np.float32).reshape(3, 4)}, str(hf / "model-00001-of-00002.safetensors"))
    save_file({"b": np.ones((2, 2), np.float16)}, str(hf / "model-00002-of-00002.safetensors"))
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    cases = {"deepspeed": DS, "megatron": MEGATRON_DIST, "megatron-legacy": MEGATRON_LEGACY,
             "dcp": str(dcp_dir), "safetensors": str(hf), "torch": torch_file}
    for name, local in cases.items():
        url = f"s3://bkt/formats/{name}" + ("/model.pt" if name == "torch" else "")
        if name == "torch":
            fs.put(local, url.removeprefix("s3://"))
        else:
            _upload(fs, local, url)
        a, b = ckptbridge.open(local), ckptbridge.open(url)
        assert b.path.startswith(url) and b.format == a.format
        same_checkpoint(a, b)
        assert b.stats.bytes_read == a.stats.bytes_read
        if name == "megatron-legacy":
            # a missing rank file is named, as locally
            fs.rm(url.removeprefix("s3://") + "/iter_0000005/mp_rank_00_001/model_optim_rng.pt")
            with pytest.raises(MissingShardError, match="mp_rank_00_001"):
                ckptbridge.open(url)


def test_detection_on_a_url_lists_instead_of_downloading(s3, torch_file):
    _, fs = s3
    ckptbridge.convert(torch_file, "s3://bkt/detect/u")
    store = storage.get("s3://bkt/detect/u")
    store.stats.reset()
    ckpt = ckptbridge.open("s3://bkt/detect/u")
    manifest = fs.size("bkt/detect/u/manifest.json") + fs.size("bkt/detect/u/extra.json")
    data = sum(fs.size(f) for f in fs.find("bkt/detect/u/data"))
    assert ckpt.format == "universal"
    # metadata only: the manifest and extra.json in whole blocks, never the data objects
    assert store.stats.bytes_fetched <= manifest + (128 << 10) < data
    assert store.stats.requests < 20


def test_state_dict_fetches_each_object_in_one_round(s3):
    """``state_dict`` over S3 equals the local read bitwise, in far fewer requests than reading
    the tensors one by one (each object's runs fetched together, objects concurrently)."""
    _, fs = s3
    url = "s3://bkt/sd/ds"
    _upload(fs, DS, url)
    local, remote = ckptbridge.open(DS), ckptbridge.open(url)
    store = storage.get(url)
    for state in local.states():
        want = local.state_dict(state)
        store.stats.reset()
        got = remote.state_dict(state)
        batched = store.stats.requests
        assert list(got) == list(want)
        assert all(got[n].dtype == want[n].dtype and got[n].tobytes() == want[n].tobytes() for n in want)
        store.stats.reset()
        for n in want:
            remote[n].state(state).read()
        assert batched * 4 <= store.stats.requests, (state, batched, store.stats.requests)


# ------------------------------------------------------------------ only the needed bytes


@pytest.mark.parametrize("where", ["s3", "gcs"])
def test_column_slice_fetches_only_the_needed_ranges(where, s3, torch_file):
    if where == "s3":
        _check_slice("s3://bkt/slice/u", torch_file)
        return
    import fsspec

    with gcs_server() as url:
        opts = {"endpoint_url": url, "token": "anon"}
        fsspec.filesystem("gs", **opts, skip_instance_cache=True).mkdir("gbkt")
        storage.configure("gs://", **opts, backoff=0.01)
        try:
            _check_slice("gs://gbkt/slice/u", torch_file)
        finally:
            storage.unconfigure("gs://")


def _check_slice(url: str, torch_file: str) -> None:
    local = ckptbridge.open(torch_file)
    ckptbridge.convert(local, url)
    ckpt = ckptbridge.open(url)
    for name in ("big.a", "big.b"):
        view = ckpt[name]
        cols = view.shape[1] // 8
        got = view[:, 3 * cols : 4 * cols]
        np.testing.assert_array_equal(got, local[name][:, 3 * cols : 4 * cols])
    needed = sum(ckpt[n].shape[0] * (ckpt[n].shape[1] // 8) * 4 for n in ("big.a", "big.b"))
    assert ckpt.stats.bytes_read == needed
    assert needed <= ckpt.stats.bytes_fetched <= 1.1 * needed, (ckpt.stats.bytes_fetched, needed)
    # negative control: a whole read fetches the whole tensors (the counter is not blind)
    ckpt.stats.reset()
    ckpt["big.a"].read()
    assert ckpt.stats.bytes_fetched == 512 * 1024 * 4
    assert ckptbridge.verify(url) == []


# ------------------------------------------------------------------ writing with the commit rule


def test_writers_to_urls_commit_last_and_refuse_committed_prefixes(s3, tmp_path):
    _, fs = s3
    src = ckptbridge.open(DS)
    out = ckptbridge.convert(src, "s3://bkt/w/u")
    assert fs.exists("bkt/w/u/COMMITTED")
    same_checkpoint(ckptbridge.open(DS), ckptbridge.open(out))
    with pytest.raises(FileExistsError, match="s3://bkt/w/u"):
        ckptbridge.convert(src, "s3://bkt/w/u")
    # other formats are built locally and uploaded: objects first, the marker last
    dcp_url = ckptbridge.reshard(src, "s3://bkt/w/dcp", to="dcp", world_size=2)
    assert fs.exists("bkt/w/dcp/COMMITTED") and fs.exists("bkt/w/dcp/.metadata")
    back = ckptbridge.open(dcp_url)
    for name in list(back)[:5]:
        np.testing.assert_array_equal(back[name].read(), src[name].read())
    st = ckptbridge.reshard(src, "s3://bkt/w/weights", to="safetensors", state="fp32")
    assert st == "s3://bkt/w/weights.safetensors"
    one = ckptbridge.open(st)
    for name in one:
        np.testing.assert_array_equal(one[name].read(), src[name].state("fp32").read())
    # overwrite: the old marker goes first; the new checkpoint replaces the old one's objects
    ckptbridge.convert(ckptbridge.open(DS), "s3://bkt/w/u", states=["fp32"], overwrite=True)
    again = ckptbridge.open("s3://bkt/w/u")
    assert again.states() == ("fp32",)
    assert not any("exp_avg" in f for f in fs.find("bkt/w/u"))


def test_a_write_that_dies_leaves_nothing_committed_and_a_rerun_succeeds(s3):
    _, fs = s3
    src = ckptbridge.open(DS)
    first = "bkt/dead/u/data/fp32-r00000-00000.safetensors"

    def dies() -> np.ndarray:  # the job dies once the first state's object is uploaded
        deadline = time.monotonic() + 60
        while not fs.exists(first) and time.monotonic() < deadline:
            fs.invalidate_cache()
            time.sleep(0.05)
        raise KeyboardInterrupt("killed")

    pieces = [Piece(n, "fp32", t.state("fp32").dtype, t.shape, Box.full(t.shape), t.state("fp32").read)
              for n, t in src.items()]
    pieces.append(Piece("late", "zz", "float32", (4,), Box.full((4,)), dies))
    with pytest.raises(KeyboardInterrupt):
        write_universal("s3://bkt/dead/u", pieces)
    fs.invalidate_cache()
    left = fs.find("bkt/dead/u")
    assert first in left and not any(f.endswith("COMMITTED") for f in left)  # objects, but no marker
    with pytest.raises(IncompleteCheckpointError, match="COMMITTED"):
        ckptbridge.open("s3://bkt/dead/u")
    stale = "bkt/dead/u/data/exp_avg-r00007-00000.safetensors"  # another earlier attempt's leftover
    fs.pipe(stale, b"junk")
    ckptbridge.convert(src, "s3://bkt/dead/u")  # no marker: not a checkpoint, so no overwrite needed
    fs.invalidate_cache()
    assert not fs.exists(stale) and not any("zz-" in f for f in fs.find("bkt/dead/u"))
    same_checkpoint(ckptbridge.open(DS), ckptbridge.open("s3://bkt/dead/u"))


def test_checkpointer_persistent_level_at_s3(s3, tmp_path):
    _, fs = s3
    with ckptbridge.Checkpointer(tmp_path / "ck", persistent="s3://bkt/persist") as ck:
        ck.save(2, {"w": np.arange(6, dtype=np.int64)})
        ck.save(4, {"w": np.arange(6, dtype=np.int64) * 2})
        ck.wait()
    steps = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("bkt/persist"))
    assert len(steps) == 2
    for s in steps:
        assert fs.exists(f"bkt/persist/{s}/COMMITTED")
    c = ckptbridge.open(f"s3://bkt/persist/{steps[-1]}")
    np.testing.assert_array_equal(c["w"].read(), np.arange(6) * 2)


# ------------------------------------------------------------------ bad input


def test_object_deleted_mid_read_names_the_object(s3, torch_file):
    _, fs = s3
    ckptbridge.convert(torch_file, "s3://bkt/del/u")
    ckpt = ckptbridge.open("s3://bkt/del/u")
    data = fs.find("bkt/del/u/data")[0]
    fs.rm(data)
    with pytest.raises(MissingShardError, match=data.rsplit("/", 1)[-1]) as info:
        ckpt["big.a"].read()
    assert "\n" not in str(info.value) and "not found" in str(info.value)


def test_unreachable_endpoint_is_one_line_naming_the_object(tmp_path):
    port = free_port()  # nothing listens there
    storage.configure("s3://nowhere/", **s3_options(f"http://127.0.0.1:{port}"), retries=2, backoff=0.01)
    try:
        t0 = time.monotonic()
        with pytest.raises(StorageError, match=r"s3://nowhere/run/ckpt.*3 attempts") as info:
            ckptbridge.open("s3://nowhere/run/ckpt")
        assert time.monotonic() - t0 < 60 and "\n" not in str(info.value)
        assert not isinstance(info.value, AccessDeniedError)
    finally:
        storage.unconfigure("s3://nowhere/")
    env = dict(os.environ, FSSPEC_S3_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="k",
               AWS_SECRET_ACCESS_KEY="s", AWS_MAX_ATTEMPTS="1", AWS_DEFAULT_REGION="us-east-1")
    r = subprocess.run([sys.executable, "-m", "ckptbridge", "inspect", "s3://nowhere/run/ckpt"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "s3://nowhere/run/ckpt" in lines[0], r.stderr


def test_refused_credentials_are_named():
    with s3_server(auth=True) as ep:  # a server that checks credentials: ours are unknown to it
        storage.configure("s3://locked/", **s3_options(ep), retries=3, backoff=0.01)
        try:
            with pytest.raises(AccessDeniedError, match=r"s3://locked/ckpt.*refused") as info:
                ckptbridge.open("s3://locked/ckpt")
            assert "\n" not in str(info.value)
            assert storage.get("s3://locked/ckpt").stats.retries == 0  # refusals are not retried
        finally:
            storage.unconfigure("s3://locked/")


@pytest.mark.parametrize("mode", ["503", "drop"])
def test_transient_errors_are_retried_with_backoff(tmp_path, torch_file, mode):
    path = ckptbridge.export(torch_file, str(tmp_path / "m.safetensors"))
    local = ckptbridge.open(path)
    with RangeServer(str(tmp_path), fail_first=2, mode=mode) as srv:
        url = f"{srv.url}/m.safetensors"
        storage.configure(srv.url, backoff=0.001, max_backoff=0.01)
        try:
            ckpt = ckptbridge.open(url)
            got = ckpt["big.b"][:, :256]
            np.testing.assert_array_equal(got, local["big.b"][:, :256])
            assert ckpt.stats.retries > 0
            assert sum(1 for _, _, s in srv.requests if s == 503) >= ckpt.stats.retries
            # negative control: with too few retries the same server makes the read fail, naming the object
            storage.configure(srv.url, retries=0)
            with pytest.raises(StorageError, match="m.safetensors"):
                ckptbridge.open(url)["big.a"].read()
        finally:
            storage.unconfigure(srv.url)


def test_missing_protocol_package_names_the_extra():
    with pytest.raises(ckptbridge.MissingExtraError, match=r"pip install 'ckptbridge\["):
        ckptbridge.open("oci://bucket@ns/ckpt")
