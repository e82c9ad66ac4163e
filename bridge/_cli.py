"""The ``ckptbridge`` command line.

::

    ckptbridge inspect PATH [--json] [--fragments]
    ckptbridge convert SRC DST
    ckptbridge export SRC OUT.safetensors [--state fp32] [--dtype bfloat16]
    ckptbridge verify PATH
    ckptbridge diff A B [--json] [--state S]
    ckptbridge reshard SRC DST --to FORMAT [--tp N --pp M --dp N --world-size N --zero-stage N -o k=v]

Rich tables on a terminal, plain text when piped. Exit status: 0 success,
1 the check failed (verify, diff with differences), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from ._checkpoint import Checkpoint
from ._errors import CheckpointError


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=not sys.stdout.isatty())


def _table(title: str, columns: Sequence[str], rows: list[Sequence[Any]]) -> None:
    if sys.stdout.isatty():
        from rich.table import Table

        table = Table(title=title)
        for c in columns:
            table.add_column(c)
        for r in rows:
            table.add_row(*(str(x) for x in r))
        _console().print(table)
    else:
        print(title)
        print("\t".join(columns))
        for r in rows:
            print("\t".join(str(x) for x in r))


def _summary(ckpt: Checkpoint) -> dict[str, Any]:
    return {
        "format": ckpt.format,
        "step": ckpt.step,
        "tensors": [
            {"name": n, "shape": list(t.shape), "dtype": t.states[t.weight_state].dtype,
             "states": list(t.states),
             "state_dtypes": {s: st.dtype for s, st in t.states.items()},
             "fragments": sum(len(st.fragments) for st in t.states.values()),
             **({"scalars": dict(t.scalars)} if t.scalars else {})}
            for n, t in ckpt.tensors.items()
        ],
        "rules": list(ckpt.rules),
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    from . import open as open_ckpt

    ckpt = open_ckpt(args.path)
    info = _summary(ckpt)
    if args.json:
        print(json.dumps(info, default=str))
        return 0
    rows = [(t["name"], "x".join(map(str, t["shape"])) or "scalar", t["dtype"], ",".join(t["states"]),
             t["fragments"]) for t in info["tensors"]]
    _table(f"{ckpt.path}  format={ckpt.format}  step={ckpt.step}  tensors={len(rows)}",
           ("name", "shape", "dtype", "states", "fragments"), rows)
    if ckpt.rules:
        print("rules:")
        for r in ckpt.rules:
            print("  " + json.dumps(r))
    if args.fragments:
        for n, t in ckpt.tensors.items():
            for s, st in t.states.items():
                for f in st.fragments:
                    print(f"{n}\t{s}\t{list(f.box.offset)}+{list(f.box.shape)}\t{f.location.describe()}")
    return 0


def _progress() -> Any:
    if not sys.stderr.isatty():
        return None, None
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), transient=True)
    task = bar.add_task("converting", total=None)
    return bar, lambda done, total: bar.update(task, completed=done, total=total)


def cmd_convert(args: argparse.Namespace) -> int:
    from . import convert

    states = args.states.split(",") if args.states else None
    bar, cb = _progress()
    if bar:
        with bar:
            out = convert(args.src, args.dst, states=states, overwrite=args.overwrite, progress=cb)
    else:
        out = convert(args.src, args.dst, states=states, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from . import export

    out = export(args.src, args.out, state=args.state, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from ._universal import verify

    problems = verify(args.path)
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    if not problems:
        print(f"ok {args.path}")
    return 1 if problems else 0


def cmd_diff(args: argparse.Namespace) -> int:
    from . import diff

    rows = diff(args.a, args.b, state=args.state)
    if args.json:
        print(json.dumps([
            {"name": r.name, "in_a": r.in_a, "in_b": r.in_b, "shape_a": r.shape_a, "shape_b": r.shape_b,
             "dtype_a": r.dtype_a, "dtype_b": r.dtype_b, "max_abs_diff": r.max_abs_diff, "equal": r.equal}
            for r in rows
        ]))
    else:
        _table(f"diff {args.a} {args.b}", ("name", "in A", "in B", "shape A", "shape B", "dtype A", "dtype B",
                                            "max |A-B|"),
               [(r.name, r.in_a, r.in_b, r.shape_a, r.shape_b, r.dtype_a, r.dtype_b, r.max_abs_diff)
                for r in rows])
    return 0 if all(r.equal for r in rows) else 1


def _options(pairs: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep:
            raise SystemExit(f"-o expects key=value, got {p!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def cmd_reshard(args: argparse.Namespace) -> int:
    from . import reshard

    opts = {"tp": args.tp, "pp": args.pp, "dp": args.dp, "world_size": args.world_size,
            "zero_stage": args.zero_stage, "state": args.state, "overwrite": args.overwrite or None,
            **_options(args.option)}
    reshard(args.src, args.dst, args.to, **opts)
    print(f"wrote {args.dst} ({args.to})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptbridge", description="Portable distributed-training checkpoints.")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("inspect", help="list tensors, shapes, dtypes, states")
    s.add_argument("path")
    s.add_argument("--json", action="store_true")
    s.add_argument("--fragments", action="store_true", help="also list every fragment and where it lives")
    s.set_defaults(fn=cmd_inspect)
    s = sub.add_parser("convert", help="write a universal directory")
    s.add_argument("src")
    s.add_argument("dst")
    s.add_argument("--states", default=None, metavar="S1,S2",
                   help="only these states (e.g. fp32,exp_avg,exp_avg_sq); default all")
    s.add_argument("--overwrite", action="store_true")
    s.set_defaults(fn=cmd_convert)
    s = sub.add_parser("export", help="one safetensors file of one state")
    s.add_argument("src")
    s.add_argument("out")
    s.add_argument("--state", default=None)
    s.add_argument("--dtype", default=None)
    s.add_argument("--overwrite", action="store_true")
    s.set_defaults(fn=cmd_export)
    s = sub.add_parser("verify", help="check a universal directory's completeness and checksums")
    s.add_argument("path")
    s.set_defaults(fn=cmd_verify)
    s = sub.add_parser("diff", help="compare two checkpoints of any formats")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--json", action="store_true")
    s.add_argument("--state", default=None)
    s.set_defaults(fn=cmd_diff)
    s = sub.add_parser("reshard", help="write a checkpoint in a format and layout")
    s.add_argument("src")
    s.add_argument("dst")
    s.add_argument("--to", required=True)
    for flag in ("--tp", "--pp", "--dp", "--world-size", "--zero-stage"):
        s.add_argument(flag, type=int, default=None)
    s.add_argument("--state", default=None)
    s.add_argument("--overwrite", action="store_true")
    s.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE")
    s.set_defaults(fn=cmd_reshard)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except (CheckpointError, FileExistsError) as err:
        print(f"ckptbridge {args.cmd}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
