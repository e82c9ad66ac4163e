"""The shape of a saved state, kept so that ``restore()`` gives back the tree ``save`` was given.

Leaves are stored under dotted names (``{"model": {"0.weight": w}}`` -> ``model.0.weight``),
which cannot be split back unambiguously (``0.weight`` holds a dot itself) and
lose key types (torch optimizer state is keyed by ``int``). So ``save`` also
records the tree's skeleton as JSON, each leaf replaced by its stored name (a string), and
``restore`` fills it back in (pure functions)::

    flat, skel = walk({"model": {"0.weight": w}, "opt": {"state": {0: {"step": s}}}})
    # {"dict": [["model", {"dict": [["0.weight", "model.0.weight"]]}],
    #           ["opt", {"dict": [["state", {"dict": [[0, {"dict": [["step", "opt.state.0.step"]]}]]}]]}]]}
    build(skel, {"model.0.weight": w2, "opt.state.0.step": s2}.__getitem__)

Dicts (any mapping) come back as ``dict`` with their keys' JSON types (str, int,
float, bool, None; other keys as their ``str``), lists as lists, tuples as tuples
and NamedTuples (optax states) as namedtuples of the same name and fields (a new
class, so nothing named in a file is ever imported).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .leaves import expand

Node = Any  # a leaf's stored name (str), or {"dict" | "list" | "tuple" | "namedtuple": children, ...}


def _key(k: Any) -> Any:
    return k if k is None or isinstance(k, (str, int, float, bool)) else str(k)


def _join(prefix: str, k: Any) -> str:
    return f"{prefix}.{k}" if prefix else str(k)


def walk(state: Any, prefix: str = "") -> tuple[list[tuple[str, Any]], Node]:
    """``(flat, skeleton)`` of ``state`` in one pass: its leaves under the names ``leaves.flatten``
    gives, and its JSON skeleton (each leaf replaced by its name)."""
    flat: list[tuple[str, Any]] = []
    return flat, _walk(state, prefix, flat)


def _walk(state: Any, prefix: str, flat: list[tuple[str, Any]]) -> Node:
    if isinstance(state, Mapping):
        return {"dict": [[_key(k), _walk(v, _join(prefix, k), flat)] for k, v in state.items()]}
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return {"namedtuple": [_walk(getattr(state, f), _join(prefix, f), flat) for f in state._fields],
                "name": type(state).__name__, "fields": list(state._fields)}
    if isinstance(state, (list, tuple)):
        kind = "list" if isinstance(state, list) else "tuple"
        return {kind: [_walk(v, _join(prefix, i), flat) for i, v in enumerate(state)]}
    sub = expand(state)  # a framework object (nn.Module, Optimizer) stands for its state dict
    if sub is not None:
        return _walk(sub, prefix, flat)
    flat.append((prefix, state))
    return prefix


def leaf_names(node: Node) -> Iterator[str]:
    """Every leaf name of a skeleton, in order."""
    if isinstance(node, str):
        yield node
        return
    if "dict" in node:
        for _, sub in node["dict"]:
            yield from leaf_names(sub)
        return
    for kind in ("list", "tuple", "namedtuple"):
        if kind in node:
            for sub in node[kind]:
                yield from leaf_names(sub)
            return


def build(node: Node, value_of: Callable[[str], Any]) -> Any:
    """The tree a skeleton describes, each leaf name replaced by ``value_of(name)``."""
    if isinstance(node, str):
        return value_of(node)
    if "dict" in node:
        return {k: build(sub, value_of) for k, sub in node["dict"]}
    if "list" in node:
        return [build(sub, value_of) for sub in node["list"]]
    if "tuple" in node:
        return tuple(build(sub, value_of) for sub in node["tuple"])
    if "namedtuple" in node:
        cls = collections.namedtuple(str(node.get("name") or "Saved"), node["fields"], rename=True)  # type: ignore[misc]
        return cls(*(build(sub, value_of) for sub in node["namedtuple"]))
    raise ValueError(f"not a saved-tree node: {sorted(node)}")
