"""What the package promises outside the code: its metadata (license, README install section,
extras as ranges with CI's pins in constraints.txt), public imports only in the notebooks, and the
README's format plug-in example working through an entry point."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
from _common import cli, one_line_error

import ckptbridge

HERE = os.path.dirname(os.path.abspath(__file__))


def _extras() -> dict[str, list[str]]:
    """The installed package's extras: extra -> its requirements (what ``pip install`` reads)."""
    from importlib.metadata import requires

    out: dict[str, list[str]] = {}
    for req in requires("ckptbridge") or []:
        m = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", req)
        if m:
            out.setdefault(m.group(1), []).append(req.split(";")[0].strip())
    return out


def test_remote_extra_is_declared():
    assert any(d.startswith("fsspec") for d in _extras()["remote"])


def test_license_readme_install_section_and_public_imports_only():
    root = os.path.join(HERE, "..")
    with open(os.path.join(root, "LICENSE")) as fh:
        assert "Apache License" in fh.read(200) or "Apache License" in fh.read()
    with open(os.path.join(root, "README.md")) as fh:
        readme = fh.read()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    for extra in ("torch", "jax", "deepspeed", "megatron", "remote"):
        assert f"ckptbridge[{extra}]" in install, extra
    for cmd in ("formats", "--format", "-O", "--rules", "--version", "python -m ckptbridge"):
        assert cmd in readme, cmd
    private = re.compile(r"(from|import)\s+ckptbridge[\w.]*\._|ckptbridge\._")
    for f in sorted(os.listdir(os.path.join(root, "notebooks"))):
        if f.endswith(".ipynb"):
            with open(os.path.join(root, "notebooks", f)) as fh:
                cells = json.load(fh)["cells"]
            code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
            assert "ckptbridge" in code and not private.search(code), f


# ---------------------------------------------------------------- extras give ranges; CI pins them


def test_extras_are_ranges_and_ci_pins_them_in_a_constraints_file():
    root = os.path.join(HERE, "..")
    extras = _extras()
    for name in ("torch", "deepspeed", "megatron"):
        for req in extras[name]:
            assert "==" not in req, (name, req)
    assert any(r.startswith("torch>=") for r in extras["torch"])
    with open(os.path.join(root, "constraints.txt")) as fh:
        pins = {line.split("==")[0].strip(): line.split("==")[1].strip()
                for line in fh if "==" in line and not line.lstrip().startswith("#")}
    assert pins["torch"] == "2.13.0" and pins["deepspeed"] == "0.19.8" and pins["megatron-core"] == "0.16.1"
    with open(os.path.join(root, "Makefile")) as fh:
        make = fh.read()
    installs = [line for line in make.splitlines() if "pip install" in line and "-e" in line]
    assert installs and all("-c constraints.txt" in line for line in installs), installs
    from importlib.metadata import version

    assert version("torch").split("+")[0] == pins["torch"]


# ---------------------------------------------------------------- the README's plug-in example, run


def _readme_blocks(section: str) -> list[tuple[str, str]]:
    with open(os.path.join(HERE, "..", "README.md")) as fh:
        text = fh.read().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", text, re.S)


def test_the_readme_format_plugin_works_through_its_entry_point(tmp_path):
    """The README's .npy plug-in, installed the way a package installs it (an entry point in
    its distribution's metadata), then used by the CLI and the API on files numpy wrote."""
    blocks = dict(_readme_blocks("Writing a format plug-in"))
    site = tmp_path / "site"
    (site / "ckpt_npy-0.1.dist-info").mkdir(parents=True)
    (site / "ckpt_npy.py").write_text(blocks["python"])
    (site / "ckpt_npy-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: ckpt-npy\nVersion: 0.1\n")
    toml = blocks["toml"]
    group = re.search(r'entry-points\."([^"]+)"', toml).group(1)
    name, target = re.search(r'^(\w+)\s*=\s*"([^"]+)"', toml, re.M).groups()
    (site / "ckpt_npy-0.1.dist-info" / "entry_points.txt").write_text(f"[{group}]\n{name} = {target}\n")
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    np.save(tmp_path / "w.npy", w)
    np.save(tmp_path / "b16.npy", np.arange(8, dtype=np.int16))
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}

    r = cli("formats", "--json", env=env)
    fmt = next(f for f in json.loads(r.stdout) if f["name"] == "npy")
    assert fmt["read"] and not fmt["write"] and fmt["open_options"][0]["name"] == "name"
    r = cli("inspect", str(tmp_path / "w.npy"), env=env)
    assert r.returncode == 0 and r.stdout.splitlines()[1] == "w\t4x6\tfloat32\tfp32:float32\t1", r.stderr
    out = tmp_path / "u"
    r = cli("convert", str(tmp_path / "w.npy"), str(out), "-O", "name=wte.weight", env=env)
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(ckptbridge.open(out)["wte.weight"].read(), w)
    assert cli("diff", str(tmp_path / "w.npy"), str(out), "--rules-b", _rename_rules(tmp_path),
               env=env).returncode == 0
    one_line_error(cli("inspect", str(tmp_path / "w.npy"), "-O", "bogus=1", env=env), "'npy'", "'bogus'")
    r = cli("inspect", str(tmp_path / "b16.npy"), "--json", env=env)
    assert json.loads(r.stdout)["tensors"][0]["dtype"] == "int16"
    # registered at run time instead (no entry point: the module alone on the path)
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy(site / "ckpt_npy.py", plain / "ckpt_npy.py")
    code = ("import sys, ckpt_npy, ckptbridge\n"
            "from ckptbridge.plugin import register_format\n"
            "register_format(ckpt_npy.FORMAT)\n"
            "ckpt = ckptbridge.open(sys.argv[1])\n"
            "print(ckpt.format, ckpt['w'][1:3, 2:5].tolist())\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "w.npy")], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(plain)})
    assert r.returncode == 0 and r.stdout.split(" ", 1) == ["npy", f"{w[1:3, 2:5].tolist()}\n"], r.stderr


def _rename_rules(tmp_path) -> str:
    path = tmp_path / "rules.json"
    path.write_text(json.dumps(ckptbridge.rules_to_json([ckptbridge.Rename(r"^wte\.weight$", "w")])))
    return str(path)
