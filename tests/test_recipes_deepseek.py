"""The ``deepseek_v3`` recipe proven with transformers' ``DeepseekV3ForCausalLM`` and MaxText 0.2.5's own
DeepSeek decoder and converter hooks.

A tiny random DeepSeek-V3 (dims no default has: hidden 48, 4 heads, q LoRA 24, kv LoRA 20, nope 12,
rope 8, v 10; 1 dense layer then 2 MoE layers of 16 routed experts (4 per token, 4 groups, top-2
groups) and a shared expert; YaRN; norms and the router correction bias random), saved by
``save_pretrained`` with the release's MTP layer tensors added (``model.layers.3.*``), is opened
with ``ckptbridge.open(hf_dir, rules=recipes.rules("deepseek_v3", src="hf", dst="maxtext", ...))``
and loaded by ``ckptbridge.adapters.flax.load`` onto MaxText's own abstract boxed tree (both
collections, ``params`` and ``MoEBiasVar``) on a 2x2 CPU mesh (fsdp 2 x tensor 2) with its
logical-axis shardings. Then, scanned and unscanned:

1. MaxText's fp32 logits equal HF's (1e-4); every ``params`` leaf is bitwise what MaxText's own
   converter hooks (``DEEPSEEK_MAXTEXT_TO_HF_PARAM_MAPPING`` / ``_HOOK_FN``) make. Where they are
   wrong (scanned: the shared experts and the router kernel fail the converter's own reshape, see
   tools/maxtext/NOTES.md) the leaf equals the unscanned conversion stacked on the layer axis (1);
   the router correction bias, which the converter maps into ``params`` where MaxText's decoder has
   no such leaf, equals HF's ``e_score_correction_bias`` (stacked on axis 0 when scanned: MaxText's
   ``MoEBiasVar`` collection keeps the layer first).
2. The MTP tensors are dropped with one warning line naming them.
3. Back: MaxText's tree through the inverse recipe is HF's checkpoint bitwise (MTP aside).
4. Negative controls far outside the tolerance: the router bias left at zero (what MaxText's
   converter leaves it), the shared experts' gate and up swapped.
5. Block fp8: the same model in DeepSeek-V3's release layout (every projection e4m3 with its
   ``weight_scale_inv`` in another shard, 16 x 24 blocks, ragged at the edges of ``kv_a_proj_with_mqa``
   (28 rows), ``kv_b_proj`` (88 rows, 20 columns) and the experts (24 rows)) opened dequantized to fp32,
   through the recipe onto MaxText's scanned tree: every leaf bitwise the recipe applied to DeepSeek's
   own dequantization (``weight_dequant``, written out in ``test_quantized.py``) saved as plain HF, and
   MaxText's logits are those of HF's ``DeepseekV3ForCausalLM`` loaded with those dequantized weights;
   the unquantized model's logits are far off (the test sees the quantization).

HF -> megatron-core: the CLI (``reshard --to megatron``, args from ``recipes.megatron_args``)
writes a TP 1 checkpoint that megatron-core's ``GPTModel`` (MLA + MoE from its own layer specs;
dense first layer; the release's MTP layer as its multi-token-prediction block, ``mtp_num_layers=1``)
loads strictly on 2 gloo ranks (``tools/megatron/core_loss.py``) and whose logits are HF's; Megatron
-> HF gives every tensor back bitwise (the MTP layer's copies of the embedding and output layer are
dropped with one line: megatron-core's MTP shares the main model's); the router's expert bias zeroed
moves the logits far (negative control). The same at EP 2 (``-o ep=2``, in the same ``core_loss.py`` call):
each rank loads its own ``mp_rank_00_00E`` strictly with HF's logits (the dense first layer's MLP in both
files, every MoE layer's experts and the MTP layer's split 8 + 8 under local ids), the files and
megatron-core's own ``torch_dist`` save of them (``savemodel:``; one key per layer, as megatron-core keys a
block of mixed dense and MoE layers) read back to HF bitwise; the grouped recipe through
``reshard --to megatron -o ep=2`` (bf16, GroupedMLP files) gives bitwise the logits of the SequentialMLP
files. In the same call, MLA at TP 2 (``reshard --to megatron --tp 2``, with and without a query LoRA, the
MTP layer's ``eh_proj`` too): each TP rank loads its file strictly with HF's logits, the files and
megatron-core's ``torch_dist`` save read back bitwise; and dense layers between MoE layers at TP > 1: a tiny
``Qwen3MoeForCausalLM`` with ``decoder_sparse_step=2`` written at TP 2 x EP 2 and at PP 2 loads strictly in
megatron-core with HF's logits and reads back bitwise. ``recipes.megatron_args`` given a checkpoint directory
counts the MTP layers its tensors have
(``save_pretrained`` writes none though the config says 1), and the writer refuses args that do not fit the
tensors. On CPU, megatron-core 0.16.1's MLA needs a core
attention that takes its key/value widths (its local ``DotProductAttention`` does not; Transformer
Engine's is CUDA-only) and two import-time gaps filled: ``tools/megatron/mla_cpu.py`` says which.
With ``megatron_experts="grouped"`` (the legacy ``GroupedMLP`` module's ``mlp.experts.weight1`` / ``weight2``,
the MTP layer's too) the model fills megatron-core's ``GPTModel(moe_grouped_gemm=True)`` strictly
(``tools/megatron/core_module.py``) with the logits of the ``SequentialMLP`` model, bitwise (bf16, GroupedMLP's
only dtype). The tiny model routes 4 of 16 experts in the top 2 of 4 groups: megatron-core ranks groups by
their top ``topk / group_topk`` scores, DeepSeek by their top 2 (DeepSeek-V3: 8 / 4 = 2).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import sys

import numpy as np
import pytest
from _common import core_loss

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_models as hf
import maxtext_client as mx

import ckptbridge
from ckptbridge import (
    CorruptionError,
    Drop,
    DroppedTensorsWarning,
    FormatError,
    OptionError,
    Rename,
    Scale,
    ShapeMismatchError,
    recipes,
)

TOL = 1e-4
BATCH, SEQ = 4, 12
MESH = {"fsdp": 2, "tensor": 2}
SPEC = hf.DeepseekSpec()
NO_Q_SPEC = dataclasses.replace(SPEC, q_lora=None, dense=0, layers=2)  # DeepSeek-V2-Lite style ``q_proj``
MTP = {  # the release's MTP layer leaves (layer num_hidden_layers) besides its decoder layer, shapes for the tiny model
    "enorm.weight": (48,), "hnorm.weight": (48,), "eh_proj.weight": (48, 96), "shared_head.norm.weight": (48,),
    "embed_tokens.weight": (256, 48), "shared_head.head.weight": (256, 48),
}
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # megatron-core's MTP shares the main model's
BIAS = "MoEBiasVar/decoder/moe_layers{}/DeepSeekMoeBlock_0/MoeBlock_0/gate/bias"
WRONG_WHEN_SCANNED = ("DeepSeekMoeBlock_0/MoeBlock_0/gate/kernel", "DeepSeekMoeBlock_0/shared_experts/wi_0/kernel",
                      "DeepSeekMoeBlock_0/shared_experts/wi_1/kernel", "DeepSeekMoeBlock_0/shared_experts/wo/kernel")


def _add_mtp(d, n_layers: int) -> list[str]:
    """An MTP layer as the release stores it (its own shard, listed in the index): a decoder layer shaped
    like the last one (MLA, MoE) and the MTP leaves, random."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(7)
    last = ckptbridge.open(d)
    shapes = {f"{n_layers}.{n[len(f'model.layers.{n_layers - 1}.'):]}": last[n].shape for n in last
              if n.startswith(f"model.layers.{n_layers - 1}.")} | {f"{n_layers}.{k}": s for k, s in MTP.items()}
    names = {f"model.layers.{k}": (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    save_file(names, str(d / "model-mtp.safetensors"))
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"] |= {k: "model-mtp.safetensors" for k in names}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return sorted(names)


def recipe(cfg: dict, scan: bool, src: str = "hf", dst: str = "maxtext") -> tuple:
    return recipes.rules(recipes.family_from_hf(cfg), src=src, dst=dst, **{**recipes.config_from_hf(cfg), "scan": scan})


def _swap_shared_gate_up(rules: tuple) -> tuple:
    swap = {"shared_experts/wi_0/kernel": "shared_experts/wi_1/kernel",
            "shared_experts/wi_1/kernel": "shared_experts/wi_0/kernel"}
    out = []
    for r in rules:
        hit = next((k for k in swap if isinstance(r, Rename) and r.to.endswith(k)), None)
        out.append(dataclasses.replace(r, to=r.to[: -len(hit)] + swap[hit]) if hit else r)
    return tuple(out)


CONTROLS = {  # label -> the recipe with one fact wrong
    "bias_at_init": lambda rules: (*rules, Scale(r"^MoEBiasVar/", 0.0)),  # what MaxText's converter leaves
    "shared_gate_up_swapped": _swap_shared_gate_up,
}


def _fp8_release(d, out) -> dict:
    """The saved model ``d`` in DeepSeek-V3's release layout in ``out``: every projection block-fp8 (e4m3,
    ``test_quantized.BLOCK``) with its ``weight_scale_inv``, weights in two shards and the scales in a third,
    ``quantization_config`` in config.json. Returns the dequantized weights (DeepSeek's ``weight_dequant``, fp32)."""
    import torch
    from safetensors.torch import load_file
    from test_quantized import BLOCK, QUANTIZED, block_quant, save_shards, weight_dequant

    files = set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values())
    stored = {n: t for f in sorted(files) for n, t in load_file(str(d / f)).items()}
    weights, scales, deq = {}, {}, {}
    for name, t in stored.items():
        weights[name] = t
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
            weights[name], scales[name + "_scale_inv"] = block_quant(t, BLOCK)
            deq[name] = weight_dequant(weights[name], scales[name + "_scale_inv"], BLOCK, torch.float32)
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(BLOCK)}
    names = sorted(weights)
    save_shards(out, [{n: weights[n] for n in names[::2]}, {n: weights[n] for n in names[1::2]}, scales], config)
    return deq


