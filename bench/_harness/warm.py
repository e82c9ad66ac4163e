"""Imports done before the clock starts, so that in-process cases time the work, not the imports.

Every in-process case imports its tool before ``ctx.region()`` (``import torch`` for torch,
``import_all("ckptbridge")`` for ckptbridge: every module of the package, as ``import torch``
loads all of torch). Start-up is measured on its own by the suites' start-up probes.
"""

from __future__ import annotations

import importlib
import pkgutil


def import_all(package: str) -> int:
    """Import ``package`` and every module under it; return how many modules that was."""
    pkg = importlib.import_module(package)
    n = 1
    for info in pkgutil.walk_packages(pkg.__path__, package + "."):
        importlib.import_module(info.name)
        n += 1
    return n


def ckptbridge(torch: bool = False) -> None:
    """The whole of ckptbridge and ckptbridge.adapters (frameworks stay lazily imported). ``torch``:
    the case hands ckptbridge torch tensors, so also import ``torch.distributed.tensor``, which
    ckptbridge's torch adapter imports on first use (seconds) and DCP at ``import
    torch.distributed.checkpoint``: before the clock for both."""
    import_all("ckptbridge")
    if torch:
        importlib.import_module("torch.distributed.tensor")
