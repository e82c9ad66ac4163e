"""Mixture-of-experts checkpoints of Megatron-LM's own training loop, read at every expert-parallel layout.

The fixtures (tests/fixtures/megatron_moe, made by tools/megatron/make_moe_ckpts.sh: Megatron-LM's
``pretrain_gpt.py`` at core_v0.16.1 on CPU/gloo, 2 MoE layers, 4 experts top-2) are one training run
resharded by Megatron itself onto each layout and trained on two iterations there:

* ``M``: fp32, SequentialMLP (``experts.local_experts.K``), a shared expert, the router's expert bias,
  torch Adam (a ChainedOptimizer of dense + expert optimizers at EP > 1); layouts EP 2 (TP1 DP2),
  TP 2 x EP 2 with expert-TP 1 (2 ranks), TP 2 x EP 2 with expert-TP 2 (4 ranks);
* ``G``: bf16, legacy GroupedMLP (``--moe-grouped-gemm``: ``experts.weight1``/``weight2`` buffers),
  Float16 optimizer with fp32 master weights; layouts EP 2, TP 2 x EP 2 with expert-TP 1;
* ``D``: fp32 SequentialMLP with the distributed optimizer (``--dist-ckpt-optim-fully-reshardable``;
  the expert parameters' buffers sharded over their expert-data-parallel group), 4 ranks EP 2; its legacy
  copy: each rank file's ``distrib_optim.pt`` is the ChainedOptimizer's ``[dense, expert]`` coalesced
  buffers (the dense part ``None`` in ``mp_rank_00_001``: only dense-DP rank 0 writes it).

Each layout is there as ``torch_dist`` and as Megatron's own ``--ckpt-convert-format torch`` legacy
per-rank files (``mp_rank_TT_EEE``). The reference is megatron-core's own gathered state of the
``torch_dist`` checkpoint (tools/megatron/core_plain.py: ``dist_checkpointing.load_plain_tensors``,
which places every shard at the global offsets megatron-core's ``sharded_state_dict`` gave it; an
expert is ``[layer, global expert]`` of ``decoder.layers.mlp.experts.experts.*``). What must hold:

* every logical tensor ckptbridge reads -- each expert under its global id, weights, fp32 master
  weights and both Adam moments -- is bitwise equal to that reference, for both formats of every
  layout, and together they cover every tensor of the reference (nothing missing, nothing extra);
* the fp32 layouts of ``M`` equal one another up to fp32 reduction order (one run, resharded by
  Megatron and trained on at each layout);
* negative controls: experts renumbered wrongly while reading (local index K of EP rank r taken as
  global id ``K * EP + r``, or as ``K``) and one expert's gate/up halves swapped in a copy of a legacy
  file each fail the check by far (relative error ~1, not rounding).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import ckptbridge
from ckptbridge.adapters.megatron import _legacy

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIX = os.path.join(HERE, "fixtures", "megatron_moe")
LAYOUTS = ["M/tp1ep2", "M/tp2ep2etp1", "M/tp2ep2", "G/tp1ep2", "G/tp2ep2etp1", "D/tp1ep2dp4"]
CASES = [(lay, fmt) for lay in LAYOUTS for fmt in ("torch_dist", "torch")]  # (layout, format) pairs read
EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.*)$")
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
# the local spec's norms are saved under the Transformer-Engine names (megatron-core's keys map)
NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, np.ndarray]]:
    """megatron-core's gathered state of each layout's torch_dist checkpoint (one subprocess)."""
    work = tmp_path_factory.mktemp("moe_refs")
    pairs = [f"{os.path.join(FIX, lay, 'torch_dist')}={work / lay.replace('/', '_')}.npz" for lay in LAYOUTS]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "megatron", "core_plain.py"), *pairs],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = {}
    for lay in LAYOUTS:
        with np.load(work / f"{lay.replace('/', '_')}.npz") as z:
            result[lay] = {k: z[k] for k in z.files}
    return result


def _ref_keys(name: str, state: str, bf16: bool) -> list[tuple[str, tuple[int, ...]]]:
    """megatron-core's keys and index of one logical tensor's state (written here, not taken from
    ckptbridge). fp32 runs: the weight is the model tensor and, with the distributed optimizer, also
    its main-param copy ``optimizer.state.param.*`` (both must match)."""
    index: tuple[int, ...] = ()
    key = name
    if m := EXPERT.match(name):
        key, index = f"decoder.layers.mlp.experts.experts.{m.group(3)}", (int(m.group(1)), int(m.group(2)))
    elif m := LAYER.match(name):
        rest = m.group(2)
        for local, dist in NORMS.items():
            if rest.startswith(local):
                rest = dist + rest[len(local):]
        key, index = f"decoder.layers.{rest}", (int(m.group(1)),)
    prefixes = {"exp_avg": ["optimizer.state.exp_avg."], "exp_avg_sq": ["optimizer.state.exp_avg_sq."],
                "fp32": ["optimizer.state.fp32_param."] if bf16 else ["", "optimizer.state.param."],
                "param": [""]}[state]
    return [(p + key, index) for p in prefixes]


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.int16) if a.dtype.itemsize == 2 and a.dtype.kind not in "iu" else a


def _as_float(a: np.ndarray, bf16_bits: bool) -> np.ndarray:
    if bf16_bits:
        return (a.astype(np.int32).astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def check(ckpt: Any, ref: dict[str, np.ndarray]) -> tuple[dict[tuple[str, str], float], set[str]]:
    """Relative max error of every (tensor, state) against megatron-core's gathered state (0.0: bitwise
    equal), and the reference entries no logical tensor covered."""
    bf16 = bool(ckpt.extra["megatron"]["args"].get("bf16"))
    vocab = ckpt.extra["megatron"]["vocab_size"]
    covered: dict[str, int] = {}
    errors: dict[tuple[str, str], float] = {}
    for name, t in ckpt.index.tensors.items():
        for state in t.states:
            got = ckpt[name].state(state)[...]
            errors[(name, state)] = 0.0
            for key, index in _ref_keys(name, state, bf16):
                if key not in ref and key.startswith("optimizer.state.param."):
                    continue  # no distributed optimizer
                want = ref[key][index] if index else ref[key]
                if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                    want = want[:vocab]  # ckptbridge strips the vocabulary padding
                covered[key] = covered.get(key, 0) + want.size
                bits = want.dtype == np.int16
                if got.shape == want.shape and np.array_equal(_bits(got), want):
                    continue
                g, w = _as_float(_bits(got), bits), _as_float(want, bits)
                err = float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-30)) if g.shape == w.shape else float("inf")
                errors[(name, state)] = max(errors[(name, state)], err)
    missing = set()
    for key, arr in ref.items():
        rows = arr.size
        if key.endswith(("word_embeddings.weight", "output_layer.weight")):
            rows = vocab * arr.shape[-1]
        if covered.get(key, 0) != rows:
            missing.add(key)
    return errors, missing


@pytest.mark.parametrize("layout,fmt", CASES)
def test_every_expert_layout_reads_bitwise_equal_to_megatron_core(refs: dict, layout: str, fmt: str) -> None:
    ckpt = ckptbridge.open(os.path.join(FIX, layout, fmt))
    moe = ckpt.extra["megatron"]["moe"]
    assert moe["num_experts"] == 4 and moe["ep"] == 2
    assert moe["etp"] == (1 if "etp1" in layout or "/tp1ep2" in layout else 2)
    assert moe["grouped_gemm"] == layout.startswith("G")
    names = set(ckpt.index.tensors)
    experts = {n for n in names if EXPERT.match(n)}
    assert len(experts) == 2 * 4 * 2  # layers x global experts x (fc1, fc2)
    states = {"exp_avg", "exp_avg_sq", "fp32"} | ({"param"} if layout.startswith("G") else set())
    for n in experts:
        assert set(ckpt.index.tensors[n].states) == states, n
        assert ckpt.index.tensors[n].scalars["step"] == 5
    if layout.startswith("M"):
        assert "decoder.layers.1.mlp.router.expert_bias" in names
        assert "decoder.layers.0.mlp.shared_experts.linear_fc1.weight" in names
    errors, missing = check(ckpt, refs[layout])
    assert not missing, sorted(missing)
    bad = {k: v for k, v in errors.items() if v != 0.0}
    assert not bad, bad


@pytest.mark.parametrize("layout", ["M/tp2ep2etp1", "M/tp2ep2"])
def test_every_fp32_layout_equals_the_others_after_megatrons_own_reshard(layout: str) -> None:
    """M's layouts are one run resharded by Megatron (iterations 1-3 at TP1/EP1) and trained on
    (iterations 4-5) at each layout: read through ckptbridge, every tensor and state of one layout
    equals the other's up to fp32 reduction order (measured <= 3.5e-7 relative; a wrong expert or a
    swapped gate/up half is off by > 0.1). (G is bf16, whose compute differs between TP layouts.)"""
    a = ckptbridge.open(os.path.join(FIX, "M/tp1ep2", "torch"))
    b = ckptbridge.open(os.path.join(FIX, layout, "torch_dist"))
    assert set(a.index.tensors) == set(b.index.tensors)
    for name, t in a.index.tensors.items():
        for state in t.states:
            x, y = a[name].state(state)[...], b[name].state(state)[...]
            assert np.max(np.abs(x - y)) <= 1e-6 * np.max(np.abs(x)), (name, state)


def test_split_fused_gives_each_experts_gate_and_up(refs: dict) -> None:
    ckpt = ckptbridge.open(os.path.join(FIX, "M/tp2ep2", "torch"), split_fused=True)
    ref = refs["M/tp2ep2"]["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    gate = ckpt["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.gate.weight"].state("fp32")[...]
    up = ckpt["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.up.weight"].state("fp32")[...]
    assert np.array_equal(gate, ref[1, 3, :16]) and np.array_equal(up, ref[1, 3, 16:])


@pytest.mark.parametrize("mapping", ["interleaved", "local_as_global"])
@pytest.mark.parametrize("layout", ["M/tp1ep2", "G/tp2ep2etp1"])
def test_negative_control_wrong_expert_ids_fail_by_far(refs: dict, layout: str, mapping: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    right = _legacy.global_expert_name

    def wrong(name: str, ep_rank: int, num_local: int) -> str:
        m = re.match(r"^(.*\.local_experts\.)(\d+)(\..*)$", name)
        assert m
        k = int(m.group(2))
        return f"{m.group(1)}{k * 2 + ep_rank if mapping == 'interleaved' else k}{m.group(3)}"

    def wrong_grouped(name: str, w: Any, hidden: int, num_local: int, ep_rank: int) -> list:
        out = []
        for glob, st in right_grouped(name, w, hidden, num_local, 0):
            out.append((wrong(glob, ep_rank, num_local), st))
        return out

    right_grouped = _legacy.grouped_experts
    monkeypatch.setattr(_legacy, "global_expert_name", wrong if not layout.startswith("G") else right)
    if layout.startswith("G"):
        monkeypatch.setattr(_legacy, "grouped_experts", wrong_grouped)
    ckpt = ckptbridge.open(os.path.join(FIX, layout, "torch"))
    errors, missing = check(ckpt, refs[layout])
    experts = {k: v for k, v in errors.items() if EXPERT.match(k[0])}
    if mapping == "local_as_global":  # EP rank 1's experts land on rank 0's ids: experts 2, 3 never read
        assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in missing
        assert not any(".local_experts.2." in n or ".local_experts.3." in n for n, _ in experts)
    else:  # experts 1 and 2 trade places
        swapped = {k: v for k, v in experts.items() if ".local_experts.1." in k[0] or ".local_experts.2." in k[0]}
        assert not missing and swapped and min(swapped.values()) > 0.1, swapped


def test_negative_control_gate_up_swapped_in_one_expert_fails_by_far(refs: dict, tmp_path: Any) -> None:
    import torch

    dst = tmp_path / "swapped"
    shutil.copytree(os.path.join(FIX, "M/tp1ep2", "torch"), dst)
    f = dst / "iter_0000005" / "mp_rank_00_001" / "model_optim_rng.pt"
    sd = torch.load(f, map_location="cpu", weights_only=False)  # a file Megatron-LM wrote for this test
    key = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"  # EP rank 1, local 1: global 3
    gate, up = sd["model"][key].chunk(2, 0)
    sd["model"][key] = torch.cat([up, gate]).contiguous()
    torch.save(sd, f)
    errors, missing = check(ckptbridge.open(str(dst)), refs["M/tp1ep2"])
    assert not missing
    bad = {k: v for k, v in errors.items() if v != 0.0}
    name = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    assert set(bad) == {(name, "fp32")} and bad[(name, "fp32")] > 0.1, bad
