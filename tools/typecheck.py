"""Type-check the installed package layout (``ckptbridge`` = bridge/, ``ckptbridge.adapters`` = adapters/).

mypy cannot see through setuptools' editable finder, and the source folders are named
differently from the packages, so this builds the package tree as symlinks in a temporary
folder and runs mypy there (configuration: ``[tool.mypy]`` in pyproject.toml). Paths in the
report are mapped back to the repository::

    python tools/typecheck.py            # exit status of mypy
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="ckptbridge-mypy-") as tmp:
        pkg = Path(tmp) / "ckptbridge"
        pkg.mkdir()
        for entry in (ROOT / "bridge").iterdir():
            if entry.name != "__pycache__":
                (pkg / entry.name).symlink_to(entry)
        (pkg / "adapters").symlink_to(ROOT / "adapters")
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "ckptbridge"]
        out = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True,
                             env={**os.environ, "MYPYPATH": tmp})
        text = (out.stdout + out.stderr).replace("ckptbridge/adapters/", "adapters/").replace("ckptbridge/", "bridge/")
        sys.stdout.write(text)
        return out.returncode


if __name__ == "__main__":
    raise SystemExit(main())
