"""Pausing Python's cyclic garbage collector while many objects without cycles are made (no imports:
``ckptbridge``'s lazy attributes use it too)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while metadata is built: opening DeepSeek-V3 and running
    its recipe make millions of small immutable objects (boxes, fragments, states) without cycles,
    and the collector's full passes over them took half the time (20 s -> 11 s CPU). On the way out,
    what was made goes straight to the oldest generation (``gc.freeze()`` then ``gc.unfreeze()``: every
    tracked object of the process is moved there, none is frozen): otherwise the first allocation after
    runs one young-generation pass over all of it (0.1 s of CPU after DeepSeek-V3's recipe), and any
    young garbage cycle of the caller's is collected by the next full pass instead::

        with no_gc():
            tensors = apply_rules(tensors, rules)
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.freeze()
            gc.unfreeze()
            gc.enable()
