"""The ``qwen3`` and ``qwen3_moe`` recipes between Hugging Face and megatron-core, proven with both
libraries' model code.

Tiny random ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` (GQA 4/2, head_dim 24 != 64 / 4, MoE: 4
experts of width 48, top 2, normalised top-k weights) go to Megatron with the CLI
(``reshard --to megatron --rules R.json -o args=ARGS.json``, args from ``recipes.megatron_args``
over the Megatron fixture run's: ``qk_layernorm``, ``num_experts``, ``moe_*``) at TP 1 and TP 2, and
the MoE model at expert parallelism 2 (``-o ep=2``: ``mp_rank_00_000`` / ``mp_rank_00_001``, each
EP rank's two experts as ``local_experts.0/1``).
``tools/megatron/core_loss.py`` (2 gloo ranks) builds megatron-core's own ``GPTModel`` (local spec,
``q_layernorm`` / ``k_layernorm``, ``MoELayer`` with a ``TopKRouter`` and ``SequentialMLP``
experts), loads each rank's file with ``load_state_dict(strict=True)`` and dumps its logits: they
equal HF's (1e-4) and its loss is HF's cross-entropy. Back through the inverse recipe (Megatron ->
HF) every tensor is the HF original, bitwise, and with ``recipes.hf_config(args, family=...)`` as its
config.json transformers loads it with the original's logits.

Grouped GEMM (``megatron_experts="grouped"``): the Qwen3-MoE model through the recipe with megatron-core's
legacy ``GroupedMLP`` names (``mlp.experts.weight1`` / ``weight2``) fills a ``GPTModel`` built with
``moe_grouped_gemm=True`` (``tools/megatron/core_module.py``: every tensor of its ``state_dict`` filled,
nothing left over; cpu_shim's pure-torch grouped GEMM). megatron-core runs GroupedMLP in bf16 only: its
logits are bitwise those of the same model built with ``SequentialMLP`` experts and filled by the
sequential recipe, whose fp32 logits are HF's (1e-4). A weight1 laid out as ``[E, X, 2F]`` (experts
stacked on the columns, not megatron-core's ``view(X, E, 2F)``) loads as strictly and moves the logits
far (negative control).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from _common import core_loss

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_models as hf

import ckptbridge
from ckptbridge import Reshape, Unstack, recipes

pytestmark = pytest.mark.heavy

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TEMPLATE = os.path.join(HERE, "fixtures", "megatron", "A", "tp1pp1", "torch")  # a real run's args
TOL = 1e-4
SHAPE = {"heads": 4, "kv_heads": 2, "head_dim": 24}
MODELS = {
    "qwen3": hf.HFSpec("qwen3", mlp=96, **SHAPE),
    "qwen3_moe": hf.HFSpec("qwen3_moe", mlp=48, experts=4, experts_per_tok=2, **SHAPE),
}
CASES = {"qwen3_tp1": ("qwen3", 1, 1), "qwen3_moe_tp1": ("qwen3_moe", 1, 1), "qwen3_moe_tp2": ("qwen3_moe", 2, 1),
         "qwen3_moe_ep2": ("qwen3_moe", 1, 2)}  # label: (model, TP, EP)
CORE_MODULE = os.path.join(ROOT, "tools", "megatron", "core_module.py")
BF16 = {"bf16": True, "params_dtype": "torch.bfloat16"}


def _cli(*argv: str) -> None:
    from ckptbridge._cli import main

    assert main(list(argv)) == 0, argv


def _rules(cfg_file, src: str, dst: str) -> tuple:
    return recipes.rules(recipes.family_from_hf(cfg_file), src=src, dst=dst, **recipes.config_from_hf(cfg_file))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("recipes_qwen3_megatron")
    template = ckptbridge.open(TEMPLATE).extra["megatron"]["args"]
    models, dirs = {}, {}
    for name, spec in MODELS.items():
        models[name] = hf.build(spec)
        dirs[name] = hf.save(models[name], work / f"hf_{name}")
        cfg = dirs[name] / "config.json"
        (work / f"args_{name}.json").write_text(json.dumps(recipes.megatron_args(cfg, template=template)))
        (work / f"rules_{name}.json").write_text(json.dumps(ckptbridge.rules_to_json(_rules(cfg, "hf", "megatron"))))
    for label, (name, tp, ep) in CASES.items():
        _cli("reshard", str(dirs[name]), str(work / label), "--to", "megatron", "--tp", str(tp), "--pp", "1",
             "--rules", str(work / f"rules_{name}.json"), "-o", f"args={work / f'args_{name}.json'}",
             *(["-o", f"ep={ep}"] if ep > 1 else []))
    recs = core_loss([str(work / label) for label in CASES], "--dump", str(work / "dump"))
    return {"work": work, "models": models, "dirs": dirs, "recs": dict(zip(CASES, recs)),
            "dumps": {label: np.load(r["dump"]) for label, r in zip(CASES, recs)}}


@pytest.mark.parametrize("label", list(CASES))
def test_hf_to_megatron_loads_strictly_in_megatron_core_with_hfs_logits(run, label):
    rec, dump = run["recs"][label], run["dumps"][label]
    name, tp, ep = CASES[label]
    assert "error" not in rec, rec
    assert rec["tp"] == tp and rec["pp"] == 1 and rec["ep"] == ep
    args = json.loads((run["work"] / f"args_{name}.json").read_text())
    assert args["qk_layernorm"] is True and args.get("num_experts") == (4 if name == "qwen3_moe" else None)
    got = hf.logits(run["models"][name], dump["tokens"])
    assert float(np.abs(got.astype(np.float64) - dump["logits"]).max()) < TOL
    loss = hf.cross_entropy(got, dump["labels"])
    assert abs(loss - rec["loss"]) <= 1e-5 * loss, (loss, rec["loss"])


@pytest.mark.parametrize("label", list(CASES))
def test_megatron_to_hf_gives_the_same_tensors_back(run, label):
    """Bitwise, and as an HF directory whose config.json is ``recipes.hf_config`` of the Megatron run's
    args: transformers loads every key and gives the original's logits."""
    import transformers

    name, _tp, _ep = CASES[label]
    cfg = run["dirs"][name] / "config.json"
    back = ckptbridge.open(run["work"] / label, rules=_rules(cfg, "megatron", "hf"))
    orig = ckptbridge.open(run["dirs"][name])
    assert sorted(back) == sorted(orig)
    for key in orig:
        assert back[key].read().tobytes() == orig[key].read().tobytes(), key
    out = run["work"] / f"back-{label}"
    out.mkdir()
    ckptbridge.export(back, out / "model.safetensors")
    mg = back.extra["megatron"]
    (out / "config.json").write_text(json.dumps(recipes.hf_config(mg["args"], mg["vocab_size"], family=name)))
    assert recipes.config_from_hf(out / "config.json") == recipes.config_from_hf(cfg)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    tokens = run["dumps"][label]["tokens"]
    got, want = hf.logits(model.eval(), tokens), hf.logits(run["models"][name], tokens)
    assert float(np.abs(got.astype(np.float64) - want).max()) < TOL


