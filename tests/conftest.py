"""Shared test setup.

JAX tests run on 8 fake CPU devices; XLA reads ``XLA_FLAGS`` once, when jax
initialises its backend, so the flag is set here, before any test module
imports jax (setting it later has no effect).
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import pytest  # noqa: E402  (after the XLA flag above)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Test files with a ``heavy`` test first, each file's tests in their order: `make test`'s
    pytest-xdist workers take a file at a time in this order, so the long files start early and the
    many short ones even out the workers' ends (alphabetically, a long file came last, alone)."""
    heavy = {item.path for item in items if item.get_closest_marker("heavy")}
    items.sort(key=lambda item: item.path not in heavy)


@pytest.fixture()
def pt(tmp_path):
    """A small real checkpoint: a torch.save file (fp32 and bf16 tensors, a step) and its state dict,
    as ``(path, state_dict)``."""
    import torch

    torch.manual_seed(0)
    sd = {"embed.weight": torch.randn(9, 4), "head.weight": torch.randn(3, 4).bfloat16(), "iteration": 5}
    path = tmp_path / "m.pt"
    torch.save(sd, path)
    return str(path), sd
