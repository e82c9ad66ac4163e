"""Hugging Face sharded checkpoints written by the libraries themselves, read in place.

The index files and shards come from ``transformers``' ``save_pretrained(max_shard_size=...)``
(``model.safetensors.index.json`` + ``model-0000K-of-0000N.safetensors``) and from
``huggingface_hub.save_torch_state_dict(safe_serialization=False)`` (``pytorch_model.bin.index.json``
+ ``pytorch_model-0000K-of-0000N.bin``; transformers 5 writes safetensors only), for tiny Llama
models built from a config (no hub download). ckptbridge must list exactly the tensors the index
names, read each bitwise equal to the model's own, read a slice from its one shard only, and
write what ``transformers`` loads back into the same model.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from _common import same_bits

import ckptbridge
from ckptbridge.adapters import torch as cbt


def _llama(tie: bool = False, dtype: torch.dtype = torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=tie)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def _np(t: torch.Tensor) -> np.ndarray:
    return cbt.numpy_view(t.detach().contiguous())


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """save_pretrained of an fp32 GQA Llama, a bf16 one with tied embeddings, and hub .bin shards."""
    import huggingface_hub

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for label, tie, dtype in (("fp32", False, torch.float32), ("bf16_tied", True, torch.bfloat16)):
        model = _llama(tie, dtype)
        model.save_pretrained(root / label, max_shard_size="20KB")
        out[label] = (str(root / label), model)
    model = _llama()
    os.makedirs(root / "bin")
    sd = {k: v for k, v in model.state_dict().items()}
    huggingface_hub.save_torch_state_dict(sd, root / "bin", safe_serialization=False, max_shard_size="20KB")
    out["bin"] = (str(root / "bin"), model)
    return out


@pytest.mark.parametrize("label,index", [("fp32", "model.safetensors.index.json"),
                                         ("bf16_tied", "model.safetensors.index.json"),
                                         ("bin", "pytorch_model.bin.index.json")])
def test_library_written_index_reads_bitwise(saved, label: str, index: str) -> None:
    path, model = saved[label]
    with open(os.path.join(path, index)) as fh:
        weight_map = json.load(fh)["weight_map"]
    shards = set(weight_map.values())
    assert len(shards) >= 3, shards  # really sharded
    c = ckptbridge.open(path)
    assert c.format == ("torch-save" if label == "bin" else "safetensors")
    assert set(c) == set(weight_map)  # exactly what the library's index names
    sd = model.state_dict()
    for name in c:
        assert same_bits(c[name].read(), _np(sd[name])), name
        assert {os.path.basename(f.location.file) for f in c[name].fragments} == {weight_map[name]}, name
    if label == "bf16_tied":  # transformers saves the tied lm_head once, as the embedding
        assert "lm_head.weight" not in c and c["model.embed_tokens.weight"].dtype == "bfloat16"
    # a slice reads only its bytes, from the one shard that holds it
    name = "model.layers.1.mlp.down_proj.weight"
    c.stats.reset()
    got = c[name][3:5]
    assert same_bits(got, _np(sd[name][3:5]))
    assert c.stats.bytes_read == 2 * sd[name].shape[1] * sd[name].element_size()
    assert [os.path.basename(f) for f in c.stats.per_file] == [weight_map[name]]


@pytest.mark.parametrize("label,index", [("fp32", "model.safetensors.index.json"),
                                         ("bin", "pytorch_model.bin.index.json")])
def test_index_and_shards_that_disagree_are_refused(saved, tmp_path, label: str, index: str) -> None:
    """The index must describe the shards: an entry naming the wrong shard, a tensor the index
    lists that no shard holds, a shard tensor the index does not list (shards mixed from two
    saves, an index out of date) each fail naming the tensor; a shard outside the directory too."""
    import shutil

    dst = tmp_path / label
    shutil.copytree(saved[label][0], dst)
    path = dst / index
    orig = json.loads(path.read_text())

    def with_map(weight_map: dict) -> None:
        path.write_text(json.dumps({**orig, "weight_map": weight_map}))

    shards = list(orig["weight_map"].values())
    name, shard = next((k, f) for k, f in orig["weight_map"].items() if shards.count(f) > 1)  # still listed
    name2 = next(k for k, f in orig["weight_map"].items() if k != name and shards.count(f) > 1)
    other = next(s for s in sorted(set(shards)) if s != shard)
    with_map({**orig["weight_map"], name: other})
    with pytest.raises(ckptbridge.FormatError, match=rf"{name}.* is listed in {other} but .*{shard} holds it"):
        ckptbridge.open(dst)
    with_map({**orig["weight_map"], "model.ghost.weight": shard})
    with pytest.raises(ckptbridge.MissingShardError, match=r"'model\.ghost\.weight' is listed in .* but no shard"):
        ckptbridge.open(dst)
    with_map({k: v for k, v in orig["weight_map"].items() if k != name2})
    with pytest.raises(ckptbridge.FormatError, match=rf"{name2}' is not in .*weight_map"):
        ckptbridge.open(dst)
    with_map({**orig["weight_map"], name: "../outside.bin"})
    with pytest.raises(ckptbridge.FormatError, match="outside"):
        ckptbridge.open(dst)
    with_map(orig["weight_map"])
    assert set(ckptbridge.open(dst)) == set(orig["weight_map"])


@pytest.mark.parametrize("label", ["fp32", "bf16_tied", "bin"])
def test_transformers_loads_what_ckptbridge_writes(saved, tmp_path, label: str) -> None:
    """Reshard the sharded checkpoint to one safetensors file; transformers' from_pretrained loads
    it (strictly: no missing or unexpected keys) into a model with bitwise the same weights and logits."""
    import shutil

    from transformers import LlamaForCausalLM

    path, model = saved[label]
    out = tmp_path / "one"
    out.mkdir()
    ckptbridge.reshard(path, str(out / "model.safetensors"), to="safetensors")
    shutil.copy(os.path.join(saved["fp32" if label == "bin" else label][0], "config.json"), out / "config.json")
    back, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True, dtype=model.dtype)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    # logits equal those of transformers loading the original shards (the same non-persistent
    # buffers, e.g. RoPE's inv_freq, as a from_pretrained model has)
    orig = LlamaForCausalLM.from_pretrained(saved["fp32"][0] if label == "bin" else path, dtype=model.dtype)
    ids = torch.arange(12).reshape(1, 12) % 96
    with torch.no_grad():
        assert torch.equal(back.eval()(ids).logits, orig.eval()(ids).logits)
