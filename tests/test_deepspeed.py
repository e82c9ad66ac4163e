"""The DeepSpeed adapter against real DeepSpeed 0.19.8 checkpoints.

Every run in ``tests/fixtures/deepspeed/runs.tar.xz`` (see the README there) was
written by real DeepSpeed on CPU/gloo together with DeepSpeed's own
``ds_to_universal`` and ``zero_to_fp32`` outputs and the live engine's state.
Each logical tensor and state read by ckptbridge must equal them bitwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch
from _common import same_bits

import ckptbridge
from ckptbridge import Checkpoint, FormatError, MissingShardError, TruncatedError
from ckptbridge import open as cb_open
from ckptbridge.adapters import deepspeed as ds_adapter

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures", "deepspeed")
with open(os.path.join(FIX, "runs.json")) as _fh:
    RUNS = json.load(_fh)
BY_NAME = {r["name"]: r for r in RUNS}
STATES = ("fp32", "exp_avg", "exp_avg_sq")
# With round_robin_gradients DeepSpeed's param_slice_mappings point at the wrong slices, so both
# its universal output and its live-engine getters (safe_get_full_*) are wrong (see README);
# zero_to_fp32 and the module's own bf16 weights are right and are what those runs compare with.
DS_MAPPING_WRONG = {"s2_bf16_w4_rr"}


_UNPACKED: dict[str, str] = {}


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The fixture runs, unpacked once per session."""
    import lzma
    import tarfile

    if "dir" in _UNPACKED:  # shared with the other test_deepspeed_* modules that import this fixture
        return _UNPACKED["dir"]
    out = _UNPACKED["dir"] = str(tmp_path_factory.mktemp("deepspeed_runs"))
    with lzma.open(os.path.join(FIX, "runs.tar.xz")) as fh, tarfile.open(fileobj=fh) as tar:
        tar.extractall(out, filter="data")
    return out


def _load(path: str) -> object:
    return torch.load(path, map_location="cpu", weights_only=True)


def _np(t: object) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def run_ds_train(launch, ws: int, out: str, args: list[str], dump: bool, timeout: int) -> dict:
    """Run tools/ds_train.py (``launch``: make_deepspeed_ckpt.launch) at world size ``ws`` with
    ``--out out --no_save``; its meta.json, with the engine state it dumped under "loaded"."""
    os.makedirs(out, exist_ok=True)
    args = [*args, "--out", out, "--no_save"]
    if dump:
        args += ["--dump_loaded", os.path.join(out, "loaded.pt")]
    launch(ws, args, os.path.join(out, "log.txt"), timeout=timeout)
    with open(os.path.join(out, "meta.json")) as fh:
        meta = json.load(fh)
    if dump:
        meta["loaded"] = _load(os.path.join(out, "loaded.pt"))
    return meta


def assert_loaded_equals(loaded: dict, src_root: str) -> None:
    """The fp32 weights and Adam moments a live engine holds (dumped by ds_train.py) equal the
    checkpoint's bitwise; the step advanced to 3; the per-group weight decay survived."""
    src = cb_open(src_root)
    params = loaded["params"]
    assert set(params) == set(src)
    for n, states in params.items():
        assert set(states) == set(STATES)
        for k, t in states.items():
            assert same_bits(_np(t), src[n].state(k).read()), f"{n}/{k} loaded wrong"
    assert loaded["steps"] == [3.0]
    assert [g["weight_decay"] for g in loaded["param_groups"]] == [0.1, 0.0]


