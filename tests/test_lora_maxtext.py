"""LoRA adapters carried alone between HF PEFT and MaxText 0.2.5 through the Llama recipe.

Oracles, all outside ckptbridge: PEFT 0.21 (its ``save_pretrained`` adapters, its adapter-on
logits, ``merge_and_unload``), and MaxText 0.2.5's own code run in ``.maxtext/venv``
(``tools/maxtext/lora.py``): its HF->MaxText converter, its adapter tree
(``lora_utils.get_lora_abstract_state_nnx``), its merge (``apply_lora_on_base_params_nnx``, as
``MaxEngine.apply_adapter``) and its decoder's forward. The model is a tiny Llama-3 (rotary
interleave and query scale both apply) on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import ckptbridge
from ckptbridge import recipes
from ckptbridge.adapters import lora as carry
from ckptbridge.rules import Scale

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
import hf_models as hf  # noqa: E402
import maxtext_client as mx  # noqa: E402
from lora_refs import adam_step, with_moments  # noqa: E402

LORA_TOOL = mx.ROOT / "tools" / "maxtext" / "lora.py"
SPEC = hf.HFSpec("llama", rope="llama3")
QWEN3 = hf.HFSpec("qwen3")
ATTN = ["q_proj", "k_proj", "v_proj"]  # what MaxText 0.2.5's adapter tree holds
ALL = [*ATTN, "o_proj", "gate_proj", "up_proj", "down_proj"]
BATCH, SEQ = 2, 16
BETAS = (0.9, 0.999)


def _adapter(root: Path, name: str, seed: int, targets: list[str], spec: hf.HFSpec = SPEC, **kw) -> Path:
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **kw)
    peft.get_peft_model(hf.build(spec), cfg).save_pretrained(root / name)
    return root / name


def _model(base: Path):
    return __import__("transformers").AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


def _peft_logits(base: Path, adapter: Path, tokens: np.ndarray) -> np.ndarray:
    return hf.logits(peft.PeftModel.from_pretrained(_model(base), adapter).eval(), tokens)


def _rules(cfg: dict, src: str, dst: str, scan: bool) -> tuple:
    family = recipes.family_from_hf(cfg)
    return recipes.rules(family, src=src, dst=dst, **{**recipes.config_from_hf(cfg), "scan": scan})


def _forward_job(spec: dict, root: Path, label: str, params: str, mx_cfg: dict) -> dict:
    """MaxText's merge of ``<label>.safetensors`` onto ``params`` and its forward (``lora.py``)."""
    return {"cmd": "lora-forward", "spec": spec, "params": str(root / params), "lora": str(root / f"{label}.safetensors"),
            "adapter_config": mx_cfg, "tokens": str(root / "tokens.npy"), "out": str(root / f"{label}.logits.npy"),
            "report": str(root / f"{label}.json")}


def _qwen3(root: Path, tokens: np.ndarray) -> tuple[dict, list[dict]]:
    """The second family: a tiny Qwen3 (q/k norms, query scaled at run time), its attention adapter
    carried to MaxText, and the jobs that merge and run it there."""
    base = hf.save(hf.build(QWEN3), root / "qwen3")
    cfg = json.loads((base / "config.json").read_text())
    attn = _adapter(root, "qwen3_attn", 23, ATTN, spec=QWEN3, use_rslora=True)
    lora = carry.carry(ckptbridge.open(attn), _rules(cfg, "hf", "maxtext", scan=False))
    _write(lora, root / "qwen3_attn.safetensors")
    mx_cfg = {"r": 4, "lora_alpha": lora.extra["lora"]["lora_alpha"], "target_modules": ATTN}
    spec = mx.spec_from_hf(cfg, scan=False, batch=BATCH, seq=SEQ)
    jobs = [mx.convert_job(spec, base, root / "qwen3_mt.safetensors"),
            _forward_job(spec, root, "qwen3_attn", "qwen3_mt.safetensors", mx_cfg)]
    return {"base": base, "attn": attn, "want": _peft_logits(base, attn, tokens)}, jobs


def _write(lora: ckptbridge.Checkpoint, path: Path) -> Path:
    ckptbridge.reshard(lora, path, to="safetensors")
    return path


