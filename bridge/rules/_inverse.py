"""Inverting a regex rename: ``(pattern, to)`` -> the ``(pattern, to)`` that maps the results back
(groups become holes, literals are unescaped), used by the rules' ``inverse()``."""

from __future__ import annotations

import re
from typing import Any

from .._errors import FormatError

_GROUP = re.compile(r"\((\?P<(?P<name>\w+)>|\?:)?(?P<body>(?:[^()\\]|\\.)*)\)")


def invert_rename(pattern: str, to: str, hole: int | str | None = None) -> tuple[str, str]:
    """The reverse ``(pattern, to)`` of a literal-with-groups rename such as
    ``^model\\.layers\\.(\\d+)\\.mlp$ -> layers/\\1/mlp``: each group of ``pattern`` that ``to``
    uses comes back as a group of the reverse pattern. ``hole`` (a group ``to`` does not use,
    e.g. a stacked index) becomes a ``\\x00`` marker in the reverse replacement."""
    body = pattern
    anchored_start, anchored_end = body.startswith("^"), body.endswith("$") and not body.endswith("\\$")
    body = body[1 if anchored_start else 0 : len(body) - (1 if anchored_end else 0)]
    literal: list[tuple[str, Any]] = []  # ("lit", text) or ("group", (number, name, regex))
    pos, number = 0, 0
    for m in _GROUP.finditer(body):
        literal.append(("lit", _unescape(body[pos : m.start()], pattern)))
        capturing = m.group(1) != "?:"
        if capturing:
            number += 1
            literal.append(("group", (number, m.group("name"), m.group("body"))))
        else:
            raise FormatError(f"cannot invert rename {pattern!r}: non-capturing groups")
        pos = m.end()
    literal.append(("lit", _unescape(body[pos:], pattern)))
    groups = {v[0]: v for k, v in literal if k == "group"}
    by_name = {v[1]: v[0] for v in groups.values() if v[1]}
    # the reverse pattern: ``to`` with its group references replaced by the groups' regexes
    rev_pattern, used, names = "", [], []  # a reverse group keeps the name of the group it came from
    for piece in re.split(r"(\\\d+|\\g<\w+>)", to):
        ref = re.fullmatch(r"\\(\d+)|\\g<(\w+)>", piece)
        if ref:
            n = int(ref.group(1)) if ref.group(1) else by_name[ref.group(2)]
            if n not in groups:
                raise FormatError(f"cannot invert rename {pattern!r} -> {to!r}: no group {n}")
            used.append(n)
            own = groups[n][1]
            names.append(own if own and own not in names else f"g{len(used)}")
            rev_pattern += f"(?P<{names[-1]}>{groups[n][2]})"
        else:
            rev_pattern += re.escape(piece)
    hole_n = by_name.get(hole) if isinstance(hole, str) else hole
    rev_to = ""
    for kind, v in literal:
        if kind == "lit":
            rev_to += v.replace("\\", "\\\\")
        elif v[0] == hole_n:
            rev_to += "\x00"
        elif v[0] in used:
            rev_to += f"\\g<{names[used.index(v[0])]}>"
        else:
            raise FormatError(f"cannot invert rename {pattern!r} -> {to!r}: group {v[0]} is dropped")
    return ("^" if anchored_start else "") + rev_pattern + ("$" if anchored_end else ""), rev_to


def _unescape(text: str, pattern: str) -> str:
    """A regex fragment that matches one literal string, as that string."""
    out, i = "", 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and not text[i + 1].isalnum():
            out += text[i + 1]
            i += 2
            continue
        if c in ".^$*+?{}[]|\\":
            raise FormatError(f"cannot invert rename {pattern!r}: {text!r} is not a literal")
        out += c
        i += 1
    return out
