"""The format registry: every checkpoint format is a plug-in that registers one :class:`Format`.

A format says how to recognise its files (``detect``), how to open them as a
:class:`~ckptbridge.CheckpointIndex` (``index``, with typed ``open_options``)
and, optionally, how to write a checkpoint in it (``write``, with typed
``write_options``). ``ckptbridge.open``, ``ckptbridge.reshard``, the CLI
(``--to`` choices, ``--format``, per-format option help) and ``inspect`` all
read this one registry.

Built-in formats live in ``ckptbridge.adapters`` and are found through the
``ckptbridge.formats`` entry-point group, so a third-party package registers a
format the same way (``[project.entry-points."ckptbridge.formats"]``,
``myformat = "mypkg.ckpt:FORMAT"``) or at run time::

    from ckptbridge.plugin import Format, WriteOptions, register_format

    @dataclass(frozen=True)
    class MyWriteOptions(WriteOptions):
        shards: int = 1

    register_format(Format("mine", detect=detect, index=index, write=write,
                           write_options=MyWriteOptions, priority=40))

Entry points are loaded on the first look-up (not at ``import ckptbridge``), one
module per format, and an adapter that fails to import (a missing extra) does
not hide the others: its error becomes a hint naming the extra to install.
"""

from __future__ import annotations

import dataclasses
import types
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .._errors import OptionError, UnknownFormatError
from .._errors import (
    require as require,  # adapters' import-or-hint, re-exported for ckptbridge.plugin
)
from .._plugins import PluginGroup

if TYPE_CHECKING:
    from .._read.checkpoint import Checkpoint, CheckpointIndex

ENTRY_POINT_GROUP = "ckptbridge.formats"


@dataclass(frozen=True)
class Options:
    """Base of every format's typed options (frozen dataclasses; fields are the options)."""


@dataclass(frozen=True)
class OpenOptions(Options):
    """Options of a format's reader (``ckptbridge.open(path, format, **options)``)."""


@dataclass(frozen=True)
class WriteOptions(Options):
    """Options of a format's writer (``ckptbridge.reshard(src, dst, to, **options)``).

    ``overwrite``: replace an existing destination (only once the new one is complete).
    """

    overwrite: bool = False


OpenT = TypeVar("OpenT", bound=OpenOptions, contravariant=True)
WriteT = TypeVar("WriteT", bound=WriteOptions, contravariant=True)


class Detector(Protocol):
    """``detect(path) -> bool``: is ``path`` (a local path or URL) in this format? Cheap (a few
    listings or a header read) and never raises::

        def detect(path: str) -> bool:
            return path.endswith(".raw32")
    """

    def __call__(self, path: str, /) -> bool: ...


class Indexer(Protocol[OpenT]):
    """``index(path, options) -> CheckpointIndex``: the checkpoint's metadata (logical tensors,
    fragments, rules), nothing read; ``options`` is an instance of the format's ``open_options``::

        def index(path: str, options: MyOpenOptions) -> CheckpointIndex: ...
    """

    def __call__(self, path: str, options: OpenT, /) -> CheckpointIndex: ...


class Writer(Protocol[WriteT]):
    """``write(ckpt, dst, options) -> str``: write ``ckpt`` at ``dst`` (the format's suffix
    already added) with an instance of the format's ``write_options``; returns the path written::

        def write(ckpt: Checkpoint, dst: str, options: MyWriteOptions) -> str: ...
    """

    def __call__(self, ckpt: Checkpoint, dst: str, options: WriteT, /) -> str: ...


@dataclass(frozen=True)
class Format:
    """One checkpoint format, as registered by its adapter.

    ``detect`` (a :class:`Detector`) must be cheap and never raise. ``index``
    (an :class:`Indexer`) opens it (metadata only). ``write`` (a :class:`Writer`)
    writes a checkpoint (``None`` for read-only formats); each takes an instance
    of the format's own options class (hence ``Indexer[Any]``).
    ``priority``: detection order, lowest first (specific formats before
    generic ones). ``aliases``: other names it answers to; ``deprecated_aliases``:
    old names it still answers to, each with one ``DeprecationWarning`` per process
    (a renamed format). ``extra``: the ``pip install ckptbridge[extra]`` the format
    needs, named in errors when its imports fail. ``suffix``: the file
    extension of single-file formats (added to a destination without one).
    """

    name: str
    detect: Detector | None = None
    index: Indexer[Any] | None = None
    write: Writer[Any] | None = None
    open_options: type[OpenOptions] = OpenOptions
    write_options: type[WriteOptions] = WriteOptions
    priority: int = 50
    extra: str | None = None
    suffix: str = ""
    description: str = ""
    aliases: tuple[str, ...] = field(default=())
    deprecated_aliases: tuple[str, ...] = field(default=())

    @property
    def readable(self) -> bool:
        return self.index is not None

    @property
    def writable(self) -> bool:
        return self.write is not None


_GROUP = PluginGroup(ENTRY_POINT_GROUP)
_REGISTRY: dict[str, Format] = {}
_BROKEN = _GROUP.broken  # entry-point name -> why it failed to load
_LOCK = _GROUP.lock
_INSTALLED: set[int] = set()  # ids of entry-point values already registered
_WARNED: set[str] = set()  # deprecated names already warned about


