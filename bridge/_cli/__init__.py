"""The ``ckptbridge`` command line (also ``python -m ckptbridge``).

::

    ckptbridge inspect PATH [--json] [--fragments]
    ckptbridge convert SRC DST [--states S1,S2]
    ckptbridge export SRC OUT.safetensors [--state fp32] [--dtype bfloat16]
    ckptbridge verify PATH
    ckptbridge diff A B [--json] [--state S] [--atol X] [--rtol Y]
    ckptbridge reshard SRC DST --to FORMAT [--tp N --pp M ... -o key=value]
    ckptbridge merge BASE ADAPTER [ADAPTER ...] OUT --to FORMAT [--weight W ...]
    ckptbridge formats
    ckptbridge recipe [FAMILY SRC DST [--hf-config config.json] [-c key=value ...] [--out R.json]]

Every command that reads takes ``--format`` (skip detection), ``-O key=value`` (the
source format's open options) and ``--rules FILE.json`` (view the source through
mapping rules). Rich tables and progress bars on a terminal; clean tab-separated
output and no progress when piped. Exit status: 0 success, 1 a check failed
(verify, diff found differences), 2 bad input or a failed write (one line on
stderr naming the file).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence

from .._errors import CheckpointError
from .commands import silence_stdout
from .parser import build_parser

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():  # a renamed format's old name (--format torch) is said on stderr
            warnings.filterwarnings("default", message="format name ", category=DeprecationWarning)
            return int(args.fn(args))
    except (CheckpointError, OSError) as err:  # bad input or a failed write: one line, exit 2
        if isinstance(err, BrokenPipeError):
            silence_stdout()
            return 0
        text = str(err) or type(err).__name__
        if isinstance(err, OSError) and not isinstance(err, CheckpointError) and err.filename:
            text = f"{err.filename}: {err.strerror or text}"
        print(f"ckptbridge {args.cmd}: error: {' '.join(text.split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ckptbridge {args.cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
