"""Entry-point plug-in groups, loaded once on first use (formats, checkpointer leaf providers).

    group = PluginGroup("ckptbridge.formats")
    for value in group.load():          # the entry points' values, each group loaded once
        ...
    group.broken                         # {entry-point name: why it failed to import}
"""

from __future__ import annotations

import importlib.metadata
import threading
from typing import Any


class PluginGroup:
    """The values of one entry-point group; an entry point that fails to import (its optional
    dependency is missing) is recorded in ``broken`` instead of hiding the others."""

    def __init__(self, group: str) -> None:
        self.group = group
        self.lock = threading.RLock()
        self.broken: dict[str, str] = {}
        self._loaded: list[Any] | None = None

    def load(self) -> list[Any]:
        with self.lock:
            if self._loaded is None:
                values = []
                for ep in importlib.metadata.entry_points(group=self.group):
                    try:
                        values.append(ep.load())
                    except ImportError as err:
                        self.broken[ep.name] = f"{type(err).__name__}: {err}"
                self._loaded = values
            return list(self._loaded)

    @property
    def loaded(self) -> bool:
        return self._loaded is not None
