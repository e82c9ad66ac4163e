"""torch.distributed.checkpoint directories, single process: formats, safety, writer options.

(The multi-rank FSDP2 cases are in test_torch.py.)
"""

from __future__ import annotations

import os
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptbridge
import ckptbridge as cb_open
from ckptbridge import (
    FormatError,
    TruncatedError,
    UnsafePickleError,
    reshard,
)
from ckptbridge.adapters import torch as cbt


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"layer.w": torch.randn(6, 5, generator=g), "layer.b": torch.arange(5),
                  "emb": torch.randn(4, 3, generator=g).to(torch.bfloat16),
                  "t": torch.randn(5, 4, generator=g).t()},  # a transposed (non-contiguous) tensor
        "step": 11,
        "note": {"text": "hello"},
    }


def _save(path, sd, **kw) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(sd, no_dist=True, **kw) if "storage_writer" in kw else dcp.save(sd, checkpoint_id=path, no_dist=True)


@pytest.mark.parametrize("fmt", ["torch_save", "safetensors"])
def test_plain_tensors_both_serialization_formats(tmp_path, fmt):
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    sd = _state()
    if fmt == "safetensors":  # DCP's safetensors writer refuses non-contiguous tensors
        sd["model"]["t"] = sd["model"]["t"].contiguous()
    path = str(tmp_path / fmt)
    writer = FileSystemWriter(path, serialization_format=SerializationFormat(fmt))
    _save(path, sd, storage_writer=writer)
    ckpt = cb_open.open(path)
    assert ckpt.format == "dcp" and ckpt.step == 11
    assert set(ckpt) == {"layer.w", "layer.b", "emb", "t"}
    assert ckpt.extra["note"] == {"text": "hello"}
    for name, t in sd["model"].items():
        np.testing.assert_array_equal(ckpt[name].read(), cbt.numpy_view(t.contiguous()))
        assert ckpt[name].dtype == cbt.dtype_name(t.dtype)
    assert ckpt["layer.w"].states == ("fp32",) and ckpt["emb"].states == ("param",)
    # fragments point into the .distcp file: a row costs its bytes only
    ckpt.stats.reset()
    np.testing.assert_array_equal(ckpt["layer.w"][2], sd["model"]["layer.w"][2].numpy())
    assert ckpt.stats.bytes_read == 5 * 4
    assert all(f.location.file.endswith(".distcp") for f in ckpt["layer.w"].fragments)
    if fmt == "torch_save":  # the transposed tensor is stored with its strides and read in place
        assert ckpt["t"].fragments[0].location.strides == (1, 4)


def test_prefix_option_keeps_full_keys(tmp_path):
    _save(str(tmp_path / "c"), _state())
    ckpt = cb_open.open(str(tmp_path / "c"), prefix="")
    assert "model.layer.w" in ckpt and not ckpt.rules


def test_metadata_pickle_cannot_run_code(tmp_path):
    _save(str(tmp_path / "c"), _state())
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(tmp_path / "c" / ".metadata", "wb") as fh:
        pickle.dump(Evil(), fh)
    with pytest.raises(UnsafePickleError):
        cb_open.open(str(tmp_path / "c"))
    assert not marker.exists()


def test_truncated_distcp_names_the_file(tmp_path):
    path = tmp_path / "c"
    _save(str(path), _state())
    data = path / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises((TruncatedError, FormatError), match="__0_0.distcp"):
        cb_open.open(str(path)).state_dict()


def test_writer_via_reshard_registry_loads_with_dcp_load(tmp_path):
    src = tmp_path / "src"
    _save(str(src), _state())
    dst = tmp_path / "out"
    reshard(str(src), str(dst), to="dcp", world_size=4)
    assert sorted(os.listdir(dst)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    target = {k: torch.zeros_like(v.contiguous()) for k, v in _state()["model"].items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(dst), no_dist=True)
    for k, v in _state()["model"].items():
        assert torch.equal(target[k], v), k
    # the writer never touches an existing destination
    with pytest.raises(FileExistsError):
        reshard(str(src), str(dst), to="dcp")
    with pytest.raises(ckptbridge.OptionError, match="format 'dcp' \\(write\\) has no option 'colour'"):
        reshard(str(src), str(tmp_path / "x"), to="dcp", colour="red")
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()


def test_load_into_plain_tensors_with_rename_rule_and_cast(tmp_path):
    from ckptbridge.plugin import Rename

    sd = _state()
    _save(str(tmp_path / "c"), sd)
    targets = {"enc.layer.w": torch.zeros(6, 5, dtype=torch.bfloat16), "enc.layer.b": torch.zeros(5)}
    rest = cbt.load_into(targets, str(tmp_path / "c"), rules=[Rename(r"^layer\.", "enc.layer.")])
    assert sorted(rest) == ["emb", "t"]
    assert torch.equal(targets["enc.layer.w"], sd["model"]["layer.w"].to(torch.bfloat16))
    assert torch.equal(targets["enc.layer.b"], sd["model"]["layer.b"].float())
    with pytest.raises(KeyError, match="enc.layer.w"):
        cbt.load_into(targets, str(tmp_path / "c"))
