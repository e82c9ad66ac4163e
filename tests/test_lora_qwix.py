"""MaxText 0.2.5's training-time LoRA (qwix) read from its Orbax checkpoint and carried to HF PEFT.

Oracles, all outside ckptbridge: MaxText 0.2.5's own code run in ``.maxtext/venv``
(``tools/maxtext/lora.py`` ``qwix-forward``): ``lora_utils.apply_lora_to_model`` (what
``train_sft.py`` calls: qwix's ``LoraProvider`` on the NNX decoder with the default
``lora_module_path``: attention query/key/value/out and MLP wi_0/wi_1/wo), its forward with the
adapter on, and ``lora_utils.restore_lora_from_path`` reading the saved tree back; and PEFT 0.21
loading the carried adapter onto the transformers tiny Llama-3 whose weights MaxText's model got
through the harness's converter. The query scale and the head split apply to ``B``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import ckptbridge
from ckptbridge import recipes
from ckptbridge.adapters import lora as carry
from ckptbridge.plugin import FormatError
from ckptbridge.rules import Scale

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
import hf_models as hf  # noqa: E402
import maxtext_client as mx  # noqa: E402

LORA_TOOL = mx.ROOT / "tools" / "maxtext" / "lora.py"
SPEC = hf.HFSpec("llama", rope="llama3")
RANK, ALPHA = 4, 8.0
BATCH, SEQ = 4, 16  # the batch divides the harness's fsdp axis (MaxText's NNX decoder shards it)
SPEC_BATCH = 2  # the harness spec of tests/test_lora_maxtext.py: one MaxText build for both in a session
BETAS = (0.9, 0.999)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _rules(cfg: dict, scan: bool = False) -> tuple:
    family = recipes.family_from_hf(cfg)
    return recipes.rules(family, src="maxtext", dst="hf", **{**recipes.config_from_hf(cfg), "scan": scan})


def _peft_logits(base: Path, adapter: Path, tokens: np.ndarray) -> np.ndarray:
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return hf.logits(peft.PeftModel.from_pretrained(model, adapter).eval(), tokens)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora_qwix")
    base = hf.save(hf.build(SPEC), root / "base")
    cfg = json.loads((base / "config.json").read_text())
    train = hf.tokens(BATCH, SEQ + 1, cfg["vocab_size"], seed=5)  # MaxText's logits of [:, :-1], its loss's targets [:, 1:]
    np.save(root / "train.npy", train)
    spec = mx.spec_from_hf(cfg, scan=False, batch=SPEC_BATCH, seq=SEQ)
    mx.run_jobs([mx.convert_job(spec, base, root / "base_mt.safetensors"),
                 {"cmd": "qwix-forward", "spec": spec, "params": str(root / "base_mt.safetensors"), "rank": RANK,
                  "alpha": ALPHA, "seed": 7, "tokens": str(root / "train.npy"), "betas": BETAS,
                  "out": str(root / "qwix.logits.npy"), "ckpt": str(root / "qwix_ckpt"),
                  "train_ckpt": str(root / "train_ckpt"), "report": str(root / "qwix.json")}], script=LORA_TOOL)
    ckpt = ckptbridge.open(root / "qwix_ckpt")
    rules = _rules(cfg)
    no_scale = tuple(r for r in rules if not isinstance(r, Scale))  # negative control: B without the query scale
    for label, rs in (("peft", rules), ("noscale", no_scale)):
        carry.save_peft(carry.carry(ckpt, rs, alpha=ALPHA), root / label)
    return {"root": root, "base": base, "cfg": cfg, "tokens": train[:, :-1], "ckpt": ckpt,
            "report": json.loads((root / "qwix.json").read_text())}


def test_qwix_lora_from_maxtexts_checkpoint_gives_maxtexts_logits_in_peft(made: dict) -> None:
    root, report, ckpt = made["root"], made["report"], made["ckpt"]
    # the Orbax tree is MaxText's: its restore_lora_from_path put it into a fresh LoRA model and the
    # logits did not move; its leaves are qwix's (flattened A [in, r], B [r, out]), each read as a
    # factor of the MaxText kernel beside it
    assert report["restored_max_diff"] == 0.0
    assert {n: list(t.shape) for n, t in ckpt.tensors.items()} == report["leaves"]
    assert len(report["leaves"]) == 2 * len(MODULES) * SPEC.layers
    assert report["leaves"]["decoder/layers_0/self_attention/query/kernel_lora_b/value"] == [RANK, 64]
    assert carry.factor_of("decoder/layers_1/self_attention/out/kernel_lora_a/value") == \
        ("decoder/layers_1/self_attention/out/kernel", "A", "qwix")
    # carried to PEFT through the Llama recipe (MaxText -> HF): PEFT's adapter-on logits are MaxText's
    adapter = ckptbridge.open(root / "peft")
    config = json.loads((root / "peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (RANK, ALPHA, sorted(MODULES))
    assert len(adapter.tensors) == len(report["leaves"])
    want = np.load(root / "qwix.logits.npy")
    got = _peft_logits(made["base"], root / "peft", made["tokens"])
    assert np.abs(want - _peft_logits(made["base"], root / "noscale", made["tokens"])).max() > 100 * 1e-4
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_qwix_adam_moments_carry_to_peft_with_their_meaning(made: dict) -> None:
    """One Adam step in MaxText (qwix's LoRA leaves, ``nnx.Optimizer(..., wrt=nnx.LoRAParam)``,
    saved as Tunix's ``PeftTrainer`` checkpoint: ``model_params`` + ``optimizer_state``): carried to
    PEFT, ``mu`` / ``nu`` equal torch Adam's ``exp_avg`` / ``exp_avg_sq`` after one step on the
    carried adapter with the same batch (``(1 - b1) g``, ``(1 - b2) g^2``: the query scale divides
    ``B``'s gradient, squared in the second moment)."""
    from test_lora_maxtext import _adam_step

    root = made["root"]
    lora = carry.carry(ckptbridge.open(root / "train_ckpt"), _rules(made["cfg"]), alpha=ALPHA)
    _adam_step(made["base"], root / "peft", np.load(root / "train.npy"), root)  # torch Adam, betas BETAS
    want = {k: ckptbridge.open(root / f"{k}.safetensors") for k in ("exp_avg", "exp_avg_sq")}
    assert set(lora) == set(want["exp_avg"]) and len(lora.tensors) == len(made["report"]["leaves"])
    for name in lora:
        t, g1, g2 = lora[name], want["exp_avg"][name][...], want["exp_avg_sq"][name][...]
        np.testing.assert_array_equal(t[...], ckptbridge.open(root / "peft")[name][...], err_msg=name)
        np.testing.assert_allclose(t.state("exp_avg").read(), g1, rtol=1e-3, atol=1e-3 * np.abs(g1).max(), err_msg=name)
        np.testing.assert_allclose(t.state("exp_avg_sq").read(), g2, rtol=2e-3, atol=1e-3 * np.abs(g2).max(),
                                   err_msg=name)


def test_qwix_factors_that_do_not_fit_the_recipe_are_refused(made: dict) -> None:
    """A factor whose flattened size does not split the kernel's axes (here ``B`` and ``A``
    swapped: ``A [64, r]`` read as ``B``) names the weight; scanned (3-D) qwix factors are refused."""
    from ckptbridge.adapters.lora._plan import qwix_splits

    rules = _rules(made["cfg"])
    out = "decoder/layers_0/self_attention/out/kernel"
    assert qwix_splits(rules, out, (64, RANK), (RANK, 64))["A"][0].sizes == (4, 16)
    with pytest.raises(FormatError, match="self_attention/out/kernel"):
        qwix_splits(rules, out, (RANK, 64), (64, RANK))
    with pytest.raises(FormatError, match="unstacked 2-D"):
        qwix_splits(_rules(made["cfg"], scan=True), "decoder/layers/self_attention/query/kernel", (64, 2, RANK),
                    (RANK, 2, 64))
