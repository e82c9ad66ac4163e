"""The names rules run over, indexed so that a rule finds its tensors without testing every name.

A recipe is a hundred rules over every tensor name (92k for DeepSeek-V3): testing each rule's regex on
each name is the whole cost of applying it. Most rule patterns begin with a literal after ``^``
(``^model\\.layers\\.7\\.``) or end with one before ``$`` (``\\.q_proj\\.weight$``): every name a rule can
match starts (ends) with that literal, and those names sit in one range of the names sorted (sorted
reversed). :class:`Names` keeps its names in order with their values, renames in place, and keeps sorted
runs of every name it has held (stale names are dropped on lookup), so a rule tests only its candidates::

    names = Names({"model.layers.0.w": 1, "model.layers.1.w": 2})
    names.hits(r"^model\\.layers\\.1\\.")         # ['model.layers.1.w']
    names.rename({"model.layers.1.w": "layers/1/w"})
"""

from __future__ import annotations

import bisect
import collections
import functools
import itertools
import operator
import re
import typing
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from typing import Generic, TypeVar

from ._language import regex

V = TypeVar("V")
_META = set(".^$*+?{}[]()|\\")
_QUANTIFIERS = set("*+?{")
_MAX_RUNS = 256
_REVERSED = slice(None, None, -1)


@functools.lru_cache(maxsize=4096)
def literal_ends(pattern: str) -> tuple[str, str]:
    """The literal every match of ``pattern`` starts with (when anchored by ``^``) and ends with (when
    anchored by ``$``); ``""`` where there is none or the pattern is not plain enough to tell::

        literal_ends(r"^model\\.layers\\.(\\d+)\\.mlp\\.weight$")   # ('model.layers.', '.mlp.weight')
    """
    tokens: list[str | None] = []  # a literal character, or None for anything else at depth 0
    depth, i, n = 0, 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            nxt = pattern[i + 1 : i + 2]
            literal = nxt if nxt and not nxt.isalnum() else None
            i += 2
        elif c == "[":  # a character class: skip it whole
            j = i + 1
            j += pattern[j : j + 1] == "^"
            j += pattern[j : j + 1] == "]"
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            literal, i = None, j + 1
        elif c == "(":
            if pattern.startswith("(?", i) and not pattern.startswith(("(?:", "(?P<"), i):
                return "", ""  # flags, lookarounds, conditionals: not plain
            depth += 1
            literal, i = None, i + 1
        elif c == ")":
            depth -= 1
            literal, i = None, i + 1
        elif c == "|":
            if depth == 0:
                return "", ""  # alternatives at the top: no common literal
            literal, i = None, i + 1
        elif c in _QUANTIFIERS:
            if tokens:
                tokens[-1] = None  # the quantified token is not a fixed literal
            literal, i = None, i + 1
        else:
            literal, i = (None if c in _META else c), i + 1
        if depth == 0 or c == "(":
            tokens.append(literal if c not in "^$" else c)
    prefix = suffix = ""
    if tokens[:1] == ["^"]:
        for t in tokens[1:]:
            if t is None or t in "^$":
                break
            prefix += t
    if tokens[-1:] == ["$"] and not pattern.endswith("\\$"):
        for t in reversed(tokens[:-1]):
            if t is None or t in "^$":
                break
            suffix = t + suffix
    return prefix, suffix


