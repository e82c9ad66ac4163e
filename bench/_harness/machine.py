"""Machine facts, measured in the same run as the benchmarks (a fresh process).

    python bench/_harness/machine.py WORKDIR MIB   # prints one JSON object

* cores (``os.cpu_count``, the affinity mask), CPU model, memory total/available, load average;
* ``memcpy_gbps``: best of 3 ``numpy.copyto`` of MIB MiB into a buffer touched before;
* ``fresh_memory_gbps``: writing MIB MiB into freshly allocated memory (page faults included;
  on virtual machines this is often far slower than memcpy, see /work/shared/BENCHMARKING.md);
* ``disk_write_gbps``: the best of a buffered write + fsync, ``O_DIRECT`` with one stream and with
  three, of MIB MiB in WORKDIR (every mode, best of 2);
* ``disk_read_gbps``: ``O_DIRECT`` reads of that file (the device, not the page cache), one and
  three streams, best of 2; ``cached_read_gbps``: buffered reads of it from the page cache.

Standard-normal data, never zeros, and never one block written over and over: ``O_DIRECT``
writes come from a page-aligned copy of the whole data (virtual disks can take a repeated
block faster than non-repeating data: up to 1.25x on the VM these benchmarks ran on), in the
kind of memory ckptbridge's own direct I/O uses (``ckptbridge._storage.hostmem.aligned_buffer``:
private, huge pages), and ``O_DIRECT`` reads land in the same kind: from shared anonymous
memory the same writes ran 1.2-1.7x slower on that VM, which understated the disk.
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import subprocess
import sys
import threading
import time

from ckptbridge._storage.hostmem import aligned_buffer

BLOCK = 8 << 20


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            k, v = line.split(":", 1)
            if k in ("MemTotal", "MemAvailable"):
                out[k] = int(v.split()[0]) * 1024
    return out


def _streams(fd: int, nbytes: int, buf: mmap.mmap, streams: int, write: bool) -> None:
    offs = list(range(0, nbytes, BLOCK))

    def run(k: int) -> None:
        if write:  # each block from its own place in ``buf`` (the whole data)
            data = memoryview(buf)
            for o in offs[k::streams]:
                os.pwrite(fd, data[o : o + BLOCK], o)
            return
        local = aligned_buffer(BLOCK)
        for o in offs[k::streams]:
            os.preadv(fd, [local], o)

    ths = [threading.Thread(target=run, args=(k,)) for k in range(streams)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()


def git_commit() -> str | None:
    """The checkout's short commit, ``+dirty`` when a tracked file differs from it (``None`` outside git)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else None
    except OSError:
        return None


def facts(work: str, mib: int) -> dict:
    import numpy as np

    nbytes = max(BLOCK, (mib << 20) // BLOCK * BLOCK)
    src = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    dst[...] = 0
    copies = []
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - t)
    t = time.perf_counter()
    fresh = np.empty_like(src)
    np.copyto(fresh, src)
    fresh_s = time.perf_counter() - t
    del fresh
    aligned = aligned_buffer(nbytes)  # the data to write, page-aligned for O_DIRECT
    aligned.write(memoryview(src).cast("B"))
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, "machine-disk.bin")
    write: dict[str, float] = {}
    for _ in range(2):
        for mode in ("buffered", "direct1", "direct3"):
            if os.path.exists(path):
                os.remove(path)
            t = time.perf_counter()
            if mode == "buffered":
                with open(path, "wb") as fh:
                    fh.write(memoryview(src).cast("B"))
                    fh.flush()
                    os.fsync(fh.fileno())
            else:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
                _streams(fd, nbytes, aligned, 1 if mode == "direct1" else 3, True)
                os.fsync(fd)
                os.close(fd)
            write[mode] = max(write.get(mode, 0.0), nbytes / (time.perf_counter() - t) / 1e9)
    read: dict[str, float] = {}
    for _ in range(2):
        for mode in ("direct1", "direct3", "cached"):
            t = time.perf_counter()
            if mode == "cached":
                with open(path, "rb") as fh:
                    while fh.readinto(dst):
                        pass
            else:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                _streams(fd, nbytes, aligned, 1 if mode == "direct1" else 3, False)
                os.close(fd)
            read[mode] = max(read.get(mode, 0.0), nbytes / (time.perf_counter() - t) / 1e9)
    os.remove(path)
    mem = _meminfo()
    return {
        "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)), "cpu": _cpu_model(),
        "mem_total_bytes": mem.get("MemTotal"), "mem_available_bytes": mem.get("MemAvailable"),
        "loadavg": list(os.getloadavg()), "kernel": platform.release(), "python": platform.python_version(),
        "probe_bytes": nbytes,
        "memcpy_gbps": nbytes / min(copies) / 1e9, "fresh_memory_gbps": nbytes / fresh_s / 1e9,
        "disk_write_gbps": max(write.values()), "disk_write_modes_gbps": write,
        "disk_read_gbps": max(read["direct1"], read["direct3"]), "cached_read_gbps": read["cached"],
        "disk_read_modes_gbps": read, "workdir": os.path.abspath(work),
    }


def versions() -> dict[str, str]:
    """Versions of the tools compared (from package metadata: nothing is imported)."""
    from importlib import metadata

    out = {}
    for dist in ("ckptbridge", "torch", "jax", "orbax-checkpoint", "tensorstore", "deepspeed", "megatron-core",
                 "safetensors", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


if __name__ == "__main__":
    res = facts(sys.argv[1], int(sys.argv[2]))
    res["versions"] = versions()
    print(json.dumps(res))
