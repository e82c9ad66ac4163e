"""Dtype names used in manifests and the numpy dtypes behind them.

Names follow the short spelling used by safetensors and torch
(``float32``, ``bfloat16``, ...). bfloat16 and the fp8 types come from
``ml_dtypes`` so that the core needs numpy only.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ._errors import FormatError

_NUMPY: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16),
    "int8": np.dtype(np.int8),
    "uint64": np.dtype(np.uint64),
    "uint32": np.dtype(np.uint32),
    "uint16": np.dtype(np.uint16),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
    "complex64": np.dtype(np.complex64),
    "complex128": np.dtype(np.complex128),
}
_NAMES = {v: k for k, v in _NUMPY.items()}

# safetensors spells dtypes differently.
_SAFETENSORS = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
    "BOOL": "bool", "C64": "complex64",
}
_TO_SAFETENSORS = {v: k for k, v in _SAFETENSORS.items()}


def to_numpy(name: str) -> np.dtype:
    """``"bfloat16"`` -> ``np.dtype(ml_dtypes.bfloat16)``."""
    try:
        return _NUMPY[name]
    except KeyError:
        raise FormatError(f"unsupported dtype {name!r}; known: {sorted(_NUMPY)}") from None


def name_of(dtype: object) -> str:
    """Canonical name of a numpy dtype (or of a name already canonical)."""
    if isinstance(dtype, str) and dtype in _NUMPY:
        return dtype
    try:
        return _NAMES[np.dtype(dtype)]  # type: ignore[call-overload]
    except (KeyError, TypeError):
        raise FormatError(f"unsupported dtype {dtype!r}") from None


def itemsize(name: str) -> int:
    return to_numpy(name).itemsize


def from_safetensors(code: str) -> str:
    try:
        return _SAFETENSORS[code]
    except KeyError:
        raise FormatError(f"unsupported safetensors dtype {code!r}") from None


def to_safetensors(name: str) -> str:
    try:
        return _TO_SAFETENSORS[name]
    except KeyError:
        raise FormatError(f"dtype {name!r} has no safetensors spelling") from None
