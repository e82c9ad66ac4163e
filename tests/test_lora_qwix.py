"""MaxText 0.2.5's training-time LoRA (qwix) carried both ways with HF PEFT, unscanned and scanned.

Oracles, all outside ckptbridge: MaxText 0.2.5's own code run in ``.maxtext/venv``
(``tools/maxtext/lora.py`` ``qwix-forward`` / ``qwix-restore``): ``lora_utils.apply_lora_to_model``
(what ``train_sft.py`` calls: qwix's ``LoraProvider`` on the NNX decoder with the default
``lora_module_path``: attention query/key/value/out and MLP wi_0/wi_1/wo), its forward with the
adapter on, ``lora_utils.restore_lora_from_path`` reading a saved tree back, ``optimizers.get_optimizer``
(the SFT optimizer a Tunix checkpoint restores into, with Orbax v1 as Tunix calls it); PEFT 0.21
loading an adapter onto the transformers tiny Llama-3 whose weights MaxText's model got through the
harness's converter; torch Adam for the moments. The query scale and the head split apply to ``B``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import ckptbridge
from ckptbridge import recipes
from ckptbridge.adapters import lora as carry
from ckptbridge.plugin import FormatError, OptionError
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


def _qwix_forward(spec: dict, root: Path, label: str, params: str, train: bool = False) -> dict:
    """MaxText's qwix LoRA drawn, run and saved (``lora.py qwix-forward``) as ``<label>_ckpt`` (and,
    ``train``, one Adam step as ``<label>_train``), its logits ``<label>.logits.npy``, report ``<label>.json``."""
    job = {"cmd": "qwix-forward", "spec": spec, "params": str(root / params), "rank": RANK, "alpha": ALPHA,
           "seed": 7, "tokens": str(root / "train.npy"), "out": str(root / f"{label}.logits.npy"),
           "ckpt": str(root / f"{label}_ckpt"), "report": str(root / f"{label}.json")}
    return job | ({"train_ckpt": str(root / f"{label}_train"), "betas": BETAS} if train else {})


def _qwix_restore(spec: dict, root: Path, labels: list[str], params: str, train: bool = False) -> dict:
    """Each ``<label>`` (save_qwix's step 0) restored by MaxText's ``restore_lora_from_path`` and run
    (``lora.py qwix-restore``); the first one's report; ``train``: Tunix's checkpoint
    ``<first label>_tunix`` restored too."""
    job = {"cmd": "qwix-restore", "spec": spec, "params": str(root / params), "rank": RANK, "alpha": ALPHA,
           "lora": [str(root / label / "0" / "items") for label in labels], "tokens": str(root / "train.npy"),
           "out": [str(root / f"{label}.logits.npy") for label in labels], "report": str(root / f"{labels[0]}.json")}
    return job | ({"train_ckpt": str(root / f"{labels[0]}_tunix"), "betas": BETAS} if train else {})


def _peft_to_qwix(root: Path, base: Path, cfg: dict, train: np.ndarray) -> Path:
    """A PEFT adapter on every module (rsLoRA: its scale folds into ``B``) and one torch Adam step
    on it, carried to qwix: unscanned with its moments (``to_qwix``, ``to_qwix_tunix``), without
    the query scale (``to_qwix_noscale``, the negative control) and scanned (``to_qwix_scan``)."""
    from lora_refs import with_moments
    from test_lora_maxtext import _adam_step

    torch.manual_seed(11)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(MODULES), init_lora_weights=False,
                             use_rslora=True)
    adapter = root / "peft_full"
    peft.get_peft_model(hf.build(SPEC), config).save_pretrained(adapter)
    (root / "peft_full_adam").mkdir()
    _adam_step(base, adapter, train, root / "peft_full_adam")  # torch Adam: exp_avg / exp_avg_sq of PEFT's names
    to_mx = recipes.rules(recipes.family_from_hf(cfg), src="hf", dst="maxtext",
                          **{**recipes.config_from_hf(cfg), "scan": False})
    no_scale = tuple(r for r in to_mx if not isinstance(r, Scale))
    src = ckptbridge.open(adapter)
    carry.save_qwix(carry.carry(src, to_mx, qwix=True), root / "to_qwix")
    carry.save_qwix(carry.carry(with_moments(adapter, root / "peft_full_adam"), to_mx, qwix=True), root / "to_qwix_tunix", step=1,
                    adam="opt_state/1/0", counts=("opt_state/1/2/count",))  # MaxText's SFT optimizer
    carry.save_qwix(carry.carry(src, no_scale, qwix=True), root / "to_qwix_noscale")
    scan = recipes.rules(recipes.family_from_hf(cfg), src="hf", dst="maxtext",
                         **{**recipes.config_from_hf(cfg), "scan": True})
    carry.save_qwix(carry.carry(src, scan, qwix=True), root / "to_qwix_scan")
    return adapter


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora_qwix")
    base = hf.save(hf.build(SPEC), root / "base")
    cfg = json.loads((base / "config.json").read_text())
    train = hf.tokens(BATCH, SEQ + 1, cfg["vocab_size"], seed=5)  # MaxText's logits of [:, :-1], its loss's targets [:, 1:]
    np.save(root / "train.npy", train)
    adapter = _peft_to_qwix(root, base, cfg, train)
    spec = mx.spec_from_hf(cfg, scan=False, batch=SPEC_BATCH, seq=SEQ)
    spec_scan = mx.spec_from_hf(cfg, scan=True, batch=SPEC_BATCH, seq=SEQ)
    mx.run_jobs([mx.convert_job(spec, base, root / "base_mt.safetensors"),
                 _qwix_forward(spec, root, "qwix", "base_mt.safetensors", train=True),
                 _qwix_restore(spec, root, ["to_qwix", "to_qwix_noscale"], "base_mt.safetensors", train=True),
                 mx.convert_job(spec_scan, base, root / "base_mt_scan.safetensors"),
                 _qwix_forward(spec_scan, root, "qwix_scan", "base_mt_scan.safetensors", train=True),
                 _qwix_restore(spec_scan, root, ["to_qwix_scan"], "base_mt_scan.safetensors")], script=LORA_TOOL)
    ckpt = ckptbridge.open(root / "qwix_ckpt")
    rules = _rules(cfg)
    no_scale = tuple(r for r in rules if not isinstance(r, Scale))  # negative control: B without the query scale
    for label, rs in (("qwix_peft", rules), ("qwix_noscale", no_scale)):
        carry.save_peft(carry.carry(ckpt, rs, alpha=ALPHA), root / label)
    carry.save_peft(carry.carry(ckptbridge.open(root / "qwix_scan_ckpt"), _rules(cfg, scan=True), alpha=ALPHA),
                    root / "qwix_scan_peft")
    return {"root": root, "base": base, "cfg": cfg, "tokens": train[:, :-1], "ckpt": ckpt, "adapter": adapter,
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
    adapter = ckptbridge.open(root / "qwix_peft")
    config = json.loads((root / "qwix_peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (RANK, ALPHA, sorted(MODULES))
    assert len(adapter.tensors) == len(report["leaves"])
    want = np.load(root / "qwix.logits.npy")
    got = _peft_logits(made["base"], root / "qwix_peft", made["tokens"])
    assert np.abs(want - _peft_logits(made["base"], root / "qwix_noscale", made["tokens"])).max() > 100 * 1e-4
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("label", ["qwix", "qwix_scan"])
def test_qwix_adam_moments_carry_to_peft_with_their_meaning(made: dict, label: str) -> None:
    """One Adam step in MaxText (qwix's LoRA leaves, ``nnx.Optimizer(..., wrt=nnx.LoRAParam)``,
    saved as Tunix's ``PeftTrainer`` checkpoint: ``model_params`` + ``optimizer_state``; unscanned
    and scanned): carried to PEFT, ``mu`` / ``nu`` equal torch Adam's ``exp_avg`` / ``exp_avg_sq``
    after one step on the carried adapter with the same batch (``(1 - b1) g``, ``(1 - b2) g^2``: the
    query scale divides ``B``'s gradient, squared in the second moment)."""
    from test_lora_maxtext import _adam_step

    root, adapter, torch_adam = made["root"], made["root"] / f"{label}_peft", made["root"] / f"{label}_adam"
    lora = carry.carry(ckptbridge.open(root / f"{label}_train"), _rules(made["cfg"], scan=label == "qwix_scan"),
                       alpha=ALPHA)
    torch_adam.mkdir()
    _adam_step(made["base"], adapter, np.load(root / "train.npy"), torch_adam)  # torch Adam, betas BETAS
    want = {k: ckptbridge.open(torch_adam / f"{k}.safetensors") for k in ("exp_avg", "exp_avg_sq")}
    assert set(lora) == set(want["exp_avg"]) and len(lora.tensors) == len(made["report"]["leaves"])
    for name in lora:
        t, g1, g2 = lora[name], want["exp_avg"][name][...], want["exp_avg_sq"][name][...]
        np.testing.assert_array_equal(t[...], ckptbridge.open(adapter)[name][...], err_msg=name)
        np.testing.assert_allclose(t.state("exp_avg").read(), g1, rtol=1e-3, atol=1e-3 * np.abs(g1).max(), err_msg=name)
        np.testing.assert_allclose(t.state("exp_avg_sq").read(), g2, rtol=2e-3, atol=1e-3 * np.abs(g2).max(),
                                   err_msg=name)


def test_peft_adapter_carried_to_qwix_resumes_in_maxtext_with_peft_logits_and_adam(made: dict) -> None:
    """PEFT -> qwix (``carry(..., qwix=True)``, ``save_qwix``): MaxText's ``restore_lora_from_path``
    puts it into the LoRA model ``apply_lora_to_model`` built, which then gives PEFT's adapter-on
    logits; Tunix's restore of the checkpoint with the moments gives MaxText's optimizer the moments
    MaxText's own first Adam step takes from there (torch's, carried: the query scale divides ``B``'s
    first moment, squared in the second)."""
    root, own = made["root"], made["report"]["leaves"]
    report = json.loads((root / "to_qwix.json").read_text())
    # what save_qwix wrote is MaxText's own qwix tree (names, flattened shapes), no leaf more
    assert _tree(root / "to_qwix" / "0" / "items") == own == report["leaves"]
    assert report["metadata"]["lora"] == {"lora_rank": RANK, "lora_alpha": ALPHA}  # what sync_lora_metadata reads
    want = _peft_logits(made["base"], made["adapter"], made["tokens"])
    np.testing.assert_allclose(np.load(root / "to_qwix.logits.npy"), want, atol=1e-4, rtol=0)
    assert np.abs(np.load(root / "to_qwix_noscale.logits.npy") - want).max() > 100 * 1e-4
    tunix = report["tunix"]
    assert tunix["step"] == 1 and tunix["params_max_diff"] == 0.0
    assert tunix["counts"] == {"opt_state/1/0/count/value": 1, "opt_state/1/2/count/value": 1, "step/value": 1}
    assert len([n for n in tunix["names"] if "/mu/" in n]) == len(own)
    assert tunix["moments_rel_diff"]["mu"] < 1e-3 and tunix["moments_rel_diff"]["nu"] < 2e-3, tunix["moments_rel_diff"]


def _tree(path: Path) -> dict[str, list[int]]:
    """The leaves of an Orbax checkpoint: path -> shape."""
    return {n: list(t.shape) for n, t in ckptbridge.open(path).tensors.items()}


def _swapped(adapter: Path, out: Path) -> Path:
    """``adapter`` with the pairs of its two layers exchanged (the negative control of a layer axis)."""
    from ckptbridge.plugin import Checkpoint, CheckpointIndex, LogicalTensor

    src = ckptbridge.open(adapter)
    swap = {".layers.0.": ".layers.1.", ".layers.1.": ".layers.0."}
    names = {n: next((n.replace(a, b) for a, b in swap.items() if a in n), n) for n in src.tensors}
    tensors = {names[n]: LogicalTensor(names[n], dict(t.states)) for n, t in src.tensors.items()}
    index = CheckpointIndex("lora", src.path, tensors, None, {"lora": {"r": RANK, "lora_alpha": ALPHA}})
    return Path(carry.save_peft(Checkpoint(index, src.files), out))


def test_scanned_qwix_carries_both_ways(made: dict) -> None:
    """MaxText ``scan_layers=True``: qwix's factors stacked at ``param_scan_axis`` (``A [in, layers,
    r]``, ``B [r, layers, out]``), read (MaxText's scanned qwix checkpoint -> PEFT gives MaxText's
    logits) and written (PEFT -> scanned qwix, restored by MaxText, gives PEFT's logits); with the
    two layers exchanged both are far off."""
    root = made["root"]
    own = json.loads((root / "qwix_scan.json").read_text())
    assert own["restored_max_diff"] == 0.0
    assert own["leaves"]["decoder/layers/self_attention/out/kernel_lora_a/value"] == [64, SPEC.layers, RANK]
    assert own["leaves"]["decoder/layers/self_attention/key/kernel_lora_b/value"] == [RANK, SPEC.layers, 32]
    # read: MaxText's scanned checkpoint to PEFT (the fixture's qwix_scan_peft)
    want = np.load(root / "qwix_scan.logits.npy")
    np.testing.assert_allclose(_peft_logits(made["base"], root / "qwix_scan_peft", made["tokens"]), want, atol=1e-4,
                               rtol=0)
    swapped = _swapped(root / "qwix_scan_peft", root / "qwix_scan_swapped")
    assert np.abs(_peft_logits(made["base"], swapped, made["tokens"]) - want).max() > 100 * 1e-4
    # written: PEFT to MaxText's scanned tree, restored by restore_lora_from_path
    report = json.loads((root / "to_qwix_scan.json").read_text())
    assert _tree(root / "to_qwix_scan" / "0" / "items") == own["leaves"] == report["leaves"]
    got = np.load(root / "to_qwix_scan.logits.npy")
    np.testing.assert_allclose(got, _peft_logits(made["base"], made["adapter"], made["tokens"]), atol=1e-4, rtol=0)
    swapped = _swapped(made["adapter"], root / "peft_full_swapped")
    assert np.abs(got - _peft_logits(made["base"], swapped, made["tokens"])).max() > 100 * 1e-4


def test_qwix_factors_that_do_not_fit_the_recipe_are_refused(made: dict) -> None:
    """A factor whose flattened size does not split the kernel's axes (here ``B`` and ``A``
    swapped: ``A [64, r]`` read as ``B``) names the weight, and so do unstacked factors of a scanned
    kernel; a scanned ``out`` kernel's ``A [H*D, layers, r]`` splits its heads and puts the layer
    axis where ``W [H, layers, D, E]`` has it. ``qwix=True`` without MaxText kernels at the
    destination and ``save_qwix`` of other factors are refused."""
    from ckptbridge.adapters.lora._plan import qwix_splits
    from ckptbridge.rules import SplitDim, Transpose

    rules = _rules(made["cfg"])
    out = "decoder/layers_0/self_attention/out/kernel"
    assert qwix_splits(rules, out, (64, RANK), (RANK, 64))["A"][0].sizes == (4, 16)
    with pytest.raises(FormatError, match="self_attention/out/kernel"):
        qwix_splits(rules, out, (RANK, 64), (64, RANK))
    scan, stacked = _rules(made["cfg"], scan=True), "decoder/layers/self_attention/out/kernel"
    with pytest.raises(FormatError, match="out/kernel.*scanned"):
        qwix_splits(scan, stacked, (64, RANK), (RANK, 64))
    split = qwix_splits(scan, stacked, (64, 2, RANK), (RANK, 2, 64))
    assert split["B"] == () and [type(r) for r in split["A"]] == [SplitDim, Transpose]
    assert (split["A"][0].sizes, split["A"][1].perm) == ((4, 16), (0, 2, 1, 3))
    with pytest.raises(OptionError, match="qwix=True"):  # qwix=True needs rules to MaxText
        carry.carry(ckptbridge.open(made["adapter"]), _rules(made["cfg"]), qwix=True)
    with pytest.raises(FormatError, match="only qwix-named"):  # save_qwix writes qwix factors only
        carry.save_qwix(ckptbridge.open(made["adapter"]), made["root"] / "refused")
    assert not (made["root"] / "refused").exists()