def _engine_reference(run: str) -> dict[str, dict[str, np.ndarray]]:
    """{name: {state: array}} gathered from the live engine when the checkpoint was saved."""
    if os.path.exists(os.path.join(run, "reference.pt")):
        ref = _load(os.path.join(run, "reference.pt"))["params"]
        return {n: {k: _np(v) for k, v in d.items()} for n, d in ref.items()}
    if not os.path.exists(os.path.join(run, "reference_full_fp32.pt")):
        return {}  # tensor-parallel runs: compared with ds_to_universal only
    fp32 = _load(os.path.join(run, "reference_full_fp32.pt"))
    opt = _load(os.path.join(run, "reference_optim_state.pt"))
    return {n: {"fp32": _np(v), **{k: _np(x) for k, x in opt[n].items()}} for n, v in fp32.items()}


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_matches_deepspeed_tools_and_engine(runs_dir: str, name: str) -> None:
    info = BY_NAME[name]
    run = os.path.join(runs_dir, name)
    ckpt = cb_open(os.path.join(run, "ckpt"))
    assert ckpt.format == "deepspeed"
    assert ckpt.step == info["global_steps"]
    prov = ckpt.provenance
    assert prov["dp"] * prov["tp"] * prov["pp"] == info["world_size"]
    assert ckpt.provenance["zero_stage"] == info["stage"]

    engine = _engine_reference(run)
    assert set(engine) <= set(ckpt)
    for n, states in engine.items():
        if name in DS_MAPPING_WRONG:
            break
        for k, want in states.items():
            got = ckpt[n].state(k).read()
            assert same_bits(got, want.reshape(got.shape)), f"{name}: {n}/{k} differs from the live engine"
        assert ckpt[n].scalars["step"] == info["global_steps"]

    compared_universal = 0
    if info["ds_universal"] and name not in DS_MAPPING_WRONG:
        zero = os.path.join(run, "ckpt", info["tag"] + "_universal", "zero")
        shared = set(ckpt.extra.get("shared_params") or {})
        for n in os.listdir(zero):
            if not os.path.isdir(os.path.join(zero, n)):
                continue
            for k in STATES:
                f = os.path.join(zero, n, f"{k}.pt")
                if not os.path.exists(f):
                    continue
                obj = _load(f)
                want = _np(obj["param"] if isinstance(obj, dict) else obj)
                if k in ckpt[n].states and n not in shared:
                    got = ckpt[n].state(k).read()
                else:  # ds_to_universal writes module.float() for frozen and tied parameters
                    got = ckpt[n].state("param" if "param" in ckpt[n].states else "fp32").read(dtype="float32")
                assert same_bits(got.reshape(-1), want.reshape(-1)), f"{name}: {n}/{k} != ds_to_universal"
                compared_universal += 1
            sfile = os.path.join(zero, n, "step.pt")
            if os.path.exists(sfile):
                assert float(_load(sfile)) == ckpt[n].scalars["step"]
        assert compared_universal >= 3 * max(len(engine), 1)

    if info["zero_to_fp32"]:
        z = _load(os.path.join(run, "fp32", "pytorch_model.bin"))
        assert set(z) == set(ckpt), f"{name}: tensor names differ from zero_to_fp32's"
        for n, t in z.items():
            view = ckpt[n].state("fp32") if "fp32" in ckpt[n].states else ckpt[n]
            assert same_bits(view.read(), _np(t)), f"{name}: {n} != zero_to_fp32"


@pytest.mark.parametrize("name", sorted(n for n, r in BY_NAME.items() if r["dtype"] in ("bf16", "fp16")))
def test_16bit_module_weights(runs_dir: str, name: str) -> None:
    """``param`` = the bf16/fp16 module weights stored in the checkpoint (ZeRO-1/2 / BF16_Optimizer)."""
    half = ml_dtypes.bfloat16 if BY_NAME[name]["dtype"] == "bf16" else np.float16
    run = os.path.join(runs_dir, name)
    ckpt = cb_open(os.path.join(run, "ckpt"))
    with_param = [n for n in ckpt if "param" in ckpt[n].states]
    if BY_NAME[name]["stage"] == 3:  # ZeRO-3 stores only shape-[0] placeholders in 'module'
        assert all("fp32" in ckpt[n].states for n in ckpt)
        return
    assert with_param
    ref_path = os.path.join(run, "reference_module_sd.pt")
    ref = _load(ref_path) if os.path.exists(ref_path) else None
    for n in with_param:
        got = ckpt[n].state("param").read()
        assert got.dtype == half
        if "fp32" in ckpt[n].states:  # engine-independent: 16-bit weights = round(fp32 master)
            assert same_bits(got, ckpt[n].state("fp32").read().astype(half))
        if ref is not None:
            assert same_bits(got, _np(ref[n]))


