"""CI-size smoke test of ``bench/make_big_state.py`` (the big-state benchmark's generator).

It makes a tiny state (2 layers of width 64) in the three layouts with the real libraries
(DeepSpeed ZeRO-2 and ZeRO-3 on 2 CPU ranks, torch DCP of an FSDP2 model + AdamW) and
checks that ckptbridge opens each with every parameter, shape and state the generator
promises, that the values are what the libraries made (bf16 weights = fp32 master in a
fresh DeepSpeed engine; random Adam moments; DCP's AdamW state after one step), and that
``convert`` writes a checkpoint that verifies; that ``bench_ds_resume.py --big`` resumes the
ZeRO-2 state on one rank both ways with equal first losses; and that ``bench_big_state.py`` runs
every case on it with its inputs evicted first and its outputs fsync'd (no timing asserted).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import ckptbridge

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "bench")
sys.path.insert(0, BENCH)
import make_big_state  # noqa: E402

SIZE = {"layers": 2, "d_model": 64, "vocab": 128, "ctx": 16}


@pytest.mark.heavy
def test_generator_makes_all_layouts(tmp_path):
    out = str(tmp_path / "big")
    subprocess.run([sys.executable, os.path.join(BENCH, "make_big_state.py"), out, "--layers", "2",
                    "--d-model", "64", "--vocab", "128", "--ctx", "16", "--ws", "2"],
                   check=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(os.path.join(out, "info.json")) as fh:
        info = json.load(fh)
    want = make_big_state.shapes(SIZE["layers"], SIZE["d_model"], SIZE["vocab"], SIZE["ctx"])
    assert info["tensors"] == len(want) == 12 * 2 + 5
    assert info["params"] == sum(int(np.prod(s)) for s in want.values())
    assert info["largest_tensor_fp32_bytes"] == 4 * 256 * 64
    assert set(info["formats"]) == {"ds2", "ds3", "dcp"}
    for fmt, f in info["formats"].items():
        ckpt = ckptbridge.open(f["path"])
        assert ckpt.format == ("dcp" if fmt == "dcp" else "deepspeed")
        assert {n: ckpt[n].shape for n in ckpt} == want, fmt
        for name in ("blocks.1.fc.weight", "ln_f.bias", "wte.weight"):
            t = ckpt[name]
            assert {"fp32", "exp_avg", "exp_avg_sq"} <= set(t.states), (fmt, name, t.states)
            m, v = t.state("exp_avg").read(), t.state("exp_avg_sq").read()
            assert np.abs(m).mean() > 0 and (v >= 0).all() and v.max() > 0
        if fmt == "ds2":  # a fresh engine: the fp32 master is the bf16 module weights, upcast
            w = ckpt["blocks.1.fc.weight"]
            assert w.state("param").dtype == "bfloat16"
            np.testing.assert_array_equal(w.state("param").read().astype(np.float32), w.state("fp32").read())
            assert w.state("fp32").read().astype(ml_dtypes.bfloat16).astype(np.float32).tolist() == \
                w.state("fp32").read().tolist()
        if fmt == "dcp":  # torch AdamW after one step: exp_avg = (1 - beta1) * grad, exp_avg_sq = (1 - beta2) * grad^2
            t = ckpt["blocks.0.qkv.weight"]
            m, v = t.state("exp_avg").read(), t.state("exp_avg_sq").read()
            np.testing.assert_allclose(v, (m / 0.1) ** 2 * 0.05, rtol=1e-4, atol=1e-12)
            assert t.scalars.get("step") == 1
    dst = str(tmp_path / "universal")
    ckptbridge.convert(info["formats"]["ds3"]["path"], dst)
    assert ckptbridge.verify(dst) == []

    # bench_ds_resume.py --big resumes this state at a new DP degree both ways (its timings are
    # the generator's resume worker's): the first losses agree
    results = tmp_path / "results"
    subprocess.run([sys.executable, os.path.join(BENCH, "bench_ds_resume.py"), "--big", out, "--dst-ws", "1",
                    "--reps", "1", "--workdir", str(tmp_path / "resume")], check=True, timeout=1800,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "CB_BENCH_RESULTS": str(results),
                        "CB_BENCH_PROBE_MIB": "16"})
    with open(results / "ds_resume_big.json") as fh:
        res = json.load(fh)
    assert res["commit"] and res["machine"]["memcpy_gbps"] > 0  # every result file says where it ran
    assert res["first_losses_equal"] and res["src"] == {"ws": 2, "stage": 2} and res["dst"]["ws"] == 1
    assert 0 < res["median"]["native"]["ready_s"] <= res["median"]["native"]["ttfs_s"]

    # bench_big_state.py on this state, one rep: every command starts with its inputs evicted and a
    # convert's time includes the fsync of its output; both torch loads give the same weights
    subprocess.run([sys.executable, os.path.join(BENCH, "bench_big_state.py"), out, "--reps", "1"], check=True,
                   timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1", "CB_BENCH_RESULTS": str(results),
                                      "CB_BENCH_PROBE_MIB": "16"})
    with open(results / "big_state.json") as fh:
        big = json.load(fh)
    assert big["commit"] and big["machine"]["memcpy_gbps"] > 0
    assert set(big["runs"]) == {*(f"convert/{f}/{t}" for f in ("ds2", "ds3") for t in ("ds_to_universal", "ckptbridge")),
                                "convert/dcp/ckptbridge", "jax/orbax", "jax/cb-native", "jax/cb-orbax",
                                "torch/dcp", "torch/ckptbridge"}
    for label, (row,) in big["runs"].items():
        assert row["evicted_mib"] > 0 and 0 <= row["fsync_s"] <= row["wall_s"], (label, row)
    assert big["summary"]["torch"]["same_checksum"] and big["summary"]["convert/ds2"]["flat_ok"]