def _adam_step(base: Path, adapter: Path, batch: np.ndarray, root: Path) -> None:
    """One torch Adam step on PEFT's adapter; its moments saved under the adapter's tensor names."""
    adam_step(peft.PeftModel.from_pretrained(_model(base), adapter, is_trainable=True), batch, root, BETAS)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora_mx")
    base = hf.save(hf.build(SPEC), root / "base")
    cfg = json.loads((base / "config.json").read_text())
    attn = _adapter(root, "attn", 21, ATTN, use_rslora=True)  # rsLoRA: its scale folds into B
    full = _adapter(root, "full", 22, ALL)
    hf.save(peft.PeftModel.from_pretrained(_model(base), full).merge_and_unload(), root / "merged")
    tokens = hf.tokens(BATCH, SEQ, cfg["vocab_size"], seed=3)
    np.save(root / "tokens.npy", tokens)
    np.save(root / "train.npy", hf.tokens(BATCH, SEQ + 1, cfg["vocab_size"], seed=4))
    _adam_step(base, attn, np.load(root / "train.npy"), root)

    to_mx = _rules(cfg, "hf", "maxtext", scan=False)
    lora = carry.carry(ckptbridge.open(attn), to_mx)
    no_scale = tuple(r for r in to_mx if not isinstance(r, Scale))  # negative control: B without its scale
    _write(lora, root / "attn.safetensors")
    _write(carry.carry(ckptbridge.open(attn), no_scale), root / "attn_noscale.safetensors")
    _write(carry.carry(ckptbridge.open(full), to_mx), root / "full.safetensors")
    _write(carry.carry(ckptbridge.open(full), _rules(cfg, "hf", "maxtext", scan=True)), root / "full_scan.safetensors")
    megatron = carry.carry(ckptbridge.open(attn), _rules(cfg, "hf", "megatron", scan=False))  # q/k/v fused, rank 12
    via = carry.carry(megatron, _rules(cfg, "megatron", "maxtext", scan=False))
    _write(via, root / "via_megatron.safetensors")

    adapter_cfg = json.loads((attn / "adapter_config.json").read_text())
    mx_cfg = {"r": lora.extra["lora"]["r"], "lora_alpha": lora.extra["lora"]["lora_alpha"],
              "target_modules": sorted(adapter_cfg["target_modules"])}
    spec = mx.spec_from_hf(cfg, scan=False, batch=BATCH, seq=SEQ)
    spec_scan = mx.spec_from_hf(cfg, scan=True, batch=BATCH, seq=SEQ)
    jobs = [mx.convert_job(spec, base, root / "base_mt.safetensors"),
            mx.convert_job(spec, root / "merged", root / "merged_mt.safetensors")]
    jobs += [_forward_job(spec, root, label, "base_mt.safetensors", mx_cfg) for label in ("attn", "attn_noscale")]
    jobs.append(_forward_job(spec, root, "via_megatron", "base_mt.safetensors",
                             {**mx_cfg, "r": via.extra["lora"]["r"], "lora_alpha": via.extra["lora"]["lora_alpha"]}))
    jobs.append({"cmd": "lora-grad", "spec": spec, "params": str(root / "base_mt.safetensors"),
                 "lora": str(root / "attn.safetensors"), "adapter_config": mx_cfg,
                 "tokens": str(root / "train.npy"), "out": str(root / "attn.grad.safetensors")})
    jobs.append({"cmd": "lora-tree", "spec": spec_scan, "adapter_config": {**mx_cfg, "target_modules": ALL},
                 "report": str(root / "tree_scan.json")})
    qwen3, more = _qwen3(root, tokens)
    mx.run_jobs(jobs + more, script=LORA_TOOL)  # one MaxText process (its import is most of the time)
    return {"root": root, "base": base, "cfg": cfg, "attn": attn, "full": full, "tokens": tokens, "mx_cfg": mx_cfg,
            "qwen3": qwen3, "megatron": megatron}


