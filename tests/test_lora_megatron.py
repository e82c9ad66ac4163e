"""Megatron-Bridge LoRA adapters (``adapter.linear_in`` / ``adapter.linear_out`` beside each wrapped
megatron-core linear) carried to and from HF PEFT through the Llama recipe.

Megatron -> PEFT: the fused QKV's and gate/up's ``linear_out`` (``B``) split like the base rows,
their ``linear_in`` (``A``) shared by the parts. PEFT -> Megatron: the parts' pairs fuse into one of
the summed rank (``A`` stacked, ``B`` block-diagonal in the weight's row order).

The references are outside ckptbridge: Megatron-Bridge's merge (``peft/lora_merge.py``
``LoRAMerge.merge``: ``W + alpha / dim * linear_out @ linear_in``), megatron-core's own ``GPTModel``
(``tools/megatron/core_module.py``) filled with the merged weights, PEFT 0.21's adapter-on logits,
``merge_and_unload`` and backward. Megatron-Bridge itself is not installed here: its adapter files
are written by the test under its names (not by its code), its merge formula is applied in torch.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import ckptbridge
from ckptbridge import recipes
from ckptbridge.adapters import lora
from ckptbridge.plugin import Checkpoint, CheckpointIndex, FormatError, Join, LogicalTensor

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
import hf_models as hf  # noqa: E402
from lora_refs import bridge_merge, core_module, peft_merged  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

SPEC = hf.HFSpec("llama")  # GQA: 4 query heads in 2 groups
R, ALPHA = 4, 8.0
MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANKS = {"k_proj": 2, "up_proj": 2}  # PEFT's rank_pattern: the fused QKV's rank is 4 + 2 + 4, gate/up's 4 + 2


def _rules(cfg: dict, src: str, dst: str) -> tuple:
    return recipes.rules("llama", src=src, dst=dst, **recipes.config_from_hf(cfg))


def _hf_dir(ckpt: ckptbridge.Checkpoint, config: Path, out: Path) -> Path:
    out.mkdir()
    ckptbridge.reshard(ckpt, out / "model.safetensors", to="safetensors")
    shutil.copy(config, out / "config.json")
    return out


def _model(model_dir: Path):
    return __import__("transformers").AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _logits(model_dir: Path, tokens: np.ndarray, adapter: Path | None = None) -> np.ndarray:
    model = _model(model_dir)
    return hf.logits(peft.PeftModel.from_pretrained(model, adapter).eval() if adapter else model, tokens)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora_megatron")
    base = hf.save(hf.build(SPEC), root / "hf")
    return {"root": root, "base": base, "cfg": json.loads((base / "config.json").read_text())}


@pytest.fixture(scope="module")
def fused(base: dict) -> dict:
    """A PEFT adapter on every linear (a rank pattern: k_proj and up_proj rank 2) carried to Megatron."""
    torch.manual_seed(31)
    config = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=ALL, rank_pattern=RANKS, init_lora_weights=False)
    peft.get_peft_model(hf.build(SPEC), config).save_pretrained(base["root"] / "peft")
    to_meg = _rules(base["cfg"], "hf", "megatron")
    carried = lora.carry(ckptbridge.open(base["root"] / "peft"), to_meg)
    return {**base, "peft": base["root"] / "peft", "to_meg": to_meg, "carried": carried,
            "weights": ckptbridge.open(base["base"], rules=to_meg).state_dict()}


def test_megatron_bridge_adapter_to_peft_gives_the_megatron_merge(base: dict, tmp_path: Path) -> None:
    cfg, weights = base["cfg"], ckptbridge.open(base["base"], rules=_rules(base["cfg"], "hf", "megatron")).state_dict()
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
    save_file(bridge_merge(weights, adapter, ALPHA, R), str(tmp_path / "meg_merged.safetensors"))
    ref = ckptbridge.open(tmp_path / "meg_merged.safetensors", rules=_rules(cfg, "megatron", "hf"))
    tokens = hf.tokens(2, 12, cfg["vocab_size"], seed=6)
    want = _logits(_hf_dir(ref, base["base"] / "config.json", tmp_path / "ref"), tokens)

    opened = ckptbridge.open(tmp_path / "meg_lora.safetensors")
    assert lora.factor_of(next(iter(opened))) is not None
    carried = lora.carry(opened, _rules(cfg, "megatron", "hf"), alpha=ALPHA)
    lora.save_peft(carried, tmp_path / "peft")
    got = _logits(base["base"], tokens, tmp_path / "peft")
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    assert np.abs(want - _logits(base["base"], tokens)).max() > 1e-2  # the adapter moves the logits
    # the fused QKV's linear_in is q's, k's and v's A; its linear_out rows split per group like W's
    peft_ckpt = ckptbridge.open(tmp_path / "peft")
    fused_a = adapter["decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight"]
    for proj in ("q_proj", "k_proj", "v_proj"):
        np.testing.assert_array_equal(peft_ckpt[f"base_model.model.model.layers.0.self_attn.{proj}.lora_A.weight"][...],
                                      fused_a)
    # PEFT -> Megatron fuses the parts' pairs (below); a fused weight with a part not adapted is refused, named
    no_k = {n: t for n, t in peft_ckpt.tensors.items() if ".k_proj." not in n}
    with pytest.raises(FormatError, match=r"linear_qkv\.weight'.* no pair for part\(s\) \['k'\]"):
        lora.carry(Checkpoint(CheckpointIndex("lora", peft_ckpt.path, no_k), peft_ckpt.files), _rules(cfg, "hf", "megatron"))


def test_peft_adapter_into_fused_megatron_weights_gives_peft_logits_in_megatron_core(fused: dict, tmp_path: Path) -> None:
    """PEFT -> Megatron-Bridge names through the hf->megatron recipe, whose Joins fuse q/k/v (GQA:
    rows interleaved per query group) and gate/up: one pair per fused weight, ``A`` the parts' ``A``
    stacked, ``B`` block-diagonal. Megatron-Bridge's merge of it into the Megatron base, loaded by
    megatron-core's own GPTModel, gives PEFT's adapter-on logits; back to PEFT, PEFT's own
    ``merge_and_unload`` gives the original adapter's merged weights."""
    cfg, carried = fused["cfg"], fused["carried"]
    dim, alpha = carried.extra["lora"]["r"], carried.extra["lora"]["lora_alpha"]
    assert dim == 4 + 2 + 4 and alpha == ALPHA / R * dim  # the fused QKV's summed rank; PEFT's scaling alpha / r
    factors = carried.state_dict()
    qkv = "decoder.layers.0.self_attention.linear_qkv.adapter"
    assert factors[f"{qkv}.linear_in.weight"].shape == (dim, SPEC.emb) and len(factors) == 2 * len(MODULES) * SPEC.layers
    # B's rows in the wrong order (q, k, v one after the other, as if there were no query groups): the control
    ungrouped = tuple(dataclasses.replace(r, groups=1, widths=(64, 32, 32)) if isinstance(r, Join)
                      and "linear_qkv" in r.to else r for r in fused["to_meg"])
    bad = lora.carry(ckptbridge.open(fused["peft"]), ungrouped).state_dict()
    source = {f"{label}.{n}": v for label, f in (("good", factors), ("bad", bad))
              for n, v in bridge_merge(fused["weights"], f, alpha, dim).items()}
    save_file(source, str(tmp_path / "merged.safetensors"))
    tokens = hf.tokens(2, 12, cfg["vocab_size"], seed=6)
    got = core_module(tmp_path, fused["base"] / "config.json", tmp_path / "merged.safetensors", ["good", "bad"], tokens)
    want = _logits(fused["base"], tokens, fused["peft"])
    assert "error" not in got["good"] and sorted(got["good"]["unplaced"]) == sorted(n for n in source if n[:4] == "bad.")
    np.testing.assert_allclose(got["good"]["logits"][..., :cfg["vocab_size"]], want, atol=1e-4, rtol=0)
    assert np.abs(got["bad"]["logits"][..., :cfg["vocab_size"]] - want).max() > 0.1  # measured 1.1 (good: 7e-7)
    assert np.abs(want - _logits(fused["base"], tokens)).max() > 1e-2  # the adapter moves the logits
    # back to PEFT (the fused pair splits: each part the whole A, its rows of B): PEFT's merge is the original's
    lora.save_peft(lora.carry(carried, _rules(cfg, "megatron", "hf")), tmp_path / "back")
    merged = {k: peft_merged(lambda: _model(fused["base"]), p) for k, p in (("peft", fused["peft"]), ("back", tmp_path / "back"))}
    assert merged["back"].keys() == merged["peft"].keys()
    for name, w in merged["peft"].items():
        np.testing.assert_array_equal(merged["back"][name], w, err_msg=name)


