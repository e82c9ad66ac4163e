"""The ``gpt_oss`` recipe proven with transformers' ``GptOssForCausalLM`` and MaxText 0.2.5's own gpt-oss.

A tiny random ``GptOssForCausalLM`` (fp32; GQA 4/2 heads, head_dim 24 != hidden/heads = 16, 4 layers
alternating sliding (window 4 in 16 tokens) and full attention, attention biases and sinks, 4
experts top-2 with a router bias and expert biases, the fused ``gate_up_proj`` with interleaved
gate/up columns) opened through ``recipes.rules("gpt_oss", ...)`` and loaded by
``ckptbridge.adapters.flax.load`` onto MaxText's own boxed tree on a 2x2 mesh (fsdp x tensor):

1. every leaf is bitwise what MaxText's own converter hooks make (``GPT_OSS`` in its
   ``param_mapping.py``), scanned (pairs of layers, every leaf stacked on axis 1) and not;
2. MaxText's fp32 logits equal HF's (<= 1e-4);
3. back through the inverse recipe: bitwise HF's original tensors and MaxText's own export;
4. the same model in bfloat16 into MaxText's bf16 tree: bitwise its converter at bf16;
5. negative controls: gate/up not de-interleaved, sinks zeroed, leave the tolerance by far.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_models as hf
import maxtext_client as mx
from maxtext_family import BATCH, MESH, SEQ, back, leaves_bitwise, prepare, recipe
from test_recipes_maxtext import _err, _from_pretrained

import ckptbridge
from ckptbridge import Deinterleave, Scale, recipes

pytestmark = pytest.mark.heavy

TOL = 1e-4

CONTROLS = {  # label -> the recipe with one fact wrong
    "not_deinterleaved": lambda rules: tuple(r for r in rules if not isinstance(r, Deinterleave)),
    "sinks_zeroed": lambda rules: (*rules, Scale(r"/sinks$", 0.0)),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import torch

    work = tmp_path_factory.mktemp("gpt_oss")
    model = hf.gpt_oss()
    bf16 = hf.save(hf.gpt_oss().to(torch.bfloat16), work / "hf_bf16")  # a bf16 release's dtype

    def bf16_jobs(cfg):  # MaxText with bf16 weights: its converter (save_dtype bf16) and the recipe
        spec = {**mx.spec_from_hf(cfg, scan=True, mesh=MESH, batch=BATCH, seq=SEQ), "weight_dtype": "bfloat16"}
        return [{**mx.convert_job(spec, bf16, work / "bf16.conv.safetensors"), "save_dtype": "bfloat16"},
                mx.load_job(spec, bf16, recipe(cfg, True), dump=work / "bf16.dump.safetensors",
                            tokens=work / "tokens.npy", logits=work / "bf16.logits.npy")]

    run = prepare(work, model, lambda cfg: {label: wrong(recipe(cfg, True)) for label, wrong in CONTROLS.items()},
                  bf16_jobs)
    ref_bf16 = hf.logits(hf.gpt_oss().to(torch.bfloat16).to(torch.float32), run["tokens"])
    return {**run, "ref": hf.logits(model, run["tokens"]), "ref_bf16": ref_bf16}


@pytest.mark.parametrize("scan", [True, False], ids=["scan1", "scan0"])
def test_hf_to_maxtext_every_leaf_bitwise_and_logits(run, scan):
    theirs = leaves_bitwise(run["work"], scan)
    at = "decoder/layers/layers_1/" if scan else "decoder/layers_1/"
    assert theirs[at + "GptOssMlp/wi_0"].shape == ((4, 2, 64, 48) if scan else (4, 64, 48))
    assert theirs[at + "GptOssAttention/sinks"].shape == ((4, 2) if scan else (4,))
    assert _err(np.load(run["work"] / f"scan{int(scan)}.logits.npy"), run["ref"]) < TOL


@pytest.mark.parametrize("scan", [True, False], ids=["scan1", "scan0"])
def test_maxtext_to_hf_through_the_inverse_recipe(run, scan):
    mine, d = back(run["work"], run["cfg"], scan)  # bitwise MaxText's own export
    orig = ckptbridge.open(run["hf_dir"])
    for name, value in mine.items():  # a pure relayout: HF's own bytes too
        assert value.tobytes() == orig[name].read().tobytes(), name
    assert _err(hf.logits(_from_pretrained(d), run["tokens"]), run["ref"]) < TOL


def test_bf16_weights_load_bitwise_with_their_logits(run):
    """A bf16 checkpoint into MaxText's bf16 tree (``weight_dtype=bfloat16``; its gpt-oss layer norms
    stay float32, ``models/gpt_oss.py``, the final norm does not): every leaf bitwise MaxText's
    converter at ``save_dtype=bfloat16`` (in the tree's dtype); logits those of HF's fp32 run of the
    same bf16 weights."""
    mine, theirs = (mx.read_params(run["work"] / f"bf16.{k}.safetensors") for k in ("dump", "conv"))
    assert sorted(mine) == sorted(theirs)
    for key, value in theirs.items():
        assert str(mine[key].dtype) == ("float32" if key.endswith("_layer_norm/scale") else "bfloat16"), key
        assert mine[key].tobytes() == value.astype(mine[key].dtype).tobytes(), key
    assert _err(np.load(run["work"] / "bf16.logits.npy"), run["ref_bf16"]) < TOL


def test_gate_up_columns_deinterleave_without_reading(run):
    ckpt = ckptbridge.open(run["hf_dir"], rules=recipe(run["cfg"], False))
    wi_0, wi_1 = ckpt["decoder/layers_0/GptOssMlp/wi_0"], ckpt["decoder/layers_0/GptOssMlp/wi_1"]
    assert wi_0.shape == wi_1.shape == (4, 64, 48) and ckpt.stats.bytes_read == 0
    fused = ckptbridge.open(run["hf_dir"])["model.layers.0.mlp.experts.gate_up_proj"].read()
    assert wi_0.read().tobytes() == np.ascontiguousarray(fused[..., ::2]).tobytes()
    assert wi_1.read().tobytes() == np.ascontiguousarray(fused[..., 1::2]).tobytes()


@pytest.mark.parametrize("label", list(CONTROLS))
def test_negative_controls_move_the_logits(run, label):
    """Measured: 0.16 (gate/up not de-interleaved), 2.4e-2 (sinks zeroed), against 1.8e-7."""
    err = _err(np.load(run["work"] / f"{label}.logits.npy"), run["ref"])
    assert err > 50 * TOL, (label, err)


def test_config_and_shape_errors_name_the_tensor(run):
    cfg = run["cfg"]
    assert recipes.family_from_hf(cfg) == "gpt_oss"
    assert recipes.config_from_hf(cfg) == {"n_heads": 4, "n_kv_heads": 2, "head_dim": 24, "tie_embeddings": False,
                                           "qkv_bias": True, "rope": "default", "n_layers": 4, "moe_mlp": 48}
    with pytest.raises(ckptbridge.OptionError, match="n_layers=3 is odd"):
        recipes.rules("gpt_oss", src="hf", dst="maxtext", **{**recipes.config_from_hf(cfg), "n_layers": 3})
    bad = {**recipes.config_from_hf(cfg), "moe_mlp": 32}
    with pytest.raises(ckptbridge.ShapeMismatchError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj'.*64"):
        ckptbridge.open(run["hf_dir"], rules=recipes.rules("gpt_oss", src="hf", dst="maxtext", **bad))
    assert dataclasses.is_dataclass(recipes.config_type("gpt_oss"))