# ------------------------------------------------------------------ grouped GEMM (legacy GroupedMLP)


def _experts_on_columns(rules: tuple) -> tuple:
    """The megatron -> HF grouped rules with weight1 read as ``[E, X, 2F]`` (a plausible wrong layout)."""
    out = []
    for r in rules:
        if isinstance(r, Reshape):  # view(X, E, 2F) -> split the columns into (X, 2F) instead
            x, _e, f2 = r.shape
            r = Reshape(r.pattern, (-1, x, f2), r.from_shape)
        elif isinstance(r, Unstack) and "weight1" in r.pattern:
            r = dataclasses.replace(r, dim=1)
        out.append(r)
    return tuple(out)


@pytest.fixture(scope="module")
def grouped(run):
    """core_module.py: GroupedMLP (bf16) through the grouped recipe, SequentialMLP (bf16 and fp32) through the
    sequential one, GroupedMLP with the wrong weight1 layout; one process."""
    work, d = run["work"], run["dirs"]["qwen3_moe"]
    cfg = recipes.config_from_hf(d / "config.json")
    args = json.loads((work / "args_qwen3_moe.json").read_text())
    np.save(work / "grouped_tokens.npy", hf.tokens(2, 12, MODELS["qwen3_moe"].vocab, seed=3))
    to_hf = recipes.rules("qwen3_moe", src="megatron", dst="hf", **cfg, megatron_experts="grouped")
    items = {  # label -> (args, rules HF -> megatron)
        "grouped": ({**args, **BF16, "moe_grouped_gemm": True}, ckptbridge.invert(to_hf)),
        "sequential": ({**args, **BF16}, recipes.rules("qwen3_moe", src="hf", dst="megatron", **cfg)),
        "sequential_fp32": (args, recipes.rules("qwen3_moe", src="hf", dst="megatron", **cfg)),
        "wrong_layout": ({**args, **BF16, "moe_grouped_gemm": True}, ckptbridge.invert(_experts_on_columns(to_hf))),
    }
    argv = []
    for label, (a, rules) in items.items():
        (work / f"{label}.args.json").write_text(json.dumps(a))
        (work / f"{label}.rules.json").write_text(json.dumps(ckptbridge.rules_to_json(rules)))
        argv.append(f"{work / f'{label}.args.json'},{work / f'{label}.rules.json'}={work / f'{label}.logits.npy'}")
    out = subprocess.run([sys.executable, CORE_MODULE, "--source", str(d), "--tokens", str(work / "grouped_tokens.npy"),
                          *argv], capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    recs = [json.loads(line[len("CORE_MODULE "):]) for line in out.stdout.splitlines() if line.startswith("CORE_MODULE ")]
    assert out.returncode == 0 and len(recs) == len(items), out.stdout[-3000:] + out.stderr[-5000:]
    vocab = MODELS["qwen3_moe"].vocab
    return {"recs": dict(zip(items, recs)), "tokens": np.load(work / "grouped_tokens.npy"),
            "logits": {k: np.load(work / f"{k}.logits.npy")[..., :vocab].astype(np.float64) for k in items}}


def test_grouped_gemm_names_load_strictly_in_megatron_cores_grouped_mlp(run, grouped):
    """Measured: grouped == sequential bitwise (bf16); sequential fp32 2.4e-7 from HF; wrong layout 6.4e-2 off."""
    recs, lg = grouped["recs"], grouped["logits"]
    for label, experts in (("grouped", "GroupedMLP"), ("sequential", "SequentialMLP"),
                           ("sequential_fp32", "SequentialMLP"), ("wrong_layout", "GroupedMLP")):
        assert "error" not in recs[label] and recs[label]["unplaced"] == [] and recs[label]["experts"] == experts, recs
    assert lg["grouped"].tobytes() == lg["sequential"].tobytes()  # the same model, megatron-core's two experts modules
    ref = hf.logits(run["models"]["qwen3_moe"], grouped["tokens"])
    assert float(np.abs(lg["sequential_fp32"] - ref).max()) < TOL
    assert float(np.abs(lg["wrong_layout"] - lg["grouped"]).max()) > 100 * TOL


def test_grouped_gemm_names_back_to_hf_bitwise(run):
    d = run["dirs"]["qwen3_moe"]
    cfg = {**recipes.config_from_hf(d / "config.json"), "megatron_experts": "grouped"}
    mg = ckptbridge.open(d, rules=recipes.rules("qwen3_moe", src="hf", dst="megatron", **cfg))
    spec = MODELS["qwen3_moe"]
    assert mg["decoder.layers.1.mlp.experts.weight1"].shape == (spec.emb, spec.experts * 2 * spec.mlp)
    assert mg["decoder.layers.1.mlp.experts.weight2"].shape == (spec.experts * spec.mlp, spec.emb)
    assert not [n for n in mg if "local_experts" in n]
    back = mg.with_rules(recipes.rules("qwen3_moe", src="megatron", dst="hf", **cfg))
    raw = ckptbridge.open(d)
    assert sorted(back) == sorted(raw)
    for name in raw:
        assert back[name].read().tobytes() == raw[name].read().tobytes(), name
