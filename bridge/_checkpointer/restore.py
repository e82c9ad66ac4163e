"""Restoring a saved step into live state: names matched strictly, everything checked before any copy.

``Checkpointer.restore_into`` walks the live tree the way ``save`` walked the saved
one (same dotted names; an ``nn.Module`` or optimizer stands for its state dict,
and a fresh optimizer first creates its state, as
``torch.distributed.checkpoint.state_dict.set_state_dict`` does), compares the two
name sets like torch's ``load_state_dict`` and only then copies::

    result = restore_into(live, saved_values, saved_names, where="ckpts/step_00000007")
    missing, unexpected = result          # both empty when strict (the default)

Tensors and numpy arrays are filled in place (cast to the live dtype); plain
values (numbers, strings) are written back into the dicts and lists holding
them; framework objects finish with their provider's ``after_restore`` (an
optimizer takes its saved hyper-parameters).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import CheckpointError, ShapeMismatchError, TensorNotFoundError
from .._read.open import open as open_checkpoint
from .leaves import LeafProvider, provider_for

_PLAIN = (str, bytes, int, float, bool, np.generic)


@dataclass(frozen=True)
class RestoreResult:
    """What ``Checkpointer.restore_into`` restored.

    ``missing_keys``: live names the step does not have; ``unexpected_keys``: saved
    names the live state does not have (both empty unless ``strict=False``).
    Unpacks like torch's ``load_state_dict`` result::

        missing, unexpected = ck.restore_into(state, strict=False)
    """

    step: int
    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()

    def __iter__(self) -> Iterator[list[str]]:
        return iter((list(self.missing_keys), list(self.unexpected_keys)))


@dataclass(frozen=True)
class _Slot:
    """One live leaf: its name, value, and the container (and key) holding it, if mutable."""

    name: str
    value: Any
    parent: Any = None
    key: Any = None


@dataclass(frozen=True)
class _Object:
    """A framework object in the live tree (it stands for its state dict)."""

    name: str
    obj: Any
    live: Any  # its state tree, as walked
    provider: LeafProvider


def _join(prefix: str, k: Any) -> str:
    return f"{prefix}.{k}" if prefix else str(k)


def _walk(state: Any, prefix: str, parent: Any, key: Any, objects: list[_Object]) -> Iterator[_Slot]:
    """The live leaves, named exactly as ``leaves.flatten`` names saved ones."""
    if isinstance(state, Mapping):
        mutable = state if isinstance(state, MutableMapping) else None
        for k, v in state.items():
            yield from _walk(v, _join(prefix, k), mutable, k, objects)
    elif isinstance(state, tuple) and hasattr(state, "_fields"):
        for k in state._fields:
            yield from _walk(getattr(state, k), _join(prefix, k), None, None, objects)
    elif isinstance(state, (list, tuple)):
        items = state if isinstance(state, list) else None
        for i, v in enumerate(state):
            yield from _walk(v, _join(prefix, i), items, i, objects)
    elif state is None or isinstance(state, (*_PLAIN, np.ndarray)):
        yield _Slot(prefix, state, parent, key)
    else:
        provider = provider_for(state)
        sub = provider.state_of(state, True) if provider is not None and provider.state_of else None
        if sub is None:
            yield _Slot(prefix, state, parent, key)
        else:
            objects.append(_Object(prefix, state, sub, provider))  # type: ignore[arg-type]
            yield from _walk(sub, prefix, None, None, objects)


def _refill(live: Any, prefix: str, saved: Mapping[str, Any]) -> Any:
    """``live``'s structure with each leaf replaced by its saved value (live leaf if none)."""
    if isinstance(live, Mapping):
        return {k: _refill(v, _join(prefix, k), saved) for k, v in live.items()}
    if isinstance(live, tuple) and hasattr(live, "_fields"):
        return type(live)(*(_refill(getattr(live, k), _join(prefix, k), saved) for k in live._fields))
    if isinstance(live, (list, tuple)):
        items = [_refill(v, _join(prefix, i), saved) for i, v in enumerate(live)]
        return items if isinstance(live, list) else tuple(items)
    return saved.get(prefix, live)


