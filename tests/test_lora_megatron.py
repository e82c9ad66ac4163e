"""Megatron-Bridge LoRA adapters (``adapter.linear_in`` / ``adapter.linear_out`` beside each wrapped
megatron-core linear) read with their base weight named and carried to HF PEFT through the Llama
recipe: the fused QKV's and gate/up's ``linear_out`` (``B``) split like the base rows, their
``linear_in`` (``A``) shared by the parts.

The reference is Megatron-Bridge's merge (``peft/lora.py`` ``LoRAMerge``: ``W + alpha / dim *
linear_out @ linear_in``) applied to the Megatron base, whose HF form (the base recipe, proven
against megatron-core in ``tests/test_recipes_megatron.py``) gives the logits; PEFT 0.21 loads the
carried adapter onto the HF base and must give the same logits. Megatron-Bridge itself is not
installed here: its adapter files are written by the test under its names (not by its code).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import ckptbridge
from ckptbridge import recipes
from ckptbridge.adapters import lora
from ckptbridge.plugin import FormatError

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
import hf_models as hf  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

SPEC = hf.HFSpec("llama")
R, ALPHA = 4, 8.0
MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def _rules(cfg: dict, src: str, dst: str) -> tuple:
    return recipes.rules("llama", src=src, dst=dst, **recipes.config_from_hf(cfg))


def _hf_dir(ckpt: ckptbridge.Checkpoint, config: Path, out: Path) -> Path:
    out.mkdir()
    ckptbridge.reshard(ckpt, out / "model.safetensors", to="safetensors")
    shutil.copy(config, out / "config.json")
    return out


def _logits(model_dir: Path, tokens: np.ndarray, adapter: Path | None = None) -> np.ndarray:
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return hf.logits(peft.PeftModel.from_pretrained(model, adapter).eval() if adapter else model, tokens)


def test_megatron_bridge_adapter_to_peft_gives_the_megatron_merge(tmp_path: Path) -> None:
    base = hf.save(hf.build(SPEC), tmp_path / "hf")
    cfg = json.loads((base / "config.json").read_text())
    meg = ckptbridge.open(base, rules=_rules(cfg, "hf", "megatron"))
    weights = meg.state_dict()
    rng = np.random.default_rng(5)
    adapter = {}
    for layer in range(SPEC.layers):
        for module in MODULES:
            rows, cols = weights[f"decoder.layers.{layer}.{module}.weight"].shape
            at = f"decoder.layers.{layer}.{module}.adapter"
            adapter[f"{at}.linear_in.weight"] = rng.standard_normal((R, cols)).astype(np.float32) * 0.1
            adapter[f"{at}.linear_out.weight"] = rng.standard_normal((rows, R)).astype(np.float32) * 0.1
    save_file(adapter, str(tmp_path / "meg_lora.safetensors"))

    # Megatron-Bridge's merge on the Megatron base, seen as HF through the base recipe
    merged = dict(weights)
    for name in adapter:
        if name.endswith(".linear_out.weight"):
            w = name.replace(".adapter.linear_out.weight", ".weight")
            delta = adapter[name].astype(np.float64) @ adapter[name.replace("linear_out", "linear_in")]
            merged[w] = (weights[w] + ALPHA / R * delta).astype(np.float32)
    save_file(merged, str(tmp_path / "meg_merged.safetensors"))
    ref = ckptbridge.open(tmp_path / "meg_merged.safetensors", rules=_rules(cfg, "megatron", "hf"))
    tokens = hf.tokens(2, 12, cfg["vocab_size"], seed=6)
    want = _logits(_hf_dir(ref, base / "config.json", tmp_path / "ref"), tokens)

    opened = ckptbridge.open(tmp_path / "meg_lora.safetensors")
    assert lora.factor_of(next(iter(opened))) is not None
    carried = lora.carry(opened, _rules(cfg, "megatron", "hf"), alpha=ALPHA)
    lora.save_peft(carried, tmp_path / "peft")
    got = _logits(base, tokens, tmp_path / "peft")
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    assert np.abs(want - _logits(base, tokens)).max() > 1e-2  # the adapter moves the logits
    # the fused QKV's linear_in is q's, k's and v's A; its linear_out rows split per group like W's
    peft_ckpt = ckptbridge.open(tmp_path / "peft")
    fused_a = adapter["decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight"]
    for proj in ("q_proj", "k_proj", "v_proj"):
        np.testing.assert_array_equal(peft_ckpt[f"base_model.model.model.layers.0.self_attn.{proj}.lora_A.weight"][...],
                                      fused_a)
    # and back: PEFT -> Megatron joins nothing it cannot (three A's are not one): refused, named
    with pytest.raises(FormatError, match="Join"):
        lora.carry(peft_ckpt, _rules(cfg, "hf", "megatron"))
