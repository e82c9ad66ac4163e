"""A pickle loader that never runs code from the file.

Checkpoints written by ``torch.save`` (and DeepSpeed, Megatron, DCP on top of
it) are pickles. Plain ``pickle.load`` would import and call whatever the
file names, so a hostile checkpoint could run ``os.system``. Here
``find_class`` resolves only a short allow-list of data constructors
(containers, numpy arrays, torch's tensor-rebuild functions, which we
reimplement without torch); a call into a module that can run code
(``os``, ``subprocess``, ``builtins.eval`` ...) raises
:class:`UnsafePickleError`; every other class becomes an inert
:class:`Opaque` record of its name, arguments and state, so metadata objects
such as DeepSpeed's ``fragment_address`` or Megatron's ``argparse.Namespace``
stay readable without importing their libraries::

    obj = safe_loads(data, persistent_load=lambda pid: ...)
"""

from __future__ import annotations

import collections
import io
import pickle
import reprlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptbridge.plugin import FormatError, UnsafePickleError

# Modules whose callables can execute code or touch the system: refused outright.
_DANGEROUS_MODULES = (
    "os", "posix", "nt", "subprocess", "sys", "shutil", "socket", "pty", "runpy", "code",
    "importlib", "pickle", "_pickle", "marshal", "types", "ctypes", "multiprocessing",
    "webbrowser", "platform", "signal", "tempfile", "pathlib", "io", "_io", "threading",
    "asyncio", "commands", "popen2", "pdb", "timeit", "operator", "functools", "inspect",
)
_DANGEROUS_BUILTINS = {
    "eval", "exec", "compile", "open", "getattr", "setattr", "delattr", "__import__",
    "globals", "locals", "vars", "input", "breakpoint", "exit", "quit", "help", "memoryview",
    "type", "object", "super", "classmethod", "staticmethod", "property", "apply", "execfile",
}
# Plain data classes that live in otherwise refused modules: kept as inert Opaque records
# (Megatron-LM's args hold ``exit_signal=signal.Signals.SIGTERM``, an Enum built from its value).
_INERT_IN_DANGEROUS = {("signal", "Signals"), ("signal", "Handlers"), ("signal", "Sigmasks")} | {
    # torch DCP's ``.metadata`` records ``StorageMeta.checkpoint_id`` as a path object.
    ("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
}


def _no_size(kind: type) -> Any:
    """``bytes``/``bytearray`` from data only: ``bytearray(10**12)`` would allocate a terabyte."""

    def build(*args: Any) -> Any:
        if args and isinstance(args[0], int):
            raise FormatError(f"pickle asks for a {kind.__name__} of {args[0]} zero bytes")
        return kind(*args)

    return build


_SAFE_BUILTINS = {
    "set": set, "frozenset": frozenset, "slice": slice, "complex": complex,
    "bytearray": _no_size(bytearray), "bytes": _no_size(bytes), "list": list, "dict": dict,
    "tuple": tuple, "int": int, "float": float, "bool": bool, "str": str,
}


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxstring, _REPR.maxother = 4, 30, 30, 200, 200


class Opaque:
    """An object of a class ckptbridge did not import: its name, arguments and state.

    Attribute access reads the pickled state (``obj.numel`` for a
    ``fragment_address``); enums expose ``.value``; dict-like pickles keep their
    items (``obj.items_``).
    """

    _module = "?"
    _qualname = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        obj = object.__new__(cls)
        obj.__dict__.update(args_=args, kwargs_=kwargs, state_=None, items_={}, list_=[])
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.__dict__["state_"] = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__["items_"][key] = value

    def append(self, value: Any) -> None:
        self.__dict__["list_"].append(value)

    def extend(self, values: Any) -> None:
        self.__dict__["list_"].extend(values)

    @property
    def fields(self) -> dict[str, Any]:
        """The pickled attributes, merged from ``__dict__`` and ``__slots__`` state."""
        state = self.__dict__["state_"]
        if isinstance(state, tuple) and len(state) == 2 and all(
            s is None or isinstance(s, dict) for s in state
        ):
            return {**(state[0] or {}), **(state[1] or {})}
        return dict(state) if isinstance(state, dict) else {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        fields = self.fields
        if name in fields:
            return fields[name]
        if name == "value" and self.__dict__["args_"]:
            return self.__dict__["args_"][0]
        raise AttributeError(f"{self._module}.{self._qualname} object has no field {name!r}")

    def __repr__(self) -> str:
        inner = self.fields or self.__dict__["args_"]
        return f"<{self._module}.{self._qualname} {_REPR.repr(inner)}>"


_OPAQUE_CLASSES: dict[tuple[str, str], type[Opaque]] = {}


def opaque_class(module: str, name: str) -> type[Opaque]:
    key = (module, name)
    cls = _OPAQUE_CLASSES.get(key)
    if cls is None:
        cls = type(name.rsplit(".", 1)[-1], (Opaque,), {"_module": module, "_qualname": name})
        _OPAQUE_CLASSES[key] = cls
    return cls


# ---------------------------------------------------------------- torch pieces


@dataclass(frozen=True)
class StorageRef:
    """A torch storage inside an archive: its record key, dtype and element count."""

    key: str
    dtype: str
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A torch tensor as pickled: a view (offset, size, stride in elements) of a storage."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> str:
        return self.storage.dtype


@dataclass(frozen=True)
class TorchDtype:
    """A ``torch.dtype`` value found in a pickle (``torch.float32`` -> ``TorchDtype("float32")``)."""

    name: str


_STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "UntypedStorage": "uint8", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128", "Float8_e4m3fnStorage": "float8_e4m3fn",
    "Float8_e5m2Storage": "float8_e5m2", "UInt16Storage": "uint16", "UInt32Storage": "uint32",
    "UInt64Storage": "uint64",
}
_TORCH_DTYPES = {
    "float32": "float32", "float": "float32", "float64": "float64", "double": "float64",
    "float16": "float16", "half": "float16", "bfloat16": "bfloat16", "int64": "int64",
    "long": "int64", "int32": "int32", "int": "int32", "int16": "int16", "short": "int16",
    "int8": "int8", "uint8": "uint8", "bool": "bool", "complex64": "complex64",
    "complex128": "complex128", "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
    "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
}
TORCH_DTYPE_NAMES = frozenset(_TORCH_DTYPES)  # the names ``torch.<name>`` a pickle may use for a dtype


@dataclass(frozen=True)
class StorageType:
    dtype: str


def _rebuild_tensor(storage: Any, offset: int, size: Any, stride: Any, *_: Any, **__: Any) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise FormatError(f"tensor rebuilt from {type(storage).__name__}, expected a storage record")
    return TensorRef(storage, int(offset), tuple(int(s) for s in size), tuple(int(s) for s in stride))


def _rebuild_parameter(data: Any, *_: Any, **__: Any) -> Any:
    return data


def _rebuild_from_type_v2(func: Callable[..., Any], _new_type: Any, args: Any, _state: Any) -> Any:
    if func not in (_rebuild_tensor, _rebuild_parameter):
        raise UnsafePickleError(f"tensor subclass rebuilt with {func!r}")
    return func(*args)


def _unsupported(what: str) -> Callable[..., Any]:
    def fail(*_: Any, **__: Any) -> Any:
        raise FormatError(f"unsupported tensor kind in pickle: {what}")

    return fail


_TORCH_FUNCS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch._utils", "_rebuild_sparse_tensor"): _unsupported("sparse tensor"),
    ("torch._utils", "_rebuild_qtensor"): _unsupported("quantized tensor"),
    ("torch._utils", "_rebuild_meta_tensor_no_storage"): _unsupported("meta tensor"),
    ("torch._utils", "_rebuild_wrapper_subclass"): _unsupported("tensor subclass (DTensor?)"),
    ("torch", "Size"): lambda *a: tuple(a[0]) if a else (),
    ("torch", "device"): lambda *a: ":".join(str(x) for x in a),
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): lambda *_a: {},
    ("_codecs", "encode"): lambda s, enc="utf-8": s.encode(enc),
}


