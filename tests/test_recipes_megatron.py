"""The shipped recipes between megatron-core, Hugging Face and MaxText, proven with each one's model code.

The Megatron family A fixtures are a real (Megatron-LM) llama-like run: 4 layers, hidden 64,
4 heads in 2 query groups (GQA), SwiGLU ffn 128, RMSNorm, RoPE, untied, vocab 251 padded to 256,
torch Adam state after 5 iterations. ``tools/megatron/core_loss.py`` builds megatron-core's own
``GPTModel`` from a checkpoint's args and reports its per-token losses and logits (``--dump``).

(a) Megatron -> HF: ``ckptbridge.open(A, rules=recipes.rules("llama", src="megatron", dst="hf", ...))``
    resharded as safetensors with ``recipes.hf_config(args, vocab_size)``: ``LlamaForCausalLM.
    from_pretrained`` finds every key, and its logits are megatron-core's on the same tokens (over
    the 251 real vocabulary entries; Megatron's loss also counts its 5 padding rows). Splitting the
    fused QKV without its query groups (negative control) misses by far.
(b) Megatron -> MaxText through the composed recipe (+ ``Pad`` to MaxText's 256-entry vocabulary):
    weights and optax ``mu``/``nu``/``count`` from Megatron's Adam state, loaded onto MaxText's boxed
    tree on its mesh; MaxText's logits are megatron-core's; every leaf is MaxText's own converter
    applied to the HF export of (a) (moments too, with the query's moments scaled by ``1/c`` and
    ``1/c**2`` where the converter, made for weights, multiplies them by ``c``).
(c) HF -> Megatron with the CLI (``reshard --to megatron --rules R.json -o args=ARGS.json``, args from
    ``recipes.megatron_args(config.json, template=A's args)``), at TP 1 and TP 2, Llama and Qwen2
    (QKV biases): megatron-core loads it strictly and its loss and logits are HF's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import numpy as np
import pytest
from _common import core_loss

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_models as hf
import maxtext_client as mx

import ckptbridge
from ckptbridge import Pad, Split, recipes

pytestmark = pytest.mark.heavy

HERE = os.path.dirname(os.path.abspath(__file__))
A = os.path.join(HERE, "fixtures", "megatron", "A")
SOURCE = os.path.join(A, "tp2pp2", "torch")  # TP/PP shards and the Adam state, merged by the reader
REFERENCE = os.path.join(A, "tp1pp1", "torch")  # Megatron's own reshard of the same run: megatron-core's logits
CFG = {"n_heads": 4, "n_kv_heads": 2, "head_dim": 16}
VOCAB, PADDED = 251, 256
TOL = 1e-4
HF_TO_MEGATRON = {  # label -> (HF model, tp)
    "llama_tp1": (hf.HFSpec("llama", layers=2, head_dim=16), 1),
    "llama_tp2": (hf.HFSpec("llama", layers=2, head_dim=16), 2),
    "qwen2_tp1": (hf.HFSpec("qwen2", layers=2, head_dim=16), 1),
}


def _cli(*argv: str) -> None:
    from ckptbridge._cli import main

    assert main(list(argv)) == 0, argv


def _core_loss(items: list[str], dump) -> list[dict]:
    recs = core_loss(items, "--dump", str(dump))
    for rec in recs:
        assert "error" not in rec, rec
    return recs


def _to_hf(src, rules, config: dict, out, state: str | None = None):
    """``src`` through ``rules`` as an HF directory (one state as model.safetensors + config.json)."""
    out.mkdir(parents=True, exist_ok=True)
    ckptbridge.export(ckptbridge.open(src, rules=rules), out / "model.safetensors", state=state)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("recipes_megatron")
    src = ckptbridge.open(SOURCE)
    args = src.extra["megatron"]["args"]
    assert src.extra["megatron"]["vocab_size"] == VOCAB
    config = {**recipes.hf_config(args, vocab_size=VOCAB), "dtype": "float32"}
    to_hf = recipes.rules("llama", src="megatron", dst="hf", **CFG)
    # (a) the HF export of the weights, and of each Adam moment (for MaxText's converter below)
    hf_dir = _to_hf(SOURCE, to_hf, config, work / "hf")
    for state in ("exp_avg", "exp_avg_sq"):
        _to_hf(SOURCE, to_hf, config, work / state, state)
    ungrouped = tuple(dataclasses.replace(r, widths=(64, 32, 32), groups=1) if isinstance(r, Split)
                      and "linear_qkv" in r.pattern else r for r in to_hf)
    _to_hf(SOURCE, ungrouped, config, work / "hf_ungrouped")
    # (c) HF -> Megatron with the CLI, args from the HF config over A's args
    hf_models = {}
    for label, (spec, tp) in HF_TO_MEGATRON.items():
        name = spec.family
        if name not in hf_models:
            model = hf.build(spec)
            d = hf.save(model, work / f"hf_{name}")
            cfg_file = d / "config.json"
            (work / f"args_{name}.json").write_text(json.dumps(recipes.megatron_args(cfg_file, template=args)))
            rules = recipes.rules(recipes.family_from_hf(cfg_file), src="hf", dst="megatron",
                                  **recipes.config_from_hf(cfg_file))
            (work / f"rules_{name}.json").write_text(json.dumps(ckptbridge.rules_to_json(rules)))
            hf_models[name] = (model, d)
        _cli("reshard", str(hf_models[name][1]), str(work / label), "--to", "megatron", "--tp", str(tp),
             "--pp", "1", "--rules", str(work / f"rules_{name}.json"), "-o", f"args={work / f'args_{name}.json'}")
    items = [REFERENCE, *(str(work / label) for label in HF_TO_MEGATRON)]
    recs = dict(zip(["reference", *HF_TO_MEGATRON], _core_loss(items, work / "dump")))
    dumps = {k: np.load(r["dump"]) for k, r in recs.items()}
    # (b) Megatron -> MaxText (vocabulary re-padded to 256), and MaxText's converter on (a)'s export
    tokens = dumps["reference"]["tokens"]
    np.save(work / "tokens.npy", tokens.astype(np.int32))
    spec = mx.spec_from_hf(config, scan=True, batch=tokens.shape[0], seq=tokens.shape[1])
    pad = (Pad(r"^token_embedder/embedding$", 0, VOCAB, PADDED), Pad(r"^decoder/logits_dense/kernel$", 1, VOCAB, PADDED))
    to_maxtext = recipes.rules("llama", src="megatron", dst="maxtext", scan=True, **CFG) + pad
    jobs = [mx.load_job({**spec, "vocab": PADDED}, SOURCE, to_maxtext, opt=True, dump=work / "mt.safetensors",
                        tokens=work / "tokens.npy", logits=work / "mt.logits.npy", report=work / "mt.json")]
    for kind in ("hf", "exp_avg", "exp_avg_sq"):
        jobs.append(mx.convert_job(spec, work / kind, work / f"conv_{kind}.safetensors"))
    mx.run_jobs(jobs)
    return {"work": work, "recs": recs, "dumps": dumps, "hf": hf_models, "args": args, "config": config,
            "hf_dir": hf_dir, "src": src}


def _err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def _hf_logits(model_or_dir, tokens):
    import transformers

    model = model_or_dir
    if not hasattr(model, "forward"):
        model, info = transformers.AutoModelForCausalLM.from_pretrained(str(model_or_dir), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        model.eval()
    return hf.logits(model, tokens)


# ------------------------------------------------------------------ (a) Megatron -> HF


def test_megatron_to_hf_logits_equal_megatron_core(run):
    import transformers

    ref = run["dumps"]["reference"]
    assert ref["logits"].shape == (4, 32, PADDED)
    got = _hf_logits(run["hf_dir"], ref["tokens"])
    assert got.shape == (4, 32, VOCAB)
    assert _err(got, ref["logits"][..., :VOCAB]) < TOL
    cfg = transformers.AutoConfig.from_pretrained(str(run["hf_dir"]))
    assert cfg.model_type == "llama" and cfg.num_key_value_heads == 2 and not cfg.tie_word_embeddings


def test_qkv_split_without_groups_misses(run):
    ref = run["dumps"]["reference"]
    got = _hf_logits(run["work"] / "hf_ungrouped", ref["tokens"])
    assert _err(got, ref["logits"][..., :VOCAB]) > 100 * TOL


# ------------------------------------------------------------------ (b) Megatron -> MaxText


def test_megatron_to_maxtext_logits_equal_megatron_core(run):
    report = json.loads((run["work"] / "mt.json").read_text())
    assert report["not_boxed"] == [] and report["not_maxtext_sharding"] == [] and report["count"] == 5
    got = np.load(run["work"] / "mt.logits.npy")
    ref = run["dumps"]["reference"]["logits"]
    assert got.shape == (4, 32, PADDED)
    assert _err(got[..., :VOCAB], ref[..., :VOCAB]) < TOL
    assert not got[..., VOCAB:].any()  # the re-padded rows are zeros


def test_megatron_to_maxtext_weights_and_moments_are_maxtexts_own_conversion(run):
    """Each leaf and its optax mu / nu: MaxText's converter on the HF export of (a) (the moments'
    query kernels divided by c**2 and c**3: the converter scales any tensor it is given by c, a
    moment needs 1/c and 1/c**2); count is Megatron's iteration."""
    work = run["work"]
    mine = mx.read_params(work / "mt.safetensors")
    assert int(np.asarray(mine["count"]).reshape(())) == run["src"].step == 5
    c = np.float64(1 / math.sqrt(CFG["head_dim"]))
    for kind, prefix, power in (("hf", "", 1), ("exp_avg", "mu/", -1), ("exp_avg_sq", "nu/", -2)):
        theirs = mx.read_params(work / f"conv_{kind}.safetensors")
        for name, value in theirs.items():
            got = mine[prefix + name]
            if name in ("token_embedder/embedding", "decoder/logits_dense/kernel"):
                axis = 0 if name.startswith("token") else 1
                assert not np.take(got, range(VOCAB, PADDED), axis=axis).any()
                got = np.take(got, range(VOCAB), axis=axis)
            if name.endswith("query/kernel") and power != 1:
                want = value.astype(np.float64) * c ** (power - 1)  # the converter multiplied by c
                assert np.allclose(got, want, rtol=1e-6, atol=0), (kind, name)
            else:
                assert got.tobytes() == value.tobytes(), (kind, name)


# ------------------------------------------------------------------ (c) HF -> Megatron


@pytest.mark.parametrize("label", list(HF_TO_MEGATRON))
def test_hf_to_megatron_loads_in_megatron_core_with_hfs_loss(run, label):
    rec, dump = run["recs"][label], run["dumps"][label]
    spec, tp = HF_TO_MEGATRON[label]
    assert rec["tp"] == tp and rec["pp"] == 1
    model = run["hf"][spec.family][0]
    got = hf.logits(model, dump["tokens"])
    assert _err(got, dump["logits"]) < TOL  # vocab 256: no Megatron padding for TP 1 or 2
    loss = hf.cross_entropy(got, dump["labels"])
    assert abs(loss - rec["loss"]) <= 1e-5 * loss, (loss, rec["loss"])
    per_token = -np.take_along_axis(_log_softmax(got), dump["labels"][..., None], -1).reshape(-1)
    assert np.allclose(per_token, dump["token_losses"], rtol=1e-4, atol=1e-5)


def _log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))
