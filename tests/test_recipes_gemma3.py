"""The ``gemma3`` recipe proven with transformers' ``Gemma3ForCausalLM`` and MaxText 0.2.5's own Gemma 3.

A tiny random ``Gemma3ForCausalLM`` (GQA 4/2 heads, head_dim 32 != hidden/heads = 16, 8 layers: one
scanned block of Gemma 3's 6-layer pattern and 2 left over, sliding window 4 in 16 tokens, q/k
norms, pre/post attention and feed-forward norms, tied embeddings) opened through
``recipes.rules("gemma3", ...)`` and loaded by ``ckptbridge.adapters.flax.load`` onto MaxText's own
boxed tree on a 2x2 mesh (fsdp x tensor) with its logical-axis shardings:

1. every leaf is bitwise what MaxText's own converter hooks make (``GEMMA3`` in its
   ``param_mapping.py``: norms ``1 + w``, the embedding times bf16(sqrt(hidden))), scanned and not;
2. MaxText's fp32 logits equal HF's (<= 1e-4; MaxText's tied logits use a bfloat16 table, as in
   ``test_recipes_maxtext.py``);
3. back through the inverse recipe: bitwise what MaxText's own export makes (``(w + 1) - 1`` in
   float32, not always ``w``), loading in ``from_pretrained`` with HF's logits;
4. negative controls: without the norm offset, or without the embedding scale, the logits leave
   the tolerance by far; the sliding window matters in these 16 tokens.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_models as hf
import maxtext_client as mx
from test_recipes_maxtext import _err, _export_hf, _from_pretrained

import ckptbridge
from ckptbridge import Offset, Scale, recipes

pytestmark = pytest.mark.heavy

TOL = 1e-4
BATCH, SEQ = 4, 16
MESH = {"fsdp": 2, "tensor": 2}


def recipe(cfg: dict, scan: bool, src: str = "hf", dst: str = "maxtext") -> tuple:
    return recipes.rules(recipes.family_from_hf(cfg), src=src, dst=dst, **{**recipes.config_from_hf(cfg), "scan": scan})


def _without(rules: tuple, kind: type) -> tuple:
    return tuple(r for r in rules if not isinstance(r, kind))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("gemma3")
    model = hf.gemma3()
    hf_dir = hf.save(model, work / "hf")
    cfg = json.loads((hf_dir / "config.json").read_text())
    tokens = hf.tokens(BATCH, SEQ, cfg["vocab_size"], seed=1)
    np.save(work / "tokens.npy", tokens)
    jobs = []
    for scan in (True, False):
        spec = mx.spec_from_hf(cfg, scan=scan, mesh=MESH, batch=BATCH, seq=SEQ)
        k = f"scan{int(scan)}"
        jobs += [mx.convert_job(spec, hf_dir, work / f"{k}.conv.safetensors"),
                 mx.load_job(spec, hf_dir, recipe(cfg, scan), dump=work / f"{k}.dump.safetensors",
                             tokens=work / "tokens.npy", logits=work / f"{k}.logits.npy", report=work / f"{k}.json"),
                 mx.to_hf_job(spec, work / f"{k}.conv.safetensors", hf_dir / "config.json", work / f"{k}.mt2hf")]
    spec = mx.spec_from_hf(cfg, scan=True, mesh=MESH, batch=BATCH, seq=SEQ)
    for label, kind in (("no_offset", Offset), ("no_embed_scale", Scale)):
        jobs.append(mx.load_job(spec, hf_dir, _without(recipe(cfg, True), kind), tokens=work / "tokens.npy",
                                logits=work / f"{label}.logits.npy"))
    mx.run_jobs(jobs)
    return {"work": work, "cfg": cfg, "hf_dir": hf_dir, "tokens": tokens, "model": model,
            "ref": hf.logits_bf16_table(model, tokens), "ref_fp32": hf.logits(model, tokens)}


@pytest.mark.parametrize("scan", [True, False], ids=["scan1", "scan0"])
def test_hf_to_maxtext_every_leaf_bitwise_and_logits(run, scan):
    work, k = run["work"], f"scan{int(scan)}"
    report = json.loads((work / f"{k}.json").read_text())
    assert report["not_boxed"] == [] and report["not_maxtext_sharding"] == [] and report["devices"] == 4
    mine, theirs = mx.read_params(work / f"{k}.dump.safetensors"), mx.read_params(work / f"{k}.conv.safetensors")
    assert sorted(mine) == sorted(theirs) and len(theirs) == report["leaves"]
    if scan:  # one block of 6 stacked on axis 1, the 2 layers left over unstacked
        assert theirs["decoder/layers/layers_5/self_attention/query/kernel"].shape == (64, 1, 4, 32)
        assert theirs["decoder/layers_remainder/layers_1/self_attention/query/kernel"].shape == (64, 4, 32)
    for key, value in theirs.items():
        assert mine[key].dtype == value.dtype and mine[key].tobytes() == value.tobytes(), key
    assert _err(np.load(work / f"{k}.logits.npy"), run["ref"]) < TOL


@pytest.mark.parametrize("scan", [True, False], ids=["scan1", "scan0"])
def test_maxtext_to_hf_through_the_inverse_recipe_is_maxtexts_export(run, scan):
    from safetensors.numpy import load_file

    work, cfg, k = run["work"], run["cfg"], f"scan{int(scan)}"
    d = _export_hf(work / f"{k}.dump.safetensors", recipe(cfg, scan, "maxtext", "hf"), run["hf_dir"] / "config.json",
                   work / f"{k}.back")
    mine, theirs = load_file(str(d / "model.safetensors")), load_file(str(work / f"{k}.mt2hf" / "model.safetensors"))
    assert sorted(mine) == sorted(theirs) == sorted(ckptbridge.open(run["hf_dir"]))
    for name, value in theirs.items():
        assert mine[name].dtype == value.dtype and mine[name].tobytes() == value.tobytes(), name
    orig = ckptbridge.open(run["hf_dir"])
    norm = "model.layers.0.input_layernorm.weight"  # (w + 1) - 1 in float32: not w, within an ulp of 1
    assert mine[norm].tobytes() != orig[norm].read().tobytes()
    assert np.abs(mine[norm] - orig[norm].read()).max() <= np.spacing(np.float32(2.0))
    assert _err(hf.logits(_from_pretrained(d), run["tokens"]), run["ref_fp32"]) < TOL


def test_the_recipe_maps_values_without_reading(run):
    cfg = run["cfg"]
    ckpt = ckptbridge.open(run["hf_dir"], rules=recipe(cfg, True))
    norm = ckpt["decoder/layers/layers_0/pre_self_attention_norm/scale"]
    assert norm.shape == (64, 1) and ckpt.stats.bytes_read == 0
    raw = ckptbridge.open(run["hf_dir"])
    want = raw["model.layers.0.input_layernorm.weight"].read() + np.float32(1.0)
    assert norm.read()[:, 0].tobytes() == want.tobytes()
    emb = ckpt["token_embedder/embedding"].read()
    assert emb.tobytes() == (raw["model.embed_tokens.weight"].read() * np.float32(8.0)).tobytes()


@pytest.mark.parametrize("label", ["no_offset", "no_embed_scale"])
def test_negative_controls_move_the_logits(run, label):
    err = _err(np.load(run["work"] / f"{label}.logits.npy"), run["ref"])
    assert err > 50 * TOL, (label, err)


def test_the_sliding_window_matters_in_these_tokens(run):
    wide = hf.gemma3(window=SEQ)
    assert _err(hf.logits(wide, run["tokens"]), run["ref_fp32"]) > 50 * TOL


def test_config_and_shape_errors_name_the_tensor(run):
    cfg = run["cfg"]
    assert recipes.family_from_hf(cfg) == "gemma3"
    assert recipes.config_from_hf(cfg) == {"n_heads": 4, "n_kv_heads": 2, "head_dim": 32, "tie_embeddings": True,
                                           "qkv_bias": False, "rope": "default", "n_layers": 8, "hidden": 64}
    with pytest.raises(ckptbridge.OptionError, match="n_layers"):
        recipes.rules("gemma3", src="hf", dst="maxtext", n_heads=4, n_kv_heads=2, head_dim=32, hidden=64)
    bad = {**recipes.config_from_hf(cfg), "head_dim": 16}
    with pytest.raises(ckptbridge.ShapeMismatchError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight"):
        ckptbridge.open(run["hf_dir"], rules=recipes.rules("gemma3", src="hf", dst="maxtext", **bad))
    assert dataclasses.is_dataclass(recipes.config_type("gemma3"))
