"""Where checkpoint bytes live: local files, or objects behind any fsspec URL, through one small API.

Every reader and writer names files by a string: a local path, or a URL
(``s3://bucket/run/ckpt/data/fp32-r00000-00000.safetensors``, ``gs://``,
``hf://``, ``memory://``, any fsspec protocol; ``file://`` is a local path).
The functions here take either and dispatch on it: local paths go straight to
``os`` (the executor in ``ckptbridge._read`` keeps its memory maps and
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
``ckptbridge._commit``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import posixpath
import random
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import Any, BinaryIO

from ._errors import (
    AccessDeniedError,
    CheckpointError,
    MissingExtraError,
    MissingShardError,
    StorageError,
    TruncatedError,
    WriteError,
    require,
)
from ._paths import file_url_path

# ------------------------------------------------------------------ paths


def is_url(path: str | os.PathLike[str]) -> bool:
    """True for ``proto://...`` other than ``file://`` (those are local paths)."""
    p = os.fspath(path)
    return "://" in p and not p.startswith("file://")


def local(path: str | os.PathLike[str]) -> str:
    """``file:///x`` -> ``/x`` (``file://localhost/x`` and percent escapes too, see
    :func:`ckptbridge._paths.file_url_path`); any other path or URL unchanged."""
    p = os.fspath(path)
    return file_url_path(p) if p[:7].lower() == "file://" else p


def protocol(url: str) -> str:
    return url.split("://", 1)[0].lower()


def join(base: str, *parts: str) -> str:
    """``os.path.join`` for local paths, ``/``-joining for URLs."""
    return posixpath.join(base, *parts) if is_url(base) else os.path.join(base, *parts)


def normpath(path: str) -> str:
    """``os.path.normpath`` that keeps a URL's ``scheme://``."""
    if not is_url(path):
        return os.path.normpath(path)
    scheme, rest = path.split("://", 1)
    lead = "/" if rest.startswith("/") else ""
    return f"{scheme}://{lead}{posixpath.normpath(rest).lstrip('/')}"


def abspath(path: str) -> str:
    return path if is_url(path) else os.path.abspath(path)


def dirname(path: str) -> str:
    return posixpath.dirname(path.rstrip("/")) if is_url(path) else os.path.dirname(os.path.abspath(path))


def basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/")) if is_url(path) else os.path.basename(os.path.normpath(path))


def inside(root: str, rel: str) -> str | None:
    """``root/rel`` normalised, or ``None`` when ``rel`` is absolute or climbs out of ``root``."""
    if not isinstance(rel, str) or "\x00" in rel or rel.startswith("/") or os.path.isabs(rel):
        return None
    full = normpath(join(root, rel))
    base = normpath(root).rstrip("/")
    sep = "/" if is_url(root) else os.sep
    return full if full.startswith(base + sep) else None


# ------------------------------------------------------------------ policy and statistics


@dataclass(frozen=True)
class RemotePolicy:
    """How a URL's bytes are fetched.

    ``retries``: attempts after the first for a transient error. ``backoff``: the
    first delay in seconds (doubling, with jitter, capped at ``max_backoff``).
    ``concurrency``: ranged requests in flight. ``part_bytes``: a range longer
    than this is fetched as several concurrent parts. ``max_gap``: two ranges
    further apart than this are never merged into one request. ``max_waste``:
    the gaps merged into requests add at most this fraction of the bytes needed.
    """

    retries: int = 5
    backoff: float = 0.05
    max_backoff: float = 2.0
    concurrency: int = 32
    part_bytes: int = 8 << 20
    max_gap: int = 1 << 20
    max_waste: float = 0.0625


