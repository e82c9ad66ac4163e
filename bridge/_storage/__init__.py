"""Where checkpoint bytes live: local files, or objects behind any fsspec URL, through one small API.

Every reader and writer names files by a string: a local path, or a URL
(``s3://bucket/run/ckpt/data/fp32-r00000-00000.safetensors``, ``gs://``,
``hf://``, ``memory://``, any fsspec protocol; ``file://`` is a local path).
The functions here take either and dispatch on it: local paths go straight to
``os`` (the executor in ``ckptbridge._read.executor`` keeps its memory maps and
``preadv`` for them: no overhead), URLs to an :class:`FsspecStorage`, which

* reads byte ranges concurrently (one batched ``cat_ranges`` per call on
  asynchronous file systems such as s3fs, gcsfs and HTTP; a thread pool
  otherwise), after *coalescing* ranges whose gaps are small (never more
  than ``max_waste`` of the bytes needed) and splitting big ones into parts;
* retries transient errors (connection resets, timeouts, 5xx) with
  exponential backoff and jitter, and turns the rest into one-line errors
  naming the object: :class:`~ckptbridge.MissingShardError` (object not found,
  e.g. deleted while being read), :class:`~ckptbridge.AccessDeniedError`
  (credentials refused), :class:`~ckptbridge.StorageError` (unreachable, or
  still failing after the retries);
* counts what it fetched (``stats``: bytes, requests, retries), so tests and
  benchmarks can check that only the needed ranges travelled;
* answers ``exists``/``isdir``/``listdir`` from one listing per directory,
  so format detection on a URL is a few listings, never a download.

fsspec is an optional dependency (``pip install 'ckptbridge[remote]'``, plus
``[s3]``, ``[gcs]`` or ``[hf]`` for the protocol's own package)::

    from ckptbridge.plugin import storage
    storage.configure("s3://bucket/", endpoint_url="http://127.0.0.1:5000", retries=3)
    storage.isdir("s3://bucket/run/ckpt"), storage.listdir("s3://bucket/run/ckpt")
    with storage.open_read("s3://bucket/run/ckpt/manifest.json") as fh:
        fh.read()
    storage.get("s3://bucket/").stats.bytes_fetched

Object stores have no rename: writers build a checkpoint directly under its
destination prefix and write the ``COMMITTED`` marker last (see
``ckptbridge._storage.commit``).
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any, BinaryIO

from .._errors import MissingShardError
from .fsspec_files import FsspecStorage
from .local_files import LocalStorage
from .paths import abspath, basename, dirname, inside, is_url, join, local, normpath, protocol
from .policy import Fetched, FetchStats, RemotePolicy

__all__ = [  # the path API (dispatching on local path vs URL) and the types it hands out
    "FetchStats",
    "Fetched",
    "FsspecStorage",
    "LocalStorage",
    "RemotePolicy",
    "abspath",
    "basename",
    "configure",
    "dirname",
    "exists",
    "find",
    "get",
    "getsize",
    "inside",
    "is_url",
    "isdir",
    "isfile",
    "join",
    "listdir",
    "local",
    "makedirs",
    "normpath",
    "open_read",
    "options",
    "prime",
    "protocol",
    "read_bytes",
    "read_text",
    "remote",
    "remove",
    "spool_dir",
    "unconfigure",
    "upload_tree",
    "write_bytes",
]

# ------------------------------------------------------------------ registry

_LOCAL = LocalStorage()
_LOCK = threading.Lock()
_CONFIG: dict[str, tuple[dict[str, Any], RemotePolicy]] = {}
_STORES: dict[tuple[str, str], FsspecStorage] = {}
_POLICY_FIELDS = {f.name for f in fields(RemotePolicy)}


def configure(prefix: str, **options: Any) -> None:
    """Storage options for every URL starting with ``prefix`` (the longest matching prefix wins).

    :class:`RemotePolicy` fields (``retries``, ``backoff``, ``concurrency``, ``part_bytes``,
    ``max_gap``, ``max_waste`` ...) set how bytes are fetched; every other keyword goes to the
    fsspec file system (``endpoint_url``, ``key``, ``secret``, ``token``, ``anon`` ...).
    fsspec's own configuration (``FSSPEC_S3_ENDPOINT_URL`` ...) and the clients' environment
    variables (``AWS_ENDPOINT_URL``, ``STORAGE_EMULATOR_HOST`` ...) apply as usual::

        configure("s3://bucket/", endpoint_url="http://127.0.0.1:9000", key="k", secret="s")
    """
    pol = {k: options.pop(k) for k in list(options) if k in _POLICY_FIELDS}
    with _LOCK:
        base_opts, base_pol = _CONFIG.get(prefix, ({}, RemotePolicy()))
        _CONFIG[prefix] = ({**base_opts, **options}, replace(base_pol, **pol))


def unconfigure(prefix: str | None = None) -> None:
    """Drop the options set for ``prefix`` (all when None) and the file systems made with them."""
    with _LOCK:
        if prefix is None:
            _CONFIG.clear()
        else:
            _CONFIG.pop(prefix, None)
        _STORES.clear()


def _config_for(url: str) -> tuple[dict[str, Any], RemotePolicy]:
    with _LOCK:
        best = max((p for p in _CONFIG if url.startswith(p)), key=len, default=None)
        return _CONFIG[best] if best is not None else ({}, RemotePolicy())


def options(url: str) -> dict[str, Any]:
    """The fsspec options configured for ``url`` (a copy; ``{}`` when none), for adapters that hand
    the same endpoint and credentials to another client (e.g. TensorStore's kvstore drivers)."""
    return copy.deepcopy(_config_for(url)[0])


def get(path: str) -> LocalStorage | FsspecStorage:
    """The storage that holds ``path`` (local files, or a configured fsspec file system)."""
    if not is_url(path):
        return _LOCAL
    proto = protocol(path)
    options, policy = _config_for(path)
    key = (proto, repr(sorted(options.items(), key=lambda kv: kv[0])) + repr(policy))
    with _LOCK:
        store = _STORES.get(key)
    if store is None:
        store = FsspecStorage(proto, options, policy)
        with _LOCK:
            store = _STORES.setdefault(key, store)
    return store


# ------------------------------------------------------------------ the path API adapters use


def remote(url: str) -> FsspecStorage:
    """The fsspec storage holding ``url`` (a URL, not a local path)."""
    store = get(url)
    if not isinstance(store, FsspecStorage):
        raise ValueError(f"{url}: not a URL")
    return store


def exists(path: str) -> bool:
    return os.path.exists(path) if not is_url(path) else get(path).exists(path)


def isdir(path: str) -> bool:
    return os.path.isdir(path) if not is_url(path) else get(path).isdir(path)


def isfile(path: str) -> bool:
    return os.path.isfile(path) if not is_url(path) else get(path).isfile(path)


def listdir(path: str) -> list[str]:
    return os.listdir(path) if not is_url(path) else get(path).listdir(path)


def getsize(path: str) -> int:
    return os.path.getsize(path) if not is_url(path) else get(path).size(path)


def open_read(path: str) -> BinaryIO:
    """A binary, seekable file for reading ``path`` (a cached ranged reader for URLs)."""
    return open(path, "rb") if not is_url(path) else get(path).open_read(path)


def read_bytes(path: str, start: int = 0, length: int | None = None) -> bytes:
    """``length`` bytes (default: to the end) from ``start``."""
    if not is_url(path):
        with open(path, "rb") as fh:
            fh.seek(start)
            return fh.read() if length is None else fh.read(length)
    store = remote(path)
    if length is None:
        length = store.size(path) - start
    return store.read_cached(path, start, length) if length <= (1 << 20) else store.read_range(path, start, length)


def read_ranges(path: str, spans: Sequence[tuple[int, int]]) -> list[bytes]:
    """The bytes of each ``(start, length)`` span of one file: one open for a local file; for a
    URL one concurrent round (coalesced, retried, see :class:`RemotePolicy`)."""
    if is_url(path):
        return remote(path).read_ranges(path, spans)
    try:
        with open(path, "rb") as fh:
            return [os.pread(fh.fileno(), n, s) for s, n in spans]
    except FileNotFoundError:
        raise MissingShardError(f"{path}: file not found") from None


def read_text(path: str, limit: int | None = None, errors: str = "strict") -> str:
    """A UTF-8 text file (its first ``limit`` characters/bytes)."""
    if not is_url(path):
        with open(path, encoding="utf-8", errors=errors) as fh:
            return fh.read() if limit is None else fh.read(limit)
    size = getsize(path)
    return read_bytes(path, 0, size if limit is None else min(size, limit)).decode("utf-8", errors)


def write_bytes(path: str, data: bytes) -> None:
    """Write a whole file or object (fsynced when local)."""
    get(path).write_bytes(path, data)


def remove(path: str) -> None:
    get(path).remove(path)


def makedirs(path: str) -> None:
    get(path).makedirs(path)


def find(url: str) -> list[str]:
    """Every file under ``url``, relative to it (recursive)."""
    if not is_url(url):
        out: list[str] = []
        for root, _, names in os.walk(url):
            out.extend(os.path.relpath(os.path.join(root, n), url) for n in names)
        return sorted(out)
    return remote(url).find(url)


def prime(url: str) -> None:
    """Start a fresh view of ``url`` (drop cached listings) and list it once."""
    if is_url(url):
        store = remote(url)
        store.invalidate(url)
        store._listing(url)


def upload_tree(local_dir: str, url: str, skip: Sequence[str] = ()) -> list[str]:
    """Upload every file below ``local_dir`` under prefix ``url`` (concurrently); relative names."""
    store = get(url)
    rels = [r for r in find(local_dir) if r not in skip]
    if isinstance(store, LocalStorage):
        raise ValueError(f"{url}: not a URL")

    def put(rel: str) -> None:
        store.put_file(os.path.join(local_dir, rel), join(url, rel.replace(os.sep, "/")))

    from concurrent.futures import ThreadPoolExecutor  # (not imported by open: it needs no pool)

    with ThreadPoolExecutor(min(8, max(1, len(rels)))) as pool:
        list(pool.map(put, rels))
    return rels


def spool_dir() -> str:
    """Where writers to URLs build what they upload (``CKPTBRIDGE_SPOOL``, else the temp dir)."""
    import tempfile

    return tempfile.mkdtemp(prefix="ckptbridge-spool-", dir=os.environ.get("CKPTBRIDGE_SPOOL") or None)
