"""Objects behind any fsspec URL: listings cached per directory, ranged reads coalesced and
fetched concurrently, retries with backoff, and writes that appear whole."""


from __future__ import annotations

import contextlib
import copy
import io
import posixpath
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, BinaryIO

from .._errors import (
    MissingExtraError,
    MissingShardError,
    StorageError,
    TruncatedError,
    WriteError,
    require,
)
from .policy import Fetched, FetchStats, RemotePolicy, classify, coalesce, translate

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
        from concurrent.futures import ThreadPoolExecutor  # (imported when a URL is opened)

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