def _dequantized_model(model, deq: dict, out):
    """HF's ``DeepseekV3ForCausalLM`` with the dequantized weights (a ``save_pretrained`` checkpoint of
    the model with them substituted, read back by ``from_pretrained``; no MTP layer)."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    hf.save(model, out)
    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(f))
        save_file({n: deq.get(n, t).contiguous() for n, t in tensors.items()}, str(f), metadata={"format": "pt"})
    return transformers.DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("recipes_deepseek")
    model = hf.build_deepseek(SPEC)
    d = hf.save(model, work / "hf")
    cfg = json.loads((d / "config.json").read_text())
    mtp = _add_mtp(d, SPEC.layers)
    tokens = hf.tokens(BATCH, SEQ, SPEC.vocab, seed=1)
    np.save(work / "tokens.npy", tokens)
    deq = _fp8_release(d, work / "fp8")
    deq_model = _dequantized_model(copy.deepcopy(model), deq, work / "deq")
    jobs, files = [], {}
    for scan in (False, True):
        spec = mx.spec_from_hf(cfg, scan=scan, batch=BATCH, seq=SEQ, mesh=MESH)
        f = files[scan] = {k: work / f"scan{int(scan)}.{k}.{ext}" for k, ext in (
            ("conv", "safetensors"), ("dump", "safetensors"), ("logits", "npy"), ("report", "json"),
            ("conv_report", "json"))}
        jobs.append(mx.convert_job(spec, d, f["conv"], report=f["conv_report"]))
        jobs.append(mx.load_job(spec, d, recipe(cfg, scan), dump=f["dump"], tokens=work / "tokens.npy",
                                logits=f["logits"], report=f["report"]))
        for label, wrong in CONTROLS.items() if scan else ():  # the controls once, on the scanned tree
            jobs.append(mx.load_job(spec, d, wrong(recipe(cfg, scan)), tokens=work / "tokens.npy",
                                    logits=work / f"scan{int(scan)}.{label}.npy"))
    jobs.append(mx.load_job(spec, work / "fp8", recipe(cfg, True), open_options={"dequantize_dtype": "float32"},
                            dump=work / "fp8.dump.safetensors", tokens=work / "tokens.npy", logits=work / "fp8.npy",
                            report=work / "fp8.json"))
    results = mx.run_jobs(jobs)
    return {"work": work, "dir": d, "cfg": cfg, "ref": hf.logits(model, tokens), "files": files, "results": results,
            "mtp": mtp, "model": model, "deq": deq, "deq_ref": hf.logits(deq_model, tokens)}


def _err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


def _stack_layers(unscanned: dict, axis: int) -> dict:
    """MaxText's unscanned conversion stacked as its scanned decoder keeps it (dense / MoE stacks)."""
    per: dict = {}
    for name, value in unscanned.items():
        m = re.match(r"^decoder/(dense|moe)_layers_(\d+)/(.*)$", name)
        if m:
            per.setdefault(f"decoder/{m.group(1)}_layers/{m.group(3)}", {})[int(m.group(2))] = value
    return {k: np.stack([v[i] for i in sorted(v)], axis=axis) for k, v in per.items()}


