"""The package users install: the sdist and the wheel built from this checkout, installed in fresh
virtualenvs (never this editable checkout).

1. ``python -m build`` makes the sdist and builds the wheel from it (so the sdist is complete
   too); the wheel holds every subpackage of ``bridge/`` and ``adapters/`` (each folder with an
   ``__init__.py``) and ``py.typed``, and its metadata is complete (license, URLs, classifiers,
   a long description that ``twine check --strict`` renders).
2. A venv with the wheel and no extras (numpy, ml_dtypes, rich, zlib-ng from the ranges in
   pyproject.toml): every public module of the package imports (the runtime adapters too) (torch and jax are not installed), and
   ``ckptbridge inspect / convert / verify / diff / recipe / formats`` work on a real Megatron-LM
   checkpoint (read by ckptbridge's own unpickler: no torch needed).
3. A venv with ``ckptbridge[torch,jax]`` (torch pinned to the CPU wheel, everything else from the
   extras' ranges): the converted checkpoint loads onto a torch ``DeviceMesh`` with DTensor
   placements and onto a JAX ``Mesh`` of 8 CPU devices, bitwise.

Slow (two venvs, a few minutes); it runs in CI like every test.
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MEGATRON = ROOT / "tests" / "fixtures" / "megatron" / "A" / "tp2pp2" / "torch"
TORCH_PIN = "torch==2.13.0"  # the CPU wheel (constraints.txt); unpinned, pip pulls a CUDA build

pytestmark = pytest.mark.heavy


def _run(*cmd: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd,
                         env={**os.environ, **(env or {})}, timeout=900)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    # a venv outside the checkout, and no PYTHONPATH: nothing of the source tree can leak in
    return path / "bin" / "python"


SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "bridge", "adapters")


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """sdist + wheel, built from a copy of the sources (a build in the checkout would leave an
    ``ckptbridge.egg-info`` there, whose entry points shadow the editable install's once stale)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, src)
    return out


@pytest.fixture(scope="module")
def wheel(dist) -> Path:
    (whl,) = dist.glob("ckptbridge-*.whl")
    return whl


def _source_packages() -> set[str]:
    out = set()
    for folder, name in (("bridge", "ckptbridge"), ("adapters", "ckptbridge/adapters")):
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(ROOT / folder).as_posix()
            out.add(name if rel == "." else f"{name}/{rel}")
    return out


def test_wheel_and_sdist_hold_every_package_and_complete_metadata(dist, wheel):
    (sdist,) = dist.glob("ckptbridge-*.tar.gz")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert packages == _source_packages()
    assert "ckptbridge/py.typed" in names
    modules = {n for n in names if n.endswith(".py")}
    sources = {f"ckptbridge/{p.relative_to(ROOT / 'bridge').as_posix()}" for p in (ROOT / "bridge").rglob("*.py")}
    sources |= {f"ckptbridge/adapters/{p.relative_to(ROOT / 'adapters').as_posix()}"
                for p in (ROOT / "adapters").rglob("*.py")}
    assert modules == sources, sorted(modules ^ sources)
    meta = email.message_from_bytes(zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))))
    assert meta["License-Expression"] == "Apache-2.0"
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert meta["Description-Content-Type"] == "text/markdown" and "ckptbridge" in meta.get_payload()
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Documentation", "Source", "Issues"} <= set(urls)
    assert any(c.startswith("Programming Language :: Python :: 3") for c in meta.get_all("Classifier"))
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "ckptbridge = ckptbridge._cli:main" in entry.replace("\r", "") or "ckptbridge = ckptbridge." in entry
    # the long description renders on an index (twine's own check: markdown parses, metadata valid)
    _run(sys.executable, "-m", "twine", "check", "--strict", sdist, wheel)


IMPORT_ALL = """
import importlib, pkgutil, sys
import ckptbridge
assert ckptbridge.__file__.startswith(sys.prefix), ckptbridge.__file__  # the installed wheel
names = [m.name for m in pkgutil.walk_packages(ckptbridge.__path__, "ckptbridge.")
         if not any(part.startswith("_") for part in m.name.split("."))]  # the public modules
for name in names:
    importlib.import_module(name)
for framework in ("torch", "jax"):
    assert framework not in sys.modules, framework + " imported by ckptbridge"
print(len(names))
"""


def test_wheel_without_extras_imports_everything_and_runs_the_cli(wheel, tmp_path):
    py = _venv(tmp_path / "venv")
    _run(py, "-m", "pip", "install", "-q", "--no-compile", wheel)
    with pytest.raises(AssertionError):  # the venv really has no torch
        _run(py, "-c", "import torch")
    assert int(_run(py, "-c", IMPORT_ALL, cwd=tmp_path)) >= 15
    cli = tmp_path / "venv" / "bin" / "ckptbridge"
    work = tmp_path / "work"
    work.mkdir()
    assert "megatron" in _run(cli, "formats", cwd=work)
    shown = _run(cli, "inspect", MEGATRON, cwd=work)
    assert "embedding.word_embeddings.weight" in shown
    _run(cli, "convert", MEGATRON, work / "uni", cwd=work)
    _run(cli, "verify", work / "uni", cwd=work)
    assert "differ" not in _run(cli, "diff", MEGATRON, work / "uni", cwd=work).lower()
    rules = _run(cli, "recipe", "llama", "hf", "maxtext", "-c", "n_heads=4", "-c", "n_kv_heads=2",
                 "-c", "head_dim=16", cwd=work)
    assert '"rename"' in rules.lower()


LOAD_BOTH = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import numpy as np
import ckptbridge
from ckptbridge.adapters import jax as cbjax, torch as cbtorch
path = sys.argv[1]
ckpt = ckptbridge.open(path)
name = "embedding.word_embeddings.weight"
want = ckpt[name].read()

import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
got = cbtorch.load(path, mesh, {name: [Shard(0)]})[name]
assert np.array_equal(got.full_tensor().float().numpy(), want.astype(np.float32))
dist.destroy_process_group()

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
assert len(jax.devices()) == 8
jmesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
arr = cbjax.load(path, {name: NamedSharding(jmesh, P(None, "model"))})[name]
assert len(arr.addressable_shards) == 8
assert np.array_equal(np.asarray(arr.astype("float32")), want.astype(np.float32))
print("ok", torch.__version__, jax.__version__)
"""


def test_wheel_with_torch_and_jax_loads_onto_both_meshes(wheel, tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from _dist import free_port

    py = _venv(tmp_path / "venv")
    pin = tmp_path / "pin.txt"
    pin.write_text(TORCH_PIN + "\n")
    # --no-compile: byte-compiling all of torch and jax (~3k files) is not what this test shows
    _run(py, "-m", "pip", "install", "-q", "--no-compile", "-c", pin, f"ckptbridge[torch,jax] @ {wheel.as_uri()}")
    out = _run(py, "-c", LOAD_BOTH, MEGATRON, str(free_port()), cwd=tmp_path, env={"JAX_PLATFORMS": "cpu"})
    assert out.startswith("ok 2.13.0")
