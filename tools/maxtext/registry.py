"""The harness's model families: every ``tools/maxtext/<family>.py`` registers itself here, one way.

A family module defines ``FAMILIES``, a tuple of :class:`MaxTextFamily` (one module may hold
several: ``llama.py`` has llama, mistral, qwen2 and mixtral); :func:`family` finds the record of a
spec's ``family`` among every module of this directory (a module that is not a family, such as a
helper, defines no ``FAMILIES``; ``harness.py``, this file and ``_*.py`` are not read)::

    # tools/maxtext/qwen3.py
    from registry import MaxTextFamily
    FAMILIES = (MaxTextFamily("qwen3", overrides, converter="qwen3-0.6b"), ...)

    # tools/maxtext/harness.py
    fam = registry.family(spec.family)          # SystemExit naming the known families
    overrides = fam.overrides(spec) | spec.extra
    key, drop_rope = fam.converter_key(spec)    # into MaxText's PARAM_MAPPING / HOOK_FNS
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
NOT_FAMILIES = ("harness.py", "registry.py")


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class MaxTextFamily:
    """One spec ``family``: its MaxText keys, its converter and how the converter reads HF files.

    - ``overrides(spec)``: MaxText ``base.yml`` keys on top of the harness's common ones (the spec's
      ``extra`` is applied after them);
    - ``converter``: the key into MaxText's ``PARAM_MAPPING`` / ``HOOK_FNS``, or ``spec -> (key, drop
      the rotary permutation hook adjust_rope)`` when it depends on the spec;
    - ``moe``: the spec has experts (``experts > 0``) exactly when this is true;
    - ``converter_config(hf_config)``: the HF config.json as MaxText's converter reads it;
    - ``hf_name(name)``: the converter's HF tensor name as the HF checkpoint spells it.
    """

    name: str
    overrides: Callable[[Any], dict[str, Any]]
    converter: str | Callable[[Any], tuple[str, bool]]
    moe: bool = False
    converter_config: Callable[[dict[str, Any]], dict[str, Any]] = _same
    hf_name: Callable[[str], str] = _same

    def converter_key(self, spec: Any) -> tuple[str, bool]:
        """(key into MaxText's PARAM_MAPPING/HOOK_FNS, drop its ``adjust_rope`` hook) for ``spec``."""
        return (self.converter, False) if isinstance(self.converter, str) else self.converter(spec)


@functools.cache
def families() -> dict[str, MaxTextFamily]:
    """Every registered family by name (each module of this directory's ``FAMILIES``)."""
    out: dict[str, MaxTextFamily] = {}
    for path in sorted(HERE.glob("*.py")):
        if path.name in NOT_FAMILIES or path.name.startswith("_"):
            continue
        for fam in getattr(_module(path), "FAMILIES", ()):
            if fam.name in out:
                raise SystemExit(f"{path}: family {fam.name!r} is registered twice")
            out[fam.name] = fam
    return out


def family(name: str) -> MaxTextFamily:
    """The record of the spec family ``name``; SystemExit naming the known ones."""
    known = families()
    if name not in known:
        raise SystemExit(f"spec: family {name!r} is not one of {sorted(known)}")
    return known[name]


def _module(path: Path) -> Any:
    mod_spec = importlib.util.spec_from_file_location(f"harness_{path.stem}", path)
    if mod_spec is None or mod_spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module