@pytest.mark.heavy
@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
def test_hf_to_maxtext_logits_and_every_leaf(run, scan):
    f = run["files"][scan]
    report = json.loads(f["report"].read_text())
    assert report["not_boxed"] == [] and report["not_maxtext_sharding"] == []  # MaxText's boxes, on its mesh
    assert report["devices"] == 4
    mine, theirs = mx.read_params(f["dump"]), mx.read_params(f["conv"])
    conv = json.loads(f["conv_report"].read_text())
    suffix = "" if scan else "_{}"
    biases = [BIAS.format(suffix.format(i)) for i in range(SPEC.layers - SPEC.dense)]
    assert conv["not_converted"] == (biases[:1] if scan else biases)  # the converter has no MoEBiasVar hook
    wrong = {f"decoder/moe_layers/{leaf}" for leaf in WRONG_WHEN_SCANNED} if scan else set()
    assert set(conv["errors"]) == wrong  # MaxText's scanned DeepSeek conversion fails exactly these
    assert sorted(mine) == sorted([*theirs, *wrong, *conv["not_converted"]])
    for key, value in theirs.items():
        assert mine[key].dtype == value.dtype and mine[key].tobytes() == value.tobytes(), key
    if scan:  # the leaves the scanned converter gets wrong: its unscanned conversion stacked on axis 1
        stacked = _stack_layers(mx.read_params(run["files"][False]["conv"]), axis=1)
        for key in wrong:
            assert mine[key].tobytes() == np.ascontiguousarray(stacked[key]).tobytes(), key
    raw = ckptbridge.open(run["dir"])
    hf_bias = [raw[f"model.layers.{i}.mlp.gate.e_score_correction_bias"].read() for i in range(SPEC.dense, SPEC.layers)]
    if scan:
        assert mine[biases[0]].tobytes() == np.stack(hf_bias, axis=0).tobytes()
    else:
        for name, b in zip(biases, hf_bias, strict=True):
            assert mine[name].tobytes() == b.tobytes(), name
    assert _err(np.load(f["logits"]), run["ref"]) < TOL


@pytest.mark.heavy
def test_mtp_layer_dropped_with_one_line_naming_it(run):
    with pytest.warns(DroppedTensorsWarning) as caught:
        ckpt = ckptbridge.open(run["dir"], rules=recipe(run["cfg"], True))
    lines = [str(w.message) for w in caught if issubclass(w.category, DroppedTensorsWarning)]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert all(name in lines[0] for name in run["mtp"])
    assert not any(".layers.3." in n or "layers_3" in n for n in ckpt)
    assert Drop in {type(r) for r in recipe(run["cfg"], True)}


@pytest.mark.heavy
@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
def test_maxtext_to_hf_through_the_inverse_recipe_bitwise(run, scan):
    """MaxText's loaded tree (the harness dump: both collections) back through the inverse recipe
    is HF's checkpoint, bitwise, every tensor but the MTP layer's."""
    back = ckptbridge.open(run["files"][scan]["dump"], rules=recipe(run["cfg"], scan, "maxtext", "hf"))
    raw = ckptbridge.open(run["dir"])
    assert sorted(back) == sorted(n for n in raw if n not in run["mtp"])
    for name in back:
        assert back[name].read().tobytes() == raw[name].read().tobytes(), name


@pytest.mark.heavy
@pytest.mark.parametrize("label", list(CONTROLS))
def test_negative_controls_move_the_logits(run, label):
    """Measured: 5.1e-2 (bias at zero), 1.1e-2 (shared gate/up swapped), against 1.6e-7 above."""
    err = _err(np.load(run["work"] / f"scan1.{label}.npy"), run["ref"])
    assert err > 50 * TOL, (label, err)


@pytest.mark.heavy
def test_fp8_release_into_maxtext_gives_the_dequantized_models_logits(run):
    """Measured: 1.6e-7 from the dequantized model's logits; 1.9e-2 from the unquantized model's."""
    work = run["work"]
    report = json.loads((work / "fp8.json").read_text())
    assert report["not_boxed"] == [] and report["not_maxtext_sharding"] == [] and report["devices"] == 4
    raw = ckptbridge.open(work / "fp8", dequantize=False)
    assert sum(n.endswith("_scale_inv") for n in raw) == len(run["deq"]) > 100
    assert {str(raw[n].dtype) for n in run["deq"]} == {"float8_e4m3fn"}
    mine = mx.read_params(work / "fp8.dump.safetensors")
    theirs = ckptbridge.open(work / "deq", rules=recipe(run["cfg"], True))  # DeepSeek's dequantization, plain HF
    assert sorted(mine) == sorted(theirs)
    for name, value in mine.items():
        assert value.dtype == np.float32 and value.tobytes() == theirs[name].read().tobytes(), name
    logits = np.load(work / "fp8.npy")
    assert _err(logits, run["deq_ref"]) < TOL
    assert _err(logits, run["ref"]) > 50 * TOL  # the quantization shows: the test would see it skipped


# ------------------------------------------------------------------ data level (no MaxText, no Megatron)


@pytest.fixture(scope="module")
def no_q_lora(tmp_path_factory):
    """A tiny DeepSeek without a query LoRA (DeepSeek-V2-Lite style ``q_proj``), no dense layer."""
    return hf.save(hf.build_deepseek(NO_Q_SPEC), tmp_path_factory.mktemp("hf") / "ds_no_q_lora")


def test_config_from_hf_and_family(no_q_lora):
    cfg = recipes.config_from_hf(no_q_lora / "config.json")
    assert recipes.family_from_hf(no_q_lora / "config.json") == "deepseek_v3"
    assert cfg == {"n_heads": 4, "n_layers": 2, "first_dense": 0, "q_lora_rank": 0, "kv_lora_rank": 20,
                   "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10, "mtp_layers": 1,
                   "n_experts": 16, "moe_mlp": 24}