class Names(Generic[V]):
    """Names in order, each with a value; :meth:`hits` finds the names a pattern matches through sorted
    runs of names (and of reversed names), :meth:`rename` renames in place."""

    def __init__(self, items: Mapping[str, V]) -> None:
        self.values: dict[str, V] = dict(items)
        self.order: list[str] = list(self.values)
        self.pos = dict(zip(self.order, range(len(self.order))))
        self._runs = _Runs(reverse=False), _Runs(reverse=True)  # sorted names, sorted reversed names
        self._newline = _any_newline(self.order)  # ``$`` also matches before a final newline

    def rebuilt(self, items: Mapping[str, V]) -> Names[V]:
        """Other items (some names gone, some new), taking over this index's runs (cheaper than sorting again;
        this one sorts its own names again if it is looked up later)."""
        out = Names(items)
        out._runs, self._runs = self._runs, (_Runs(reverse=False), _Runs(reverse=True))
        out._add_run(itertools.filterfalse(self.pos.__contains__, out.order))
        return out

    def kept(self, gone: Container[str]) -> dict[str, V]:
        """The items but those named in ``gone``, in order (for :meth:`rebuilt`)."""
        keep = list(itertools.filterfalse(gone.__contains__, self.order))
        return dict(zip(keep, map(self.values.__getitem__, keep)))

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[str]:
        return iter(self.order)

    def items(self) -> Iterator[tuple[str, V]]:
        return zip(self.order, map(self.values.__getitem__, self.order))

    def hits(self, pattern: str) -> list[str]:
        """The names ``pattern`` matches (``re.search``), in order."""
        return self.matches(pattern)[0]

    def matches(self, pattern: str) -> tuple[list[str], list[re.Match[str]]]:
        """:meth:`hits` and their matches (for :func:`substitute_all`: each name searched once)::

            names.matches(r"^model\\.layers\\.(\\d+)\\.")   # (['model.layers.0.w', ...], [<re.Match ...>, ...])
        """
        search = regex(pattern).search
        candidates = self._candidates(pattern)
        if candidates is None:
            candidates = list(self.order)  # a copy: renaming changes ``order`` in place
        else:
            candidates = list(filter(self.pos.__contains__, candidates))
            candidates.sort(key=self.pos.__getitem__)
        found: list[re.Match[str]] = list(map(search, candidates))  # type: ignore[arg-type]  # Nones: next line
        if None not in found:
            return candidates, found
        keep = list(map(operator.is_not, found, itertools.repeat(None)))
        return list(itertools.compress(candidates, keep)), list(itertools.compress(found, keep))

    def rename(self, new: Mapping[str, str]) -> None:
        """Rename ``old -> new`` for each item of ``new`` (the caller checked the new names are free)."""
        at, values, to = list(map(self.pos.pop, new)), list(map(self.values.pop, new)), list(new.values())
        collections.deque(map(self.order.__setitem__, at, to), 0)  # C loops: 46k names a rule at 671B
        self.pos.update(zip(to, at))
        self.values.update(zip(to, values))
        self._newline = self._newline or _any_newline(to)
        self._add_run(to)

    def _add_run(self, names: Iterable[str]) -> None:
        added = list(names)
        if added:
            self._runs[0].add(added)
            self._runs[1].add(added)

    def _candidates(self, pattern: str) -> list[str] | None:
        """Names that may match (a superset, stale names included), or None: test every name."""
        prefix, suffix = literal_ends(pattern)
        if not prefix and not suffix:
            return None
        limit = len(self.order) // 4  # more candidates than this: testing every name is cheaper
        ranges = []  # (how many, reversed?, runs, the bounds of the names with the literal in each)
        for backwards, literal in ((False, prefix), (True, "" if self._newline else suffix[::-1])):
            side = self._runs[backwards]
            # the runs as they are first: names added since can only add to a count already over the limit
            if literal and _count(side.runs, literal)[0] <= limit:
                ranges.append((*_count(side.get(self.order), literal), backwards, side.runs))
        if not ranges:
            return None
        count, bounds, backwards, runs = min(ranges, key=operator.itemgetter(0))
        if count > limit:
            return None
        out = dict.fromkeys(itertools.chain.from_iterable(run[lo:hi] for run, (lo, hi) in zip(runs, bounds)))
        return list(map(operator.getitem, out, itertools.repeat(_REVERSED))) if backwards else list(out)


class _Runs:
    """Sorted runs (``reverse``: of the names reversed, for suffix look-ups) holding every name a
    :class:`Names` has (and stale ones, dropped on lookup). Added names are sorted in only when a look-up
    needs them (a recipe renames 46k names a rule and looks most of them up by prefix only): one run for
    all of them, or one sort of the live names when they are many (which drops the stale ones)."""

    def __init__(self, reverse: bool) -> None:
        self.reverse = reverse
        self.runs: list[list[str]] = []
        self.added: list[list[str]] | None = None  # None: sort the live names on first use

    def add(self, names: list[str]) -> None:
        if self.added is not None:
            self.added.append(names)

    def get(self, live: list[str]) -> list[list[str]]:
        """The runs, names added since the last call sorted in (``live``: every name there is now)."""
        if self.added is None or len(self.runs) >= _MAX_RUNS or sum(map(len, self.added)) > len(live) // 2:
            self.runs, self.added = [self._sorted(live)], []
        elif self.added:
            self.runs.append(self._sorted(set(itertools.chain.from_iterable(self.added))))
            self.added = []
        return self.runs

    def _sorted(self, names: Iterable[str]) -> list[str]:
        return sorted(map(operator.getitem, names, itertools.repeat(_REVERSED)) if self.reverse else names)


def _any_newline(names: Iterable[str]) -> bool:
    return any(map(operator.contains, names, itertools.repeat("\n")))


def _count(runs: list[list[str]], literal: str) -> tuple[int, list[tuple[int, int]]]:
    """How many names of the sorted ``runs`` start with ``literal``, and where they are in each (:func:`_bounds`)."""
    bounds = list(map(_bounds, runs, itertools.repeat(literal)))
    return sum(itertools.starmap(operator.sub, map(operator.itemgetter(1, 0), bounds))), bounds


