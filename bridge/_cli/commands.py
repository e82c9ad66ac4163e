"""The commands of the ``ckptbridge`` command line, one ``cmd_*`` function each (``args`` from
:func:`ckptbridge._cli.parser.build_parser`; returns the exit status), and their output helpers."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .._errors import (
    CheckpointError,
    MissingExtraError,
    OptionError,
    UnknownFormatError,
    WriteError,
)
from .._formats.convert import convert, diff, export
from .._formats.registry import describe_options, formats, get_format
from .._formats.verify import verify_checkpoint
from .._read.checkpoint import Checkpoint
from .._read.open import open as open_ckpt
from .._read.reshard import destination, reshard
from ..rules import rule_from_json

# flags of `reshard` that are shorthands for format options of the same name
_LAYOUT_FLAGS = ("tp", "pp", "dp", "world_size", "zero_stage", "state")


# ------------------------------------------------------------------ output helpers


def _tty(stream: Any = None) -> bool:
    return bool(getattr(stream or sys.stdout, "isatty", lambda: False)())


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A rich table on a terminal; on a pipe the header line and tab-separated rows only."""
    if _tty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for c in columns:
            table.add_column(c)
        for r in rows:
            table.add_row(*(str(x) for x in r))
        Console(highlight=False).print(table)
    else:
        print("\t".join(columns))
        for r in rows:
            print("\t".join(str(x) for x in r))


@contextlib.contextmanager
def _progress(label: str, total: int, done: Callable[[], int]) -> Iterator[None]:
    """A progress bar on stderr while the block runs, polling ``done()`` (bytes); nothing on a pipe."""
    if not _tty(sys.stderr) or total <= 0:
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), transient=True, console=Console(stderr=True))
    task = bar.add_task(label, total=total)
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.1):
            bar.update(task, completed=min(done(), total))

    with bar:
        th = threading.Thread(target=poll, daemon=True)
        th.start()
        try:
            yield
        finally:
            stop.set()
            th.join()
            bar.update(task, completed=min(done(), total))  # the last frame shows where it ended


@contextlib.contextmanager
def _writing(dst: str) -> Iterator[None]:
    """Failures to write ``dst`` (read-only place, ``/proc``, full disk ...) become one
    :class:`WriteError` naming ``dst``; errors about the source pass through unchanged."""
    try:
        yield
    except WriteError as err:
        raise _write_failure(err, dst) from err
    except (CheckpointError, FileExistsError):
        raise
    except OSError as err:
        if err.filename and not _under(os.fspath(err.filename), dst):
            raise  # about another file (the source): main() names it
        raise _write_failure(err, dst) from err


def _under(name: str, dst: str) -> bool:
    """Whether a failing path is the destination, inside it, its staging copy, or a parent of it."""
    name, target = os.path.abspath(name), os.path.abspath(dst)
    return (name == target or name.startswith((target + os.sep, target + ".partial"))
            or target.startswith(name.rstrip(os.sep) + os.sep))


def _write_failure(err: OSError, dst: str) -> WriteError:
    reason = os.strerror(err.errno) if err.errno else str(err)
    name = os.fspath(err.filename) if err.filename else None
    where = f": {name}" if name and os.path.abspath(name) != os.path.abspath(dst) else ""
    return WriteError(f"{dst}: cannot write the checkpoint here ({reason}{where})", err.errno)


def _bytes_of(ckpt: Checkpoint, states: Sequence[str] | None = None) -> int:
    return sum(st.nbytes for t in ckpt.tensors.values() for s, st in t.states.items()
               if states is None or s in states)


def _view_bytes(ckpt: Checkpoint, state: str | None) -> int:
    """Bytes of one state of every tensor (``None``: each tensor's weights), as export and diff read."""
    if state is not None:
        return _bytes_of(ckpt, [state])
    return sum(t.state().nbytes for t in ckpt.tensors.values())


# ------------------------------------------------------------------ argument parsing


