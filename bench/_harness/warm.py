"""Imports done before the clock starts, so that in-process cases time the work, not the imports.

Every in-process case imports its tool before ``ctx.region()`` (``import torch`` for torch,
``warm.ckptbridge()`` for ckptbridge: every module of the package and its format plug-ins, as ``import torch``
loads all of torch). Start-up is measured on its own by the suites' start-up probes.
"""

from __future__ import annotations

import importlib
import pkgutil


def import_all(package: str) -> int:
    """Import ``package`` and every module under it (not ``__main__``: it runs the command line);
    return how many modules that was."""
    pkg = importlib.import_module(package)
    n = 1
    for info in pkgutil.walk_packages(pkg.__path__, package + "."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        importlib.import_module(info.name)
        n += 1
    return n


def ckptbridge(torch: bool = False) -> None:
    """The whole of ckptbridge and every format plug-in it registers (the ``ckptbridge.formats``
    entry points: the adapters ``ckptbridge.open`` would load on first use; frameworks stay lazily
    imported). ``torch``:
    the case hands ckptbridge torch tensors, so also import ``torch.distributed.tensor``, which
    ckptbridge's torch adapter imports on first use (seconds) and DCP at ``import
    torch.distributed.checkpoint``: before the clock for both."""
    from importlib.metadata import entry_points

    import_all("ckptbridge")
    for ep in entry_points(group="ckptbridge.formats"):
        ep.load()
    if torch:
        importlib.import_module("torch.distributed.tensor")
