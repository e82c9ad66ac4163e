"""One spelling of "make this JSON-able" for manifests and ``extra.json``."""

from __future__ import annotations

from typing import Any

import numpy as np


def jsonable(obj: Any) -> Any:
    """``obj`` with dicts keyed by strings, tuples as lists, numpy scalars as Python numbers and
    anything else not JSON-native as its ``repr`` (so a manifest never fails to write)::

        >>> jsonable({1: (np.float32(0.5), None, object)})["1"][:2]
        [0.5, None]
    """
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    return repr(obj)
