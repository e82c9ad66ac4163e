"""The package's shape: public names written once, a narrow plug-in interface, and the README's
map of the repository checked against the tree."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import ckptbridge
import ckptbridge.plugin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# for third-party plug-ins: the registration calls and the type of `storage`
THIRD_PARTY = {"register_format", "register_leaf_provider", "register_job_store", "Storage",
               "Derivation", "DerivedRegion"}  # the types a third-party derived tensor is written against


def _type_checking_names(path: str) -> dict[str, tuple[str, str]]:
    """Public name -> (module, attribute) from the ``if TYPE_CHECKING:`` block of ``path``."""
    with open(path) as fh:
        tree = ast.parse(fh.read())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test).endswith("TYPE_CHECKING"))
    return {a.asname or a.name: ("." * n.level + (n.module or ""), a.name)
            for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}


def test_every_public_name_is_written_once_and_resolves():
    listed = _type_checking_names(os.path.join(ROOT, "bridge", "__init__.py"))
    assert sorted(ckptbridge.__all__) == sorted([*listed, "__version__"])
    assert dir(ckptbridge) == sorted([*ckptbridge.__all__, *ckptbridge._SUBMODULES])
    for name, (module, attr) in listed.items():
        value = getattr(ckptbridge, name)  # resolves through the lazy loader
        assert value is getattr(importlib.import_module(module, "ckptbridge"), attr), name
    for sub in ckptbridge._SUBMODULES:
        assert getattr(ckptbridge, sub).__name__ == f"ckptbridge.{sub}"
    assert ckptbridge.Rename is ckptbridge.rules.Rename  # the rules live in ckptbridge.rules
    with pytest.raises(AttributeError, match="no attribute 'Renamee'"):
        ckptbridge.Renamee  # noqa: B018


def _adapter_plugin_imports() -> set[str]:
    used = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "adapters")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f)) as fh:
                    tree = ast.parse(fh.read())
                used |= {a.name for n in ast.walk(tree)
                         if isinstance(n, ast.ImportFrom) and n.module == "ckptbridge.plugin" for a in n.names}
    return used


def test_the_plugin_interface_holds_what_adapters_use_and_nothing_private():
    names = set(ckptbridge.plugin.__all__)
    assert not [n for n in names if n.startswith("_")]
    lazy = _type_checking_names(os.path.join(ROOT, "bridge", "plugin.py"))  # imported on first use
    eager = {n for n in vars(ckptbridge.plugin) if not n.startswith("_") and n not in ("annotations", "TYPE_CHECKING")}
    assert names == set(lazy) | eager
    for name, (module, attr) in lazy.items():
        assert getattr(ckptbridge.plugin, name) is getattr(importlib.import_module(module, "ckptbridge"), attr), name
    used = _adapter_plugin_imports()
    assert used <= names, sorted(used - names)
    assert names - used <= THIRD_PARTY, f"exported but used by no adapter: {sorted(names - used - THIRD_PARTY)}"
    # storage reaches adapters as the typed protocol, not the storage package
    from ckptbridge.plugin import Storage, storage

    assert not isinstance(storage, type(os)) and isinstance(storage, object)
    assert {m for m in dir(Storage) if not m.startswith("_")} == {m for m in dir(storage) if not m.startswith("_")}
    # a submodule named like a function of the path API would replace it once imported
    import pkgutil

    import ckptbridge._storage as pkg

    subs = {m.name for m in pkgutil.iter_modules(pkg.__path__)}
    assert not subs & set(pkg.__all__), sorted(subs & set(pkg.__all__))
    for sub in subs:
        importlib.import_module(f"ckptbridge._storage.{sub}")
    assert storage.protocol("s3://bucket/key") == "s3" and storage.join("s3://b", "k") == "s3://b/k"


def _layout_block() -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as fh:
        text = fh.read()
    section = text.split("## Layout of the repository", 1)[1]
    return section.split("```", 2)[1].splitlines()[1:]


def _named() -> dict[str, set[str]]:
    """Folder -> the entries the README's map names under it ("" for the repository root)."""
    out: dict[str, set[str]] = {"": set()}
    parent = ""
    for line in _layout_block():
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent > 2:
            continue  # a description's continuation
        tokens = re.split(r"\s{2,}", line.strip())[0].split(" ")
        if not all(re.fullmatch(r"[\w.]+/?", t) for t in tokens):
            continue
        if indent == 0:
            out[""].update(tokens)
            parent = tokens[0].rstrip("/")
            out.setdefault(parent, set())
        else:
            out[parent].update(tokens)
    return out


