"""The steps every family's MaxText proof takes (``test_recipes_gemma3.py``, ``test_recipes_gpt_oss.py``).

A tiny HF model saved in ``work/hf``; for scanned and unscanned MaxText: MaxText's own converter
(``scanN.conv.safetensors``), the recipe loaded by ``ckptbridge.adapters.flax.load`` onto MaxText's
boxed tree on a 2x2 mesh (``scanN.dump.safetensors``, ``scanN.logits.npy``, ``scanN.json``) and
MaxText's own export of its conversion (``scanN.mt2hf/``); then the checks::

    run = maxtext_family.prepare(work, model, lambda cfg: {"no_offset": rules})   # runs the jobs
    theirs = maxtext_family.leaves_bitwise(work, scan=True)      # {name: ndarray}, asserted
    mine, d = maxtext_family.back(work, cfg, scan=True)          # the inverse recipe's HF export
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hf_models as hf
import maxtext_client as mx
import numpy as np
from test_recipes_maxtext import _export_hf

from ckptbridge import recipes

BATCH, SEQ = 4, 16
MESH = {"fsdp": 2, "tensor": 2}


def recipe(cfg: dict[str, Any], scan: bool, src: str = "hf", dst: str = "maxtext") -> tuple:
    """The family's recipe for an HF config.json, as a user spells it."""
    return recipes.rules(recipes.family_from_hf(cfg), src=src, dst=dst, **{**recipes.config_from_hf(cfg), "scan": scan})


def jobs(work: Path, cfg: dict[str, Any], controls: dict[str, tuple]) -> list[dict[str, Any]]:
    """Converter, recipe load and MaxText export, scanned and not; each control (rules with one fact
    wrong) loaded scanned for its logits (``<label>.logits.npy``). Tokens: ``work/tokens.npy``."""
    hf_dir, tokens = work / "hf", work / "tokens.npy"
    out = []
    for scan in (True, False):
        spec = mx.spec_from_hf(cfg, scan=scan, mesh=MESH, batch=BATCH, seq=SEQ)
        k = f"scan{int(scan)}"
        out += [mx.convert_job(spec, hf_dir, work / f"{k}.conv.safetensors"),
                mx.load_job(spec, hf_dir, recipe(cfg, scan), dump=work / f"{k}.dump.safetensors", tokens=tokens,
                            logits=work / f"{k}.logits.npy", report=work / f"{k}.json"),
                mx.to_hf_job(spec, work / f"{k}.conv.safetensors", hf_dir / "config.json", work / f"{k}.mt2hf")]
    spec = mx.spec_from_hf(cfg, scan=True, mesh=MESH, batch=BATCH, seq=SEQ)
    out += [mx.load_job(spec, hf_dir, rules, tokens=tokens, logits=work / f"{label}.logits.npy")
            for label, rules in controls.items()]
    return out


def prepare(work: Path, model: Any, controls: Callable[[dict[str, Any]], dict[str, tuple]],
            more: Callable[[dict[str, Any]], list[dict[str, Any]]] = lambda cfg: []) -> dict[str, Any]:
    """Save ``model`` in ``work/hf``, draw the tokens and run :func:`jobs` (with ``controls(cfg)``)
    and ``more(cfg)`` in one harness process: ``{"work", "cfg", "hf_dir", "tokens"}``."""
    hf_dir = hf.save(model, work / "hf")
    cfg = json.loads((hf_dir / "config.json").read_text())
    tokens = hf.tokens(BATCH, SEQ, cfg["vocab_size"], seed=1)
    np.save(work / "tokens.npy", tokens)
    mx.run_jobs(jobs(work, cfg, controls(cfg)) + more(cfg))
    return {"work": work, "cfg": cfg, "hf_dir": hf_dir, "tokens": tokens}


def leaves_bitwise(work: Path, scan: bool) -> dict[str, np.ndarray]:
    """Assert the loaded tree is MaxText's boxes and shardings on 4 devices, every leaf bitwise the
    converter's; the converter's leaves."""
    k = f"scan{int(scan)}"
    report = json.loads((work / f"{k}.json").read_text())
    assert report["not_boxed"] == [] and report["not_maxtext_sharding"] == [] and report["devices"] == 4
    mine, theirs = mx.read_params(work / f"{k}.dump.safetensors"), mx.read_params(work / f"{k}.conv.safetensors")
    assert sorted(mine) == sorted(theirs) and len(theirs) == report["leaves"]
    for key, value in theirs.items():
        assert mine[key].dtype == value.dtype and mine[key].tobytes() == value.tobytes(), key
    return theirs


def back(work: Path, cfg: dict[str, Any], scan: bool) -> tuple[dict[str, np.ndarray], Path]:
    """The loaded tree through the inverse recipe as an HF directory: (its tensors, the directory);
    asserts HF's names, every tensor bitwise what MaxText's own export makes."""
    from safetensors.numpy import load_file

    import ckptbridge

    k = f"scan{int(scan)}"
    d = _export_hf(work / f"{k}.dump.safetensors", recipe(cfg, scan, "maxtext", "hf"), work / "hf" / "config.json",
                   work / f"{k}.back")
    mine, theirs = load_file(str(d / "model.safetensors")), load_file(str(work / f"{k}.mt2hf" / "model.safetensors"))
    assert sorted(mine) == sorted(theirs) == sorted(ckptbridge.open(work / "hf"))
    for name, value in theirs.items():
        assert mine[name].dtype == value.dtype and mine[name].tobytes() == value.tobytes(), name
    return mine, d