def _numpy_reconstruct(*args: Any) -> Any:
    # numpy pickles call _reconstruct(ndarray, (0,), b"b") and then __setstate__ with the real
    # shape and bytes (which numpy checks against each other); any other shape would allocate
    # whatever the file claims, so it is refused.
    if len(args) < 3 or tuple(args[1]) != (0,):
        raise FormatError(f"unexpected numpy array reconstruction {args[1:2]!r}")
    return np.ndarray.__new__(np.ndarray, (0,), args[2])


_NUMPY_FUNCS = {
    "_reconstruct": _numpy_reconstruct,
    "ndarray": np.ndarray,
    "dtype": np.dtype,
    "scalar": lambda dt, data=b"": np.frombuffer(data, dtype=dt)[0] if data else dt.type(0),
}


def resolve(module: str, name: str) -> Any:
    """What a ``GLOBAL module name`` opcode means here: a safe callable, or an Opaque class."""
    top = module.split(".", 1)[0]
    if (module, name) in _TORCH_FUNCS:
        return _TORCH_FUNCS[(module, name)]
    if module == "builtins" or module == "__builtin__":
        if name in _SAFE_BUILTINS:
            return _SAFE_BUILTINS[name]
        raise UnsafePickleError(f"the pickle calls builtins.{name}: refused (it could run code)")
    if (module, name) in _INERT_IN_DANGEROUS:
        return opaque_class(module, name)
    if top in _DANGEROUS_MODULES:
        raise UnsafePickleError(f"the pickle calls {module}.{name}: refused (it could run code)")
    if module in ("numpy.core.multiarray", "numpy._core.multiarray", "numpy") and name in _NUMPY_FUNCS:
        return _NUMPY_FUNCS[name]
    if module == "torch" and name in _STORAGE_DTYPES:
        return StorageType(_STORAGE_DTYPES[name])
    if module == "torch" and name in _TORCH_DTYPES:
        return TorchDtype(_TORCH_DTYPES[name])
    if top == "numpy" and name.endswith("DType"):  # numpy 2's dtype classes (numpy.dtypes.Float32DType)
        return np.dtype
    return opaque_class(module, name)


class SafeUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, persistent_load: Callable[[Any], Any] | None) -> None:
        super().__init__(file)
        self._persistent = persistent_load

    def find_class(self, module: str, name: str) -> Any:
        return resolve(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise FormatError(f"pickle refers to external data {pid!r} but none is available")
        return self._persistent(pid)


def safe_loads(data: bytes, persistent_load: Callable[[Any], Any] | None = None, source: str = "<bytes>") -> Any:
    """Unpickle ``data`` without running code; errors name ``source``."""
    try:
        return SafeUnpickler(io.BytesIO(data), persistent_load).load()
    except (UnsafePickleError, FormatError) as err:
        raise type(err)(f"{source}: {err}") from None
    except Exception as err:  # any malformed stream ends here, never deeper
        raise FormatError(f"{source}: not a readable pickle ({type(err).__name__}: {err})") from None
