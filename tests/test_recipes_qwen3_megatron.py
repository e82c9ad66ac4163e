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
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_models as hf

import ckptbridge
from ckptbridge import recipes

pytestmark = pytest.mark.heavy

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TEMPLATE = os.path.join(HERE, "fixtures", "megatron", "A", "tp1pp1", "torch")  # a real run's args
CORE_LOSS = os.path.join(ROOT, "tools", "megatron", "core_loss.py")
TOL = 1e-4
SHAPE = {"heads": 4, "kv_heads": 2, "head_dim": 24}
MODELS = {
    "qwen3": hf.HFSpec("qwen3", mlp=96, **SHAPE),
    "qwen3_moe": hf.HFSpec("qwen3_moe", mlp=48, experts=4, experts_per_tok=2, **SHAPE),
}
CASES = {"qwen3_tp1": ("qwen3", 1, 1), "qwen3_moe_tp1": ("qwen3_moe", 1, 1), "qwen3_moe_tp2": ("qwen3_moe", 2, 1),
         "qwen3_moe_ep2": ("qwen3_moe", 1, 2)}  # label: (model, TP, EP)


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
    out = subprocess.run([sys.executable, CORE_LOSS, "--world", "2", "--dump", str(work / "dump"),
                          *(str(work / label) for label in CASES)], capture_output=True, text=True, cwd=ROOT,
                         timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    recs = [json.loads(line[len("CORE_LOSS "):]) for line in out.stdout.splitlines() if line.startswith("CORE_LOSS ")]
    assert out.returncode == 0 and len(recs) == len(CASES), out.stdout[-3000:] + out.stderr[-5000:]
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