def _listing(names: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def _is_tensor(value: Any) -> bool:
    return value is not None and not isinstance(value, _PLAIN)


def restore_into(state: Any, saved: Mapping[str, Any], saved_names: Sequence[str], *, step: int, where: str,
                 strict: bool = True) -> RestoreResult:
    """Copy ``saved`` (name -> array or plain value) into the live ``state`` (see the module doc).

    ``saved_names``: the names the step's own tree holds (what counts as unexpected).
    Raises :class:`~ckptbridge.TensorNotFoundError` listing missing and unexpected names
    when ``strict``; :class:`~ckptbridge.ShapeMismatchError` for a shape that differs,
    before anything is copied.
    """
    objects: list[_Object] = []
    slots = list(_walk(state, "", None, None, objects))
    live_names = {s.name for s in slots}
    missing = tuple(s.name for s in slots if s.name not in saved)
    unexpected = tuple(n for n in saved_names if n not in live_names)
    if strict and (missing or unexpected):
        parts = [f"{where}: the saved step does not match the state to restore into"]
        if missing:
            parts.append(f"missing (in the state, not saved): {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected (saved, not in the state): {_listing(unexpected)}")
        parts.append("pass strict=False to restore the names both have")
        raise TensorNotFoundError("; ".join(parts))
    plan: list[tuple[_Slot, Any, LeafProvider | None]] = []
    problems: list[str] = []
    shapes_only = True
    for s in slots:
        if s.name not in saved:
            continue
        value, arr = s.value, saved[s.name]
        if not _is_tensor(value):
            plan.append((s, arr, None))
            continue
        if not isinstance(arr, np.ndarray):
            problems.append(f"{s.name!r}: saved as the value {arr!r}, not as a tensor")
            shapes_only = False
            continue
        provider = None if isinstance(value, np.ndarray) else provider_for(value)
        if not isinstance(value, np.ndarray) and (provider is None or provider.copy_into is None):
            problems.append(f"{s.name!r}: a {type(value).__module__}.{type(value).__qualname__} cannot be "
                            "filled in place (restore() returns the saved arrays)")
            shapes_only = False
            continue
        if tuple(np.shape(value)) != tuple(arr.shape):
            problems.append(f"{s.name!r}: saved shape {tuple(arr.shape)}, live shape {tuple(np.shape(value))}")
            continue
        plan.append((s, arr, provider))
    if problems:
        cls = ShapeMismatchError if shapes_only else CheckpointError
        raise cls(f"{where}: cannot restore {_listing(problems, 8)}")
    for s, arr, provider in plan:
        if provider is not None:
            provider.copy_into(s.value, arr)  # type: ignore[misc]
        elif isinstance(s.value, np.ndarray):
            np.copyto(s.value, arr, casting="unsafe")
        elif s.parent is not None:
            s.parent[s.key] = arr.item() if isinstance(arr, np.ndarray) and arr.ndim == 0 else arr
    for o in objects:
        if o.provider.after_restore is not None:
            o.provider.after_restore(o.obj, _refill(o.live, o.name, saved))
    return RestoreResult(step, () if strict else missing, () if strict else unexpected)


def load_step(path: str) -> tuple[dict[str, Any], Any]:
    """A committed step's values (flat name -> array or value) and its saved tree's skeleton
    (``None`` if not recorded)."""
    with open_checkpoint(path) as ckpt:
        out: dict[str, Any] = {name: ckpt[name].read() for name in ckpt}
        out.update(ckpt.extra.get("values", {}))
        tree = ckpt.extra.get("tree")
    return out, tree if isinstance(tree, (dict, str)) else None
