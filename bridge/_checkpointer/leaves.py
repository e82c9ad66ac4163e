"""What the checkpointer captures: tensor leaves, and the runtimes that provide them.

A saved state is a tree of dicts, lists and NamedTuples whose leaves are
tensors (numpy here; torch and JAX through their runtime plug-ins) or plain
values. Each tensor becomes one or more :class:`Leaf` objects: this rank's box
of the tensor and how to copy its current value into a host buffer.

Runtimes register a :class:`LeafProvider` (``ckptbridge.adapters.torch`` and
``ckptbridge.adapters.jax`` do, through the ``ckptbridge.leaf_providers``
entry-point group), so the core never imports a framework: a provider is
loaded the first time a value of its framework is saved::

    register_leaf_provider(LeafProvider("mytensors", ("mylib",), leaves=my_leaves))
"""

from __future__ import annotations

import functools
import mmap
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _dtypes
from .._plugins import PluginGroup
from .._read.model import Box

ENTRY_POINT_GROUP = "ckptbridge.leaf_providers"


@dataclass(frozen=True)
class Leaf:
    """One tensor (or this rank's shard of one) to capture.

    ``copy(out)`` writes the tensor's current value into the host buffer
    ``out``; ``lazy`` says a guard protects it, so the copy may run later in
    the background. ``write`` is False for replicas another rank writes.
    ``start()``, if set, begins an asynchronous device-to-host transfer: the
    snapshot calls it for every leaf before the first ``copy``, so that all
    transfers overlap instead of running one after the other.
    """

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box
    copy: Callable[[np.ndarray], None]
    lazy: bool = False
    write: bool = True
    key: Any = None  # identity of the live tensor, for guards
    per_process: bool = False  # a plain tensor every process holds: treated as replicated, rank 0 writes
    pin: Callable[[mmap.mmap], Callable[[], None]] | None = None  # page-locks host buffers (CUDA tensors)
    start: Callable[[], None] | None = None

    @property
    def buffer_key(self) -> str:
        return buffer_key(self.name, self.box)


def buffer_key(name: str, box: Box) -> str:
    """The host buffer of one leaf (a tensor, or this rank's box of it)."""
    return f"{name}@{','.join(map(str, box.offset))}"


@dataclass(frozen=True)
class Capture:
    """What guards protect during one save: ``keys`` (identities of tensors an optimizer hook
    guards) and ``guarded`` (the train step is wrapped by ``Checkpointer.guard``)."""

    keys: frozenset[Any] = frozenset()
    guarded: bool = False


@dataclass(frozen=True)
class LeafProvider:
    """How the checkpointer captures and restores one framework's tensors.

    ``modules``: prefixes of ``type(value).__module__`` it handles (``("torch",)``).
    ``leaves(name, value, capture)``: the value's leaves on this rank.
    ``copy_into(value, array)``: restore a saved global array into a live value in place.
    ``guard_keys(optimizer)``: identities of every tensor ``optimizer.step()`` changes.
    ``state_of(obj, restoring)``: the live state tree of a framework object that stands for
    its state (a torch ``nn.Module`` or optimizer: its ``state_dict()``), else ``None``; with
    ``restoring`` the object first creates state it does not have yet (a fresh optimizer).
    ``after_restore(obj, saved)``: finish restoring such an object from its saved sub-tree
    (e.g. an optimizer's hyper-parameters, which its ``state_dict()`` only copies).
    ``donated(fn, args, kwargs)``: identities (leaf ``key``) of the values a call
    ``fn(*args, **kwargs)`` donates, or None when it cannot tell (a guarded call then waits
    for every pending snapshot).
    """

    name: str
    modules: tuple[str, ...]
    leaves: Callable[[str, Any, Capture], list[Leaf]]
    copy_into: Callable[[Any, np.ndarray], None] | None = None
    guard_keys: Callable[[Any], set[Any]] | None = None
    state_of: Callable[[Any, bool], Any] | None = None
    after_restore: Callable[[Any, Any], None] | None = None
    donated: Callable[[Any, tuple[Any, ...], Mapping[str, Any]], frozenset[Any] | None] | None = None


_GROUP = PluginGroup(ENTRY_POINT_GROUP)
_PROVIDERS: list[LeafProvider] = []


_BY_TYPE: dict[type, LeafProvider | None] = {}  # provider_for's answers (save walks thousands of leaves)


