"""Type-check the installed package layout (``ckptbridge`` = bridge/, ``ckptbridge.adapters`` = adapters/).

mypy cannot see through setuptools' editable finder, and the source folders are named
differently from the packages, so this builds the package tree as symlinks in a temporary
folder and runs mypy there (configuration: ``[tool.mypy]`` in pyproject.toml, strict). Paths
in the report are mapped back to the repository::

    python tools/typecheck.py                 # the whole package; exit status of mypy
    python tools/typecheck.py user.py ...     # these files as a user's code, against the package

The second form is how ``tests/test_typing.py`` sees what a user's type checker sees
(``reveal_type(ckptbridge.open(p)["w"].shape)``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(files: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="ckptbridge-mypy-") as tmp:
        pkg = Path(tmp) / "ckptbridge"
        pkg.mkdir()
        for entry in (ROOT / "bridge").iterdir():
            if entry.name != "__pycache__":
                (pkg / entry.name).symlink_to(entry)
        (pkg / "adapters").symlink_to(ROOT / "adapters")
        targets = [os.path.abspath(f) for f in files] or ["-p", "ckptbridge"]
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *targets]
        out = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True,
                             env={**os.environ, "MYPYPATH": tmp})
        text = (out.stdout + out.stderr).replace("ckptbridge/adapters/", "adapters/").replace("ckptbridge/", "bridge/")
        sys.stdout.write(text)
        return out.returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