def test_round_robin_uses_flat_order_not_deepspeeds_slice_mappings(runs_dir: str) -> None:
    """With round_robin_gradients DeepSpeed's universal output is wrong; ours matches its module weights."""
    run = os.path.join(runs_dir, "s2_bf16_w4_rr")
    ckpt = cb_open(os.path.join(run, "ckpt"))
    theirs = cb_open(os.path.join(run, "ckpt", "global_step3_universal"))
    z = _load(os.path.join(run, "fp32", "pytorch_model.bin"))
    wrong = 0
    for n in ckpt:
        module_bf16 = ckpt[n].state("param").read()  # the weights the engine trained with
        ours = ckpt[n].state("fp32").read()
        assert same_bits(ours.astype(ml_dtypes.bfloat16), module_bf16)
        assert same_bits(ours, _np(z[n]))
        wrong += not same_bits(theirs[n].state("fp32").read().astype(ml_dtypes.bfloat16), module_bf16)
    assert wrong, "DeepSpeed fixed its round-robin conversion: move the run out of DS_MAPPING_WRONG"


def test_frozen_and_shared_parameters(runs_dir: str) -> None:
    for name in ("s2_bf16_w2_frozen_tied", "s3_fp32_w2_frozen_tied"):
        ckpt = cb_open(os.path.join(runs_dir, name, "ckpt"))
        assert "wpe.weight" in ckpt and "exp_avg" not in ckpt["wpe.weight"].states
        assert ckpt["lm_head.weight"].fragments == ckpt["wte.weight"].fragments
        assert set(ckpt.extra["shared_params"]) == {"lm_head.weight"}


@pytest.mark.parametrize("name", sorted(n for n in BY_NAME if n.startswith("tp2_")))
def test_megatron_deepspeed_tensor_parallel(runs_dir: str, name: str) -> None:
    """mp_rank_XX files merged with the checkpoint's universal_checkpoint_info patterns."""
    ckpt = cb_open(os.path.join(runs_dir, name, "ckpt"))
    assert (ckpt.provenance["tp"], ckpt.provenance["dp"]) == (2, 2)
    assert ckpt["blocks.0.fc.weight"].shape == (96, 24)  # column parallel: 2 x [48, 24]
    assert ckpt["blocks.0.fc_out.weight"].shape == (24, 96)  # row parallel: 2 x [24, 48]
    assert ckpt["lm_head.weight"].shape == (101, 24)  # vocab padded to 102, cropped
    rules = {(r["rule"], r["pattern"], r.get("dim")) for r in ckpt.rules}
    assert ("Shard", r"^(?:.*\.fc_out\.weight)", 1) in rules and ("Shard", ".*", 0) in rules
    assert ("Replicate", r"^(?:wte\.weight)", None) in rules
    assert any(r["rule"] == "Pad" for r in ckpt.rules)
    mp1 = [f for f in ckpt["blocks.0.fc.weight"].state("exp_avg").fragments if "mp_rank_01" in f.location.file]
    assert mp1 and all(f.box.offset[0] >= 48 for f in mp1)
    if ckpt.extra["ds_config"]["bf16"]["enabled"] and BY_NAME[name]["stage"] < 3:  # ZeRO-3: no 16-bit copy
        for n in ckpt:
            assert same_bits(ckpt[n].state("param").read(), ckpt[n].state("fp32").read().astype(ml_dtypes.bfloat16))


def test_pipeline_parallel_layer_files(runs_dir: str) -> None:
    """PipelineModule: a stage per mp_rank_XX, bf16 weights in layer_XX-model_states.pt files."""
    ckpt = cb_open(os.path.join(runs_dir, "pp2_s1_bf16_w4", "ckpt"))
    assert (ckpt.provenance["pp"], ckpt.provenance["dp"]) == (2, 2)
    assert ckpt["0.wte.weight"].shape == (101, 24) and ckpt["4.lm_head.weight"].shape == (101, 24)
    stage1 = {f.location.file for f in ckpt["4.lm_head.weight"].state("exp_avg").fragments}
    assert all("mp_rank_01" in os.path.basename(f) for f in stage1)
    weights = {f.location.file for f in ckpt["4.lm_head.weight"].state("param").fragments}
    assert [os.path.basename(f) for f in weights] == ["layer_04-model_states.pt"]


