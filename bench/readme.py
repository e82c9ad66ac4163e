#!/usr/bin/env python
"""Regenerate the README's benchmark tables from the result files (never typed by hand).

    python bench/readme.py [--results bench/results] [--readme README.md] [--check]

Every ``bench/results/<suite>-<size>.json`` is rendered (``_harness.report.readme_block``)
between the README's marker comments ``<!-- bench:<suite>-<size> -->`` and
``<!-- /bench:<suite>-<size> -->``. A result file without markers, or markers without a
result file, is reported. ``--check`` changes nothing and exits 1 if the README is stale.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness.report import readme_block, validate

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
        if doc is None:
            missing.append(key)
            body = f"*No result file `bench/results/{key}.json` yet: run `make bench`.*\n"
        else:
            body = readme_block(doc)
        return m.group(1) + body + m.group(4)

    out = MARK.sub(sub, text)
    return out, missing, sorted(set(results) - seen)


def load_results(folder: str) -> dict[str, dict]:
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as fh:
            doc = json.load(fh)
        problems = validate(doc)
        if problems:
            raise SystemExit(f"{path}: not a valid result file: {problems[:5]}")
        out[f"{doc['suite']}-{doc['size']}"] = doc
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    with open(a.readme) as fh:
        text = fh.read()
    new, missing, unplaced = render(text, load_results(a.results))
    for key in missing:
        print(f"README marker bench:{key} has no result file in {a.results}")
    for key in unplaced:
        print(f"result {key} has no marker in {a.readme} (add <!-- bench:{key} --> ... <!-- /bench:{key} -->)")
    if a.check:
        stale = new != text
        print("README benchmark tables are " + ("stale: run python bench/readme.py" if stale else "up to date"))
        return 1 if stale else 0
    if new != text:
        with open(a.readme, "w") as fh:
            fh.write(new)
        print(f"updated {a.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
