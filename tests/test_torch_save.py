"""torch.save files read in place, without torch and without running code from the pickle."""

from __future__ import annotations

import argparse
import os
import pickle
import struct
import subprocess
import sys
import warnings
import zipfile

import numpy as np
import pytest
import torch
from _common import cli, one_line_error, small_model

import ckptbridge
from ckptbridge._formats import registry as _formats
from ckptbridge.adapters.torch_save import Opaque, TorchArchive, safe_loads


def test_module_and_optimizer_state_read_in_place(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 7)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iteration": 42,
                "args": argparse.Namespace(lr=0.1, layers=3)}, tmp_path / "ckpt.pt")
    c = ckptbridge.open(tmp_path / "ckpt.pt")
    assert c.format == "torch-save" and c.step == 42
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(c[f"model.{k}"].read(), v.numpy())
    np.testing.assert_array_equal(c["optimizer.state.0.exp_avg"].read(), opt.state[model[0].weight]["exp_avg"].numpy())
    assert "<argparse.Namespace" in str(c.extra["args"])
    # a slice reads only its bytes
    c.stats.reset()
    c["model.0.weight"][1:3]
    assert c.stats.bytes_read == 2 * 7 * 4


def test_old_format_name_torch_still_works_with_one_deprecation_warning(tmp_path, monkeypatch):
    """The format was renamed ``torch`` -> ``torch-save`` (``ckptbridge.adapters.torch`` is the
    device loader); the old name opens the same format and says so once per process."""
    torch.save({"w": torch.arange(6.0)}, tmp_path / "m.pt")
    monkeypatch.setattr(_formats, "_WARNED", set())
    with pytest.warns(DeprecationWarning, match="format name 'torch' is deprecated.*use 'torch-save'"):
        c = ckptbridge.open(tmp_path / "m.pt", format="torch")
    assert c.format == "torch-save" and c["w"].read().tolist() == [0, 1, 2, 3, 4, 5]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second use is silent, the new name never warns
        assert ckptbridge.open(tmp_path / "m.pt", format="torch").format == "torch-save"
        assert ckptbridge.open(tmp_path / "m.pt", format="torch-save").format == "torch-save"
    assert "torch" not in [f.name for f in ckptbridge.formats()]  # listed under its new name only
    # the command line says it on stderr (Python hides DeprecationWarning outside __main__)
    r = subprocess.run([sys.executable, "-m", "ckptbridge", "inspect", str(tmp_path / "m.pt"), "--format", "torch",
                        "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and '"format": "torch-save"' in r.stdout
    assert r.stderr.count("format name 'torch' is deprecated") == 1, r.stderr


def test_views_and_shared_storages(tmp_path):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    sd = {"t": base.t(), "row": base[2], "col": base[:, 3], "same": base, "narrow": base[1:4, 2:7],
          "half": torch.randn(3, 4).half(), "bf": torch.randn(5).bfloat16(), "i64": torch.arange(7),
          "b": torch.tensor([True, False]), "p": torch.nn.Parameter(torch.ones(2, 2)), "s": torch.tensor(2.5)}
    torch.save(sd, tmp_path / "v.pt")
    c = ckptbridge.open(tmp_path / "v.pt")
    for k, v in sd.items():
        got = c[k].read()
        want = v.detach()
        if want.dtype == torch.bfloat16:
            assert got.tobytes() == want.contiguous().view(torch.int16).numpy().tobytes()
        else:
            np.testing.assert_array_equal(got, want.numpy())
    assert c["t"].fragments[0].location.strides == (1, 10)


class Boom:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class EvalBoom:
    def __reduce__(self):
        return (eval, (f"__import__('os').system('touch ' + {self.marker!r})",))


@pytest.mark.parametrize("payload_cls", [Boom, EvalBoom])
def test_code_execution_payload_is_refused_and_never_runs(tmp_path, payload_cls):
    marker = tmp_path / "pwned"
    payload = payload_cls()
    payload.marker = str(marker)
    torch.save({"w": torch.ones(2), "evil": payload}, tmp_path / "evil.pt")
    with pytest.raises(ckptbridge.UnsafePickleError, match="evil.pt"):
        ckptbridge.open(tmp_path / "evil.pt")
    with pytest.raises(ckptbridge.UnsafePickleError):
        safe_loads(pickle.dumps(payload))
    assert not marker.exists(), "the payload ran"


def test_unknown_classes_become_inert_records():
    class Config:
        def __init__(self):
            self.hidden = 64
            self.name = "gpt"

    Config.__module__ = "somelib.config"
    Config.__qualname__ = "Config"
    import sys
    import types

    sys.modules["somelib"] = types.ModuleType("somelib")
    sys.modules["somelib.config"] = mod = types.ModuleType("somelib.config")
    mod.Config = Config
    try:
        data = pickle.dumps({"cfg": Config()})
    finally:
        del sys.modules["somelib"], sys.modules["somelib.config"]
    obj = safe_loads(data)
    assert isinstance(obj["cfg"], Opaque) and obj["cfg"].hidden == 64 and obj["cfg"].name == "gpt"


def test_legacy_and_damaged_files_give_clear_errors(tmp_path):
    (tmp_path / "legacy.pt").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ckptbridge.CheckpointError):
        ckptbridge.open(tmp_path / "legacy.pt", format="torch-save")
    torch.save({"w": torch.randn(100, 100)}, tmp_path / "ok.pt")
    raw = (tmp_path / "ok.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ckptbridge.CheckpointError, match="cut.pt"):
        ckptbridge.open(tmp_path / "cut.pt")
    with pytest.raises(ckptbridge.MissingShardError, match="nope.pt"):
        ckptbridge.open(tmp_path / "nope.pt")


def test_archive_offsets_point_at_storage_bytes(tmp_path):
    t = torch.arange(12, dtype=torch.int32)
    torch.save({"t": t}, tmp_path / "a.pt")
    arch = TorchArchive.open(str(tmp_path / "a.pt"))
    (key, (off, length)), = arch.storage_offsets.items()
    with zipfile.ZipFile(tmp_path / "a.pt") as zf:
        name = next(n for n in zf.namelist() if n.endswith(f"data/{key}"))
        assert zf.read(name) == (tmp_path / "a.pt").read_bytes()[off : off + length]


def test_save_torch_writes_what_torch_save_would(tmp_path, monkeypatch):
    """``save_torch`` (torch-free) against ``torch.save`` of the same objects: named classes
    (``Global``/``Reduce``/``Object``), tensors given as arrays, as callables and as pieces, each
    data record 64-byte aligned also when zipfile adds zip64 fields to a record's header."""
    import signal

    from ckptbridge.adapters.torch_save import Global, Object, Reduce, Tensor, save_torch

    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    obj = {
        "args": Object(Global("argparse", "Namespace"),
                       {"params_dtype": Global("torch", "bfloat16"), "exit_signal": Reduce(Global("signal", "Signals"),
                                                                                            (15,)), "lr": 0.5}),
        "keys": {(Global("torch", "float16"), Global("torch", "float32")): 1},
        "w": Tensor(a, "float32"),
        "lazy": Tensor(lambda: a * 2, "float32", (4, 6)),
        "pieces": Tensor(lambda: (a[i] * 3 for i in range(4)), "float32", (4, 6)),
        "bf16": Tensor(lambda: np.full((3,), 0x3F80, np.uint16), "bfloat16", (3,)),
        "step": Tensor(np.array(7.0, np.float32), "float32"),
    }
    t = torch.from_numpy(a)
    want = {"args": argparse.Namespace(params_dtype=torch.bfloat16, exit_signal=signal.SIGTERM, lr=0.5),
            "keys": {(torch.float16, torch.float32): 1}, "w": t, "lazy": t * 2, "pieces": t * 3,
            "bf16": torch.ones(3, dtype=torch.bfloat16), "step": torch.tensor(7.0)}
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 40)  # records over 38 bytes get zip64 header fields
    assert save_torch(obj, str(tmp_path / "ours.pt")) == 3 * a.nbytes + 6 + 4
    monkeypatch.undo()
    torch.serialization.add_safe_globals([argparse.Namespace, signal.Signals])
    got = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert vars(got.pop("args")) == vars(want.pop("args")) and got.pop("keys") == want.pop("keys")
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    with zipfile.ZipFile(tmp_path / "ours.pt") as zf:
        infos = [i for i in zf.infolist() if "/data/" in i.filename]
        raw = (tmp_path / "ours.pt").read_bytes()
        zip64 = []
        for i in infos:  # the local header: its name and extra field lengths, then the data
            name_len, extra_len = struct.unpack("<HH", raw[i.header_offset + 26:i.header_offset + 30])
            extra = raw[i.header_offset + 30 + name_len:i.header_offset + 30 + name_len + extra_len]
            zip64.append(extra[-20:-16] == struct.pack("<HH", 1, 16))
            start = i.header_offset + 30 + name_len + extra_len
            assert start % 64 == 0 and raw[start:start + i.file_size] == zf.read(i), i.filename
        assert zip64 == [True, True, True, False, False]  # the three 96-byte records have zip64 fields
    assert torch.equal(torch.load(tmp_path / "ours.pt", weights_only=True, mmap=True)["lazy"], t * 2)


def _records(path):
    """Per zip record, in file order: (name without the archive prefix, general-purpose flags in
    the local and the central header, 64-byte aligned data, data bytes, the 16 bytes after the data)."""
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as zf:
        out = []
        for i in sorted(zf.infolist(), key=lambda i: i.header_offset):
            flags, name_len, extra_len = (struct.unpack("<H", raw[i.header_offset + 6:i.header_offset + 8])[0],
                                          *struct.unpack("<HH", raw[i.header_offset + 26:i.header_offset + 30]))
            start = i.header_offset + 30 + name_len + extra_len
            out.append((i.filename.split("/", 1)[1], flags, i.flag_bits, start % 64 == 0,
                        raw[start:start + i.file_size], raw[start + i.file_size:start + i.file_size + 4]))
        assert zf.testzip() is None  # every record's CRC32 checks out
    return out


def test_torch_stream_writes_the_archive_torch_save_writes(tmp_path, monkeypatch):
    """``torch_stream`` through the core's direct-I/O writer (``write_files``, chunks small enough
    that tensors go in many unaligned row blocks) against ``torch.save`` of the same state dict:
    the same records in the same order, each with torch's flags (a data descriptor after the
    data: PK\\x07\\x08), 64-byte aligned data, the same tensor bytes; torch.load reads it
    (weights_only, and mmap), bitwise; also with zip64 fields on every record and offset."""
    import ckptbridge._formats.safetensors_write as sw
    from ckptbridge.adapters.torch_save import Size, Tensor, _save
    from ckptbridge.plugin import write_files

    rng = np.random.default_rng(0)
    a = rng.standard_normal((37, 29)).astype(np.float32)
    b = rng.standard_normal(1001).astype(np.float32).view(np.uint16)[:1001]  # bfloat16 bit patterns
    want = {"param": torch.from_numpy(a), "b": torch.from_numpy(b.view(np.int16)).view(torch.bfloat16),
            "empty": torch.zeros((0, 3)), "cat_dim": 1, "shape": torch.Size((37, 29))}
    torch.save(want, tmp_path / "theirs.pt")
    monkeypatch.setattr(sw, "_CHUNK_BYTES", 300)  # row blocks of 2 rows: writes at unaligned offsets
    for zip64 in (False, True):
        if zip64:
            monkeypatch.setattr(_save, "_ZIP64", 40)  # every record over 39 bytes and every offset past 39
        ours = tmp_path / f"ours{int(zip64)}.pt"
        obj = {"param": Tensor(a, "float32"), "b": Tensor(lambda: b, "bfloat16", (1001,)),
               "empty": Tensor(np.zeros((0, 3), np.float32), "float32"), "cat_dim": 1, "shape": Size((37, 29))}
        write_files([_save.torch_stream(obj, str(ours))])
        for weights in (torch.load(ours, weights_only=True), torch.load(ours, weights_only=True, mmap=True)):
            assert weights.keys() == want.keys() and weights["cat_dim"] == 1 and weights["shape"] == want["shape"]
            for k in ("param", "b", "empty"):  # bitwise (random bfloat16 bit patterns include NaNs)
                assert weights[k].dtype == want[k].dtype and weights[k].shape == want[k].shape, k
                assert torch.equal(weights[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)), k
        got, theirs = _records(ours), _records(tmp_path / "theirs.pt")
        assert [r[0] for r in got] == [r[0] for r in theirs]
        for g, t in zip(got, theirs):
            flags, after = (0x0808, b"PK\x07\x08") if t[4] else (0x0800, b"PK\x03\x04")  # empty: no descriptor
            assert g[1:4] == t[1:4] == (flags, flags, True) and g[5] == t[5] == after, g[0]
            if g[0].startswith("data/"):
                assert g[4] == t[4], g[0]
        c = ckptbridge.open(ours)  # ckptbridge's own reader too
        assert c["param"].read().tobytes() == a.tobytes()


def test_save_torch_names_a_tensor_of_the_wrong_size(tmp_path):
    from ckptbridge.adapters.torch_save import Tensor, save_torch

    with pytest.raises(ckptbridge.FormatError, match=r"tensor 0 has shape \(5,\), expected \(4,\)"):
        save_torch({"w": Tensor(lambda: np.zeros(5, np.float32), "float32", (4,))}, str(tmp_path / "a.pt"))
    with pytest.raises(ckptbridge.FormatError, match="data/0 got 20 bytes, expected 16"):
        save_torch({"w": Tensor(lambda: iter([np.zeros(5, np.float32)]), "float32", (4,))}, str(tmp_path / "b.pt"))


# ---------------------------------------------------------------- whole pickled objects, legacy files


def test_a_pickled_module_is_a_clear_error(tmp_path):
    model = small_model()
    torch.save(model, tmp_path / "model.pt")
    with pytest.raises(ckptbridge.FormatError, match=r"pickled torch\.nn\..*Sequential object.*state_dict"):
        ckptbridge.open(tmp_path / "model.pt")
    torch.save({"model": model, "step": 3}, tmp_path / "wrapped.pt")
    one_line_error(cli("inspect", str(tmp_path / "wrapped.pt")), "wrapped.pt", "'model'", "state_dict()")
    torch.save({"model": model.state_dict(), "step": 3}, tmp_path / "ok.pt")  # the fix it suggests
    assert len(ckptbridge.open(tmp_path / "ok.pt")) == 4


def test_legacy_torch_save_files_are_read_safely(tmp_path):
    sd = {"a": torch.randn(4, 3), "b": torch.arange(10), "c": torch.randn(6).bfloat16(),
          "t": torch.randn(4, 6).t(), "view": torch.arange(20.0)[5:9], "nested": {"x": torch.ones(2)},
          "iteration": 9}
    path = tmp_path / "legacy.pt"
    torch.save(sd, path, _use_new_zipfile_serialization=False)
    assert path.read_bytes()[:2] != b"PK"  # really the legacy layout
    ckpt = ckptbridge.open(path)
    assert ckpt.format == "torch-save" and ckpt.step == 9
    ref = torch.load(path)
    for name in ("a", "b", "c", "t", "view"):
        assert ckpt[name].read().tobytes() == ref[name].contiguous().view(torch.uint8).numpy().tobytes(), name
    np.testing.assert_array_equal(ckpt["nested.x"].read(), np.ones(2, np.float32))
    # truncated copies and code in the pickle are refused, naming the file
    cut = tmp_path / "cut.pt"
    cut.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ckptbridge.TruncatedError, match="cut.pt"):
        ckptbridge.open(cut)

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"w": torch.ones(2), "x": Payload()}, tmp_path / "evil.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(ckptbridge.UnsafePickleError, match="evil.pt"):
        ckptbridge.open(tmp_path / "evil.pt")
    assert not os.path.exists(tmp_path / "pwned")
