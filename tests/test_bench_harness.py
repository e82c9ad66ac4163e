"""The benchmark harness can't rot: CI runs it at ``--quick`` on real cases and checks what it measured.

Not a timed test: no timing is asserted. ``bench/run.py core --quick`` runs two read cases
(ckptbridge and ``torch.load``) in fresh processes on inputs written by torch, safetensors,
DCP and ckptbridge; the result file must have the schema's shape
(``_harness.report.validate``), every measurement must be filled, and the bytes-read
measures must see the input: ``torch.load`` reads the 32 MiB file with read calls
(``rchar``), and with the inputs evicted from the page cache both tools get (most of) it
from the storage device (``read_bytes``). A case that reads nothing (negative control,
``write/torch.save``) shows none. The README generator then renders the file between its
markers, idempotently.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
MIB = 1 << 20


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("bench")
    out = work / "results"
    cmd = [sys.executable, os.path.join(BENCH, "run.py"), "core", "--quick", "--work", str(work / "work"),
           "--out", str(out), "--only", "read all/ckptbridge", "--only", "read all/torch.load",
           "--only", "write/torch.save"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(out / "core-quick.json") as fh:
        doc = json.load(fh)
    assert (out / "core-quick.md").read_text().startswith("# Core")
    return doc


def test_schema_and_measurements(quick_result: dict) -> None:
    sys.path.insert(0, BENCH)
    from _harness.report import validate

    doc = quick_result
    assert validate(doc) == []
    assert doc["schema"] == "ckptbridge-bench/1" and doc["size"] == "quick" and doc["cold_inputs_run"]
    m = doc["machine"]
    assert m["cores"] >= 1 and m["memcpy_gbps"] > 0 and m["disk_write_gbps"] > 0 and m["disk_read_gbps"] > 0
    cases = {c["name"]: c for c in doc["cases"]}
    assert set(cases) == {"read all/ckptbridge", "read all/torch.load", "write/torch.save"}
    for c in cases.values():
        assert c["status"] == "ok", c.get("reason")
        run = c["runs"][0]
        assert run["wall_s"] > 0 and run["outer_s"] > run["wall_s"] and run["samples"] >= 0
        assert run["maxrss"] > 0 and run["pss_peak"] > 0
    src = 32 * MIB  # the quick state: 16 tensors, 1/32 GiB
    torch_load, ours, write = cases["read all/torch.load"], cases["read all/ckptbridge"], cases["write/torch.save"]
    assert torch_load["runs"][0]["rchar"] >= src  # torch.load reads the file with read calls
    assert ours["runs"][0]["bytes_read"] >= 0.9 * src  # read calls + mapped pages
    for c in (torch_load, ours):  # inputs evicted: the device delivers the file, whatever the method
        assert c["cold"]["evicted_bytes"] >= src
        assert c["cold"]["read_bytes"] >= 0.9 * src, c["cold"]
        assert c["median"]["m.checksum"] == pytest.approx(ours["median"]["m.checksum"], rel=1e-9)
        assert c["median"]["pss_above_base"] >= 0.5 * src  # both hold the whole state at the end
    assert write["runs"][0]["rchar"] < src / 8 and write["cold"]["read_bytes"] < src / 8  # reads nothing
    assert write["runs"][0]["wchar"] >= src  # ... and writes the file
    group = next(g for g in doc["groups"] if g["group"] == "read everything")
    assert group["ref"] == "read all/ckptbridge" and group["checksums_agree"] is True
    peer = group["peers"][0]
    assert peer["tool"] == "torch.load" and peer["speedup_default"] > 0


def test_readme_tables_from_results(quick_result: dict, tmp_path) -> None:
    sys.path.insert(0, BENCH)
    import readme

    text = "intro\n<!-- bench:core-quick -->\nstale\n<!-- /bench:core-quick -->\n<!-- bench:core-8g -->\n" \
           "<!-- /bench:core-8g -->\nend\n"
    new, missing, unplaced = readme.render(text, {"core-quick": quick_result})
    assert missing == ["core-8g"] and unplaced == []
    assert "stale" not in new and "| torch.load |" in new and "(ref)" in new and new.endswith("end\n")
    assert readme.render(new, {"core-quick": quick_result})[0] == new  # idempotent
    _, _, unplaced = readme.render("no markers\n", {"core-quick": quick_result})
    assert unplaced == ["core-quick"]


def test_readme_standalone_results(quick_result: dict, tmp_path) -> None:
    """A standalone benchmark's result (its own JSON, no harness schema) goes into the README as the
    Markdown its script wrote, verbatim, or as a pointer to the JSON: never as re-typed numbers."""
    sys.path.insert(0, BENCH)
    import readme

    (tmp_path / "core-quick.json").write_text(json.dumps(quick_result))
    machine = {"cores": 2, "cpu": "AMD EPYC", "loadavg": [0.4, 0.5, 0.6], "load_avg_at_end": [0.3, 0.5, 0.6],
               "memcpy_gbps": 13.6, "disk_write_gbps": 1.37, "disk_read_gbps": 2.5}
    (tmp_path / "bench_async.json").write_text(json.dumps({"cases": {"torch": {"loop_s": 12.5}}, "commit": "abc1234",
                                                           "finished": "2026-11-27T08:00:00+00:00", "machine": machine}))
    (tmp_path / "bench_async.md").write_text("| loop | s |\n|---|---|\n| torch | 12.5 |\n")
    (tmp_path / "ds_resume.json").write_text(json.dumps({"median": {"native": 3.25}, "speedup_ttfs": 1.953}))
    results = readme.load_results(str(tmp_path))
    assert set(results) == {"core-quick", "bench_async", "ds_resume"}
    text = "".join(f"<!-- bench:{k} -->\nold\n<!-- /bench:{k} -->\n" for k in ("bench_async", "ds_resume", "bench_x"))
    new, missing, unplaced = readme.render(text, results)
    assert missing == ["bench_x"] and unplaced == ["core-quick"]
    assert "| torch | 12.5 |" in new and "bench/results/bench_async.json" in new
    # where each was measured: the file's commit and machine, or that the file does not say
    assert "*Measured at commit abc1234, finished 2026-11-27T08:00:00+00:00: 2 cores (AMD EPYC), load average " \
           "0.3 when it finished, memcpy 13.6 GB/s, disk write 1.37 / read 2.50 GB/s.*" in new
    assert new.count("records no commit or machine facts") == 1  # ds_resume's file
    assert "bench/results/ds_resume.json" in new and "3.25" not in new  # only its headline figures
    assert "| `speedup_ttfs` | 1.95 |" in new
    assert "old" not in new and "No result file `bench/results/bench_x.json`" in new
    # the commits block: every file under the commit it names, the files that name none apart
    gpu = {"gpu": "NVIDIA H200", "commit": "2343c44587aa", "time": "2026-11-26T11:28:11+0000", "cpus": 16}
    (tmp_path / "gpu_check.json").write_text(json.dumps({"checks": [], "machine": gpu}))
    results = readme.load_results(str(tmp_path))
    assert readme.provenance_line(results["gpu_check"][readme.RAW]) == \
        "*Measured at commit 2343c44587, 2026-11-26T11:28:11+0000, on NVIDIA H200.*\n"
    block = readme.commits_block(results)
    assert "* commit **abc1234**: 1 result file, 2026-11-27T08:00:00+00:00 (2 cores): `bench_async`" in block
    assert "* commit **(none recorded)**: 1 result file: `ds_resume`" in block
    assert "* commit **2343c44587**: 1 result file, 2026-11-26T11:28:11+0000 (NVIDIA H200): `gpu_check`" in block
    assert readme.unrecorded(results) == ["ds_resume"]
    marked = "".join(f"<!-- bench:{k} -->\n<!-- /bench:{k} -->\n" for k in (*results, "commits"))
    readme_copy = tmp_path / "README.md"
    readme_copy.write_text(marked)
    assert readme.main(["--results", str(tmp_path), "--readme", str(readme_copy)]) == 0
    assert block in readme_copy.read_text()
    assert readme.main(["--check", "--results", str(tmp_path), "--readme", str(readme_copy)]) == 1  # ds_resume
    (tmp_path / "ds_resume.json").unlink()
    readme_copy.write_text(marked.replace("<!-- bench:ds_resume -->\n<!-- /bench:ds_resume -->\n", ""))
    assert readme.main(["--results", str(tmp_path), "--readme", str(readme_copy)]) == 0
    assert readme.main(["--check", "--results", str(tmp_path), "--readme", str(readme_copy)]) == 0
    (tmp_path / "bad-quick.json").write_text(json.dumps({"schema": "ckptbridge-bench/1"}))
    with pytest.raises(SystemExit, match="not a valid result file"):  # a broken harness file is refused
        readme.load_results(str(tmp_path))


def test_bench_async_runs_and_reports_its_baselines(tmp_path) -> None:
    """bench_async at a tiny size (no timing asserted): each case measures its own loop without
    checkpoints in the same process, and the report's ratios are computed against it; the result
    carries the commit and the machine facts (``_proc.provenance``)."""
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(BENCH, "bench_async.py"), "--gib", "0.02", "--steps", "4",
           "--regimes", "disk", "--frameworks", "jax", "--cases", "ckptbridge", "--reps", "1",
           "--scratch", str(tmp_path / "scratch"), "--out", str(out), "--name", "t"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "CB_BENCH_PROBE_MIB": "16"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((out / "t.json").read_text())
    assert doc["commit"] and doc["machine"]["disk_write_gbps"] > 0 and doc["machine"]["probe_bytes"] == 16 << 20
    cases = doc["regimes"]["disk"]["jax"]
    assert set(cases) == {"none", "ckptbridge"}
    ours = cases["ckptbridge"]
    assert ours["saves"] == 2 and len(ours["stalls"]) == 2 and ours["saves_written"] == 2
    assert ours["plain_loop_seconds"] > 0 and ours["step_mad"] >= 0 and ours["bytes_written"] > 0
    md = (out / "t.md").read_text()
    assert "same loop without checkpoints" in md and "| jax | ckptbridge |" in md


def test_headlines_compare_like_with_like_and_the_readme_matches_the_results(tmp_path) -> None:
    """The committed results, derived again: DeepSpeed's headline is ``reshard --to
    deepspeed-universal`` (DeepSpeed's own layout, what ds_to_universal writes) against
    ds_to_universal, ckptbridge's own layout a second row; each Orbax case against ckptbridge
    reading the same checkpoint. No standalone table is cut. ``readme.py --check`` passes on the
    repository and fails on a README edited by hand (negative control)."""
    sys.path.insert(0, BENCH)
    import readme

    results = readme.load_results(os.path.join(BENCH, "results"))
    for size in ("1g", "8g"):
        doc = results[f"deepspeed-{size}"]
        (g,) = doc["groups"]
        wall = {c["name"]: c["median"]["wall_s"] for c in doc["cases"] if c["median"]}
        assert g["ref"] == "cb/reshard"
        (peer,) = g["peers"]
        assert peer["speedup_default"] == wall["ds/default"] / wall["cb/reshard"]
        jax = results[f"jax-{size}"]
        (p,) = jax["groups"][0]["peers"]
        wall = {c["name"]: c["median"]["wall_s"] for c in jax["cases"] if c["median"]}
        assert (p["vs_default"], p["vs_fastest"]) == ("cb/orbax", "cb/orbax-nozstd")
        assert p["speedup_default"] == wall["orbax/default"] / wall["cb/orbax"]
    rows = {f"r{i}_ratio": float(i) for i in range(100)}
    assert readme.headline_table(rows).count("\n| `r") == 100  # every row, none cut
    assert readme.main(["--check"]) == 0
    readme_copy = tmp_path / "README.md"
    with open(os.path.join(ROOT, "README.md")) as fh:
        text = fh.read()
    quoted = re.search(r"\d+\.\d\dx faster", text)  # a generated ratio, typed over by hand below
    assert quoted, "the README quotes no generated ratio"
    readme_copy.write_text(text.replace(quoted.group(0), "99.99x faster", 1))
    assert readme.main(["--check", "--readme", str(readme_copy)]) == 1


_MAPPED_READER = """
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import ckptbridge
from _harness.context import region

ckpt = ckptbridge.open(sys.argv[2])
with region():
    total = sum(float(ckpt[name].read()[::4096].sum()) for name in ckpt) if sys.argv[3] == "read" else 0.0
print(ckpt.stats.bytes_read, total)
"""


def test_bytes_read_at_256_mib_cannot_miss_mapped_reads(tmp_path) -> None:
    """ckptbridge reads through memory maps and drops the pages after copying, so sampled
    ``RssFile`` growth (``mapped``) can miss them. The two counts the tables rely on cannot: with
    the inputs evicted, ``read_bytes`` (from the storage device) sees >= 0.9x the 256 MiB file,
    and the reader's own count (``ckpt.stats.bytes_read``) is the tensors' bytes exactly. Negative
    control: the same process opening the file but reading nothing shows neither."""
    from safetensors.numpy import save_file

    sys.path.insert(0, BENCH)
    from _harness.measure import measure
    from _harness.runner import evict

    size = 256 * MIB
    arrays = {f"t{i}": np.full(size // 4 // 4, i + 1, dtype=np.float32) for i in range(4)}
    src = tmp_path / "src" / "state.safetensors"
    src.parent.mkdir()
    save_file(arrays, str(src))
    script = tmp_path / "reader.py"
    script.write_text(_MAPPED_READER)
    got = {}
    for mode in ("read", "none"):
        assert evict(str(src.parent)) >= size
        out = tmp_path / f"{mode}.out"
        m = measure([sys.executable, str(script), BENCH, str(src), mode], env=dict(os.environ), stdout=str(out))
        assert m.returncode == 0 and m.wall_s is not None, out.read_text()[-2000:]
        own, total = out.read_text().split()[-2:]
        got[mode] = (m, int(own), float(total))
    m, own, total = got["read"]
    assert m.read_bytes >= 0.9 * size, m  # the device delivered the file, however it was read
    assert own == size and total == sum((i + 1) * (size // 16 // 4096) for i in range(4))
    m, own, _ = got["none"]
    assert own == 0 and m.read_bytes < size / 8, m