@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
def test_hf_maxtext_hf_without_a_query_lora_is_the_identity(no_q_lora, scan):
    cfg = json.loads((no_q_lora / "config.json").read_text())
    ckpt = ckptbridge.open(no_q_lora, rules=recipe(cfg, scan))
    at = "decoder/moe_layers/" if scan else "decoder/moe_layers_1/"
    assert ckpt[at + "self_attention/query/kernel"].shape == ((48, 2, 4, 20) if scan else (48, 4, 20))
    assert ckpt[BIAS.format("" if scan else "_1")].shape == ((2, 16) if scan else (16,))
    assert not any("dense_layers" in n for n in ckpt) and ckpt.stats.bytes_read == 0
    back = ckpt.with_rules(recipe(cfg, scan, "maxtext", "hf"))
    raw = ckptbridge.open(no_q_lora)
    assert sorted(back) == sorted(raw)
    for name in raw:
        assert back[name].read().tobytes() == raw[name].read().tobytes(), name


def test_hf_megatron_hf_names_and_bytes(no_q_lora):
    cfg = json.loads((no_q_lora / "config.json").read_text())
    for norms in ("local", "te"):
        over = {**recipes.config_from_hf(cfg), "megatron_norms": norms}
        mg = ckptbridge.open(no_q_lora, rules=recipes.rules("deepseek_v3", src="hf", dst="megatron", **over))
        q_norm = "q_layernorm.weight" if norms == "local" else "linear_q_up_proj.layer_norm_weight"
        assert q_norm not in " ".join(mg)  # no query LoRA: no query norm
        layer = "decoder.layers.1."
        for leaf in ("self_attention.linear_q_proj.weight", "self_attention.linear_kv_down_proj.weight",
                     "self_attention.linear_kv_up_proj.weight", "self_attention.linear_proj.weight",
                     "mlp.router.weight", "mlp.router.expert_bias", "mlp.experts.local_experts.7.linear_fc1.weight",
                     "mlp.experts.local_experts.7.linear_fc2.weight", "mlp.shared_experts.linear_fc1.weight",
                     "input_layernorm.weight", "pre_mlp_layernorm.weight"):
            assert layer + leaf in mg, leaf
        assert mg[layer + "mlp.experts.local_experts.7.linear_fc1.weight"].shape == (48, 48)  # [gate; up]
        dense = ckptbridge.open(no_q_lora, rules=recipes.rules("deepseek_v3", src="hf", dst="megatron",
                                                               **{**over, "first_dense": 1}))
        fused = "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"  # TE fuses a dense layer's pre-MLP norm
        assert (fused in dense) == (norms == "te") and ("decoder.layers.0.pre_mlp_layernorm.weight" in dense) == (
            norms == "local") and "decoder.layers.1.pre_mlp_layernorm.weight" in dense
        back = mg.with_rules(recipes.rules("deepseek_v3", src="megatron", dst="hf", **over))
        raw = ckptbridge.open(no_q_lora)
        assert sorted(back) == sorted(raw)
        for name in raw:
            assert back[name].read().tobytes() == raw[name].read().tobytes(), name


def test_a_config_that_does_not_fit_fails_before_reading(no_q_lora):
    ckpt = ckptbridge.open(no_q_lora)
    over = {**recipes.config_from_hf(no_q_lora / "config.json"), "n_heads": 8}
    with pytest.raises(ShapeMismatchError) as err:
        ckpt.with_rules(recipes.rules("deepseek_v3", src="hf", dst="maxtext", **over))
    assert "tensor 'model.layers.0.self_attn.q_proj.weight': expected shape (160, *) (n_heads x (qk_nope_head_dim " \
        "+ qk_rope_head_dim) = 8 x 20 rows), found (80, 48)" in str(err.value)
    assert ckpt.stats.bytes_read == 0
    with pytest.raises(OptionError, match="first_dense=5 is not in 0..n_layers=2"):
        recipes.rules("deepseek_v3", src="hf", dst="maxtext", **{**over, "first_dense": 5})


# ------------------------------------------------------------------ HF -> megatron-core (MLA + MoE, 2 gloo ranks)

MEGATRON_A = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "megatron", "A", "tp2pp2", "torch")
CORE_MODULE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "megatron",
                           "core_module.py")


def test_megatron_args_follow_the_mtp_tensors_and_the_writer_checks_the_layers(no_q_lora, tmp_path):
    """transformers' ``save_pretrained`` writes no MTP tensors though the config says ``num_nextn_predict_layers=1``:
    given the checkpoint (its directory, or its config.json beside the weights) ``megatron_args`` follows the
    tensors. The writer refuses, before writing anything, Megatron args whose MTP layers the tensors lack, or
    whose ``moe_layer_freq`` makes a layer dense that has a router (naming the tensor)."""
    cfg = json.loads((no_q_lora / "config.json").read_text())
    template = {**ckptbridge.open(MEGATRON_A).extra["megatron"]["args"], "tensor_model_parallel_size": 1,
                "pipeline_model_parallel_size": 1}
    assert cfg["num_nextn_predict_layers"] == 1 and not [n for n in ckptbridge.open(no_q_lora) if ".layers.2." in n]
    assert recipes.megatron_args(cfg, template=template)["mtp_num_layers"] == 1  # the config alone says 1
    for given in (no_q_lora, str(no_q_lora), no_q_lora / "config.json"):
        args = recipes.megatron_args(given, template=template)
        assert args["mtp_num_layers"] is None and args["moe_layer_freq"] == [1, 1], given
    rules = recipes.rules("deepseek_v3", src="hf", dst="megatron", **recipes.config_from_hf(cfg))
    for label, wrong, named in (
            ("mtp", {"mtp_num_layers": 1}, r"mtp_num_layers=1 but there is no tensor 'mtp\.layers\.0\.\*'"),
            ("freq", {"moe_layer_freq": [0, 1]}, r"tensor 'decoder\.layers\.0\.mlp\.\S+' does not belong in layer 0, "
                                                 r"which moe_layer_freq=\[0, 1\] makes a dense layer")):
        (tmp_path / f"{label}.json").write_text(json.dumps({**args, **wrong}))
        with pytest.raises(FormatError, match=named):
            ckptbridge.reshard(str(no_q_lora), tmp_path / label, "megatron", rules=rules, args=str(tmp_path / f"{label}.json"))
        assert not (tmp_path / label).exists()


