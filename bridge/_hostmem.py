"""Page-aligned host buffers for direct I/O, backed by huge pages where the kernel allows.

Every buffer the writers hand to ``O_DIRECT`` (staging slots, the Checkpointer's
snapshot images) comes from here: a private anonymous mapping advised
``MADV_HUGEPAGE``. On this project's VM a 1 GiB ``O_DIRECT`` write from such
memory runs 1.2x (new file) to 1.7x (overwrite) faster than from the shared
anonymous memory ``mmap.mmap(-1, n)`` gives, for the same memcpy speed into
it: each request then covers a few physically contiguous 2 MiB pages instead
of thousands of scattered 4 KiB ones::

    buf = aligned_buffer(64 << 20)
    os.pwrite(fd, memoryview(buf)[: 16 << 20], 0)
"""

from __future__ import annotations

import contextlib
import mmap

_HUGE = 2 << 20  # smaller buffers cannot hold a huge page


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A zeroed, page-aligned, process-private buffer of ``nbytes`` (at least 1)."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    buf = mmap.mmap(-1, max(nbytes, 1), flags=flags) if flags else mmap.mmap(-1, max(nbytes, 1))
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and nbytes >= _HUGE:
        with contextlib.suppress(OSError):  # transparent huge pages off: ordinary pages
            buf.madvise(advice)
    return buf