def test_fused_pair_trains_the_parts_blocks_like_peft_and_its_zero_blocks_too(fused: dict) -> None:
    """What resuming a carried fused pair means. The gradient of the adapter term of Megatron's
    fused LoRA linear (``s (x A^T) B^T``, which Megatron-Bridge's ``LoRALinear`` adds to the base
    output) with respect to ``A`` is the parts' ``A`` gradients (PEFT's own backward) stacked, and with
    respect to ``B``'s diagonal blocks the parts' ``B`` gradients over their fold (as ``Scale``
    carries the first moment): the carried Adam moments there (stacked, over the fold, over its
    square) are exact. The zero blocks beside them get a gradient too: the fused pair trains as one
    adapter of the summed rank, from exact-zero moments there."""
    layer = "decoder.layers.0.self_attention.linear_qkv"
    model = peft.PeftModel.from_pretrained(_model(fused["base"]), fused["peft"], is_trainable=True)
    attn = model.base_model.model.model.layers[0].self_attn
    heads, groups, d = 4, 2, 16  # megatron-core's QKV rows: per query group, its q heads then its k, its v
    torch.manual_seed(7)
    x, up = torch.randn(5, SPEC.emb), torch.randn(5, groups, (heads // groups + 2) * d)
    q, k, v = up[..., :heads // groups * d], up[..., -2 * d:-d], up[..., -d:]
    parts = {"q_proj": q.reshape(5, -1), "k_proj": k.reshape(5, -1), "v_proj": v.reshape(5, -1)}
    sum((getattr(attn, p)(x) * g).sum() for p, g in parts.items()).backward()
    c = fused["carried"]
    a, b = (torch.tensor(c[f"{layer}.adapter.linear_{n}.weight"][...], requires_grad=True) for n in ("in", "out"))
    y = c.extra["lora"]["lora_alpha"] / c.extra["lora"]["r"] * (x @ a.T) @ b.T
    (y * up.reshape(5, -1)).sum().backward()
    at, rows = 0, b.grad.reshape(groups, -1, b.shape[1])
    opened = ckptbridge.open(fused["peft"])  # moments: the factors themselves as stand-ins, to see where they go
    states = {n: LogicalTensor(n, dict.fromkeys(("param", "exp_avg", "exp_avg_sq"), t.state()))
              for n, t in opened.tensors.items()}
    moments = lora.carry(Checkpoint(CheckpointIndex("lora", opened.path, states), opened.files), fused["to_meg"])
    m_a = moments[f"{layer}.adapter.linear_in.weight"].state("exp_avg").read()
    m_b = {k: moments[f"{layer}.adapter.linear_out.weight"].state(k).read().reshape(groups, -1, b.shape[1])
           for k in ("exp_avg", "exp_avg_sq")}
    row_of = {"q_proj": slice(0, heads // groups * d), "k_proj": slice(-2 * d, -d), "v_proj": slice(-d, None)}
    for p in ("q_proj", "k_proj", "v_proj"):
        lora_a, lora_b = getattr(attn, p).lora_A["default"].weight, getattr(attn, p).lora_B["default"].weight
        rank, fold = lora_a.shape[0], getattr(attn, p).scaling["default"] / (ALPHA / R)
        torch.testing.assert_close(a.grad[at:at + rank], lora_a.grad, rtol=1e-5, atol=1e-6)
        block = rows[:, row_of[p]].reshape(-1, b.shape[1])
        torch.testing.assert_close(block[:, at:at + rank], lora_b.grad / fold, rtol=1e-5, atol=1e-6)
        beside = torch.cat([block[:, :at], block[:, at + rank:]], dim=1)  # the zeros beside the block
        assert beside.abs().max() > 1e-2 * lora_b.grad.abs().max()  # get a gradient too
        stored = f"base_model.model.model.layers.0.self_attn.{p}.lora_"
        np.testing.assert_array_equal(m_a[at:at + rank], opened[stored + "A.weight"][...])
        for k, power in (("exp_avg", 1), ("exp_avg_sq", 2)):
            moment = m_b[k][:, row_of[p]].reshape(-1, b.shape[1])
            np.testing.assert_array_equal(moment[:, at:at + rank], opened[stored + "B.weight"][...] / fold ** power)
            assert not moment[:, :at].any() and not moment[:, at + rank:].any()
        at += rank
