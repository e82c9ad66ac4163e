"""How an object store's bytes are fetched: the :class:`RemotePolicy`, the statistics, the pure
range planning (coalesce small gaps, split big ranges) and the translation of client errors into
the error tree (one line naming the object)."""


from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from .._errors import (
    AccessDeniedError,
    CheckpointError,
    MissingExtraError,
    MissingShardError,
    StorageError,
    TruncatedError,
)


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