QWEN_SPEC = hf.HFSpec("qwen3_moe", layers=4, mlp=48, experts=4, experts_per_tok=2, heads=4, kv_heads=2, head_dim=24)
QWEN_CASES = {"qwen_tp2ep2": ("-o", "tp=2", "-o", "ep=2", "-o", "etp=1"), "qwen_pp2": ("-o", "tp=1", "-o", "pp=2")}


def _qwen_dense_layers(work, template: dict) -> dict:
    """A tiny ``Qwen3MoeForCausalLM`` with ``decoder_sparse_step=2`` (layers 0, 2 dense with a SwiGLU MLP of
    width 96; layers 1, 3 MoE: 4 experts of width 48, top 2), written by ``reshard --to megatron`` at TP 2 x EP 2
    (ETP 1) and at PP 2 (``QWEN_CASES``), for the same ``core_loss.py`` call as the DeepSeek checkpoints (MLA
    is laid out at TP 1 only: this is the TP > 1 case of dense layers between MoE layers)."""
    import transformers

    from ckptbridge._cli import main

    cfg = hf.config(QWEN_SPEC)
    cfg.decoder_sparse_step = 2  # HF: layer i is MoE when (i + 1) % 2 == 0
    model = hf.build_config(transformers.Qwen3MoeForCausalLM, cfg, QWEN_SPEC.seed)
    d = hf.save(model, work / "hf_qwen")
    args = recipes.megatron_args(d, template=template)
    (work / "qwen.args.json").write_text(json.dumps(args))
    rules = recipes.rules("qwen3_moe", src="hf", dst="megatron", **recipes.config_from_hf(d / "config.json"))
    (work / "qwen.rules.json").write_text(json.dumps(ckptbridge.rules_to_json(rules)))
    for label, opts in QWEN_CASES.items():
        assert main(["reshard", str(d), str(work / label), "--to", "megatron", "--rules", str(work / "qwen.rules.json"),
                     "-o", f"args={work / 'qwen.args.json'}", *opts]) == 0, label
    return {"model": model, "dir": d, "args": args}


@pytest.fixture(scope="module")
def megatron(tmp_path_factory, no_q_lora):
    """HF -> Megatron with the CLI (``reshard --to megatron --rules R.json -o args=ARGS.json``, args from
    ``recipes.megatron_args``), loaded strictly by megatron-core's ``GPTModel`` (MLA + MoE layer
    specs, the core attention of ``tools/megatron/mla_cpu.py``) on 2 gloo ranks (``core_loss.py``), in one
    call: TP 1 / EP 1 (``mg``; the negative control ``mg_bias_zero``), EP 2 (``mg_ep2``: each rank one EP rank),
    and in bf16 at EP 2 the grouped recipe (``megatron_experts="grouped"``: whole-layer ``experts.weight1/2``)
    into legacy GroupedMLP files (``grouped_ep2``, ``moe_grouped_gemm``) beside the sequential recipe's
    SequentialMLP files (``sequential_ep2``); MLA at TP 2 (``reshard --tp 2``: ``mla_tp2``, the MTP layer too, its
    megatron-core ``torch_dist`` save ``mla_tp2_dist``, and ``mla_tp2_noq`` without a query LoRA)."""

    from ckptbridge._cli import main

    work = tmp_path_factory.mktemp("deepseek_megatron")
    model = hf.build_deepseek(SPEC)
    d = hf.save(model, work / "hf")
    mtp = _add_mtp(d, SPEC.layers)
    template = {**ckptbridge.open(MEGATRON_A).extra["megatron"]["args"], "tensor_model_parallel_size": 1,
                "pipeline_model_parallel_size": 1}
    args = recipes.megatron_args(d, template=template)  # the checkpoint dir: mtp_num_layers from its tensors
    bf16 = {**args, "bf16": True, "params_dtype": "torch.bfloat16"}
    for label, a in (("args", args), ("bf16", bf16), ("bf16_grouped", {**bf16, "moe_grouped_gemm": True})):
        (work / f"{label}.json").write_text(json.dumps(a))
    cfg = recipes.config_from_hf(d / "config.json")
    rules = recipes.rules("deepseek_v3", src="hf", dst="megatron", **cfg)
    grouped = recipes.rules("deepseek_v3", src="hf", dst="megatron", **cfg, megatron_experts="grouped")
    items = []
    for label, rr, a, ep in (("mg", rules, "args", 1), ("mg_bias_zero", (*rules, Scale(r"\.mlp\.router\.expert_bias$", 0.0)),
                                                        "args", 1),
                             ("mg_ep2", rules, "args", 2), ("grouped_ep2", grouped, "bf16_grouped", 2),
                             ("sequential_ep2", rules, "bf16", 2)):
        (work / f"{label}.rules.json").write_text(json.dumps(ckptbridge.rules_to_json(rr)))
        assert main(["reshard", str(d), str(work / label), "--to", "megatron", "--tp", "1", "--pp", "1", "--rules",
                     str(work / f"{label}.rules.json"), "-o", f"args={work / f'{a}.json'}", "-o", f"ep={ep}"]) == 0
        items.append(str(work / label))
    items.insert(3, f"savemodel:{work / 'mg_ep2'}={work / 'dist_ep2'}")  # megatron-core's own torch_dist save of it
    noq_cfg = recipes.config_from_hf(no_q_lora / "config.json")
    (work / "noq.json").write_text(json.dumps(recipes.megatron_args(no_q_lora, template=template)))
    (work / "noq.rules.json").write_text(json.dumps(ckptbridge.rules_to_json(
        recipes.rules("deepseek_v3", src="hf", dst="megatron", **noq_cfg))))
    for label, src, rr, a in (("mla_tp2", d, "mg", "args"), ("mla_tp2_noq", no_q_lora, "noq", "noq")):
        assert main(["reshard", str(src), str(work / label), "--to", "megatron", "--tp", "2", "--pp", "1", "--rules",
                     str(work / f"{rr}.rules.json"), "-o", f"args={work / f'{a}.json'}"]) == 0
        items.append(str(work / label))
    items.append(f"savemodel:{work / 'mla_tp2'}={work / 'mla_tp2_dist'}")
    qwen = _qwen_dense_layers(work, template)  # dense layers between MoE layers at TP 2 x EP 2 and PP 2 (no MLA)
    items += [str(work / label) for label in QWEN_CASES]
    recs = core_loss(list(items), "--dump", str(work / "dump"), env={"MEGATRON_CPU_SHIM_GG": "1"})
    return {"work": work, "dir": d, "model": model, "qwen": qwen, "recs": dict(zip([os.path.basename(i) for i in items], recs)),
            "dumps": {os.path.basename(i): np.load(r["dump"]) for i, r in zip(items, recs) if "dump" in r},
            "rules": rules, "mtp": mtp, "noq": no_q_lora}


