"""A live tensor-parallel DeepSpeed engine resumes straight from a native checkpoint of another TP x DP.

The sources are real Megatron-DeepSpeed-style runs (``tools/ds_train_tp.py``: TP=2 x DP=2 with an
``mpu``, a row-parallel ``fc_out``, replicated norms and embedding, and a vocabulary-parallel
``lm_head`` padded from 101 rows to a multiple of TP). Each case launches ``ds_train_tp.py`` at a
new layout under torchrun (CPU/gloo): ``ckptbridge.adapters.deepspeed.load_engine`` fills the
engine, every TP rank dumps what it holds (fp32 master, Adam moments, the weights the forward
uses), and two steps are trained.

* Each TP rank's state must equal, bitwise, its slice of the checkpoint's logical tensors, cut
  here with numpy as DeepSpeed's universal load cuts it (``universal_checkpoint.py``): replicated
  parameters whole, ``fc_out`` along dim 1, the rest along dim 0, ``lm_head`` re-padded with zero
  rows to ``rows x TP`` first. The low-precision weights must be the master rounded.
* The source is the native checkpoint, or (one case) ``ds_to_universal``'s output of it.
* Where DeepSpeed can load its own ``ds_to_universal`` output at the new layout (ZeRO-1/2), a
  second engine in the same processes resumes with ``load_universal`` and trains the same two
  steps: the two loss sequences must be bitwise equal. DeepSpeed's ZeRO-3 universal load does not
  cut tensor-parallel slices (it fails on this checkpoint: "start + length exceeds dimension
  size"), so the ZeRO-3 case checks the state, and that TP=2 and TP=4 continue alike.
"""

from __future__ import annotations

import json
import os
import re
import sys

import ml_dtypes
import numpy as np
import pytest
from test_deepspeed import _load, _np, runs_dir  # noqa: F401  (session fixture)

from ckptbridge import open as cb_open

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
import make_deepspeed_ckpt as tools  # noqa: E402