def test_3d_pipeline_tensor_data_parallel(runs_dir: str) -> None:
    """Megatron-DeepSpeed 3D (TP2 x PP2 x DP2): per-layer files per TP rank
    (``layer_XX-model_YY``) merge with the universal_checkpoint_info patterns; the optimizer's
    model-parallel ranks are (stage, TP rank). Bitwise vs ds_to_universal: the test above."""
    ckpt = cb_open(os.path.join(runs_dir, "pp2_tp2_s1_bf16_w8", "ckpt"))
    assert (ckpt.provenance["tp"], ckpt.provenance["pp"], ckpt.provenance["dp"]) == (2, 2, 2)
    assert ckpt["1.fc.weight"].shape == (96, 24)  # column parallel: 2 x [48, 24]
    assert ckpt["3.fc_out.weight"].shape == (24, 96)  # row parallel: 2 x [24, 48]
    assert ckpt["4.lm_head.weight"].shape == (101, 24)  # vocab padded to 102, cropped
    weights = sorted(os.path.basename(f.location.file) for f in ckpt["3.fc_out.weight"].state("param").fragments)
    assert weights == ["layer_03-model_00-model_states.pt", "layer_03-model_01-model_states.pt"]
    last_stage = {os.path.basename(f.location.file) for f in ckpt["4.lm_head.weight"].state("exp_avg").fragments}
    assert last_stage and all(re.search(r"mp_rank_0[23]_optim", f) for f in last_stage)
    for n in ckpt:  # the module's bf16 weights agree with the fp32 master, TP shards included
        assert same_bits(ckpt[n].state("param").read(), ckpt[n].state("fp32").read().astype(ml_dtypes.bfloat16))