@pytest.mark.heavy
def test_hf_to_megatron_loads_strictly_in_megatron_core_with_hfs_logits(megatron):
    rec, dump = megatron["recs"]["mg"], megatron["dumps"]["mg"]
    assert "error" not in rec and rec["tp"] == 1 and rec["pp"] == 1  # load_state_dict(strict=True) passed
    got = hf.logits(megatron["model"], dump["tokens"])
    assert _err(got, dump["logits"]) < TOL  # measured 1.2e-7 (the zeroed expert bias: 6.5e-2)
    loss = hf.cross_entropy(got, dump["labels"])
    assert abs(loss - rec["loss"]) <= 1e-5 * loss, (loss, rec["loss"])
    bias_zero = megatron["dumps"]["mg_bias_zero"]
    assert _err(hf.logits(megatron["model"], bias_zero["tokens"]), bias_zero["logits"]) > 50 * TOL  # negative control


@pytest.mark.heavy
@pytest.mark.parametrize("label", ["mg", "mg_ep2", "dist_ep2", "mla_tp2", "mla_tp2_dist"],
                         ids=["ep1", "ep2", "ep2_torch_dist", "tp2", "tp2_torch_dist"])
def test_megatron_to_hf_gives_the_same_tensors_back(megatron, label):
    """The MTP layer too (megatron-core's ``mtp.layers.0``, which GPTModel with ``mtp_num_layers=1`` loaded
    strictly above), but for its copies of the embedding and output layer, dropped with one line; from the
    EP 2 files too (each expert under its global id), and from megatron-core's own ``torch_dist`` save of them
    (``dist_checkpointing.save`` of its ``sharded_state_dict``: with the dense first layer, one key per layer);
    from the TP 2 files (replicated tensors read on both ranks and checked equal) and megatron-core's
    ``torch_dist`` save of them (its ShardedTensor offsets of the MLA projections)."""
    cfg = recipes.config_from_hf(megatron["dir"] / "config.json")
    dist = "dist" in label
    mg = ckptbridge.open(megatron["work"] / label, check_replicas=not dist)
    assert mg.extra["megatron"]["args"]["expert_model_parallel_size"] == (2 if "ep2" in label else 1)
    assert mg.extra["megatron"]["args"]["tensor_model_parallel_size"] == (2 if "tp2" in label else 1)
    assert mg.extra["megatron"]["format"] == ("torch_dist" if dist else "torch")
    if dist:  # megatron-core keyed the mixed dense / MoE block per layer, no layer axis
        from ckptbridge.adapters.dcp import read_metadata

        keys = read_metadata(str(next((megatron["work"] / label).glob("iter_*")))).tensors
        assert "decoder.layers.1.mlp.experts.experts.linear_fc1.weight" in keys
        assert "decoder.layers.0.mlp.linear_fc1.weight" in keys and not any(k.startswith("decoder.layers.mlp") for k in keys)
    assert mg.extra["megatron"]["args"]["mtp_num_layers"] == 1
    mtp = sorted(n for n in mg if n.startswith("mtp.layers.0."))
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
            "mtp.layers.0.final_layernorm.weight", "mtp.layers.0.transformer_layer.mlp.router.expert_bias",
            "mtp.layers.0.transformer_layer.self_attention.linear_kv_down_proj.weight"} <= set(mtp)
    back = mg.with_rules(recipes.rules("deepseek_v3", src="megatron", dst="hf", **cfg))
    raw = ckptbridge.open(megatron["dir"])
    copies = sorted(f"model.layers.{SPEC.layers}.{k}" for k in MTP_COPIES)
    assert sorted(back) == sorted(n for n in raw if n not in copies)
    assert sorted(n for n in back if n.startswith(f"model.layers.{SPEC.layers}.")) == \
        sorted(n for n in megatron["mtp"] if n not in copies)
    for name in back:
        assert back[name].read().tobytes() == raw[name].read().tobytes(), name
    with pytest.warns(DroppedTensorsWarning) as caught:  # HF -> megatron: the copies, named on one line
        ckptbridge.open(megatron["dir"], rules=megatron["rules"])
    lines = [str(w.message) for w in caught if issubclass(w.category, DroppedTensorsWarning)]
    assert len(lines) == 1 and all(n in lines[0] for n in copies) and "\n" not in lines[0]


