"""Public names imported on first use (PEP 562), listed once in a module's ``if TYPE_CHECKING:`` block.

``ckptbridge``, ``ckptbridge.plugin`` and each built-in format's package list their heavy public
names as the imports of that block: mypy reads them, and at run time the module's ``__getattr__``
imports each one the first time it is used. A format package is imported by format detection (its
entry point), so this keeps detection from importing every format's reader and writer (the
package itself imports only its ``_format`` module: ``detect`` and the options classes)::

    from typing import TYPE_CHECKING

    from ckptbridge.plugin import Format, LazyNames

    from ._format import MyOpenOptions, MyWriteOptions, detect

    if TYPE_CHECKING:
        from ._reader import index as index
        from ._writer import write as write

    def _open(path, options):
        from . import index        # through __getattr__: the reader is imported on the first open
        return index(path, tag=options.tag)

    FORMAT = Format("mine", detect=detect, index=_open, write=LazyNames.deferred(__name__, "write"),
                    open_options=MyOpenOptions, write_options=MyWriteOptions, extra="torch")
    __getattr__ = LazyNames(__name__, FORMAT.extra)   # `from pkg import write` still works

A name whose module fails to import raises :class:`~ckptbridge.MissingExtraError` naming the
module, the cause and, with ``extra``, the ``pip install 'ckptbridge[extra]'`` that provides it
(what the registry says of a format whose entry point fails to import), never a bare ``ImportError``
from deep in a call.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any


def type_checking_names(path: str) -> dict[str, tuple[str, str]]:
    """Name -> (module, name there) for each import of the ``if TYPE_CHECKING:`` block of the file ``path``."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test).endswith("TYPE_CHECKING"))
    return {a.asname or a.name: ("." * n.level + (n.module or ""), a.name)
            for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}


class LazyNames:
    """The ``__getattr__`` of module ``module``: each name of its ``TYPE_CHECKING`` block is imported
    on first use and then kept in the module (later uses are plain attributes). ``extra``: the
    ``ckptbridge[extra]`` to name when an import fails (a format's ``Format.extra``)."""

    def __init__(self, module: str, extra: str | None = None) -> None:
        self.module = module
        self.extra = extra
        self._names: dict[str, tuple[str, str]] | None = None  # read from the source on first use

    def names(self) -> dict[str, tuple[str, str]]:
        """Name -> (module, name there), as :func:`type_checking_names` reads them."""
        if self._names is None:
            self._names = type_checking_names(str(importlib.import_module(self.module).__file__))
        return self._names

    def __call__(self, name: str) -> Any:
        where = self.names().get(name)
        if where is None:
            raise AttributeError(f"module {self.module!r} has no attribute {name!r}")
        module, attr = where
        owner = importlib.import_module(self.module)  # itself (already imported): its package resolves `.x`
        try:
            value = getattr(importlib.import_module(module, owner.__package__), attr)
        except ImportError as err:
            from ._errors import MissingExtraError

            if isinstance(err, MissingExtraError):
                raise
            hint = f"; install it with: pip install 'ckptbridge[{self.extra}]'" if self.extra else ""
            raise MissingExtraError(
                f"{self.module}.{name} needs {importlib.util.resolve_name(module, owner.__package__)!r}, which "
                f"failed to import ({type(err).__name__}: {err}){hint}") from err
        setattr(owner, name, value)
        return value

    @staticmethod
    def deferred(module: str, name: str) -> Callable[..., Any]:
        """A function that calls ``module.name``, looked up (through the module's ``LazyNames``) when
        it is first called: a format's ``write`` whose module is heavy, without a wrapper of its own::

            FORMAT = Format("dcp", ..., write=LazyNames.deferred(__name__, "write"))
        """
        def call(*args: Any, **kwargs: Any) -> Any:
            return getattr(importlib.import_module(module), name)(*args, **kwargs)

        call.__name__ = call.__qualname__ = name
        call.__module__ = module
        return call