def test_extra_is_json_and_names_the_optimizer(runs_dir: str) -> None:
    ckpt = cb_open(os.path.join(runs_dir, "s2_bf16_w2", "ckpt"))
    text = json.dumps(ckpt.extra)
    assert "weight_decay" in text
    groups = ckpt.extra["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert ckpt.extra["ds_config"]["zero_optimization"]["stage"] == 2
    assert ckpt.extra["optimizer"]["clip_grad"] == 1.0
    assert ckpt.rules and ckpt.rules[-1]["rule"] == "FlatPartition"
    s3 = cb_open(os.path.join(runs_dir, "s3_bf16_w2_subgrp", "ckpt"))
    assert len(set(s3.extra["sub_groups"])) > 2  # several sub-groups per param group
    json.dumps(s3.extra)


def test_open_tag_folder_and_root_agree(runs_dir: str) -> None:
    root = os.path.join(runs_dir, "s2_fp32_w4", "ckpt")
    a, b = cb_open(root), cb_open(os.path.join(root, "global_step3"))
    assert a.path == b.path and list(a) == list(b)
    assert ds_adapter.detect(root) and ds_adapter.detect(os.path.join(root, "global_step3"))
    assert not ds_adapter.detect(runs_dir) and not ds_adapter.detect(os.path.join(root, "latest"))


def test_flat_partitions_are_zero_copy_fragments(runs_dir: str) -> None:
    """A parameter straddling two ranks is two+ fragments, one per rank file, no copies."""
    ckpt = cb_open(os.path.join(runs_dir, "s2_bf16_w2", "ckpt"))
    files = {f.location.file for n in ckpt for f in ckpt[n].state("exp_avg").fragments}
    assert {os.path.basename(f) for f in files} == {
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    straddling = [n for n in ckpt if len({f.location.file for f in ckpt[n].state("fp32").fragments}) == 2]
    assert straddling
    assert ckpt.stats.bytes_read == 0


def test_slice_reads_only_overlapping_fragments(runs_dir: str) -> None:
    ckpt = cb_open(os.path.join(runs_dir, "s2_bf16_w2", "ckpt"))
    # a parameter split between rank 0 and rank 1: find where the split row is
    name = next(n for n in ckpt if len({f.location.file for f in ckpt[n].state("exp_avg").fragments}) == 2)
    view = ckpt[name].state("exp_avg")
    frags = view.fragments
    rows, cols = view.shape
    full = view.read()
    ckpt.stats.reset()
    got = view[0:2]  # the first two rows live in one rank file
    assert same_bits(got, full[0:2])
    assert ckpt.stats.bytes_read == 2 * cols * 4
    assert len(ckpt.stats.per_file) == 1
    ckpt.stats.reset()
    last = view[rows - 1:rows]
    assert same_bits(last, full[rows - 1:rows])
    assert ckpt.stats.bytes_read == cols * 4
    assert len(ckpt.stats.per_file) == 1
    assert {f.location.file for f in frags} >= set(ckpt.stats.per_file)
    # one element in the middle: 4 bytes
    ckpt.stats.reset()
    assert view[rows // 2, cols // 2] == full[rows // 2, cols // 2]
    assert ckpt.stats.bytes_read == 4


def _copy_run(runs_dir: str, tmp_path: object, name: str = "s2_bf16_w2") -> str:
    dst = os.path.join(str(tmp_path), name)
    shutil.copytree(os.path.join(runs_dir, name, "ckpt"), dst)
    return dst


def test_missing_rank_file_is_named(runs_dir: str, tmp_path: object) -> None:
    root = _copy_run(runs_dir, tmp_path)
    os.remove(os.path.join(root, "global_step3", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    with pytest.raises(MissingShardError, match=r"bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt \(dp rank 1"):
        cb_open(root)


def test_truncated_rank_file_is_named(runs_dir: str, tmp_path: object) -> None:
    root = _copy_run(runs_dir, tmp_path)
    f = os.path.join(root, "global_step3", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(TruncatedError, match=r"bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt.*dp rank 1"):
        cb_open(root)


def test_truncated_after_open_is_named_on_read(runs_dir: str, tmp_path: object) -> None:
    root = _copy_run(runs_dir, tmp_path, "s3_bf16_w2")
    ckpt = cb_open(root)
    f = os.path.join(root, "global_step3", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 3)
    with pytest.raises(TruncatedError, match="bf16_zero_pp_rank_1"):
        for n in ckpt:
            ckpt[n].state("exp_avg_sq").read()


def test_latest_naming_a_missing_tag(runs_dir: str, tmp_path: object) -> None:
    root = _copy_run(runs_dir, tmp_path)
    shutil.rmtree(os.path.join(root, "global_step3"))
    with pytest.raises(MissingShardError, match="global_step3"):
        cb_open(root)
    with pytest.raises(FormatError):
        ds_adapter.index(str(tmp_path))


def test_deepspeed_universal_folder_opens_too(runs_dir: str) -> None:
    for name in ("s2_bf16_w2", "s3_fp32_w4"):
        native = cb_open(os.path.join(runs_dir, name, "ckpt"))
        univ = cb_open(os.path.join(runs_dir, name, "ckpt", "global_step3_universal"))
        assert set(univ) == set(native)
        for n in native:
            for k in STATES:
                assert same_bits(univ[n].state(k).read(), native[n].state(k).read())
            assert univ[n].scalars == native[n].scalars


def test_convert_to_universal_directory(runs_dir: str, tmp_path: object) -> None:
    src = os.path.join(runs_dir, "s1_bf16opt_w2", "ckpt")
    out = os.path.join(str(tmp_path), "u")
    ckptbridge.convert(src, out)
    a, b = cb_open(src), cb_open(out)
    assert set(a) == set(b)
    for n in a:
        for k in a[n].states:
            assert same_bits(b[n].state(k).read(), a[n].state(k).read())


def test_index_is_fast_and_reads_no_tensor_data(runs_dir: str) -> None:
    ckpt = cb_open(os.path.join(runs_dir, "s3_bf16_w2_subgrp", "ckpt"))
    assert isinstance(ckpt, Checkpoint)
    assert ckpt.stats.bytes_read == 0
    assert len(ckpt) == 39


def test_cli_convert_only_some_states(runs_dir: str, tmp_path: object) -> None:
    """``convert --states`` writes just those states (what ds_to_universal writes), bitwise;
    a state no tensor has is an error naming it, and nothing is written."""
    import subprocess
    import sys

    src = os.path.join(runs_dir, "s2_bf16_w2", "ckpt")
    out = os.path.join(str(tmp_path), "u")
    cli = [sys.executable, "-m", "ckptbridge", "convert", src]
    r = subprocess.run([*cli, out, "--states", ",".join(STATES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    a, b = cb_open(src), cb_open(out)
    for n in a:
        assert set(b[n].states) == set(STATES)
        for k in STATES:
            assert same_bits(b[n].state(k).read(), a[n].state(k).read())
    bad = os.path.join(str(tmp_path), "bad")
    r = subprocess.run([*cli, bad, "--states", "fp32,exp_avgsq"], capture_output=True, text=True)
    assert r.returncode == 2 and "'exp_avgsq'" in r.stderr and not os.path.exists(bad)
