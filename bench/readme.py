#!/usr/bin/env python
"""Regenerate the README's benchmark tables from the result files (never typed by hand).

    python bench/readme.py [--results bench/results] [--readme README.md] [--check]

Every harness result ``bench/results/<suite>-<size>.json`` (schema ``ckptbridge-bench/1``) is
rendered (``_harness.report.readme_block``) between the README's marker comments
``<!-- bench:<suite>-<size> -->`` and ``<!-- /bench:<suite>-<size> -->``. A standalone
benchmark's result ``bench/results/<stem>.json`` (its own format: bench_async.py,
bench_orbax_inplace.py, bench_ds_resume.py, bench_big_state.py, bench_recipes.py ...) goes
between ``<!-- bench:<stem> -->`` markers as the Markdown table its script wrote beside it
(``<stem>.md``), or, where the script writes none, as a pointer to the JSON: never as numbers
typed or re-derived here. A result file without markers, or markers without a result file,
is reported (the README then says the file is missing). The harness results' comparisons are
derived again from their runs (``summarize``), and each one's ``<suite>-<size>.md`` is rewritten
from it. ``--check`` (in ``make lint``) changes nothing and exits 1 if the README or a harness
``.md`` differs from what the result files give, a result file and the README's markers do
not match, or a result file records no commit or machine facts. The block between
``<!-- bench:commits -->`` markers lists the commits the result files were measured at.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness.report import markdown, readme_block, summarize, validate

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MARK = re.compile(r"(<!-- bench:(?P<key>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /bench:(?P=key) -->)", re.S)


def render(text: str, results: dict[str, dict]) -> tuple[str, list[str], list[str]]:
    """``text`` with every marked block replaced; (new text, keys without results, results without markers)."""
    seen: set[str] = set()
    missing: list[str] = []

    def sub(m: re.Match) -> str:
        key = m.group("key")
        seen.add(key)
        doc = results.get(key)
        if key == COMMITS:
            body = commits_block(results)
        elif doc is None:
            missing.append(key)
            body = f"*No result file `bench/results/{key}.json` yet (bench/README.md: the command that writes it).*\n"
        elif STANDALONE in doc:
            body = standalone_block(key, doc[STANDALONE], doc.get(RAW))
        else:
            body = readme_block(doc)
        return m.group(1) + body + m.group(4)

    out = MARK.sub(sub, text)
    return out, missing, sorted(set(results) - seen)


COMMITS = "commits"  # the marker whose block says which commits the result files were measured at


STANDALONE = "_standalone_md"  # key of a standalone result: the text of its .md (or None)
RAW = "_standalone_json"  # and its JSON
HEADLINE = re.compile(r"ratio|speedup|summary|goal|equal|_vs_|bytes_fetched|fetched_over", re.I)


def headline_table(doc: Any) -> str:
    """The numbers and yes/no values of a standalone result whose key path names a ratio, a
    speed-up, a goal or a summary, as a two-column table (paths as in the JSON, values as written).
    Every such row is shown: none is cut, so no row against ckptbridge can fall out of sight."""
    rows: list[tuple[str, str]] = []

    def walk(node: Any, path: list[str], hit: bool) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, [*path, str(k)], hit or bool(HEADLINE.search(str(k))))
        elif hit and isinstance(node, bool):
            rows.append((".".join(path), "yes" if node else "no"))
        elif hit and isinstance(node, (int, float)):
            rows.append((".".join(path), f"{node:.3g}" if isinstance(node, float) else str(node)))

    walk(doc, [], False)
    if not rows:
        return "*(no ratio, speed-up or goal in this file)*\n"
    out = ["| figure | value |", "|---|---|", *(f"| `{k}` | {v} |" for k, v in rows)]
    return "\n".join(out) + "\n"


def provenance(doc: Any) -> tuple[str, str, str] | None:
    """(commit, when, where) a result file says it was measured at, or ``None`` when it does not say:
    a harness result (``commit``, ``started``, its machine facts), a standalone one
    (``_proc.provenance``: ``commit``, ``finished``, the harness's machine facts) or
    ``tools/gpu_check.py``'s record (its ``machine``: ``commit``, ``time``, the GPU)."""
    if not isinstance(doc, dict):
        return None
    m = doc.get("machine")
    if not isinstance(m, dict):
        return None
    if doc.get("commit") and isinstance(m.get("memcpy_gbps"), (int, float)):
        return str(doc["commit"]), str(doc.get("finished") or doc.get("started") or "?"), f"{m.get('cores')} cores"
    if m.get("commit") and m.get("time") and "gpu" in m:
        return str(m["commit"])[:10], str(m["time"]), str(m["gpu"] or f"no GPU, {m.get('cpus')} CPUs")
    return None


def provenance_line(doc: Any) -> str:
    """Where and when a standalone result was measured (:func:`provenance`), or that its file
    does not say."""
    p = provenance(doc)
    if p is None:
        return "*This file records no commit or machine facts: not a figure to quote until measured again.*\n"
    m = doc["machine"]
    if "memcpy_gbps" not in m:  # tools/gpu_check.py: its own line below names the GPU and the versions
        return f"*Measured at commit {p[0]}, {p[1]}, on {p[2]}.*\n"
    return (f"*Measured at commit {p[0]}, finished {p[1]}: {m['cores']} cores ({m['cpu']}), load average "
            f"{m.get('load_avg_at_end', m['loadavg'])[0]:.1f} when it finished, memcpy {m['memcpy_gbps']:.1f} GB/s, "
            f"disk write {m['disk_write_gbps']:.2f} / read {m['disk_read_gbps']:.2f} GB/s.*\n")


def commits_block(results: dict[str, dict]) -> str:
    """One line per commit the result files were measured at: how many files, which, and the span
    of their times (files that record none are listed too: ``--check`` refuses them)."""
    by: dict[str, list[tuple[str, str, str]]] = {}
    for key, doc in sorted(results.items()):
        p = provenance(doc.get(RAW) if STANDALONE in doc else doc)
        commit, when, where = p or ("(none recorded)", "", "")
        by.setdefault(commit, []).append((key, when, where))
    lines = []
    for commit, rows in sorted(by.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        times = sorted(w for _, w, _ in rows if w)
        span = f", {times[0]} to {times[-1]}" if len(times) > 1 else (f", {times[0]}" if times else "")
        machines = ", ".join(sorted({w for _, _, w in rows if w}))
        files = f"{len(rows)} result file{'s' if len(rows) > 1 else ''}"
        lines.append(f"* commit **{commit}**: {files}{span}"
                     f"{f' ({machines})' if machines else ''}: {', '.join(f'`{k}`' for k, _, _ in rows)}")
    return "\n".join(lines) + "\n"


def unrecorded(results: dict[str, dict]) -> list[str]:
    """The result files that record no commit or no machine facts (``--check`` fails on them)."""
    return [key for key, doc in sorted(results.items())
            if provenance(doc.get(RAW) if STANDALONE in doc else doc) is None]


def standalone_block(key: str, md: str | None, doc: Any = None) -> str:
    """A standalone benchmark's own Markdown, verbatim, under a line naming its files and one
    saying where it was measured."""
    src = f"*From `bench/results/{key}.json`"
    if md is None:
        return src + " (the script's own format; its headline figures below, read from the JSON).*\n" + \
            provenance_line(doc) + "\n" + headline_table(doc)
    return src + f" and `{key}.md`, as the script wrote them.*\n" + provenance_line(doc) + "\n" + md.strip() + "\n"


def load_results(folder: str) -> dict[str, dict]:
    """Harness results by ``<suite>-<size>``; standalone ones (no harness schema) by file stem."""
    out: dict[str, dict] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as fh:
            doc = json.load(fh)
        if not isinstance(doc, dict) or "schema" not in doc:
            md = os.path.splitext(path)[0] + ".md"
            text = None
            if os.path.exists(md):
                with open(md) as fh:
                    text = fh.read()
            out[os.path.splitext(os.path.basename(path))[0]] = {STANDALONE: text, RAW: doc}
            continue
        problems = validate(doc)
        if problems:
            raise SystemExit(f"{path}: not a valid result file: {problems[:5]}")
        # the comparisons are derived again from the runs and the cases' roles (ref, vs), so a
        # table never shows a ratio its file's measurements do not give
        out[f"{doc['suite']}-{doc['size']}"] = summarize(doc)
    return out


def harness_markdown(folder: str, results: dict[str, dict]) -> dict[str, str]:
    """The ``<suite>-<size>.md`` beside each harness result, as its results make it now
    (path -> text)."""
    return {os.path.join(folder, f"{key}.md"): markdown(doc) for key, doc in results.items()
            if STANDALONE not in doc}


def _text(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return fh.read()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    with open(a.readme) as fh:
        text = fh.read()
    results = load_results(a.results)
    new, missing, unplaced = render(text, results)
    for key in missing:
        print(f"README marker bench:{key} has no result file in {a.results}")
    for key in unplaced:
        print(f"result {key} has no marker in {a.readme} (add <!-- bench:{key} --> ... <!-- /bench:{key} -->)")
    files = {a.readme: (text, new)}
    for path, md in harness_markdown(a.results, results).items():
        files[path] = (_text(path), md)
    stale = [path for path, (old, now) in files.items() if old != now]
    if a.check:
        for path in stale:
            print(f"stale: {path} (run python bench/readme.py)")
        bare = unrecorded(results)
        for key in bare:
            print(f"result {key} records no commit or machine facts (measure it again: bench/README.md)")
        ok = not stale and not missing and not unplaced and not bare
        print("README benchmark tables are " + ("up to date" if ok else "NOT up to date"))
        return 0 if ok else 1
    for path in stale:
        with open(path, "w") as fh:
            fh.write(files[path][1])
        print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
