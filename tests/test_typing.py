"""What a user's type checker sees of the public API (``py.typed``): mypy, strict as configured in
pyproject.toml, runs on a small user snippet against the package tree (``tools/typecheck.py
FILE``) and must reveal real types, not ``Any``, and refuse wrong arguments."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# expression -> the type mypy must reveal for it
REVEALED = {
    'ckptbridge.open(p)': "ckptbridge._read.checkpoint.Checkpoint",
    'ckptbridge.open(p)["w"]': "ckptbridge._read.checkpoint.TensorView",
    'ckptbridge.open(p)["w"].shape': "tuple[int, ...]",
    'ckptbridge.open(p)["w"].dtype': "str",
    'ckptbridge.open(p)["w"].states': "tuple[str, ...]",
    'ckptbridge.open(p)["w"].nbytes': "int",
    'ckptbridge.open(p)["w"][:2]': "numpy.ndarray[tuple[Any, ...], numpy.dtype[Any]]",
    'ckptbridge.open(p).step': "int | None",
    'ckptbridge.open(p).format': "str",
    'ckptbridge.open(p).tensors': "typing.Mapping[str, ckptbridge._read.model.LogicalTensor]",
    'ckptbridge.reshard(ckptbridge.open(p), "out", to="safetensors")': "str",
    'ckptbridge.convert(p, "out")': "str",
    'get_format("universal").detect': "ckptbridge._formats.registry.Detector | None",
    'get_format("universal").index': "ckptbridge._formats.registry.Indexer[Any] | None",
    'get_format("universal").write': "ckptbridge._formats.registry.Writer[Any] | None",
}

# calls a type checker must refuse (the parameters are typed, not Any) -> mypy's error code
REFUSED = {
    'ckptbridge.reshard(3, "out", to="safetensors")': "arg-type",
    'ckptbridge.open(p, rules=[1])': "list-item",
    'ckptbridge.convert(p, "out", world=2)': "arg-type",
    'ckptbridge.open(p)["w"].shape + 1': "operator",
}


def test_a_users_type_checker_sees_the_public_types(tmp_path: Path) -> None:
    head = ["import ckptbridge", "", "",
            "def get_format(name: str) -> ckptbridge.Format:",
            "    return next(f for f in ckptbridge.formats() if f.name == name)", "", "",
            "def user(p: str) -> None:"]
    body = [f"    reveal_type({e})" for e in REVEALED] + [f"    {e}" for e in REFUSED]
    snippet = tmp_path / "user_code.py"
    snippet.write_text("\n".join(head + body) + "\n")
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "typecheck.py"), str(snippet)],
                         capture_output=True, text=True, timeout=600)
    lines = {int(m[1]): (m[2], m[3]) for m in re.finditer(
        r"user_code\.py:(\d+): (?:note: Revealed type is \"(.*)\"|error: .*\[([a-z-]+)\])$",
        out.stdout, re.MULTILINE)}
    first = len(head) + 1
    revealed = {e: lines.get(first + i, (None, None))[0] for i, e in enumerate(REVEALED)}
    refused = {e: lines.get(first + len(REVEALED) + i, (None, None))[1] for i, e in enumerate(REFUSED)}
    assert revealed == REVEALED, out.stdout
    assert refused == REFUSED, out.stdout
    # no other error: none inside the package, none on the lines that must pass
    assert out.stdout.count(": error:") == len(REFUSED), out.stdout
