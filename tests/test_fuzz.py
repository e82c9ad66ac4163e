"""Hostile inputs: >= 1,000 mutated/truncated copies of real checkpoints per run, seeded.

Each case must end normally or in ckptbridge's own error naming the file, within
a time limit and an address-space limit (tools/fuzz_readers.py; run it with more
--cases for a longer campaign: `make fuzz`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

import ckptbridge

ROOT = Path(__file__).resolve().parents[1]


def _core_seeds(tmp: Path) -> list[str]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 7)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3,
                "bf": torch.randn(4).bfloat16(), "view": torch.arange(12.0).reshape(3, 4).t()}, tmp / "t.pt")
    save_file({"a": np.ones((3, 4), np.float32), "b": np.arange(5)}, str(tmp / "s.safetensors"))
    ckptbridge.convert(tmp / "t.pt", tmp / "u")
    return [str(tmp / "t.pt"), str(tmp / "s.safetensors"), str(tmp / "u")]


def _fuzz(seeds: list[str], cases: int, seed: int) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "fuzz_readers.py"), *seeds, "--cases", str(cases),
         "--seed", str(seed), "--time-limit", "10", "--memory-gib", "4"],
        capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert f"{cases} cases" in out.stdout and "0 failed" in out.stdout


def test_core_readers_survive_1000_mutations(tmp_path):
    import os

    _fuzz(_core_seeds(tmp_path), max(1000, int(os.environ.get("FUZZ_CASES", "1000"))), seed=0)
