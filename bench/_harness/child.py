"""Entry point of the fresh process that runs one case (or a suite's ``prepare``).

    python bench/_harness/child.py SPEC.json

SPEC: ``{"module", "function", "ctx": {...Ctx fields}, "result": path, "kind": "fn"|"cmd"|"prepare"}``.
A ``cmd`` case's command line runs inside the region (start-up included), its output
discarded and its stderr kept for errors; then, still inside the region, every file it
wrote under ``ctx.work`` is fsync'd (the same for every tool: files already synced cost nothing).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCH)


def fsync_tree(path: str) -> None:
    """fsync every file and directory under ``path`` (cheap for files already synced)."""
    for root, _, files in os.walk(path):
        for name in [*files, "."]:
            p = os.path.join(root, name)
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def main(spec_path: str) -> int:
    sys.path.insert(0, BENCH)
    from _harness.context import Ctx, Skip

    with open(spec_path) as fh:
        spec = json.load(fh)
    ctx = Ctx(**spec["ctx"])
    status: dict = {"ok": False}
    try:
        mod = importlib.import_module(spec["module"])
        fn = getattr(mod, spec["function"])
        if spec["kind"] == "cmd":
            argv = [str(a) for a in fn(ctx)]
            errf = os.path.join(os.path.dirname(ctx.work), ".stderr")
            with open(errf, "w") as err, ctx.region():
                rc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT).returncode
                if rc == 0:
                    fsync_tree(ctx.work)  # the outputs are on disk when the clock stops, for every tool
            if rc:
                with open(errf) as fh:
                    tail = fh.read()[-4000:]
                raise RuntimeError(f"{' '.join(argv[:6])} ... exited with {rc}:\n{tail}")
            ctx.metrics.setdefault("argv", argv)
        else:
            fn(ctx)
            if spec["kind"] == "fn" and ctx.entered != 1 and not ctx.metrics.get("_region_elsewhere"):
                raise RuntimeError(f"{spec['function']}: must time its work in exactly one ctx.region() "
                                   f"(entered {ctx.entered} times)")
        ctx.metrics.pop("_region_elsewhere", None)
        if spec.get("check"):
            getattr(mod, spec["check"])(ctx)
        status = {"ok": True, "metrics": ctx.metrics}
    except Skip as exc:
        status = {"ok": False, "skip": str(exc)}
    except BaseException as exc:  # reported to the harness, which records the case as failed
        status = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-6000:]}
    with open(spec["result"], "w") as fh:
        json.dump(status, fh, default=str)
    return 0 if status["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