class FetchStats:
    """What a storage fetched: bytes, requests and retries (thread-safe counters)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_fetched = 0
        self.requests = 0
        self.retries = 0

    def add(self, nbytes: int = 0, requests: int = 0, retries: int = 0) -> None:
        with self._lock:
            self.bytes_fetched += nbytes
            self.requests += requests
            self.retries += retries

    def reset(self) -> None:
        with self._lock:
            self.bytes_fetched = self.requests = self.retries = 0

    def __repr__(self) -> str:
        return f"FetchStats(bytes_fetched={self.bytes_fetched}, requests={self.requests}, retries={self.retries})"


# ------------------------------------------------------------------ range planning (pure)


def coalesce(spans: Sequence[tuple[int, int]], policy: RemotePolicy) -> list[tuple[int, int]]:
    """Requests ``(start, end)`` covering byte ``spans``: overlapping and touching spans
    merge; gaps merge smallest first while they are at most ``max_gap`` and their sum at
    most ``max_waste`` of the bytes needed; requests longer than ``part_bytes`` split::

        >>> coalesce([(0, 10), (10, 20), (100, 110)], RemotePolicy(max_waste=0.0))
        [(0, 20), (100, 110)]
    """
    if not spans:
        return []
    ordered = sorted((s, e) for s, e in spans if e > s)
    merged: list[list[int]] = []
    for s, e in ordered:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    needed = sum(e - s for s, e in merged)
    budget = policy.max_waste * needed
    gaps = sorted((merged[i + 1][0] - merged[i][1], i) for i in range(len(merged) - 1))
    join_after = set()
    for gap, i in gaps:
        if gap > policy.max_gap or gap > budget:
            break
        budget -= gap
        join_after.add(i)
    out: list[tuple[int, int]] = []
    if not merged:
        return out
    cur = list(merged[0])
    for i in range(1, len(merged)):
        if i - 1 in join_after:
            cur[1] = merged[i][1]
        else:
            out.append((cur[0], cur[1]))
            cur = list(merged[i])
    out.append((cur[0], cur[1]))
    parts: list[tuple[int, int]] = []
    step = max(1, policy.part_bytes)
    for s, e in out:
        parts.extend((lo, min(lo + step, e)) for lo in range(s, e, step))
    return parts


class Fetched:
    """Bytes fetched for one object: sorted, non-overlapping ``(start, bytes)`` parts."""

    def __init__(self, url: str, parts: Sequence[tuple[int, bytes]]) -> None:
        self.url = url
        self.parts = sorted(parts, key=lambda p: p[0])
        self.starts = [p[0] for p in self.parts]

    def find(self, start: int) -> int:
        """Index of the part holding byte ``start``."""
        import bisect

        i = bisect.bisect_right(self.starts, start) - 1
        if i < 0 or start >= self.starts[i] + len(self.parts[i][1]):
            raise TruncatedError(f"{self.url}: byte {start} was not fetched (internal planning error)")
        return i

    def view(self, start: int, end: int) -> memoryview | None:
        """A zero-copy view of ``[start, end)`` if one part holds it all."""
        i = self.find(start)
        s, data = self.parts[i]
        if end - s <= len(data):
            return memoryview(data)[start - s : end - s]
        return None

    def pieces(self, start: int, end: int) -> Iterator[memoryview]:
        """``[start, end)`` as consecutive views into the parts."""
        while start < end:
            i = self.find(start)
            s, data = self.parts[i]
            stop = min(end, s + len(data))
            yield memoryview(data)[start - s : stop - s]
            start = stop

    def gather(self, spans: Sequence[tuple[int, int]]) -> bytes:
        """The bytes of ``spans`` concatenated in order (one copy)."""
        return b"".join(v for s, e in spans for v in self.pieces(s, e))


# ------------------------------------------------------------------ errors


def _status(err: BaseException) -> int | None:
    for attr in ("status", "code", "status_code"):
        v = getattr(err, attr, None)
        if isinstance(v, int):
            return v
    resp = getattr(err, "response", None)
    if isinstance(resp, Mapping):
        v = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(v, int):
            return v
    return None


_DENIED_WORDS = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden",
                 "InvalidToken", "ExpiredToken", "Unauthorized", "invalid_grant")


def classify(err: BaseException) -> str:
    """``"missing"``, ``"denied"``, ``"permanent"`` or ``"transient"`` (retry)."""
    if isinstance(err, (CheckpointError, MissingExtraError)):
        return "permanent"
    if isinstance(err, FileNotFoundError):
        return "missing"
    status = _status(err)
    if isinstance(err, PermissionError) or status in (401, 403) or any(w in str(err) for w in _DENIED_WORDS):
        return "denied"
    if status == 404:
        return "missing"
    if isinstance(err, (IsADirectoryError, NotADirectoryError, ValueError, TypeError, KeyError,
                        NotImplementedError, AttributeError)):
        return "permanent"
    return "transient"


def translate(err: BaseException, url: str, doing: str) -> CheckpointError:
    """One error naming the object: not found, refused or unreachable."""
    if isinstance(err, CheckpointError):
        return err
    kind = classify(err)
    why = " ".join(f"{type(err).__name__}: {err}".split())[:300]
    if kind == "missing":
        return MissingShardError(f"{url}: object not found while {doing} (deleted, or never written?)")
    if kind == "denied":
        return AccessDeniedError(f"{url}: the object store refused access while {doing} "
                                 f"(check the credentials) ({why})")
    return StorageError(f"{url}: object store unreachable or failing while {doing} ({why})")


# ------------------------------------------------------------------ local files


class LocalStorage:
    """Plain files (the executor reads them with mmap/preadv itself)."""

    remote = False

    def __init__(self) -> None:
        self.stats = FetchStats()
        self.policy = RemotePolicy()

    def size(self, path: str) -> int:
        try:
            return os.path.getsize(path)
        except FileNotFoundError:
            raise MissingShardError(f"{path}: file not found") from None

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def read_range(self, path: str, start: int, length: int) -> bytes:
        try:
            with open(path, "rb") as fh:
                fh.seek(start)
                return fh.read(length)
        except FileNotFoundError:
            raise MissingShardError(f"{path}: file not found") from None

    def open_read(self, path: str) -> BinaryIO:
        try:
            return open(path, "rb")
        except FileNotFoundError:
            raise MissingShardError(f"{path}: file not found") from None

    def write_bytes(self, path: str, data: bytes) -> None:
        with open(path, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def invalidate(self, path: str = "") -> None:
        pass


# ------------------------------------------------------------------ fsspec


_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "hf": "hf"}


class _RangeRaw(io.RawIOBase):
    """A read-only, seekable file over an object, read in cached blocks (metadata reads)."""

    def __init__(self, store: FsspecStorage, url: str, size: int) -> None:
        self._store, self._url, self._size, self._pos = store, url, size, 0
        self.name = url

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        anchor = (0, self._pos, self._size)[whence]
        self._pos = max(0, anchor + pos)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._size - self._pos))
        if n == 0:
            return 0
        data = self._store.read_cached(self._url, self._pos, n)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def read_ranges(self, spans: Sequence[tuple[int, int]]) -> list[bytes]:
        """Several ``(start, length)`` ranges in one concurrent round."""
        return self._store.read_ranges(self._url, spans)


class _RemoteWriter:
    """A new object written front to back (``write_files``' remote twin of its local file):
    chunks arrive in file order from the writer threads and are streamed, in order, into
    one upload (multipart on S3, resumable on GCS); ``abort`` discards it."""

    def __init__(self, store: FsspecStorage, url: str) -> None:
        self.path, self._store = url, store
        try:
            self._fh = store.fs.open(store.path_of(url), "wb")
        except Exception as err:
            raise WriteError(f"{url}: cannot start writing the object "
                             f"({translate(err, url, 'writing')})") from None
        self._prev: threading.Event | None = None
        self._lock = threading.Lock()

    def chunk(self, buf: Any, start: int, n: int) -> Callable[[], None]:
        prev, mine = self._prev, threading.Event()
        self._prev = mine

        def job() -> None:
            try:
                if prev is not None:
                    prev.wait()
                with self._lock:
                    self._fh.write(bytes(memoryview(buf)[start : start + n]))
            except Exception as err:
                raise WriteError(f"{self.path}: upload failed ({translate(err, self.path, 'writing')})") from None
            finally:
                mine.set()

        return job

    def finish_after(self, writes: Sequence[threading.Event]) -> Callable[[], None]:
        def job() -> None:
            for w in writes:
                w.wait()
            if self._prev is not None:
                self._prev.wait()
            try:
                with self._lock:
                    self._fh.close()
            except Exception as err:
                raise WriteError(f"{self.path}: upload failed ({translate(err, self.path, 'writing')})") from None
            self._store.invalidate(self.path)

        return job

    def abort(self) -> None:
        with self._lock:
            discard = getattr(self._fh, "discard", None)
            with contextlib.suppress(Exception):
                if callable(discard):
                    discard()
                    self._fh.closed = True  # else its __del__ would try to finish the discarded upload
                elif not self._fh.closed:
                    self._fh.close()


class FsspecStorage:
    """Objects behind an fsspec file system (see the module doc)."""

    remote = True
    _BLOCK = 64 << 10  # metadata reads (headers, pickles, zip directories) come in blocks of this
    _BLOCK_CACHE = 64 << 20

    def __init__(self, proto: str, options: Mapping[str, Any], policy: RemotePolicy) -> None:
        fsspec = require("fsspec", "remote", f"reading or writing {proto}:// URLs")
        extra = _EXTRAS.get(proto, "remote")
        try:
            self.fs = fsspec.filesystem(proto, **copy.deepcopy(dict(options)))  # clients edit nested dicts
        except ImportError as err:
            raise MissingExtraError(
                f"{proto}:// URLs need a package that is not installed ({err}); "
                f"install it with: pip install 'ckptbridge[{extra}]'") from None
        except ValueError as err:
            raise StorageError(f"{proto}://: cannot set up this file system ({err})") from None
        self.protocol = proto
        self.policy = policy
        self.stats = FetchStats()
        self._lock = threading.Lock()
        self._dirs: dict[str, dict[str, dict[str, Any]]] = {}
        self._infos: dict[str, dict[str, Any] | None] = {}
        self._blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._async = bool(getattr(self.fs, "async_impl", False))
        self._pool = ThreadPoolExecutor(max(1, policy.concurrency), thread_name_prefix="ckptbridge-fetch") \
            if not self._async else None

    # -- paths
    def path_of(self, url: str) -> str:
        return str(type(self.fs)._strip_protocol(url))

    def _key(self, url: str) -> str:
        return url.rstrip("/")

    # -- calls with retries
    def call(self, url: str, doing: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args)``, retried with backoff on transient errors; errors name ``url``."""
        attempt = 0
        while True:
            try:
                out = fn(*args, **kwargs)
                self.stats.add(requests=1)
                return out
            except Exception as err:
                if classify(err) != "transient" or attempt >= self.policy.retries:
                    if classify(err) == "transient":
                        raise StorageError(f"{url}: still failing after {attempt + 1} attempts while {doing} "
                                           f"({' '.join(f'{type(err).__name__}: {err}'.split())[:300]})") from None
                    raise translate(err, url, doing) from None
                attempt += 1
                self.stats.add(retries=1)
                self._sleep(attempt)

    def _sleep(self, attempt: int) -> None:
        delay = min(self.policy.max_backoff, self.policy.backoff * (2 ** (attempt - 1)))
        time.sleep(delay * (0.5 + random.random() / 2))

    # -- listings
    def invalidate(self, url: str = "") -> None:
        """Forget cached listings and blocks at or under ``url`` (and its parent's listing)."""
        key = self._key(url)
        with self._lock:
            # the key, what lies under it, and every prefix above it (a new object makes its
            # ancestors' prefixes appear; a deleted one can make them vanish)
            def related(d: str) -> bool:
                return not key or d == key or d.startswith(key + "/") or key.startswith(d.rstrip("/") + "/")

            dropped = [d for d in self._dirs if related(d)]
            for d in dropped:
                del self._dirs[d]
            for d in [d for d in self._infos if related(d)]:
                del self._infos[d]
            for b in [b for b in self._blocks if not key or b[0] == key or b[0].startswith(key + "/")]:
                del self._blocks[b]
        with contextlib.suppress(Exception):  # the client's own listings too (s3fs keeps children's)
            if not url:
                self.fs.invalidate_cache()
            for d in {key, *dropped} if url else ():
                self.fs.invalidate_cache(self.path_of(d))

    def _listing(self, url: str) -> dict[str, dict[str, Any]] | None:
        """Entries of directory ``url`` by name (cached), or None when it is not a directory."""
        key = self._key(url)
        with self._lock:
            if key in self._dirs:
                return self._dirs[key]
        try:
            entries = self.call(url, "listing", self.fs.ls, self.path_of(url), detail=True)
        except MissingShardError:
            entries = []
        except NotADirectoryError:
            entries = []
        base = self.path_of(url).rstrip("/")
        out: dict[str, dict[str, Any]] = {}
        for e in entries:
            name = str(e.get("name", "")).rstrip("/")
            if name == base or not name:
                continue
            out[posixpath.basename(name)] = {"type": e.get("type"), "size": e.get("size")}
        listing = out or None
        with self._lock:
            self._dirs[key] = listing  # type: ignore[assignment]
        return listing

    def _info(self, url: str) -> dict[str, Any] | None:
        """``{"type", "size"}`` of ``url`` or None: from its directory's listing (one LIST serves
        every sibling), else one lookup (file systems that cannot list, e.g. plain HTTP), cached."""
        key = self._key(url)
        parent, name = posixpath.dirname(key), posixpath.basename(key)
        with self._lock:
            if key in self._infos:
                return self._infos[key]
        if "://" in parent and parent.split("://", 1)[1]:
            listing = self._listing(parent)
            if listing is not None and name in listing:
                return listing[name]
        try:
            info = self.call(url, "looking it up", self.fs.info, self.path_of(url))
            found: dict[str, Any] | None = {"type": info.get("type"), "size": info.get("size")}
        except MissingShardError:
            found = None
        with self._lock:
            self._infos[key] = found
        return found

    def exists(self, url: str) -> bool:
        return self._info(url) is not None or self._listing(url) is not None

    def isdir(self, url: str) -> bool:
        info = self._info(url)
        if info is not None and info.get("type") == "directory":
            return True
        if info is not None:
            return False
        return self._listing(url) is not None

    def isfile(self, url: str) -> bool:
        info = self._info(url)
        return info is not None and info.get("type") != "directory"

    def listdir(self, url: str) -> list[str]:
        listing = self._listing(url)
        if listing is None:
            raise MissingShardError(f"{url}: no such directory (prefix) in the object store")
        return sorted(listing)

    def size(self, url: str) -> int:
        info = self._info(url)
        if info is None or info.get("type") == "directory":
            raise MissingShardError(f"{url}: object not found")
        if info.get("size") is None:
            info = self.call(url, "looking it up", self.fs.info, self.path_of(url))
        return int(info["size"])

    def find(self, url: str) -> list[str]:
        """Every object under prefix ``url``, as paths relative to it."""
        base = self.path_of(url).rstrip("/")
        try:
            found = self.call(url, "listing", self.fs.find, base)
        except MissingShardError:
            return []
        return sorted(posixpath.relpath(str(f), base) for f in found if str(f).rstrip("/") != base)

    # -- reading
    def read_ranges(self, url: str, spans: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each ``(start, length)`` span of one object (coalesced, concurrent, retried)."""
        want = [(s, s + n) for s, n in spans]
        got = self.fetch(url, want)
        return [got.gather([w]) if w[1] > w[0] else b"" for w in want]

    def read_range(self, url: str, start: int, length: int) -> bytes:
        return self.read_ranges(url, [(start, length)])[0]

    def fetch(self, url: str, spans: Sequence[tuple[int, int]], policy: RemotePolicy | None = None,
              stats: Any = None) -> Fetched:
        """Fetch byte ``spans`` ``(start, end)`` of ``url``: coalesced per ``policy``, concurrently,
        transient errors retried with backoff. A short object raises :class:`TruncatedError`."""
        policy = policy or self.policy
        reqs = coalesce(spans, policy)
        results: list[bytes | None] = [None] * len(reqs)
        pending = list(range(len(reqs)))
        attempt = 0
        path = self.path_of(url)
        while pending:
            outs = self._fetch_once(path, [reqs[i] for i in pending])
            failed: list[tuple[int, BaseException]] = []
            for i, r in zip(pending, outs):
                if isinstance(r, BaseException):
                    kind = classify(r)
                    if kind != "transient":
                        raise translate(r, url, f"reading bytes {reqs[i][0]}-{reqs[i][1]}") from None
                    failed.append((i, r))
                    continue
                s, e = reqs[i]
                if len(r) != e - s:
                    raise TruncatedError(f"{url}: object ends before byte {e} (got {len(r)} of {e - s} bytes "
                                         f"from {s}; truncated or replaced while reading?)")
                results[i] = r
            done = len(pending) - len(failed)
            nbytes = sum(len(r) for i in pending if (r := results[i]) is not None)
            self.stats.add(nbytes, len(pending))
            if stats is not None:
                stats.add_fetched(url, nbytes, len(pending), len(failed))
            del done
            if not failed:
                break
            attempt += 1
            if attempt > policy.retries:
                i, err = failed[0]
                why = " ".join(f"{type(err).__name__}: {err}".split())[:300]
                raise StorageError(f"{url}: bytes {reqs[i][0]}-{reqs[i][1]} still failing after "
                                   f"{attempt} attempts ({why})")
            self.stats.add(retries=len(failed))
            self._sleep(attempt)
            pending = [i for i, _ in failed]
        return Fetched(url, [(s, r) for (s, _), r in zip(reqs, results) if r is not None])

    def _fetch_once(self, path: str, reqs: Sequence[tuple[int, int]]) -> list[Any]:
        if not reqs:
            return []
        if self._async:
            try:
                return list(self.fs.cat_ranges([path] * len(reqs), [s for s, _ in reqs], [e for _, e in reqs],
                                               on_error="return", batch_size=self.policy.concurrency))
            except Exception as err:  # the whole batch failed (e.g. connection refused before any request)
                return [err] * len(reqs)

        def one(req: tuple[int, int]) -> Any:
            try:
                return self.fs.cat_file(path, start=req[0], end=req[1])
            except Exception as err:
                return err

        if len(reqs) == 1 or self._pool is None:
            return [one(r) for r in reqs]
        return list(self._pool.map(one, reqs))

    def read_cached(self, url: str, start: int, length: int) -> bytes:
        """``length`` bytes at ``start`` through a small block cache (for metadata: headers, pickles)."""
        b = self._BLOCK
        first, last = start // b, (start + length - 1) // b
        key = self._key(url)
        missing = []
        with self._lock:
            for i in range(first, last + 1):
                if (key, i) in self._blocks:
                    self._blocks.move_to_end((key, i))
                else:
                    missing.append(i)
        if missing:
            size = self.size(url)
            spans = [(i * b, min((i + 1) * b, size)) for i in missing if i * b < size]
            got = self.fetch(url, spans, replace(self.policy, max_waste=0.0, max_gap=0))
            with self._lock:
                for s, e in spans:
                    self._blocks[(key, s // b)] = got.gather([(s, e)])
                while len(self._blocks) * b > self._BLOCK_CACHE:
                    self._blocks.popitem(last=False)
        with self._lock:
            blocks = [self._blocks.get((key, i), b"") for i in range(first, last + 1)]
        data = b"".join(blocks)
        lo = start - first * b
        return data[lo : lo + length]

    def open_read(self, url: str) -> BinaryIO:
        return io.BufferedReader(_RangeRaw(self, url, self.size(url)), buffer_size=self._BLOCK)

    # -- writing
    def write_bytes(self, url: str, data: bytes) -> None:
        self.call(url, "writing", self.fs.pipe_file, self.path_of(url), bytes(data))
        self.invalidate(url)

    def put_file(self, local_path: str, url: str) -> None:
        self.call(url, "uploading", self.fs.put_file, local_path, self.path_of(url))
        self.invalidate(url)

    def writer(self, url: str) -> _RemoteWriter:
        return _RemoteWriter(self, url)

    def remove(self, url: str) -> None:
        with contextlib.suppress(MissingShardError):
            self.call(url, "deleting", self.fs.rm_file, self.path_of(url))
        self.invalidate(url)

    def remove_many(self, urls: Sequence[str]) -> None:
        if urls:
            with contextlib.suppress(MissingShardError):
                self.call(urls[0], "deleting", self.fs.rm, [self.path_of(u) for u in urls])
            for u in urls:
                self.invalidate(u)

    def makedirs(self, url: str) -> None:
        pass  # object stores have no directories; prefixes appear with their first object


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

    with ThreadPoolExecutor(min(8, max(1, len(rels)))) as pool:
        list(pool.map(put, rels))
    return rels


def spool_dir() -> str:
    """Where writers to URLs build what they upload (``CKPTBRIDGE_SPOOL``, else the temp dir)."""
    import tempfile

    return tempfile.mkdtemp(prefix="ckptbridge-spool-", dir=os.environ.get("CKPTBRIDGE_SPOOL") or None)


def remove_local_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