def _pairs(values: Sequence[str], flag: str) -> dict[str, Any]:
    """``key=value`` strings -> dict (values stay strings: each format's typed options parse them)."""
    out: dict[str, Any] = {}
    for p in values:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise OptionError(f"{flag} expects key=value, got {p!r}")
        out[key.strip().replace("-", "_")] = value
    return out


def _rules(path: str | None) -> list[Any] | None:
    if not path:
        return None
    try:
        with open(path) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise OptionError(f"{path}: no such rules file") from None
    except ValueError as err:
        raise OptionError(f"{path}: not a JSON list of rules ({err})") from None
    if isinstance(data, dict) and "rules" in data:
        data = data["rules"]
    if not isinstance(data, list):
        raise OptionError(f"{path}: expected a JSON list of rule objects")

    return [rule_from_json(r) for r in data]


def _open(args: argparse.Namespace, path: str | None = None, *, fmt: str | None = None,
          rules: str | None = None) -> Checkpoint:
    return open_ckpt(path or args.src, fmt if fmt is not None else args.format,
                     rules=_rules(rules if rules is not None else getattr(args, "rules", None)),
                     **_pairs(getattr(args, "open_option", []) or [], "-O"))


# ------------------------------------------------------------------ commands


def _summary(ckpt: Checkpoint) -> dict[str, Any]:
    lora = ckpt.extra.get("lora") or {}  # per tensor: the LoRA adapter it is, or those merged into it
    return {
        "format": ckpt.format,
        "path": ckpt.path,
        "step": ckpt.step,
        "tensors": [
            {"name": n, "shape": list(t.shape), "dtype": _model_dtype(t),
             "states": list(t.states),
             "state_dtypes": {s: st.dtype for s, st in t.states.items()},
             "fragments": sum(len(st.fragments) for st in t.states.values()),
             **({"scalars": dict(t.scalars)} if t.scalars else {}),
             **({"lora": lora[n]} if n in lora else {})}
            for n, t in ckpt.tensors.items()
        ],
        "rules": list(ckpt.rules),
    }


def _model_dtype(t: Any) -> str:
    """The dtype of the weights as the model holds them (``param`` when present, else the master)."""
    return str(t.states["param"].dtype if "param" in t.states else t.state().dtype)


def cmd_inspect(args: argparse.Namespace) -> int:
    ckpt = _open(args, args.path)
    info = _summary(ckpt)
    if args.json:
        print(json.dumps(info, default=str))
        return 0
    lora = any("lora" in t for t in info["tensors"])
    rows = [(t["name"], "x".join(map(str, t["shape"])) or "scalar", t["dtype"],
             ",".join(f"{s}:{d}" for s, d in t["state_dtypes"].items()), t["fragments"],
             *((_lora_text(t.get("lora")),) if lora else ()))
            for t in info["tensors"]]
    if not args.fragments or _tty():  # piped, --fragments prints its own table alone (one clean TSV)
        _table(f"{ckpt.path}  format={ckpt.format}  step={ckpt.step}  tensors={len(rows)}",
               ("name", "shape", "dtype", "states", "fragments", *(("lora",) if lora else ())), rows)
    if args.fragments:
        _table("fragments", ("name", "state", "box", "location"),
               [(n, s, f"{list(f.box.offset)}+{list(f.box.shape)}", f.location.describe())
                for n, t in ckpt.tensors.items() for s, st in t.states.items() for f in st.fragments])
    if _tty() and ckpt.rules:
        print("rules (the layout of this checkpoint, and any mapping applied):")
        for r in ckpt.rules:
            print("  " + json.dumps(r))
    return 0


def _lora_text(info: dict[str, Any] | None) -> str:
    """One cell: the base weight a LoRA tensor adapts, or the adapters merged into a weight."""
    if not info:
        return ""
    if "merged" in info:
        return "merged " + ", ".join(f"{m['adapter']} (r={m['rank']}, x{m['weight']:g})" for m in info["merged"])
    if "replaced_by" in info:
        return f"replaced by {info['replaced_by']}"
    rank = f" (r={info['rank']}, scaling={info['scaling']:g})" if "rank" in info else ""
    return f"{info['part']} of {info['base']}{rank}"


