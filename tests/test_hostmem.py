"""Host buffers: ``fresh_array`` (a load's destination) and ``aligned_buffer`` (direct I/O)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from ckptbridge._storage import hostmem as _hostmem
from ckptbridge.plugin import fresh_array

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def _vm_flags(addr: int) -> set[str]:
    """The VmFlags of the mapping that holds ``addr`` (``nh``: MADV_NOHUGEPAGE, ``hg``: MADV_HUGEPAGE)."""
    inside = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.parametrize("slow", [True, False])
def test_fresh_array_avoids_huge_pages_only_where_their_first_touch_is_slow(monkeypatch, slow):
    monkeypatch.setattr(_hostmem, "huge_first_touch_is_slow", lambda: slow)
    a = fresh_array((3, 1 << 20), np.float32)  # 12 MiB
    assert a.shape == (3, 1 << 20) and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % 4096 == 0
    a[:] = 7
    assert float(a.sum()) == 7 * 3 * (1 << 20)
    assert ("nh" in _vm_flags(a.ctypes.data)) == slow
    small = fresh_array((5, 7), np.int16)  # under one huge page: always numpy's own memory
    assert small.shape == (5, 7) and small.ctypes.data % 4096 == 0 and "nh" not in _vm_flags(small.ctypes.data)


def test_the_hypervisor_rule_reads_the_kernels_page_reporting_order(monkeypatch, tmp_path):
    for text, slow in (("9\n", True), ("0\n", True), ("-1\n", False), ("x", False)):
        (tmp_path / "order").write_text(text)
        monkeypatch.setattr(_hostmem, "_REPORTING", str(tmp_path / "order"))
        _hostmem.huge_first_touch_is_slow.cache_clear()
        assert _hostmem.huge_first_touch_is_slow() is slow, text
    monkeypatch.setattr(_hostmem, "_REPORTING", str(tmp_path / "missing"))
    _hostmem.huge_first_touch_is_slow.cache_clear()
    assert _hostmem.huge_first_touch_is_slow() is False
    _hostmem.huge_first_touch_is_slow.cache_clear()
