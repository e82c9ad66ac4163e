"""The notebooks in ``notebooks/`` run top to bottom (executed with nbclient, as in CI).

Each runs in a fresh kernel with ``notebooks/`` as the working directory and
must finish without an error; each also checks its own claims with asserts
(migrated losses within tolerance, shards equal to the source ...).
"""

from __future__ import annotations

import os

import ipykernel  # noqa: F401  (the kernel the notebooks run on)
import jax  # noqa: F401  (the kernel the notebooks run on)
import matplotlib  # noqa: F401  (the kernel the notebooks run on)
import nbclient
import nbformat
import pytest
import torch  # noqa: F401  (the kernel the notebooks run on)

HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOKS = os.path.join(os.path.dirname(HERE), "notebooks")
NAMES = sorted(n for n in os.listdir(NOTEBOOKS) if n.endswith(".ipynb"))


def test_there_are_the_four_notebooks():
    assert NAMES == ["01_explore_checkpoints.ipynb", "02_migrate_deepspeed_to_flax.ipynb", "03_reshard.ipynb",
                     "04_migrate_hf_llama_to_maxtext.ipynb"]


@pytest.mark.heavy
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the inline backend: plots become outputs
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": NOTEBOOKS}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    html = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if "text/html" in o.get("data", {})]
    assert html, "the notebook shows rich HTML views"