def cmd_merge(args: argparse.Namespace) -> int:
    opts = _pairs(getattr(args, "open_option", []) or [], "-O")
    opts["adapters"] = tuple(args.adapter)
    if args.weight:
        opts["adapter_weights"] = tuple(args.weight)
    fmt = get_format(args.to)
    ckpt = open_ckpt(args.src, args.format, **opts)
    dst = destination(args.dst, fmt.name)
    write = _pairs(args.option, "-o") | ({"overwrite": True} if args.overwrite else {})
    with _progress(f"merging into {fmt.name}", _bytes_of(ckpt), lambda: ckpt.stats.bytes_read), _writing(dst):
        out = reshard(ckpt, dst, fmt.name, **write)
    print(f"wrote {out} ({fmt.name})")
    return 0


def _world(dst: str, args: argparse.Namespace) -> Any:
    """This process's place among the launcher's (torchrun, srun ...), or None when alone."""
    from .._formats.scaleout import world_from_env

    return None if args.one_process else world_from_env(dst, args.timeout)


def cmd_convert(args: argparse.Namespace) -> int:
    ckpt = _open(args)
    states = [s for s in args.states.split(",") if s] if args.states else None
    world = _world(args.dst, args)
    with _progress("converting", _bytes_of(ckpt, states) // (world.size if world else 1),
                   lambda: ckpt.stats.bytes_read), _writing(args.dst):
        out = convert(ckpt, args.dst, states=states, overwrite=args.overwrite, world=world)
    if world is None or world.rank == 0:
        print(f"wrote {out}" + (f" ({world.size} processes)" if world else ""))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    ckpt = _open(args)
    with _progress("exporting", _view_bytes(ckpt, args.state),
                   lambda: ckpt.stats.bytes_read), _writing(args.out):
        out = export(ckpt, args.out, state=args.state, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    try:
        ckpt = _open(args, args.path)
    except (UnknownFormatError, OptionError, MissingExtraError):  # bad input, not a failed check
        raise
    except CheckpointError as err:  # found but incomplete, truncated, malformed: the check failed
        print(f"FAIL {err}", file=sys.stderr)
        return 1
    with _progress("verifying", _bytes_of(ckpt), lambda: ckpt.stats.bytes_read):
        problems = verify_checkpoint(ckpt)
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    if not problems:
        print(f"ok {ckpt.path} ({ckpt.format}, {len(ckpt)} tensors, every byte readable"
              f"{', every checksum matches' if ckpt.format == 'universal' else ''})")
    return 1 if problems else 0


def cmd_diff(args: argparse.Namespace) -> int:
    a = _open(args, args.a, fmt=args.format, rules=args.rules)
    b = _open(args, args.b, fmt=args.format_b or "", rules=args.rules_b or "")
    if args.state is not None and args.state not in set(a.states()) | set(b.states()):
        raise OptionError(f"--state {args.state!r}: neither checkpoint has it (A: {list(a.states())}, "
                          f"B: {list(b.states())})")
    total = _view_bytes(a, args.state) + _view_bytes(b, args.state)
    with _progress("comparing", total, lambda: a.stats.bytes_read + b.stats.bytes_read):
        rows = diff(a, b, state=args.state, atol=args.atol, rtol=args.rtol)
    status = 0 if all(r.equal for r in rows) else 1
    try:
        if args.json:
            print(json.dumps([
                {"name": r.name, "in_a": r.in_a, "in_b": r.in_b, "shape_a": r.shape_a, "shape_b": r.shape_b,
                 "dtype_a": r.dtype_a, "dtype_b": r.dtype_b, "max_abs_diff": r.max_abs_diff, "equal": r.equal}
                for r in rows
            ]))
        else:
            _table(f"diff {a.path} {b.path}", ("name", "in A", "in B", "shape A", "shape B", "dtype A", "dtype B",
                                                "max |A-B|", "equal"),
                   [(r.name, r.in_a, r.in_b, r.shape_a, r.shape_b, r.dtype_a, r.dtype_b, r.max_abs_diff, r.equal)
                    for r in rows])
    except BrokenPipeError:  # `diff a b | head`: the verdict still stands
        silence_stdout()
    return status


def cmd_reshard(args: argparse.Namespace) -> int:
    fmt = get_format(args.to)
    opts = _pairs(args.option, "-o")
    for flag in _LAYOUT_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            if flag in opts:
                raise OptionError(f"--{flag.replace('_', '-')} and -o {flag}=... both given")
            opts[flag] = value
    if args.overwrite:
        opts["overwrite"] = True
    if fmt.name == "universal" and not args.one_process and "distributed" not in opts:
        from .._ranks import rank_from_env

        if rank_from_env()[1] > 1:  # launched as N processes: write one share each
            opts["distributed"] = True
    ckpt = _open(args)
    dst = destination(args.dst, fmt.name)
    with _progress(f"writing {fmt.name}", _bytes_of(ckpt), lambda: ckpt.stats.bytes_read), _writing(dst):
        out = reshard(ckpt, dst, fmt.name, **opts)
    print(f"wrote {out} ({fmt.name})")
    return 0


def cmd_formats(args: argparse.Namespace) -> int:
    fmts = formats()
    if args.json:
        print(json.dumps([{"name": f.name, "read": f.readable, "write": f.writable, "description": f.description,
                           "extra": f.extra,
                           "open_options": [dict(zip(("name", "type", "default", "help"), o))
                                            for o in describe_options(f.open_options)],
                           "write_options": [dict(zip(("name", "type", "default", "help"), o))
                                             for o in describe_options(f.write_options)] if f.writable else []}
                          for f in fmts]))
        return 0
    _table("formats", ("name", "read", "write", "description"),
           [(f.name, "yes" if f.readable else "-", "yes" if f.writable else "-", f.description) for f in fmts])
    if _tty():
        print("\noptions (open: -O key=value; write: reshard -o key=value):")
        for f in fmts:
            for kind, cls in (("open", f.open_options), ("write", f.write_options if f.writable else None)):
                for name, tp, default, text in describe_options(cls) if cls is not None else ():
                    print(f"  {f.name:20s} {kind:5s} {name}: {tp} = {default}  {text}")
    return 0


def _recipe_config(family: str, pairs: dict[str, str]) -> dict[str, Any]:
    """``-c key=value`` strings typed as the family's config dataclass declares them."""
    import dataclasses

    from ..recipes import config_type

    kinds = {f.name: f.type for f in dataclasses.fields(config_type(family))}
    out: dict[str, Any] = {}
    for key, value in pairs.items():
        kind = str(kinds.get(key, "str"))
        if kind == "bool":
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise OptionError(f"-c {key}={value}: expected true or false")
            out[key] = value.lower() in ("true", "1", "yes")
        elif kind in ("int", "int | None"):
            try:
                out[key] = int(value)
            except ValueError:
                raise OptionError(f"-c {key}={value}: expected an integer") from None
        else:
            out[key] = value
    return out


def cmd_recipe(args: argparse.Namespace) -> int:
    """List the recipes, or print one as the JSON rule list ``--rules`` takes."""
    from .. import recipes
    from ..rules import rules_to_json

    if not args.family:
        _table("recipes (family, source scheme, destination scheme)", ["family", "src", "dst"], recipes.available())
        return 0
    if not (args.src and args.dst):
        raise OptionError("recipe FAMILY SRC DST: give the source and the destination scheme (hf, megatron, maxtext)")
    config = recipes.config_from_hf(args.hf_config) if args.hf_config else {}
    config.update(_recipe_config(args.family, _pairs(args.config, "-c")))
    text = json.dumps(rules_to_json(recipes.rules(args.family, src=args.src, dst=args.dst, **config)), indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    else:
        print(text)
    return 0


def silence_stdout() -> None:
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