def register_leaf_provider(provider: LeafProvider) -> LeafProvider:
    with _GROUP.lock:
        _PROVIDERS[:] = [p for p in _PROVIDERS if p.name != provider.name]
        _PROVIDERS.append(provider)
        _BY_TYPE.clear()
    return provider


def _load_entry_points() -> None:
    with _GROUP.lock:
        known = {p.name for p in _PROVIDERS}
        for provider in _GROUP.load():  # a framework that is not installed is skipped: nothing of it is saved
            if provider.name not in known:
                register_leaf_provider(provider)


def provider_for(value: Any) -> LeafProvider | None:
    """The provider of ``value``'s framework (``None`` for numpy and plain values)."""
    kind = type(value)
    try:
        return _BY_TYPE[kind]
    except KeyError:
        pass
    module = kind.__module__
    if module.startswith(("numpy", "builtins")):
        return None
    with _GROUP.lock:
        found = next((p for p in _PROVIDERS if module.startswith(p.modules)), None)
    if found is None and not _GROUP.loaded:
        _load_entry_points()
        with _GROUP.lock:
            found = next((p for p in _PROVIDERS if module.startswith(p.modules)), None)
    with _GROUP.lock:
        if _GROUP.loaded or found is not None:
            _BY_TYPE[kind] = found
    return found


def providers() -> tuple[LeafProvider, ...]:
    _load_entry_points()
    with _GROUP.lock:
        return tuple(_PROVIDERS)


def expand(value: Any, restoring: bool = False) -> Any:
    """The state tree a framework object stands for (``nn.Module``, optimizer), else ``None``."""
    if isinstance(value, (np.ndarray, np.generic, str, bytes, int, float, bool)) or value is None:
        return None
    provider = provider_for(value)
    return provider.state_of(value, restoring) if provider is not None and provider.state_of else None


def flatten(state: Any, prefix: str = "", restoring: bool = False) -> Iterator[tuple[str, Any]]:
    """Leaves of nested dicts/lists/tuples/NamedTuples with dotted names
    (``{"opt": (ScaleByAdamState(count, mu, nu),)}`` -> ``opt.0.mu.w`` ...); a torch
    ``nn.Module`` or optimizer stands for its ``state_dict()``."""
    if isinstance(state, Mapping):
        for k, v in state.items():
            yield from flatten(v, f"{prefix}.{k}" if prefix else str(k), restoring)
    elif isinstance(state, tuple) and hasattr(state, "_fields"):  # NamedTuple (optax states)
        for k in state._fields:
            yield from flatten(getattr(state, k), f"{prefix}.{k}" if prefix else k, restoring)
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from flatten(v, f"{prefix}.{i}" if prefix else str(i), restoring)
    else:
        sub = expand(state, restoring)
        if sub is None:
            yield prefix, state
        else:
            yield from flatten(sub, prefix, restoring)


def _numpy_leaf(name: str, value: np.ndarray) -> Leaf:
    arr = np.asarray(value)
    shape = tuple(arr.shape)
    return Leaf(name, _dtypes.name_of(arr.dtype), shape, Box.full(shape),
                functools.partial(np.copyto, src=arr), per_process=True)


def leaves_of(state: Any, capture: Capture = Capture(),
              flat: Iterable[tuple[str, Any]] | None = None) -> tuple[list[Leaf], dict[str, Any]]:
    """Split a state into tensor leaves and JSON-able non-tensor values (``flat``: the
    state's ``flatten`` already done)."""
    leaves: list[Leaf] = []
    extra: dict[str, Any] = {}
    for name, value in flatten(state) if flat is None else flat:
        if isinstance(value, np.ndarray):
            leaves.append(_numpy_leaf(name, value))
            continue
        provider = provider_for(value)
        if provider is not None:
            leaves.extend(provider.leaves(name, value, capture))
        elif isinstance(value, np.generic):
            extra[name] = value.item()
        elif value is None or isinstance(value, (bool, int, float, str)):
            extra[name] = value
        else:
            extra[name] = repr(value)
    return leaves, extra


def pinner(leaves: list[Leaf]) -> Callable[[mmap.mmap], Callable[[], None]] | None:
    """How to page-lock host buffers for these leaves (set by providers for device tensors), if at all."""
    return next((leaf.pin for leaf in leaves if leaf.pin is not None), None)
