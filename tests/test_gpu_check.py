"""``tools/gpu_check.py`` with the device replaced by the CPU, so that the GPU check cannot rot.

Every check runs (Checkpointer staging and stall, restore_into, DeepSpeed / DCP loads onto a
``DeviceMesh`` and into tensors, the DeepSpeed run onto a jax ``Mesh``) against references
from DeepSpeed's own ``zero_to_fp32`` / ``ds_to_universal`` and torch's own ``dcp.save``;
the table and the JSON record are written. On a GPU the same script ran with ``--device cuda``
(its record: ``bench/results/gpu_check.json``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

from test_deepspeed import runs_dir  # noqa: F401  (session fixture)

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "tools", "gpu_check.py")
CHECKS = {"torch pinned staging", "torch stall vs D2H", "torch restore_into", "jax stall vs D2H",
          "DeepSpeed -> tensors", "DeepSpeed -> DeviceMesh", "DCP -> DeviceMesh", "DCP -> tensors",
          "DeepSpeed -> jax Mesh"}


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def test_every_check_passes_on_cpu_and_the_record_has_the_machine(runs_dir, tmp_path):  # noqa: F811
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--device", "cpu", "--mib", "2", "--reps", "2", "--out", str(out),
         "--deepspeed-run", os.path.join(runs_dir, "s2_bf16_w2")],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    rows = {r["check"]: r for r in record["checks"]}
    assert set(rows) == CHECKS and record["ok"] and all(r["ok"] for r in rows.values())
    for name in rows:  # the printed table holds every row
        assert f"| {name} | pass |" in proc.stdout
    assert rows["torch pinned staging"]["figure"].startswith("0/")  # no CUDA: nothing page-locked
    assert rows["torch pinned staging"]["figure"] != "0/0 images locked"
    assert rows["DeepSpeed -> DeviceMesh"]["figure"] == "78 DTensors on cpu"  # 39 fp32 + 39 exp_avg
    assert rows["DeepSpeed -> jax Mesh"]["figure"] == "39 arrays on cpu"
    stall = rows["torch stall vs D2H"]["values"]
    assert stall["bytes"] >= 2**20 and stall["d2h_s"] > 0
    machine = record["machine"]
    assert machine["device"] == "cpu" and machine["gpu"] is None and len(machine["commit"]) == 40
    assert {"torch", "jax", "cuda", "driver", "python", "cpus", "time"} <= set(machine)


def test_a_wrong_reference_fails_its_row_and_an_error_becomes_a_failed_row(runs_dir, tmp_path):  # noqa: F811
    """Negative controls: DeepSpeed's fp32 of another run (same shapes, other values) as the
    reference fails the row; a check that raises is a FAIL row naming the error."""
    gc = _module()
    run = shutil.copytree(os.path.join(runs_dir, "s2_bf16_w2"), tmp_path / "run")
    shutil.copy(os.path.join(runs_dir, "s2_fp32_w4", "fp32", "pytorch_model.bin"), run / "fp32")
    cfg = gc.Config("cpu", 1, 1, str(tmp_path), str(run))
    (row,) = gc.check_deepspeed_to_tensors(cfg)
    assert not row.ok and "differ" in row.detail
    missing = gc.Config("cpu", 1, 1, str(tmp_path), str(tmp_path / "nowhere"))
    rows = gc.run_checks(missing, (gc.check_deepspeed_to_tensors, gc.check_jax_mesh))
    assert [r.check for r in rows] == ["deepspeed_to_tensors", "jax_mesh"] and all(not r.ok and r.figure == "error" and "nowhere" in r.detail for r in rows)
    assert "| DeepSpeed -> tensors | FAIL |" in gc.table([row])
