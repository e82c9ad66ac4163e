"""The standalone benchmark scripts can't rot: CI runs each one that fits a tiny size and checks the
file it writes (its own figures, and the commit and machine facts every result file carries).

Not timed tests: no timing is asserted. ``bench_async.py`` (tests/test_bench_harness.py),
``bench_ds_resume.py --big`` and ``bench_big_state.py`` (tests/test_make_big_state.py) are run
elsewhere; ``bench_lora.py``, ``bench_quant.py`` and ``bench_recipes.py`` work at real model shapes
(gigabytes) by design, and ``bench_elastic.py`` is the elastic example that tests/test_elastic.py
runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BENCH = os.path.join(ROOT, "bench")

pytestmark = pytest.mark.heavy


def _run(tmp_path: Path, script: str, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CB_BENCH_RESULTS": str(tmp_path / "results"),
           "CB_BENCH_PROBE_MIB": "16"}
    res = subprocess.run([sys.executable, os.path.join(BENCH, script), *args], capture_output=True, text=True,
                         timeout=900, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _result(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    assert doc["commit"] and doc["finished"] and doc["machine"]["memcpy_gbps"] > 0, path  # where it ran
    assert doc["machine"]["probe_bytes"] == 16 << 20
    return doc


def test_bench_convert_mp(tmp_path: Path) -> None:
    out = tmp_path / "results" / "convert_mp.json"
    _run(tmp_path, "bench_convert_mp.py", "--size-mib", "4", "--tensors", "2", "--procs", "2", "--reps", "1",
         "--out", str(out))
    doc = _result(out)
    assert {"n1", "floor"} <= set(doc["median_s"]) and doc["net_speedup_over_n1"]["n1"] == 1.0


def test_bench_remote(tmp_path: Path) -> None:
    out = tmp_path / "results" / "remote.json"
    _run(tmp_path, "bench_remote.py", "--size-mib", "2", "--tensors", "2", "--cols", "1024", "--reps", "1",
         "--out", str(out))
    doc = _result(out)
    assert doc["checksum_ckptbridge"] == doc["checksum_source"]


def test_bench_orbax_inplace(tmp_path: Path) -> None:
    _run(tmp_path, "bench_orbax_inplace.py", "--mib", "4", "--tensors", "2", "--reps", "1", "--layouts",
         "zarr2-raw", "--root", str(tmp_path / "ckpts"))
    doc = _result(tmp_path / "results" / "orbax_inplace.json")
    assert set(doc["summary"]) == {"zarr2-raw"} and doc["reps"] == 1


def test_make_bench_writes_every_result_file() -> None:
    """``make bench`` (every harness suite at its full sizes, then ``run.py --standalone``) writes
    every result file the README's tables come from, but the GPU check's; every standalone command
    names a script that exists."""
    sys.path.insert(0, BENCH)
    import run

    stems = {p.stem for p in Path(BENCH, "results").glob("*.json")}
    harness = {f"{s.name}-{size}" for s in run.suites() for size in s.sizes if size != "quick"}
    assert stems - harness - run.RESULT_STEMS == {"gpu_check"}
    assert stems >= run.RESULT_STEMS | harness  # and each of them has its file
    for commands, _ in run.STANDALONE.values():
        for py, script, *_ in commands:
            assert py in (run.PY, run.MAXTEXT_PY) and os.path.isfile(os.path.join(BENCH, script)), script
    assert run.run_standalone(["no_such_benchmark"]) == 2