@pytest.mark.heavy
def test_mla_at_tp2_loads_strictly_with_hfs_logits_and_reads_back(megatron):
    """``reshard --to megatron --tp 2`` (2 gloo ranks = TP 2; ETP 2: the experts split too), with and without a
    query LoRA: megatron-core's ``GPTModel`` (the local spec, as ``transformer_impl="local"`` says) loads each
    rank's file strictly with HF's logits. Its local spec builds ``linear_q_down_proj`` / ``linear_kv_down_proj``
    as ``ColumnParallelLinear`` (rows split over TP, output gathered), the up projections and ``linear_q_proj``
    column-parallel by heads, ``linear_proj`` row-parallel, the q/kv norms whole on each rank: the rank files
    hold exactly those boxes of the full tensors. Megatron -> HF bitwise without a query LoRA (the LoRA model:
    ``test_megatron_to_hf_gives_the_same_tensors_back``); a replicated norm that differs on rank 1 is refused."""
    import shutil

    import torch

    work = megatron["work"]
    for label, model in (("mla_tp2", megatron["model"]), ("mla_tp2_noq", hf.build_deepseek(NO_Q_SPEC))):
        rec = megatron["recs"][label]
        assert "error" not in rec and (rec["tp"], rec["pp"], rec["ep"], rec["etp"]) == (2, 1, 1, 2), rec
        dump = megatron["dumps"][label]
        got = hf.logits(model, dump["tokens"])
        assert _err(got, dump["logits"]) < TOL, label  # measured 1.5e-7 (LoRA), 1.2e-7 (no LoRA)
        assert abs(hf.cross_entropy(got, dump["labels"]) - rec["loss"]) <= 1e-5 * rec["loss"], label
    att = "decoder.layers.0.self_attention."
    halves = {"linear_q_down_proj.weight": 0, "linear_q_up_proj.weight": 0, "linear_kv_down_proj.weight": 0,
              "linear_kv_up_proj.weight": 0, "linear_proj.weight": 1}
    whole = ("q_layernorm.weight", "kv_layernorm.weight")
    it = next((work / "mla_tp2").glob("iter_*"))
    with pytest.warns(DroppedTensorsWarning):
        view = ckptbridge.open(megatron["dir"], rules=megatron["rules"])  # the full tensors under megatron names
    for t in range(2):
        sd = torch.load(it / f"mp_rank_0{t}" / "model_optim_rng.pt", weights_only=False)["model"]
        for leaf, dim in halves.items():
            full = view[att + leaf].read()
            n = full.shape[dim] // 2
            want = full[t * n:(t + 1) * n] if dim == 0 else full[:, t * n:(t + 1) * n]
            assert sd[att + leaf].numpy().tobytes() == np.ascontiguousarray(want).tobytes(), (t, leaf)
        for leaf in whole:
            assert sd[att + leaf].numpy().tobytes() == view[att + leaf].read().tobytes(), (t, leaf)
    noq = ckptbridge.open(work / "mla_tp2_noq", check_replicas=True)
    assert noq[att + "linear_q_proj.weight"].shape == (NO_Q_SPEC.heads * (NO_Q_SPEC.qk_nope + NO_Q_SPEC.qk_rope),
                                                        NO_Q_SPEC.emb)
    back = noq.with_rules(recipes.rules("deepseek_v3", src="megatron", dst="hf",
                                        **recipes.config_from_hf(megatron["noq"] / "config.json")))
    raw = ckptbridge.open(megatron["noq"])
    assert sorted(back) == sorted(raw)
    for name in raw:
        assert back[name].read().tobytes() == raw[name].read().tobytes(), name
    bad = work / "mla_tp2_noq_bad"  # negative control: rank 1's kv norm differs
    shutil.copytree(work / "mla_tp2_noq", bad)
    f = next(bad.glob("iter_*")) / "mp_rank_01" / "model_optim_rng.pt"
    ck = torch.load(f, weights_only=False)
    ck["model"][att + "kv_layernorm.weight"] += 1.0
    torch.save(ck, f)
    with pytest.raises(CorruptionError, match=r"kv_layernorm\.weight.*rank 1 differs"):
        ckptbridge.open(bad, check_replicas=True)