def test_peft_adapter_in_maxtext_gives_peft_logits_and_merges_like_maxtexts_converter(made: dict) -> None:
    root = made["root"]
    # the carried leaves are MaxText's own adapter tree (names, shapes); MaxText's merge of them
    # and its forward give PEFT's adapter-on logits
    report = json.loads((root / "attn.json").read_text())
    assert report["given"] == report["lora_tree"] and len(report["given"]) == 2 * len(ATTN) * SPEC.layers
    want = _peft_logits(made["base"], made["attn"], made["tokens"])
    got = np.load(root / "attn.logits.npy")
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # negative control: B without the query scale the base kernel gets
    bad = np.load(root / "attn_noscale.logits.npy")
    assert np.abs(bad - want).max() > 100 * 1e-4
    # every module (attention, MLP): base + scale * a.b equals MaxText's converter run on PEFT's
    # merge_and_unload model (the rotary interleave, transposes, head split and query scale)
    base_mt, merged_mt = mx.read_params(root / "base_mt.safetensors"), mx.read_params(root / "merged_mt.safetensors")
    lora, s = mx.read_params(root / "full.safetensors"), 8 / 4
    seen = 0
    for name, b in lora.items():
        if not name.endswith("/lora_b.kernel"):
            continue
        kernel = name.removesuffix("/lora_b.kernel") + "/kernel"
        a = lora[name.replace("/lora_b.", "/lora_a.")]
        delta = np.tensordot(a.astype(np.float64), b.astype(np.float64), axes=([-1], [0]))
        np.testing.assert_allclose(base_mt[kernel] + s * delta, merged_mt[kernel], rtol=1e-5, atol=1e-6,
                                   err_msg=kernel)
        seen += 1
    assert seen == len(ALL) * SPEC.layers
    # scanned: MaxText's adapter tree shapes (layers on axis 1 of both factors), the same values
    scanned = mx.read_params(root / "full_scan.safetensors")
    tree = json.loads((root / "tree_scan.json").read_text())["lora_tree"]
    assert {n: list(v.shape) for n, v in scanned.items() if "/self_attention/" in n} == tree
    for name, v in scanned.items():
        layers = [lora[name.replace("decoder/layers/", f"decoder/layers_{i}/")] for i in range(SPEC.layers)]
        np.testing.assert_array_equal(v, np.stack(layers, axis=1), err_msg=name)


def test_qwen3_adapter_in_maxtext_gives_peft_logits(made: dict) -> None:
    """MaxText 0.2.5's adapter tree also names ``query_norm`` / ``key_norm`` (its target match is a
    substring: ``"self_attention.query" in path``), 1-D "factors" its 2-D merge cannot take: the
    carried adapter is that tree without them, and merged by MaxText it gives PEFT's logits."""
    report = json.loads((made["root"] / "qwen3_attn.json").read_text())
    extra = {n: v for n, v in report["lora_tree"].items() if n not in report["given"]}
    assert {n: v for n, v in report["lora_tree"].items() if n not in extra} == report["given"]
    assert extra and all(("/query_norm/" in n or "/key_norm/" in n) and len(v) == 1 for n, v in extra.items())
    np.testing.assert_allclose(np.load(made["root"] / "qwen3_attn.logits.npy"), made["qwen3"]["want"], atol=1e-4, rtol=0)


def test_maxtext_adapter_back_to_peft_loads_in_peft_with_the_same_values(made: dict, tmp_path: Path) -> None:
    cfg, alpha = made["cfg"], made["mx_cfg"]["lora_alpha"]
    back = _rules(cfg, "maxtext", "hf", scan=False)
    full = carry.carry(ckptbridge.open(made["root"] / "full.safetensors"), back, alpha=alpha)
    carry.save_peft(full, tmp_path / "full")
    original = ckptbridge.open(made["full"])
    again = ckptbridge.open(tmp_path / "full")
    assert set(again) == set(original)
    for name in original:  # head_dim 16: the query scale 1/4 and its inverse are exact
        np.testing.assert_array_equal(again[name][...], original[name][...], err_msg=name)
    # MaxText's scanned adapter tree (layers stacked on axis 1 of both factors) as the source: unstacked
    # back, the same factors bitwise
    scanned = carry.carry(ckptbridge.open(made["root"] / "full_scan.safetensors"), _rules(cfg, "maxtext", "hf", scan=True),
                          alpha=alpha)
    carry.save_peft(scanned, tmp_path / "full_scan")
    again = ckptbridge.open(tmp_path / "full_scan")
    assert set(again) == set(original)
    for name in original:
        np.testing.assert_array_equal(again[name][...], original[name][...], err_msg=name)
    # rsLoRA folded into B: PEFT loads the carried-back adapter (plain LoRA) with the same logits
    attn = carry.carry(ckptbridge.open(made["root"] / "attn.safetensors"), back, alpha=alpha)
    carry.save_peft(attn, tmp_path / "attn")
    np.testing.assert_allclose(_peft_logits(made["base"], tmp_path / "attn", made["tokens"]),
                               _peft_logits(made["base"], made["attn"], made["tokens"]), atol=1e-5, rtol=0)