def _bounds(run: list[str], prefix: str) -> tuple[int, int]:
    """Where the names of the sorted ``run`` that start with ``prefix`` are: ``run[lo:hi]``."""
    lo = bisect.bisect_left(run, prefix)
    hi = bisect.bisect_left(run, prefix[:-1] + chr(ord(prefix[-1]) + 1)) if ord(prefix[-1]) < 0x10FFFF else len(run)
    return lo, hi


@functools.lru_cache(maxsize=4096)
def substitute(pattern: str, to: str) -> Callable[[str], str]:
    """``lambda name: re.sub(pattern, to, name)``, faster for the renames recipes are made of: a pattern
    anchored by ``^`` (one match at most) and a template of literals and group references (``\\1``,
    ``\\g<leaf>``) are expanded here rather than by ``re``'s template engine (a Python call per name)::

        substitute(r"^model\\.layers\\.(\\d+)\\.", r"layers/\\1/")("model.layers.3.mlp")   # 'layers/3/mlp'
    """
    compiled = regex(pattern)
    template = _format(pattern, to) if pattern.startswith("^") else None
    if template is None:
        return functools.partial(compiled.sub, to)  # re's engine (and its errors)
    search = compiled.search

    def sub(name: str) -> str:
        m = search(name)
        if m is None:
            return name
        heads = _heads(template, [m])
        head = next(iter(heads)) if heads is not None else m.expand(to)
        return name[: m.start()] + head + name[m.end():]

    return sub


def substitute_all(pattern: str, to: str, names: Sequence[str],
                   matches: Sequence[re.Match[str] | None] | None = None) -> list[str]:
    """``[re.sub(pattern, to, name) for name in names]``, in C loops (``map``) when ``pattern`` is anchored
    by ``^`` and matches every name (the names a rule hit; ``matches``: their matches, when the caller has
    them) and ``to`` is literals and group references: a recipe renames DeepSeek-V3's 46k tensors thrice::

        substitute_all(r"^a\\.(\\d+)\\.", r"b/\\1/", ["a.0.w", "a.1.w"])   # ['b/0/w', 'b/1/w']
    """
    template = _format(pattern, to) if pattern.startswith("^") else None
    found = list(map(regex(pattern).search, names)) if matches is None and template is not None else matches
    if template is not None and found is not None and None not in found:
        every = typing.cast("list[re.Match[str]]", found)
        heads = _heads(template, every) if not any(map(re.Match.start, every)) else None
        if heads is not None:  # each match starts the name: the expansion, then the rest of the name
            return list(map(str.__add__, heads, map(str.__getitem__, names,
                                                    map(slice, map(re.Match.end, every), itertools.repeat(None)))))
    return list(map(substitute(pattern, to), names))


def _heads(template: tuple[str, tuple[int | str, ...]], matches: Sequence[re.Match[str]]) -> Iterable[str] | None:
    """The expansions of ``matches`` (every one a match), or None when a referenced group did not take part."""
    text, refs = template
    if not refs:
        return itertools.repeat(text % ())
    values = list(map(operator.methodcaller("group", *refs), matches))
    if None in values if len(refs) == 1 else any(map(operator.contains, values, itertools.repeat(None))):
        return None
    return map(text.__mod__, values)


@functools.lru_cache(maxsize=4096)
def _format(pattern: str, to: str) -> tuple[str, tuple[int | str, ...]] | None:
    """``to`` as a ``%`` format and the groups it references, or None when it has escapes other than group
    references or names a group ``pattern`` lacks (then ``re`` expands it, and raises)."""
    compiled = regex(pattern)
    pieces = _template(to)
    if pieces is None or not all(isinstance(p, str) or p[0] in compiled.groupindex
                                 or (isinstance(p[0], int) and p[0] <= compiled.groups) for p in pieces):
        return None
    text = "".join(p.replace("%", "%%") if isinstance(p, str) else "%s" for p in pieces)
    return text, tuple(p[0] for p in pieces if not isinstance(p, str))


def _template(to: str) -> list[str | tuple[int | str]] | None:
    """A replacement template as literals and group references ``(group,)``, or None when it has other escapes."""
    pieces: list[str | tuple[int | str]] = []
    for m in re.finditer(r"\\g<(\w+)>|\\(\d\d?)(?!\d)|\\(.)|([^\\]+)", to, re.S):
        ref, num, other, text = m.groups()
        if other is not None or (num is not None and num.startswith("0")):
            return None  # escapes (\n, \\ ...) and octal: re's own engine
        if text is not None:
            pieces.append(text)
        else:
            group = ref if ref is not None else num
            pieces.append((int(group) if group.isdigit() else group,))
    return pieces
