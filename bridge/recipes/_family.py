"""The recipe registry: a family is one module of this package that defines ``FAMILY``.

Adding a family touches its own module (and its test), nothing else: every public module of
``ckptbridge.recipes`` whose name does not start with ``_`` is imported on first use and its
``FAMILY`` registered under ``FAMILY.name``::

    # bridge/recipes/myfamily.py
    from ._family import Family
    from ._gpt import RecipeConfig, hf_to_maxtext, megatron_to_hf

    FAMILY = Family(name="myfamily", model_types=("my_model",),
                    base={("hf", "maxtext"): hf_to_maxtext, ("megatron", "hf"): megatron_to_hf})

A family writes each mapping once, in the direction whose rules are all invertible (its
``base`` pairs: ``("hf", "maxtext")`` and ``("megatron", "hf")``); the reverse directions are
their :func:`~ckptbridge.invert`, and Megatron <-> MaxText is the composition through the HF
names.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from functools import cache
from typing import Any

from .._errors import OptionError
from ..rules import Drop, Expect, Rule, invert
from ._gpt import RecipeConfig

Builder = Callable[[Any], list[Rule]]
"""A recipe's rules in one base direction, for a family's config object."""

ROUTES: dict[tuple[str, str], tuple[tuple[str, str, bool], ...]] = {  # (src, dst) -> (base pair, inverted?) steps
    ("hf", "maxtext"): (("hf", "maxtext", False),),
    ("maxtext", "hf"): (("hf", "maxtext", True),),
    ("megatron", "hf"): (("megatron", "hf", False),),
    ("hf", "megatron"): (("megatron", "hf", True),),
    ("megatron", "maxtext"): (("megatron", "hf", False), ("hf", "maxtext", False)),
    ("maxtext", "megatron"): (("hf", "maxtext", True), ("megatron", "hf", True)),
}


@dataclass(frozen=True)
class Family:
    """One model family: its HF ``model_type`` names, its config type and defaults, and the rule
    builders of its base directions (see the module doc)."""

    name: str
    model_types: tuple[str, ...]
    base: Mapping[tuple[str, str], Builder]
    config: type = RecipeConfig  # a frozen dataclass whose fields are the config keys
    defaults: Mapping[str, Any] = field(default_factory=dict)
    required: tuple[str, ...] = ("n_heads", "n_kv_heads", "head_dim")
    from_hf: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None  # HF config.json -> recipe config
    megatron_args: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None  # HF config.json -> extra Megatron args
    hf_config: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None  # Megatron args -> its HF config.json keys

    def pairs(self) -> list[tuple[str, str]]:
        """Every ``(src, dst)`` this family maps (all routes whose base steps it has)."""
        return [pair for pair, steps in ROUTES.items() if all((a, b) in self.base for a, b, _ in steps)]

    def make_config(self, config: Mapping[str, Any]) -> Any:
        """The family's config object for user ``config`` over its defaults; unknown or missing keys
        fail naming them."""
        known = {f.name for f in fields(self.config)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise OptionError(f"recipe {self.name!r}: unknown config {unknown}; known: {sorted(known)}")
        missing = [k for k in self.required if k not in config]
        if missing:
            raise OptionError(f"recipe {self.name!r}: config needs {missing} (the model's shape)")
        return self.config(**{**self.defaults, **config})

    def rules(self, src: str, dst: str, config: Mapping[str, Any]) -> tuple[Rule, ...]:
        """The rule list from scheme ``src`` to ``dst`` (the base builders, inverted and chained as
        the route says; a shape check or a drop repeated by two steps is kept once)."""
        if (src, dst) not in self.pairs():
            pairs = ", ".join(f"{s}->{d}" for s, d in self.pairs())
            raise OptionError(f"recipe {self.name!r} has no {src!r} -> {dst!r} mapping; it maps {pairs}")
        cfg = self.make_config(config)
        out: list[Rule] = []
        for a, b, inverted in ROUTES[(src, dst)]:
            step = self.base[(a, b)](cfg)
            out += [r for r in (invert(step) if inverted else step) if r not in out or not isinstance(r, (Expect, Drop))]
        return tuple(out)


@cache
def registry() -> dict[str, Family]:
    """Every family of this package, by name, in module-name order."""
    from .. import recipes as pkg

    out: dict[str, Family] = {}
    for mod in sorted(m.name for m in pkgutil.iter_modules(pkg.__path__)):
        if mod.startswith("_"):
            continue
        fam = getattr(importlib.import_module(f"{pkg.__name__}.{mod}"), "FAMILY", None)
        if isinstance(fam, Family):
            out[fam.name] = fam
    return out


def family(name: str) -> Family:
    """The registered family ``name``; an unknown name fails listing the families."""
    fam = registry().get(name)
    if fam is None:
        raise OptionError(f"no recipe family {name!r}; families: {', '.join(registry())}")
    return fam


def load_config(config: Any) -> dict[str, Any]:
    """An HF ``config.json`` as a dict, from a path, a dict or a ``PretrainedConfig``."""
    import json

    if isinstance(config, (str, bytes)) or hasattr(config, "__fspath__"):
        with open(config) as fh:
            return dict(json.load(fh))
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    return dict(config)