def test_the_readme_layout_names_the_tree():
    named = _named()
    assert {"bridge/", "adapters/", "tests/"} <= named[""]
    for entry in named[""]:
        assert os.path.exists(os.path.join(ROOT, entry)), f"README names {entry}, which does not exist"
    for folder in ("bridge", "adapters"):
        for entry in named[folder]:
            assert os.path.exists(os.path.join(ROOT, folder, entry)), f"README names {folder}/{entry}: missing"
        base = os.path.join(ROOT, folder)
        actual = {f"{e}/" for e in os.listdir(base) if os.path.isfile(os.path.join(base, e, "__init__.py"))}
        actual |= {e for e in os.listdir(base) if e.endswith(".py") and e != "__main__.py"}
        if folder == "adapters":
            actual.discard("__init__.py")
        assert actual <= named[folder], f"{folder}/ has {sorted(actual - named[folder])}, not in the README's map"


def test_the_layout_check_fails_on_a_missing_entry(monkeypatch):
    """Negative control: a map naming a folder that is not there fails the check."""
    lines = _layout_block()
    at = next(i for i, line in enumerate(lines) if line.startswith("bridge/")) + 1
    broken = [*lines[:at], "  _gone/          a folder that does not exist", *lines[at:]]
    monkeypatch.setattr(sys.modules[__name__], "_layout_block", lambda: broken)
    with pytest.raises(AssertionError, match="bridge/_gone/"):
        test_the_readme_layout_names_the_tree()


# ---------------------------------------------------------------- format packages: readers and writers load on first use

FORMAT_PACKAGES = ("dcp", "deepspeed", "megatron", "orbax", "torch_save")
_OPEN_AND_LIST = """
import json, sys
import ckptbridge
ckpt = ckptbridge.open(sys.argv[1])
assert ckpt.format == "safetensors" and ckpt["w"].read().tolist() == [[1.0, 2.0]]
loaded = sorted(m for m in sys.modules if m.startswith("ckptbridge."))
import ckptbridge.adapters.megatron as megatron
megatron.index  # a lazy name: imports the reader
print(json.dumps([loaded, sorted(m for m in sys.modules if m.startswith("ckptbridge.adapters."))]))
"""


def test_opening_safetensors_imports_no_other_format_reader_or_writer(tmp_path):
    """Detection imports every format package (its entry point), but only its ``_format`` module:
    no reader, writer or runtime of another format is imported to open a safetensors file, nor the
    parts of the core that opening does not use (the rule language, the Checkpointer, health)."""
    from safetensors.numpy import save_file

    save_file({"w": np.array([[1.0, 2.0]], dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    r = subprocess.run([sys.executable, "-c", _OPEN_AND_LIST, str(tmp_path / "model.safetensors")],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    loaded, after = json.loads(r.stdout.splitlines()[-1])
    for pkg in FORMAT_PACKAGES:
        assert f"ckptbridge.adapters.{pkg}._format" in loaded, pkg  # detection ran through it
    light = {f"ckptbridge.adapters.{pkg}{sub}" for pkg in FORMAT_PACKAGES for sub in ("", "._format")}
    light.add("ckptbridge.adapters.deepspeed._files")  # deepspeed's detect: listings only
    adapters = [m for m in loaded if m.startswith("ckptbridge.adapters.")]
    heavy = [m for m in adapters if m.split(".")[2] in FORMAT_PACKAGES and m not in light]
    assert not heavy, f"opening a safetensors file imported {heavy}"
    runtimes = [m for m in adapters if m.split(".")[2] in ("torch", "jax", "flax")]
    unused = [m for m in loaded if m.startswith(("ckptbridge.adapters.lora", "ckptbridge.rules", "ckptbridge.health",
                                                   "ckptbridge._checkpointer", "ckptbridge.recipes"))]
    assert not runtimes and not unused, runtimes + unused
    # control: the listing sees a reader once a lazy name is used
    assert "ckptbridge.adapters.megatron._reader" in after and "ckptbridge.adapters.megatron._reader" not in loaded


def test_format_packages_keep_their_public_names():
    """Every name in a format package's ``__all__`` resolves (lazy ones through ``LazyNames``, to the
    object of the module its ``TYPE_CHECKING`` import names); unknown names are AttributeErrors."""
    for pkg in (*FORMAT_PACKAGES, "lora"):
        path = os.path.join(ROOT, "adapters", pkg, "__init__.py")
        lazy = _type_checking_names(path)
        module = importlib.import_module(f"ckptbridge.adapters.{pkg}")
        assert set(lazy) <= set(module.__all__), (pkg, sorted(set(lazy) - set(module.__all__)))
        for name in module.__all__:
            value = getattr(module, name)
            if name in lazy:
                source, attr = lazy[name]
                assert value is getattr(importlib.import_module(source, module.__name__), attr), (pkg, name)
        with pytest.raises(AttributeError, match="no attribute 'indexx'"):
            module.indexx  # noqa: B018
    from ckptbridge.adapters.deepspeed import load_engine
    from ckptbridge.adapters.deepspeed._resume import load_engine as original

    assert load_engine is original