@pytest.mark.heavy
def test_hf_to_megatron_at_ep2_with_a_dense_first_layer(megatron):
    """EP 2 (``-o ep=2``; 2 gloo ranks, one EP rank each): MLA, the dense first layer, MoE layers with a shared
    expert and the router bias, the MTP layer's MoE too. Each rank loads its own file strictly with HF's logits;
    the dense layer's MLP is in both files, each MoE layer's experts split 8 + 8 under local ids (local expert K
    of EP rank 1 is global expert 8 + K)."""
    import torch

    rec, dump = megatron["recs"]["mg_ep2"], megatron["dumps"]["mg_ep2"]
    assert "error" not in rec and (rec["tp"], rec["ep"]) == (1, 2), rec  # load_state_dict(strict=True) on each rank
    assert _err(hf.logits(megatron["model"], dump["tokens"]), dump["logits"]) < TOL
    it = next((megatron["work"] / "mg_ep2").glob("iter_*"))
    assert sorted(p.name for p in it.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    view = ckptbridge.open(megatron["dir"], rules=megatron["rules"])  # the HF model under megatron-core's names
    local = SPEC.experts // 2
    for e in range(2):
        sd = torch.load(it / f"mp_rank_00_00{e}" / "model_optim_rng.pt", weights_only=False)["model"]
        assert sd["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * SPEC.mlp, SPEC.emb)  # dense, whole
        for at in ("decoder.layers.1", "decoder.layers.2", "mtp.layers.0.transformer_layer"):
            experts = {int(n.split(".")[-3]) for n in sd if n.startswith(f"{at}.mlp.experts.local_experts.")}
            assert experts == set(range(local)), (at, experts)
            for k in (0, local - 1):
                mine = sd[f"{at}.mlp.experts.local_experts.{k}.linear_fc1.weight"].numpy()
                want = view[f"{at}.mlp.experts.local_experts.{e * local + k}.linear_fc1.weight"].read()
                assert mine.tobytes() == want.tobytes(), (e, at, k)


@pytest.mark.heavy
def test_grouped_recipe_through_reshard_at_ep2_is_the_sequential_model(megatron):
    """The grouped recipe's whole-layer ``experts.weight1/2`` through ``reshard --to megatron -o ep=2`` as legacy
    GroupedMLP files (bf16): megatron-core's ``GPTModel(moe_grouped_gemm=True)`` loads them strictly on each EP
    rank and its logits are the SequentialMLP model's, bitwise; both read back as the same tensors."""
    recs, dumps = megatron["recs"], megatron["dumps"]
    for label in ("grouped_ep2", "sequential_ep2"):
        assert "error" not in recs[label] and recs[label]["ep"] == 2, recs[label]
    assert dumps["grouped_ep2"]["logits"].tobytes() == dumps["sequential_ep2"]["logits"].tobytes()
    assert _err(dumps["grouped_ep2"]["logits"], dumps["mg_ep2"]["logits"]) > 0  # bf16, not the fp32 model
    grouped, sequential = (ckptbridge.open(megatron["work"] / label) for label in ("grouped_ep2", "sequential_ep2"))
    assert grouped.extra["megatron"]["moe"]["grouped_gemm"] and sorted(grouped) == sorted(sequential)
    for name in sequential:
        assert grouped[name].read().tobytes() == sequential[name].read().tobytes(), name


@pytest.mark.heavy
def test_dense_layers_between_moe_layers_at_tp2_ep2_and_pp2(megatron):
    """Qwen3-MoE with dense layers between MoE layers (``moe_layer_freq=[0, 1, 0, 1]``, which megatron-core's
    ``get_gpt_decoder_block_spec`` reads into dense and MoE layer specs) at TP 2 x EP 2 (ETP 1: files
    ``mp_rank_00_000`` / ``mp_rank_01_001``, the dense MLPs split over TP, each MoE layer's experts two per EP
    rank, whole) and at PP 2 (stage 1: global layers 2, 3 as local 0, 1, dense then MoE): megatron-core loads
    each rank's file strictly, its logits (PP 1) are HF's and its loss HF's cross-entropy; back to HF bitwise."""
    import torch

    qwen, work = megatron["qwen"], megatron["work"]
    assert qwen["args"]["moe_layer_freq"] == [0, 1, 0, 1] and qwen["args"]["ffn_hidden_size"] == 96
    orig = ckptbridge.open(qwen["dir"])
    for label, (tp, pp, ep) in {"qwen_tp2ep2": (2, 1, 2), "qwen_pp2": (1, 2, 1)}.items():
        rec, dump = megatron["recs"][label], megatron["dumps"][label]
        assert "error" not in rec and (rec["tp"], rec["pp"], rec["ep"]) == (tp, pp, ep), rec  # strict, every rank
        got = hf.logits(qwen["model"], dump["tokens"])
        if pp == 1:
            assert _err(got, dump["logits"]) < TOL, label
        loss = hf.cross_entropy(got, dump["labels"])
        assert abs(loss - rec["loss"]) <= 1e-5 * loss, (label, loss, rec["loss"])
        back = ckptbridge.open(work / label, rules=recipes.rules("qwen3_moe", src="megatron", dst="hf",
                                                                 **recipes.config_from_hf(qwen["dir"] / "config.json")))
        assert sorted(back) == sorted(orig)
        for key in orig:
            assert back[key].read().tobytes() == orig[key].read().tobytes(), (label, key)
    it = next((work / "qwen_tp2ep2").glob("iter_*"))
    assert sorted(p.name for p in it.iterdir()) == ["mp_rank_00_000", "mp_rank_01_001"]
    for t in range(2):
        sd = torch.load(it / f"mp_rank_0{t}_00{t}" / "model_optim_rng.pt", weights_only=False)["model"]
        for layer in (0, 2):  # dense: [gate_t; up_t] rows of TP rank t, no router
            assert sd[f"decoder.layers.{layer}.mlp.linear_fc1.weight"].shape == (96, QWEN_SPEC.emb)
            assert f"decoder.layers.{layer}.mlp.router.weight" not in sd
        for layer in (1, 3):  # MoE: experts 2t, 2t + 1 whole (ETP 1) as local 0, 1
            assert {n.split(".")[6] for n in sd if n.startswith(f"decoder.layers.{layer}.mlp.experts.local_experts.")} \
                == {"0", "1"}
            assert sd[f"decoder.layers.{layer}.mlp.experts.local_experts.1.linear_fc1.weight"].shape == \
                (96, QWEN_SPEC.emb)
    stage1 = torch.load(next((work / "qwen_pp2").glob("iter_*")) / "mp_rank_00_001" / "model_optim_rng.pt",
                        weights_only=False)["model"]
    assert "decoder.layers.0.mlp.linear_fc1.weight" in stage1 and "decoder.layers.1.mlp.router.weight" in stage1


@pytest.mark.heavy
def test_grouped_gemm_names_fill_megatron_cores_grouped_mlp(megatron):
    """GroupedMLP (bf16) through the grouped recipe == SequentialMLP (bf16) through the sequential one, bitwise;
    the grouped names back to HF bitwise."""
    import subprocess

    work, d = megatron["work"], megatron["dir"]
    cfg = recipes.config_from_hf(d / "config.json")
    args = {**json.loads((work / "args.json").read_text()), "bf16": True, "params_dtype": "torch.bfloat16"}
    grouped = recipes.rules("deepseek_v3", src="hf", dst="megatron", **cfg, megatron_experts="grouped")
    argv = []
    for label, a, rules in (("grouped", {**args, "moe_grouped_gemm": True}, grouped),
                            ("sequential", args, megatron["rules"])):
        (work / f"{label}.args.json").write_text(json.dumps(a))
        (work / f"{label}.rules.json").write_text(json.dumps(ckptbridge.rules_to_json(rules)))
        argv.append(f"{work / f'{label}.args.json'},{work / f'{label}.rules.json'}={work / f'{label}.npy'}")
    np.save(work / "grouped_tokens.npy", hf.tokens(2, SEQ, SPEC.vocab, seed=5))
    out = subprocess.run([sys.executable, CORE_MODULE, "--source", str(d), "--tokens", str(work / "grouped_tokens.npy"),
                          *argv], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    recs = [json.loads(line[len("CORE_MODULE "):]) for line in out.stdout.splitlines() if line.startswith("CORE_MODULE ")]
    assert out.returncode == 0 and len(recs) == 2, out.stdout[-3000:] + out.stderr[-5000:]
    assert [(r.get("error"), r["unplaced"], r["experts"]) for r in recs] == [
        (None, [], "GroupedMLP"), (None, [], "SequentialMLP")], recs
    assert np.load(work / "grouped.npy").tobytes() == np.load(work / "sequential.npy").tobytes()
    with pytest.warns(DroppedTensorsWarning):  # the MTP layer's embedding and output copies
        mg = ckptbridge.open(d, rules=grouped)
    assert {f"{at}.mlp.experts.weight{k}" for at in ("decoder.layers.1", "mtp.layers.0.transformer_layer")
            for k in (1, 2)} <= set(mg) and not [n for n in mg if "local_experts" in n]
    assert mg["decoder.layers.1.mlp.experts.weight1"].shape == (SPEC.emb, SPEC.experts * 2 * SPEC.moe_mlp)
    back = mg.with_rules(recipes.rules("deepseek_v3", src="megatron", dst="hf", **cfg, megatron_experts="grouped"))
    raw = ckptbridge.open(d)
    assert sorted(back) == sorted(n for n in raw if not n.endswith(("embed_tokens.weight", "shared_head.head.weight"))
                                  or not n.startswith(f"model.layers.{SPEC.layers}."))
    for name in back:
        assert back[name].read().tobytes() == raw[name].read().tobytes(), name