def test_adam_moments_of_the_adapter_carry_with_their_meaning(made: dict) -> None:
    """torch Adam's moments after one step are ``(1 - b1) g`` and ``(1 - b2) g^2``: carried to
    MaxText they equal those of MaxText's own gradient with respect to its adapter leaves (the
    query scale divides B's first moment and, squared, its second; rsLoRA's fold likewise)."""
    root = made["root"]
    lora = carry.carry(with_moments(made["attn"], root), _rules(made["cfg"], "hf", "maxtext", scan=False))
    grads = mx.read_params(root / "attn.grad.safetensors")
    assert set(grads) == set(lora)
    for name, g in grads.items():
        tol = 1e-3 * np.abs(g).max()
        np.testing.assert_allclose(lora[name].state("exp_avg").read(), (1 - BETAS[0]) * g, rtol=1e-3, atol=tol,
                                   err_msg=name)
        np.testing.assert_allclose(lora[name].state("exp_avg_sq").read(), (1 - BETAS[1]) * g * g, rtol=2e-3,
                                   atol=tol * tol, err_msg=name)


def test_carry_refuses_what_a_lora_factor_cannot_follow(made: dict) -> None:
    from ckptbridge.plugin import FormatError
    from ckptbridge.rules import Offset

    rules = (*_rules(made["cfg"], "hf", "maxtext", scan=False), Offset(r"/query/kernel$", 1.0))
    with pytest.raises(FormatError, match="Offset"):
        carry.carry(ckptbridge.open(made["attn"]), rules)
    assert carry.factor_of("decoder/layers_0/mlp/wo/lora_b.kernel") == ("decoder/layers_0/mlp/wo/kernel", "B", "maxtext")
    assert carry.factor_name("model.layers.1.mlp.down_proj.weight", "A") == \
        "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"


def test_megatron_adapter_in_maxtext_gives_peft_logits(made: dict) -> None:
    """Megatron <-> MaxText, composed like the base weights' recipes: PEFT's q/k/v adapter fused into
    Megatron-Bridge's ``linear_qkv`` pair (rank 3 x 4, ``B`` block-diagonal), then split again for
    MaxText (each of query/key/value gets the whole ``A``, its rows of ``B``): MaxText's own adapter
    tree, and merged by MaxText it gives PEFT's logits. MaxText -> Megatron gives the same fused pair
    (bitwise) as PEFT -> Megatron, which ``tests/test_lora_megatron.py`` proves in megatron-core."""
    root = made["root"]
    report = json.loads((root / "via_megatron.json").read_text())
    assert report["given"] == report["lora_tree"] and all(v[-1] == 12 or v[0] == 12 for v in report["given"].values())
    want = _peft_logits(made["base"], made["attn"], made["tokens"])
    np.testing.assert_allclose(np.load(root / "via_megatron.logits.npy"), want, atol=1e-4, rtol=0)
    meg = made["megatron"]
    back = carry.carry(ckptbridge.open(root / "attn.safetensors"), _rules(made["cfg"], "maxtext", "megatron", scan=False),
                       alpha=made["mx_cfg"]["lora_alpha"])
    assert set(back) == set(meg) and back.extra["lora"] == {**meg.extra["lora"], "from": back.path}
    for name in meg:  # the query scale 1/4, its inverse and the rotary interleave are exact
        np.testing.assert_array_equal(back[name][...], meg[name][...], err_msg=name)
