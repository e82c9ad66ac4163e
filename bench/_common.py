"""Helpers shared by the benchmark scripts (imported as ``_common``: scripts run as ``python bench/X.py``)."""

from __future__ import annotations

import os
import time


def drop_caches() -> bool:
    """Drop the page cache (needs root) and let the machine settle, for "cold" reps; False if refused."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        time.sleep(5)
        return True
    except OSError:
        return False
