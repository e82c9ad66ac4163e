"""One answer to "which rank am I, how many ranks" (``ckptbridge._ranks``), in the documented
order: explicit values, a running torch.distributed / jax.distributed job (through the
``ckptbridge.rank_providers`` entry points), the launcher's variables, then one process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _dist import free_port

from ckptbridge import OptionError
from ckptbridge._ranks import Ranks, find_ranks, rank_providers, rank_world


def _run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK",
                          "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**clean, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_launcher_variables_in_order_and_explicit_values_first(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    assert find_ranks({}, frameworks=False) is None
    assert rank_world() == (0, 1)  # outside a launcher and a framework job: one process
    with pytest.raises(OptionError, match="rank and world size unknown"):
        rank_world(default=None)
    env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "RANK": "1", "WORLD_SIZE": "3"}
    assert find_ranks(env, frameworks=False) == Ranks(1, 3, "RANK/WORLD_SIZE")  # torchrun's first
    assert find_ranks({"SLURM_PROCID": "2", "SLURM_NTASKS": "4"}, frameworks=False) == Ranks(2, 4, "SLURM_PROCID/SLURM_NTASKS")
    with pytest.raises(OptionError, match="outside"):
        find_ranks({"RANK": "3", "WORLD_SIZE": "2"}, frameworks=False)
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert rank_world() == (2, 4)
    assert rank_world(rank=0) == (0, 4) and rank_world(1, 2) == (1, 2)  # given values win
    assert [p.name for p in rank_providers()][:2] == ["torch", "jax"]


def test_no_provider_imports_its_framework():
    out = _run("import sys; from ckptbridge._ranks import find_ranks; r = find_ranks()\n"
               "print(r, [m for m in ('torch', 'jax') if m in sys.modules])", RANK="5", WORLD_SIZE="8")
    assert out == "Ranks(rank=5, world=8, source='RANK/WORLD_SIZE') []"


def test_a_torch_process_group_answers_before_the_launcher_variables():
    code = (
        "import torch.distributed as dist\n"
        "from ckptbridge._ranks import find_ranks\n"
        "print(find_ranks())\n"
        f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
        "print(find_ranks())\n"
        "dist.destroy_process_group()\n"
    )
    before, after = _run(code, RANK="5", WORLD_SIZE="8").splitlines()
    assert before == "Ranks(rank=5, world=8, source='RANK/WORLD_SIZE')"  # imported, not initialised
    assert after == "Ranks(rank=0, world=1, source='torch')"


def test_a_jax_distributed_job_answers_before_the_launcher_variables():
    code = (
        "import jax\n"
        "from ckptbridge._ranks import find_ranks\n"
        "print(find_ranks())\n"
        f"jax.distributed.initialize('127.0.0.1:{free_port()}', num_processes=1, process_id=0)\n"
        "print(find_ranks())\n"
        "jax.distributed.shutdown()\n"
    )
    before, after = _run(code, SLURM_PROCID="2", SLURM_NTASKS="4", JAX_PLATFORMS="cpu").splitlines()[-2:]
    assert before == "Ranks(rank=2, world=4, source='SLURM_PROCID/SLURM_NTASKS')"
    assert after == "Ranks(rank=0, world=1, source='jax')"