VOCAB = 101
REPLICATED = (r"wte\.weight", r".*\.ln\.(weight|bias)", r"ln_f\.(weight|bias)", r".*\.fc_out_bias")
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _slice(full: np.ndarray, name: str, tp: int, rank: int) -> np.ndarray:
    """Tensor-parallel rank ``rank`` of ``tp``'s part of the logical tensor ``full`` (numpy)."""
    if name == "lm_head.weight":
        rows = -(-VOCAB // tp) * tp
        full = np.concatenate([full, np.zeros((rows - full.shape[0], *full.shape[1:]), full.dtype)])
    if any(re.fullmatch(p, name) for p in REPLICATED):
        return full
    return np.split(full, tp, axis=1 if name.endswith("fc_out.weight") else 0)[rank]


def _run(tmp: str, label: str, src: str, tp: int, nproc: int, stage: int, dtype: str,
         compare: str | None) -> dict:
    out = os.path.join(tmp, label)
    args = ["--tp", str(tp), "--stage", str(stage), "--dtype", dtype, "--steps", "2", "--out", out,
            "--no_save", "--resume_native", src]
    if compare:
        args += ["--compare_universal", compare]
    os.makedirs(out, exist_ok=True)
    tools.launch(nproc, args, os.path.join(out, "log.txt"), timeout=900, script=tools.TRAIN_TP)
    with open(os.path.join(out, "meta.json")) as fh:
        meta = json.load(fh)
    meta["loaded"] = [_load(os.path.join(out, f"loaded.tp{r}.pt")) for r in range(tp)]
    return meta


def _assert_state(meta: dict, src: str, tp: int, dtype: str) -> None:
    ckpt = cb_open(src)
    for rank, held in enumerate(meta["loaded"]):
        assert set(held) == set(ckpt), rank
        for name, states in held.items():
            for k in STATES:
                want = _slice(ckpt[name].state(k).read(), name, tp, rank)
                got = _np(states[k])
                assert got.shape == want.shape and np.array_equal(got, want), f"TP rank {rank}: {name}/{k}"
            lp = _np(states["lp"])
            master = _np(states["fp32"])
            assert np.array_equal(lp, master.astype(ml_dtypes.bfloat16) if dtype == "bf16" else master), name
    assert meta["resumed_at"] == ckpt.step
    # every rank read only its partition of its TP slices (fp32 master + 2 moments, 12 bytes an
    # element; the vocabulary's zero rows are not read): all ranks together, each element once per TP rank
    held = sum(max(0, min(s["fp32"].shape[0], VOCAB - r * s["fp32"].shape[0])) * s["fp32"][0].numel()
               if n == "lm_head.weight" else s["fp32"].numel()
               for r, per_rank in enumerate(meta["loaded"]) for n, s in per_rank.items())
    assert held * 12 <= sum(meta["bytes_read"]) <= held * 12 * 1.02, (meta["bytes_read"], held * 12)


CASES = [  # label, source run (and folder in its ckpt: the native tag or ds_to_universal's), new TP,
    # processes (TP x DP), stage, dtype; the reference is DeepSpeed's load_universal of ds_to_universal's output
    ("tp2dp2_to_tp2dp1_zero1", "tp2_s1_fp32_w4", "", 2, 2, 1, "fp32"),
    ("tp2dp2_to_tp1dp2_zero1", "tp2_s1_fp32_w4", "", 1, 2, 1, "fp32"),
    ("tp2dp2_to_tp4_zero2_bf16", "tp2_s2_bf16_w4", "", 4, 4, 2, "bf16"),
    ("universal_to_tp4_zero2_bf16", "tp2_s2_bf16_w4", "global_step2_universal", 4, 4, 2, "bf16"),
]


@pytest.mark.heavy
@pytest.mark.parametrize("label,run,folder,tp,nproc,stage,dtype", CASES, ids=[c[0] for c in CASES])
def test_tp_engine_resumes_at_a_new_layout(runs_dir: str, tmp_path, label, run, folder, tp, nproc,  # noqa: F811
                                           stage, dtype) -> None:
    root = os.path.join(runs_dir, run, "ckpt")
    src = os.path.join(root, folder) if folder else root
    meta = _run(str(tmp_path), label, src, tp, nproc, stage, dtype, root)
    _assert_state(meta, src, tp, dtype)
    assert len(meta["losses"]) == 2 and np.isfinite(meta["losses"]).all()
    assert meta["losses"] == meta["reference_losses"]  # bitwise, DeepSpeed's own universal load


@pytest.mark.heavy
def test_zero3_tp_engine_resumes_at_tp4(runs_dir: str, tmp_path) -> None:  # noqa: F811
    src = os.path.join(runs_dir, "tp2_s3_bf16_w4", "ckpt")
    tp4 = _run(str(tmp_path), "tp4", src, 4, 4, 3, "bf16", None)
    _assert_state(tp4, src, 4, "bf16")
    tp2 = _run(str(tmp_path), "tp2", src, 2, 2, 3, "bf16", None)
    _assert_state(tp2, src, 2, "bf16")
    # the same state, other reduction orders in bf16 compute
    np.testing.assert_allclose(tp4["losses"], tp2["losses"], rtol=0, atol=2e-3)


def test_each_layout_pattern_cuts_as_deepspeed(tmp_path) -> None:
    """The cuts of ``universal_checkpoint_info``'s patterns on a small file (numpy is the reference):
    two sub-parameters half by half, row-parallel along dim 1, vocabulary re-padded with zero rows
    to rows x TP, without patterns along the one dimension the shapes differ in; a shape that is no
    slice is refused, naming the file and tensor."""
    from safetensors.numpy import save_file

    from ckptbridge.adapters.deepspeed._resume import _TP, _local, _weights
    from ckptbridge.plugin import Box, ShapeMismatchError, read_state

    a = np.arange(48, dtype=np.float32).reshape(8, 6)
    v = np.arange(15, dtype=np.float32).reshape(5, 3)
    path = str(tmp_path / "m.safetensors")
    save_file({"qk": a, "row": a, "col": a, "emb": v}, path)
    ckpt = cb_open(path)
    info = {"parameter_with_2_sub_params_cat_dim_0": [r"qk"], "parameter_with_row_parallelism_patterns": [r"row"],
            "vocabulary_parameter_patterns": [r"emb"]}

    def cut(name: str, shape: tuple[int, ...], rank: int, size: int, patterns: dict = info) -> np.ndarray:
        view = _local(ckpt, name, _weights(ckpt, name), shape, _TP(rank, size, patterns))
        return read_state(view, Box((0,) * len(shape), view.shape), ckpt.files, "float32", name)

    assert np.array_equal(cut("qk", (4, 6), 1, 2), np.concatenate([a[2:4], a[6:8]]))
    assert np.array_equal(cut("row", (8, 3), 1, 2), a[:, 3:])
    assert np.array_equal(cut("col", (4, 6), 1, 2), a[4:])
    assert np.array_equal(cut("col", (8, 6), 1, 2), a)  # replicated: the shapes agree
    assert np.array_equal(cut("emb", (2, 3), 2, 4), np.concatenate([v[4:], np.zeros((1, 3), np.float32)]))
    with pytest.raises(ShapeMismatchError, match=r"tensor 'emb' has 5 vocabulary rows; .* holds 4 at tensor-parallel"):
        cut("emb", (2, 3), 1, 2)  # as DeepSpeed's assertion: a real row is never dropped
    assert np.array_equal(cut("emb", (7, 3), 0, 1), np.concatenate([v, np.zeros((2, 3), np.float32)]))
    assert np.array_equal(cut("col", (8, 3), 1, 2, {}), a[:, 3:])
    with pytest.raises(ShapeMismatchError, match=r"m\.safetensors: tensor 'col' .* is not its slice"):
        cut("col", (3, 6), 0, 2)
    with pytest.raises(ShapeMismatchError, match=r"tensor 'col' has shape \(8, 6\), the engine's parameter"):
        cut("col", (4, 6), 0, 1)


def test_unsupported_engines_are_refused_by_name(tmp_path) -> None:
    """What load_engine cannot fill is refused before anything is read, naming the checkpoint and
    the reason: no optimizer, NVMe-offloaded state, ZeRO-3 with MoE (expert-parallel) layers, an optimizer
    wrapper that is not ZeRO / BF16_Optimizer, and TP layouts cut by sub-parameter shapes."""
    from types import SimpleNamespace

    from safetensors.numpy import save_file

    from ckptbridge.adapters.deepspeed._resume import _check_supported, _tp_of
    from ckptbridge.plugin import OptionError

    path = str(tmp_path / "m.safetensors")
    save_file({"w": np.zeros(4, np.float32)}, path)
    ckpt = cb_open(path)
    zero = SimpleNamespace(bit16_groups=[], optimizer=object())
    cases = [
        (SimpleNamespace(optimizer=None), None, "has no optimizer"),
        (SimpleNamespace(), SimpleNamespace(swap_optimizer=True), "NVMe-offloaded"),
        (SimpleNamespace(has_moe_layers=True), SimpleNamespace(fp32_partitioned_groups_flat=[]), "ZeRO-3 .*MoE"),
        (SimpleNamespace(), SimpleNamespace(optimizer=object()), "is not a ZeRO-1/2/3 or BF16_Optimizer"),
    ]
    for engine, opt, why in cases:
        with pytest.raises(OptionError, match=rf"m\.safetensors: load_engine: .*{why}"):
            _check_supported(engine, opt if opt is not None else engine.optimizer, ckpt)
    _check_supported(SimpleNamespace(has_moe_layers=False), zero, ckpt)  # a ZeRO-1/2 engine passes
    _check_supported(SimpleNamespace(has_moe_layers=True), zero, ckpt)  # with MoE layers too

    class Mpu:
        def get_tensor_model_parallel_rank(self) -> int:
            return 1

        def get_tensor_model_parallel_world_size(self) -> int:
            return 2

    info = {"parameter_with_sub_params": [{"patterns": [r"qkv"], "shape": [[8, 8], 4]}]}
    with pytest.raises(OptionError, match=r"universal_checkpoint_info uses \['parameter_with_sub_params'\]"):
        _tp_of(SimpleNamespace(mpu=Mpu(), module=SimpleNamespace(universal_checkpoint_info=info)), ckpt)
    tp = _tp_of(SimpleNamespace(mpu=Mpu(), module=SimpleNamespace(universal_checkpoint_info={})), ckpt)
    assert (tp.rank, tp.size) == (1, 2)