def register_format(fmt: Format, *, replace: bool = False) -> Format:
    """Add ``fmt`` to the registry (``replace=True`` to override a format of that name)."""
    with _LOCK:
        for name in (fmt.name, *fmt.aliases, *fmt.deprecated_aliases):
            old = _REGISTRY.get(name)
            if old is not None and old is not fmt and not replace:
                raise ValueError(f"format {name!r} is already registered")
            _REGISTRY[name] = fmt
    return fmt


def _load_entry_points() -> None:
    with _LOCK:
        for value in _GROUP.load():
            if id(value) in _INSTALLED:
                continue
            _INSTALLED.add(id(value))
            for fmt in value if isinstance(value, (list, tuple)) else (value,):
                if fmt.name not in _REGISTRY:  # one registered at run time wins
                    register_format(fmt)


def formats() -> tuple[Format, ...]:
    """Every registered format, in detection order (one entry per format, aliases folded)."""
    _load_entry_points()
    with _LOCK:
        unique = {id(f): f for f in _REGISTRY.values()}
    return tuple(sorted(unique.values(), key=lambda f: (f.priority, f.name)))


def get_format(name: str) -> Format:
    """The format registered as ``name``; ``UnknownFormatError`` lists the known ones."""
    _load_entry_points()
    with _LOCK:
        fmt = _REGISTRY.get(name)
    if fmt is None:
        hint = f"; adapters that failed to import: {broken_hint()}" if _BROKEN else ""
        raise UnknownFormatError(
            f"unknown format {name!r}; known: {', '.join(f.name for f in formats())}{hint}")
    if name in fmt.deprecated_aliases:
        _warn_renamed(name, fmt.name)
    return fmt


def _warn_renamed(old: str, new: str) -> None:
    with _LOCK:
        if old in _WARNED:
            return
        _WARNED.add(old)
    warnings.warn(f"format name {old!r} is deprecated and will be removed; use {new!r}",
                  DeprecationWarning, stacklevel=3)


def broken_hint() -> str:
    return "; ".join(f"{n} ({why})" for n, why in sorted(_BROKEN.items()))


def writable_formats() -> tuple[Format, ...]:
    return tuple(f for f in formats() if f.writable)


# ------------------------------------------------------------------ typed options


def option_fields(cls: type[Options]) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls)}


def option_type(cls: type[Options], name: str) -> Any:
    hints = typing.get_type_hints(cls)
    return hints.get(name, str)


def _parse_bool(text: str, where: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on", "y", "t"):
        return True
    if low in ("0", "false", "no", "off", "n", "f"):
        return False
    raise OptionError(f"{where}: expected a yes/no value (true/false), got {text!r}")


def coerce(value: Any, tp: Any, where: str) -> Any:
    """``value`` (often a string from the command line) as type ``tp`` (bool, int, float, str,
    tuples and ``X | None``); raises :class:`OptionError` naming ``where`` when it does not fit."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        errors = []
        for a in args:
            try:
                return coerce(value, a, where)
            except OptionError as err:
                errors.append(str(err))
        raise OptionError(errors[0] if errors else f"{where}: bad value {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str):
            return _parse_bool(value, where)
        raise OptionError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise OptionError(f"{where}: expected an integer, got {value!r}")
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise OptionError(f"{where}: expected an integer, got {value!r}") from None
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise OptionError(f"{where}: expected a number, got {value!r}") from None
    if tp is str:
        return str(value)
    if origin is tuple:
        inner = (typing.get_args(tp) or (str,))[0]
        items = value.split(",") if isinstance(value, str) else list(value)
        return tuple(coerce(v, inner, where) for v in items if v != "")
    if origin is Mapping or tp is Mapping or origin is dict:
        if isinstance(value, Mapping):
            return dict(value)
        raise OptionError(f"{where}: expected a mapping, got {value!r}")
    return value


def make_options(cls: type[Options], given: Mapping[str, Any], *, what: str) -> Options:
    """Build ``cls`` from ``given``, refusing options the format does not have.

    ``what`` names the format and the operation in errors, e.g. ``"format 'megatron' (write)"``.
    """
    fields = option_fields(cls)
    unknown = sorted(k for k in given if k not in fields)
    if unknown:
        known = ", ".join(sorted(fields)) or "none"
        raise OptionError(f"{what} has no option {', '.join(repr(k) for k in unknown)} (its options: {known})")
    kwargs = {k: coerce(v, option_type(cls, k), f"{what}: option {k!r}") for k, v in given.items()}
    opts = cls(**kwargs)
    check = getattr(opts, "validate", None)
    if check is not None:
        check()
    return opts


def describe_options(cls: type[Options]) -> list[tuple[str, str, str, str]]:
    """``(name, type, default, help)`` per option, for the CLI's help text."""
    out = []
    docs = _field_docs(cls)
    for name, f in option_fields(cls).items():
        tp = option_type(cls, name)
        tname = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
        default = f.default if f.default is not dataclasses.MISSING else "required"
        out.append((name, tname, repr(default), docs.get(name, "")))
    return out


def _field_docs(cls: type[Options]) -> dict[str, str]:
    """Per-field help from the ``name: meaning`` lines of the class docstrings (base classes too)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        for line in (klass.__doc__ or "").splitlines():
            line = line.strip()
            if line.startswith("``") and "``:" in line:
                name, _, text = line[2:].partition("``:")
                out[name] = text.strip()
    return out
