"""Command line shared by ``bench/run.py`` (every suite) and each ``bench/bench_*.py`` (one suite).

    python bench/run.py                       # every suite, every full size -> bench/results/
    python bench/run.py --quick               # every suite, tiny (CI smoke) -> bench/out/results-quick/
    python bench/run.py core deepspeed --size 1g --reps 5
    python bench/bench_core.py --quick --only 'write/*'
    python bench/run.py --list                # suites, sizes and cases

Writes ``<out>/<suite>-<size>.json`` and ``.md`` per suite and size; machine facts are measured
once per invocation, in the same run. ``make bench`` then regenerates the README's tables
(``bench/readme.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from .report import markdown, validate
from .runner import BENCH, machine_facts, run_suite
from .spec import Suite

FULL = ("1g", "8g")


def write_result(doc: dict, out: str) -> str:
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, f"{doc['suite']}-{doc['size']}")
    with open(base + ".json", "w") as fh:
        json.dump(doc, fh, indent=1, sort_keys=False, default=str)
        fh.write("\n")
    with open(base + ".md", "w") as fh:
        fh.write(markdown(doc))
    return base + ".json"


def main(suites: Sequence[Suite], argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suites", nargs="*", help="suite names (default: all)")
    ap.add_argument("--size", default="full", help="quick, 1g, 8g, or full (= every size but quick)")
    ap.add_argument("--quick", action="store_true", help="same as --size quick (CI smoke test)")
    ap.add_argument("--reps", type=int, default=None, help="override the size's repetitions")
    ap.add_argument("--only", action="append", default=None, help="case name glob or group (repeatable)")
    ap.add_argument("--work", default=os.path.join(BENCH, "out", "work"), help="inputs and scratch")
    ap.add_argument("--out", default=None, help="results directory (default bench/results; quick: bench/out/results-quick)")
    ap.add_argument("--no-cold", action="store_true", help="skip the extra run per case with the inputs evicted "
                    "from the page cache (it measures bytes read from storage, mmap page faults included)")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args(argv)
    size = "quick" if a.quick else a.size
    by_name = {s.name: s for s in suites}
    chosen = [by_name[n] for n in a.suites] if a.suites else list(suites)
    unknown = [n for n in a.suites if n not in by_name]
    if unknown:
        ap.error(f"unknown suite(s) {unknown}; have {sorted(by_name)}")
    if a.list:
        for s in chosen:
            print(f"{s.name}: {s.title}; sizes {', '.join(f'{k} ({v.gib} GiB)' for k, v in s.sizes.items())}")
            for c in (*s.cases, *s.startups.values()):
                print(f"  {c.name:44s} {c.role:8s} {c.tool} [{c.settings}]")
        return 0
    sizes = [sz for sz in FULL] if size == "full" else [size]
    out = a.out or (os.path.join(BENCH, "out", "results-quick") if size == "quick" else os.path.join(BENCH, "results"))
    work = os.path.abspath(a.work)
    print(f"measuring the machine (in {work}) ...", flush=True)
    machine = machine_facts(os.path.join(work, "machine"), 64 if size == "quick" else 1024)
    failed = 0
    for s in chosen:
        for sz in sizes:
            if sz not in s.sizes:
                print(f"[{s.name}] no size {sz}; skipped")
                continue
            doc = run_suite(s, sz, work_root=work, reps=a.reps, only=a.only, machine=machine, cold=not a.no_cold,
                            log=lambda m: print(m, flush=True))
            problems = validate(doc)
            path = write_result(doc, out)
            print(f"wrote {path}" + (f" (schema problems: {problems})" if problems else ""), flush=True)
            failed += bool(problems) + sum(c["status"] == "error" for c in doc["cases"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main([]))
