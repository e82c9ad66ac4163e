"""The universal directory: round trips, commit marker, checksums, refusal to clobber."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

import ckptbridge
import ckptbridge.plugin
from ckptbridge import IncompleteCheckpointError, TruncatedError
from ckptbridge.plugin import Box, Piece, write_rank
from ckptbridge.plugin import commit_universal as commit

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _state_dict(dtype):
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(11, 6, generator=g).to(dtype),
        "layers.0.linear.weight": torch.randn(6, 6, generator=g).to(dtype),
        "layers.0.linear.bias": torch.randn(6, generator=g).to(dtype),
        "scalar": torch.tensor(3.5).to(dtype),
    }


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_state_dict_to_universal_to_export_is_bitwise(tmp_path, dtype):
    sd = _state_dict(TORCH_DTYPES[dtype])
    torch.save(sd, tmp_path / "sd.pt")
    ckptbridge.convert(tmp_path / "sd.pt", tmp_path / "u")
    ckptbridge.export(tmp_path / "u", tmp_path / "out.safetensors")
    with safe_open(str(tmp_path / "out.safetensors"), "pt") as f:
        assert set(f.keys()) == set(sd)
        for k, v in sd.items():
            got = f.get_tensor(k)
            assert got.dtype == v.dtype and got.shape == v.shape
            assert got.reshape(-1).view(torch.uint8).tolist() == v.reshape(-1).view(torch.uint8).tolist()
    u = ckptbridge.open(tmp_path / "u")
    assert u.format == "universal" and u.provenance["source_format"] == "torch-save"
    for k, v in sd.items():
        assert u[k].dtype == dtype
        raw = v.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert u[k].read().tobytes() == raw


def test_weights_open_with_plain_safetensors_and_states_are_separate(tmp_path):
    w = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    m = np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32)
    pieces = [Piece("w", "fp32", "float32", (8, 4), Box.full((8, 4)), w),
              Piece("w", "exp_avg", "float32", (8, 4), Box.full((8, 4)), lambda: m)]
    ckptbridge.plugin.write_universal(str(tmp_path / "u"), pieces, step=12, extra={"lr": 0.1}, scalars={"w": {"step": 12}})
    files = sorted(os.listdir(tmp_path / "u" / "data"))
    assert files == ["exp_avg-r00000-00000.safetensors", "fp32-r00000-00000.safetensors"]
    with safe_open(str(tmp_path / "u" / "data" / files[1]), "np") as f:
        np.testing.assert_array_equal(f.get_tensor("w"), w)
    c = ckptbridge.open(tmp_path / "u")
    assert c.step == 12 and c.extra == {"lr": 0.1} and c["w"].scalars == {"step": 12}
    np.testing.assert_array_equal(c["w"].state("exp_avg")[2:5, 1:], m[2:5, 1:])
    manifest = json.loads((tmp_path / "u" / "manifest.json").read_text())
    frag = manifest["tensors"]["w"]["states"]["fp32"]["fragments"][0]
    assert frag["checksum"].startswith("crc32:") and manifest["version"] == 1


def test_multi_rank_write_then_commit_merges_fragments(tmp_path):
    full = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)
    dst = str(tmp_path / "u")
    for rank, (a, b) in enumerate([(0, 4), (4, 10)]):
        write_rank(dst, [Piece("w", "fp32", "float32", (10, 6), Box((a, 0), (b - a, 6)), full[a:b])], rank)
    assert not os.path.exists(dst)  # nothing visible before the commit
    commit(dst, world_size=2, step=1)
    c = ckptbridge.open(dst)
    assert len(c["w"].fragments) == 2
    np.testing.assert_array_equal(c["w"].read(), full)
    with ckptbridge.open(dst) as c2:
        c2["w"][3:5]
        assert c2.stats.bytes_read == 2 * 6 * 4  # rows 3..4 only


def test_commit_refuses_when_a_rank_is_missing(tmp_path):
    dst = str(tmp_path / "u")
    write_rank(dst, [Piece("w", "fp32", "float32", (4,), Box((0,), (2,)), np.zeros(2, np.float32))], 0)
    with pytest.raises(ckptbridge.MissingShardError, match="rank 1"):
        commit(dst, world_size=2)
    assert not os.path.exists(dst)


def test_uncommitted_directory_is_not_a_checkpoint(tmp_path):
    ckptbridge.plugin.write_universal(str(tmp_path / "u"), [Piece("w", "fp32", "float32", (2,), Box.full((2,)),
                                                             np.ones(2, np.float32))])
    os.remove(tmp_path / "u" / "COMMITTED")
    with pytest.raises(IncompleteCheckpointError, match="never finished"):
        ckptbridge.open(tmp_path / "u")
    assert ckptbridge.verify(str(tmp_path / "u"))


def test_existing_checkpoint_is_never_overwritten_by_accident(tmp_path):
    torch.save({"a": torch.ones(3)}, tmp_path / "a.pt")
    ckptbridge.convert(tmp_path / "a.pt", tmp_path / "u")
    before = (tmp_path / "u" / "manifest.json").read_bytes()
    torch.save({"b": torch.zeros(3)}, tmp_path / "b.pt")
    with pytest.raises(FileExistsError):
        ckptbridge.convert(tmp_path / "b.pt", tmp_path / "u")
    assert (tmp_path / "u" / "manifest.json").read_bytes() == before
    # a failing conversion leaves the old checkpoint intact too
    (tmp_path / "bad.pt").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(ckptbridge.CheckpointError):
        ckptbridge.convert(tmp_path / "bad.pt", tmp_path / "u", overwrite=True)
    assert (tmp_path / "u" / "manifest.json").read_bytes() == before
    ckptbridge.convert(tmp_path / "b.pt", tmp_path / "u", overwrite=True)
    assert list(ckptbridge.open(tmp_path / "u")) == ["b"]


def _data_file(u):
    d = u / "data"
    return d / sorted(os.listdir(d))[0]


def test_every_flipped_byte_in_data_is_detected(tmp_path):
    torch.save({"w": torch.randn(4, 4), "v": torch.randn(3)}, tmp_path / "a.pt")
    ckptbridge.convert(tmp_path / "a.pt", tmp_path / "u")
    assert ckptbridge.verify(str(tmp_path / "u")) == []
    f = _data_file(tmp_path / "u")
    raw = bytearray(f.read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    for pos in range(header, len(raw)):
        raw[pos] ^= 0x01
        f.write_bytes(raw)
        problems = ckptbridge.verify(str(tmp_path / "u"))
        assert problems and any("'w'" in p or "'v'" in p for p in problems), pos
        raw[pos] ^= 0x01
    f.write_bytes(raw)
    assert ckptbridge.verify(str(tmp_path / "u")) == []


def test_truncated_data_file_names_file_and_tensor(tmp_path):
    torch.save({"w": torch.randn(64, 4)}, tmp_path / "a.pt")
    ckptbridge.convert(tmp_path / "a.pt", tmp_path / "u")
    f = _data_file(tmp_path / "u")
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(TruncatedError, match=r"'w'"):
        ckptbridge.open(tmp_path / "u")


def test_manifest_paths_cannot_escape_the_directory(tmp_path):
    torch.save({"w": torch.randn(2)}, tmp_path / "a.pt")
    ckptbridge.convert(tmp_path / "a.pt", tmp_path / "u")
    m = tmp_path / "u" / "manifest.json"
    doc = json.loads(m.read_text())
    doc["tensors"]["w"]["states"]["param"]["fragments"][0]["file"] = "../a.pt"
    m.write_text(json.dumps(doc))
    with pytest.raises(ckptbridge.FormatError, match="outside"):
        ckptbridge.open(tmp_path / "u")


def test_loading_refuses_corrupted_data_by_default(tmp_path):
    torch.save({"w": torch.randn(32, 8)}, tmp_path / "a.pt")
    ckptbridge.convert(tmp_path / "a.pt", tmp_path / "u")
    f = _data_file(tmp_path / "u")
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0x10
    f.write_bytes(raw)
    with pytest.raises(ckptbridge.CorruptionError, match=r"'w'.*checksum"):
        ckptbridge.open(tmp_path / "u")["w"].read()
    got = ckptbridge.open(tmp_path / "u", verify=False)["w"].read()  # explicitly asked for
    assert got.shape == (32, 8)


def test_manifest_records_where_each_target_byte_came_from(tmp_path):
    from ckptbridge import trace

    torch.save({"w": torch.randn(6, 4)}, tmp_path / "a.pt")
    ckptbridge.convert(tmp_path / "a.pt", tmp_path / "u")
    ckptbridge.convert(tmp_path / "u", tmp_path / "u2")  # a second hop keeps the checksum chain
    t = trace(tmp_path / "u", "w", (3, 2))
    assert t["source"]["location"].startswith(str(tmp_path / "a.pt"))
    t2 = trace(tmp_path / "u2", "w", (3, 2))
    assert t2["source"]["checksum"] == t["fragment"]["checksum"]
    assert t2["source"]["location"].startswith(str(tmp_path / "u" / "data"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_column_split_fragments_read_whole_and_verified(tmp_path, dtype):
    """Whole-fragment verified reads land in strided views of the request correctly."""
    from ckptbridge.plugin import dtypes as _dtypes

    full = np.arange(6 * 10, dtype=np.float32).reshape(6, 10).astype(_dtypes.to_numpy(dtype))
    dst = str(tmp_path / "u")
    cols = [(0, 3), (3, 7), (7, 10)]
    for rank, (a, b) in enumerate(cols):
        write_rank(dst, [Piece("w", "fp32", dtype, (6, 10), Box((0, a), (6, b - a)), full[:, a:b])], rank)
    commit(dst, world_size=3)
    c = ckptbridge.open(dst)
    assert c["w"].read().tobytes() == full.tobytes()
    np.testing.assert_array_equal(c["w"].read(dtype="float32"), full.astype(np.float32))
    np.testing.assert_array_equal(c["w"][2:5, 1:9], full[2:5, 1:9])


def test_mixed_aligned_and_unaligned_tensors_round_trip(tmp_path):
    """Tensors whose sizes are and are not multiples of the O_DIRECT block size, in one file."""
    rng = np.random.default_rng(0)
    sizes = [3 * 1024, 1025, 2048, (1 << 18) + 3, 1 << 19, 7, (1 << 22) + 1024]  # float32 elements
    arrays = {f"t{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate(sizes)}
    pieces = [Piece(k, "fp32", "float32", v.shape, Box.full(v.shape), v) for k, v in arrays.items()]
    ckptbridge.plugin.write_universal(str(tmp_path / "u"), pieces)
    assert ckptbridge.verify(str(tmp_path / "u")) == []
    c = ckptbridge.open(tmp_path / "u")
    for k, v in arrays.items():
        assert c[k].read().tobytes() == v.tobytes()
    (f,) = (tmp_path / "u" / "data").iterdir()
    with safe_open(str(f), "np") as fh:
        for k, v in arrays.items():
            np.testing.assert_array_equal(fh.get_tensor(k), v)


def _files_bytes(root):
    return {f.name: f.read_bytes() for f in sorted((root / "data").iterdir())}


@pytest.mark.parametrize("direct", [True, False])
def test_chunked_pipelined_writes_equal_whole_tensor_writes(tmp_path, monkeypatch, direct):
    """Big tensors are produced by rows across many small buffers and several writer threads;
    the files, offsets and checksums are the same as writing each tensor whole."""
    import zlib

    import ckptbridge._formats.safetensors_write as st

    rng = np.random.default_rng(1)
    sd = {"emb": torch.from_numpy(rng.standard_normal((301, 77)).astype(np.float32)),
          "vec": torch.from_numpy(rng.standard_normal(40_003).astype(np.float32)),
          "bf": torch.randn(129, 33).to(torch.bfloat16), "tiny": torch.tensor(3.0), "row": torch.randn(1, 9000)}
    torch.save(sd, tmp_path / "a.pt")
    ckptbridge.convert(tmp_path / "a.pt", tmp_path / "whole")
    if not direct:
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    monkeypatch.setattr(st, "_CHUNK_BYTES", 5000)  # rows of 308 bytes, 40 KB vectors: many unaligned chunks
    monkeypatch.setattr(st, "_SLOTS", 3)
    assert len(st.plan_chunks([st.FileSpec("x", [st.Entry("v", "float32", (40_003,), np.zeros(40_003, "f4"))])])) > 30
    ckptbridge.convert(tmp_path / "a.pt", tmp_path / "chunked")
    assert _files_bytes(tmp_path / "chunked") == _files_bytes(tmp_path / "whole")
    doc = json.loads((tmp_path / "chunked" / "manifest.json").read_text())
    c = ckptbridge.open(tmp_path / "chunked")
    for name, t in sd.items():
        frag = doc["tensors"][name]["states"]["param"]["fragments"][0]
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
        assert frag["checksum"] == f"crc32:{zlib.crc32(raw):08x}"
        assert c[name].read().tobytes() == raw
    assert ckptbridge.verify(str(tmp_path / "chunked")) == []


def test_a_failing_producer_stops_the_write_pipeline_cleanly(tmp_path):
    """An error while producing one chunk surfaces as that error, promptly, with no thread left
    blocked and no buffer leaked (a second write in the same process works)."""
    import threading

    import ckptbridge._formats.safetensors_write as st

    def boom():
        raise ValueError("source tensor 'b' unreadable")

    entries = [st.Entry(f"a{i}", "float32", (1 << 20,), np.ones(1 << 20, np.float32)) for i in range(6)]
    entries.insert(3, st.Entry("b", "float32", (4,), boom))
    result: list[BaseException] = []

    def run() -> None:
        try:
            st.write_file(str(tmp_path / "x.safetensors"), entries)
        except BaseException as err:
            result.append(err)

    th = threading.Thread(target=run)
    th.start()
    th.join(60)
    assert not th.is_alive(), "write pipeline hung after a producer error"
    assert isinstance(result[0], ValueError) and "'b'" in str(result[0])
    st.write_file(str(tmp_path / "y.safetensors"), entries[:3])
    with safe_open(str(tmp_path / "y.safetensors"), "np") as fh:
        np.testing.assert_array_equal(fh.get_tensor("a2"), np.ones(1 << 20, np.float32))


def test_crc32_and_combine_match_zlib():
    import zlib

    from hypothesis import given, settings
    from hypothesis import strategies as hs

    from ckptbridge._storage.crc import combine_py, crc32, crc32_combine

    @settings(max_examples=200, deadline=None)
    @given(hs.binary(max_size=3000), hs.binary(max_size=3000))
    def check(a: bytes, b: bytes) -> None:
        want = zlib.crc32(a + b)
        assert crc32(a + b) == want
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == want
        assert combine_py(zlib.crc32(a), zlib.crc32(b), len(b)) == want  # the fallback without zlib-ng

    check()


def test_disk_full_mid_convert_names_the_file_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    """ENOSPC from the writer threads surfaces as an OSError naming the data file; nothing hangs,
    the existing checkpoint at the destination is untouched, and a retry succeeds."""
    import errno

    sd = {f"t{i}": torch.randn(256, 1024) for i in range(6)}
    torch.save(sd, tmp_path / "a.pt")
    ckptbridge.convert(tmp_path / "a.pt", tmp_path / "u")
    before = _files_bytes(tmp_path / "u")
    calls = [0]
    real = os.pwrite

    def full(fd, data, at):
        calls[0] += 1
        if calls[0] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, at)

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match=r"param-r00000-00000\.safetensors.*No space left") as err:
        ckptbridge.convert(tmp_path / "a.pt", tmp_path / "u", overwrite=True)
    assert err.value.errno == errno.ENOSPC
    monkeypatch.setattr(os, "pwrite", real)
    assert _files_bytes(tmp_path / "u") == before and ckptbridge.verify(str(tmp_path / "u")) == []
    assert not [p for p in os.listdir(tmp_path) if ".partial" in p]  # the failed attempt cleaned up
    ckptbridge.convert(tmp_path / "a.pt", tmp_path / "u", overwrite=True)
    assert ckptbridge.verify(str(tmp_path / "u")) == []


def test_background_writes_run_below_the_training_threads(tmp_path):
    """The checkpointer's flush (``background=True``) reads and writes on threads with a higher
    nice value than the thread that started it, on Linux (elsewhere a thread id is not a process
    id, so priorities stay as they are); the caller's own thread keeps its priority either way.
    Relative, so it holds under an outer ``nice`` too: a training thread already at nice 12 (where
    an absolute nice of 10 would not be below it) gets its writers at 19."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import ckptbridge._formats.safetensors_write as st

    linux = sys.platform.startswith("linux")

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def trainer(outer: int | None) -> tuple[list[int], int, int]:
        if outer is not None:  # nice values are per thread on Linux: only this thread's changes
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), max(priority(), outer))
        seen = []

        def data():
            seen.append(priority())
            return np.ones(8, np.float32)

        mine = priority()
        for name, background in (("a", True), ("b", False)):
            path = str(tmp_path / f"{name}{outer}.safetensors")
            st.write_files([st.FileSpec(path, [st.Entry("x", "float32", (8,), data)])], background=background)
        return seen, mine, priority()

    for outer in (None, 12) if linux else (None,):
        with ThreadPoolExecutor(1) as pool:  # a fresh thread each time (it inherits the caller's nice)
            seen, mine, after = pool.submit(trainer, outer).result()
        lowered = min(mine + st._BACKGROUND_NICE, 19) if linux else mine
        assert seen == [lowered, mine] and after == mine, (outer, seen, mine)
        assert not linux or mine == 19 or lowered > mine
