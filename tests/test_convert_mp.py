"""Scale-out conversion: ``ckptbridge convert`` run as N processes by a real launcher.

``torchrun`` (ranks agree through its TCP store) and a bare ``RANK``/``WORLD_SIZE`` launch as
``srun`` would make it (ranks agree through files); each rank writes a balanced share and rank 0
commits. The result equals the one-process conversion (manifests up to data file names and
offsets, every tensor bitwise); a rank killed mid-conversion leaves nothing committed, and a
rerun succeeds.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
from _common import free_port

import ckptbridge

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
DS = os.path.join(FIX, "migration", "ds_zero2_w2", "ckpt")  # a real DeepSpeed ZeRO-2 run (2 ranks)
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def torchrun(n: int, *args: str, store: bool = False, **popen: object) -> subprocess.Popen:
    """``torchrun --standalone`` (a run id: ranks agree through files), or with ``store`` a static
    rendezvous on a free port and no run id (ranks agree through torchrun's TCP store)."""
    how = ["--standalone"]
    if store:
        how = ["--nnodes=1", "--node-rank=0", "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *how, f"--nproc-per-node={n}", "-m", "ckptbridge", *args]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def ranks(n: int, *args: str, job: str, extra_env: dict | None = None) -> list[subprocess.Popen]:
    """``n`` processes with RANK/WORLD_SIZE and a job id, no MASTER_ADDR (as srun launches them)."""
    env = {k: v for k, v in ENV.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return [subprocess.Popen([sys.executable, "-m", "ckptbridge", *args], text=True,
                             env={**env, "RANK": str(r), "WORLD_SIZE": str(n), "CKPTBRIDGE_JOB_ID": job,
                                  **(extra_env or {})},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(n)]


def finish(p: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def manifest(path: str) -> dict:
    with open(os.path.join(path, "manifest.json")) as fh:
        m = json.load(fh)
    for t in m["tensors"].values():  # where the bytes landed differs by design; nothing else may
        for st in t["states"].values():
            for f in st["fragments"]:
                f.pop("file"), f.pop("byte_offset")
            st["fragments"].sort(key=lambda f: f["offset"])
    m["provenance"].pop("created")
    return m


def assert_same_as_one_process(one: str, many: str, n: int) -> None:
    assert manifest(one) == manifest(many)
    a, b = ckptbridge.open(one), ckptbridge.open(many)
    for state in a.states():
        assert all(r.equal for r in ckptbridge.diff(a, b, state=state) if r.in_a), state
    assert ckptbridge.verify(many) == []
    files = sorted(os.listdir(os.path.join(many, "data")))
    assert {f.split("-r")[1][:5] for f in files} == {f"{r:05d}" for r in range(n)}  # every rank wrote
    per_rank = [sum(os.path.getsize(os.path.join(many, "data", f)) for f in files if f"-r{r:05d}-" in f)
                for r in range(n)]
    sizes = sorted((st.nbytes for t in a.tensors.values() for st in t.states.values()), reverse=True)
    assert max(per_rank) - min(per_rank) <= sizes[0] + (64 << 10), per_rank  # LPT: within one piece
    assert not glob.glob(many + ".partial*")  # no stage or coordination files left


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("one") / "u")
    ckptbridge.convert(DS, out)
    return out


@pytest.mark.heavy
@pytest.mark.parametrize("n,store", [(2, False), (3, False), (2, True)], ids=["files-2", "files-3", "tcp-store-2"])
def test_torchrun_matches_one_process(tmp_path, one_process, n, store, monkeypatch):
    out = str(tmp_path / "u")
    from ckptbridge.adapters.torch import _store

    made = tmp_path / "made"  # which store the ranks used: the TCP store's factory leaves a mark
    monkeypatch.setitem(ENV, "PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), ENV.get("PYTHONPATH")])))
    (tmp_path / "sitecustomize.py").write_text(
        "import ckptbridge.adapters.torch._store as s\n"
        "f = s.store\n"
        f"def store(*a):\n    open({str(made)!r}, 'a').write('x')\n    return f(*a)\n"
        "s.store = store\n")
    assert _store.store  # the factory the entry point names
    rc, stdout, stderr = finish(torchrun(n, "convert", DS, out, store=store))
    assert rc == 0, stderr[-3000:]
    assert f"wrote {out} ({n} processes)" in stdout
    assert_same_as_one_process(one_process, out, n)
    # with a run id every rank coordinated through files, and never asked for the TCP store
    assert (made.exists() and len(made.read_text()) == n) == store


@pytest.mark.heavy
def test_reshard_to_universal_under_torchrun(tmp_path, one_process):
    out = str(tmp_path / "u")
    rc, _, stderr = finish(torchrun(2, "reshard", DS, out, "--to", "universal"))
    assert rc == 0, stderr[-3000:]
    assert_same_as_one_process(one_process, out, 2)


def test_rank_files_without_a_store_coordinate_through_files(tmp_path, one_process):
    out = str(tmp_path / "u")
    procs = ranks(2, "convert", DS, out, job="files1")
    results = [finish(p) for p in procs]
    assert [r[0] for r in results] == [0, 0], [r[2][-2000:] for r in results]
    assert results[0][1].strip() == f"wrote {out} (2 processes)" and results[1][1] == ""
    assert_same_as_one_process(one_process, out, 2)
    # the destination is committed now: every rank refuses to write it again, naming it
    results = [finish(p) for p in ranks(2, "convert", DS, out, job="files2")]
    assert [r[0] for r in results] == [2, 2] and all(out in r[2] for r in results)


@pytest.fixture(scope="module")
def big_source(tmp_path_factory):
    """A real torch.save file of 96 MiB, so that a rank's share takes long enough to be caught."""
    torch = pytest.importorskip("torch")
    path = tmp_path_factory.mktemp("big") / "model.pt"
    g = torch.Generator().manual_seed(1)
    torch.save({f"layer{i}.w": torch.randn(1024, 2048, generator=g) for i in range(12)}, path)
    return str(path)


def _stop_rank_when_writing(root: str, out: str, rank: int, timeout: float = 120) -> psutil.Process:
    """SIGSTOP the process of ``rank`` as soon as its first data file exists (mid-conversion)."""
    deadline = time.monotonic() + timeout
    procs: list[psutil.Process] = []
    while time.monotonic() < deadline:
        if glob.glob(f"{out}.partial*/data/*-r{rank:05d}-*"):
            for p in psutil.Process(root).children(recursive=True):
                try:
                    if p.environ().get("RANK") == str(rank) and "ckptbridge" in " ".join(p.cmdline()):
                        procs.append(p)
                except psutil.Error:
                    continue
            if procs:
                procs[0].send_signal(signal.SIGSTOP)
                return procs[0]
        time.sleep(0.002)
    raise AssertionError(f"rank {rank} never started writing")


def _nothing_committed(tmp_path: str, out: str) -> None:
    assert not os.path.exists(out)
    assert not [p for p in glob.glob(f"{tmp_path}/**", recursive=True) if p.endswith("COMMITTED")]
    with pytest.raises(ckptbridge.MissingShardError):
        ckptbridge.open(out)


@pytest.mark.heavy
def test_torchrun_rank_killed_mid_conversion_commits_nothing_and_rerun_succeeds(tmp_path, big_source):
    out = str(tmp_path / "u")
    job = torchrun(2, "convert", big_source, out)
    victim = _stop_rank_when_writing(job.pid, out, 1)
    assert not glob.glob(f"{out}.partial*/manifest.r00001.json")  # caught before its share was done
    victim.send_signal(signal.SIGKILL)
    rc, _, stderr = finish(job)
    assert rc != 0
    _nothing_committed(str(tmp_path), out)
    assert not glob.glob(out + ".partial*")  # rank 0, torn down, removed the stage and coordination files
    rc, _, stderr = finish(torchrun(2, "convert", big_source, out))
    assert rc == 0, stderr[-3000:]
    one = str(tmp_path / "one")
    ckptbridge.convert(big_source, one)
    assert_same_as_one_process(one, out, 2)


@pytest.mark.heavy
def test_file_coordinated_rank_killed_is_named_and_rerun_succeeds(tmp_path, big_source):
    out = str(tmp_path / "u")
    procs = ranks(2, "convert", big_source, out, "--timeout", "3", job="kill1")
    victim = None
    deadline = time.monotonic() + 120
    while victim is None and time.monotonic() < deadline:
        if glob.glob(f"{out}.partial*/data/*-r00001-*"):
            os.kill(procs[1].pid, signal.SIGSTOP)
            victim = procs[1]
        time.sleep(0.002)
    assert victim is not None
    assert not glob.glob(f"{out}.partial*/manifest.r00001.json")
    os.kill(victim.pid, signal.SIGKILL)
    rc, _, stderr = finish(procs[0])
    victim.wait()
    assert rc == 2
    line = stderr.strip().splitlines()[-1]
    assert "rank 1 did not finish" in line and out in line, stderr[-2000:]
    _nothing_committed(str(tmp_path), out)
    assert not glob.glob(out + ".partial*")  # rank 0 removed the stage and its coordination files
    results = [finish(p) for p in ranks(2, "convert", big_source, out, job="kill2")]
    assert [r[0] for r in results] == [0, 0], [r[2][-2000:] for r in results]
    a, b = ckptbridge.open(big_source), ckptbridge.open(out)
    for name in a:
        np.testing.assert_array_equal(a[name].read(), b[name].read())


def test_world_from_env_needs_a_store_or_a_job_id(tmp_path):
    from ckptbridge._formats.scaleout import balance, world_from_env
    from ckptbridge._ranks import rank_from_env

    assert rank_from_env({}) == (0, 1)
    assert rank_from_env({"SLURM_PROCID": "2", "SLURM_NTASKS": "4"}) == (2, 4)
    assert world_from_env(str(tmp_path / "u"), env={"RANK": "0", "WORLD_SIZE": "1"}) is None
    with pytest.raises(ckptbridge.OptionError, match="CKPTBRIDGE_JOB_ID"):
        world_from_env(str(tmp_path / "u"), env={"RANK": "1", "WORLD_SIZE": "2"})
    with pytest.raises(ckptbridge.OptionError, match="outside"):
        rank_from_env({"RANK": "2", "WORLD_SIZE": "2"})
    shares = balance([10, 1, 9, 2, 8, 3], 3)
    assert sorted(i for s in shares for i in s) == list(range(6))
    assert [sum([10, 1, 9, 2, 8, 3][i] for i in s) for s in shares] == [11, 11, 11]
