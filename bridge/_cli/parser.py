"""The ``ckptbridge`` argument parser: every command, its flags and help text."""

from __future__ import annotations

import argparse
from typing import NoReturn

from .._formats.registry import describe_options, writable_formats
from .._version import __version__
from .commands import (
    cmd_convert,
    cmd_diff,
    cmd_export,
    cmd_formats,
    cmd_inspect,
    cmd_merge,
    cmd_recipe,
    cmd_reshard,
    cmd_verify,
)


def _source_args(s: argparse.ArgumentParser, *, rules: bool = True) -> None:
    s.add_argument("--format", default=None, metavar="NAME",
                   help="read the source as this format instead of detecting it (see `ckptbridge formats`)")
    s.add_argument("-O", "--open-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the source format's reader, e.g. -O split_fused=true (repeatable)")
    if rules:
        s.add_argument("--rules", default=None, metavar="FILE.json",
                       help="view the source through mapping rules (a JSON list, as `inspect --json` prints)")


def _launcher_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--one-process", action="store_true",
                   help="ignore RANK/WORLD_SIZE: write everything from this process alone")
    s.add_argument("--timeout", type=float, default=6 * 3600.0, metavar="SECONDS",
                   help="under a launcher (torchrun, srun): how long rank 0 waits for the others")


def _writer_epilog() -> str:
    try:
        lines = ["write options per format (-o key=value; --tp/--pp/... are shorthands):"]
        for f in writable_formats():
            opts = ", ".join(f"{n} ({t}, default {d})" for n, t, d, _ in describe_options(f.write_options))
            lines.append(f"  {f.name}: {opts}")
        return "\n".join(lines)
    except Exception:  # help text must never fail
        return ""


def _writable_names() -> list[str]:
    try:
        return [f.name for f in writable_formats()]
    except Exception:
        return []


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line too (exit 2), pointing at ``--help`` instead of printing the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ckptbridge", description="Portable distributed-training checkpoints: "
                                "read DeepSpeed, Megatron, DCP, Orbax, torch and safetensors checkpoints, "
                                "convert, reshard and compare them.")
    p.add_argument("--version", action="version", version=f"ckptbridge {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = sub.add_parser("inspect", help="list the tensors: names, shapes, dtypes, states, fragments",
                       description="List the logical tensors of a checkpoint of any format.")
    s.add_argument("path", help="checkpoint file or directory")
    s.add_argument("--json", action="store_true", help="one JSON object (format, step, tensors, rules)")
    s.add_argument("--fragments", action="store_true",
                   help="also list every fragment and where its bytes are (piped: that table alone)")
    _source_args(s)
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("convert", help="write a universal directory (streaming, checksummed)",
                       description="Write the universal layout from a checkpoint of any format.")
    s.add_argument("src", help="source checkpoint")
    s.add_argument("dst", help="new universal directory")
    s.add_argument("--states", default=None, metavar="S1,S2",
                   help="only these states (e.g. fp32,exp_avg,exp_avg_sq); default all")
    s.add_argument("--overwrite", action="store_true", help="replace DST once the new one is complete")
    _launcher_args(s)
    _source_args(s)
    s.set_defaults(fn=cmd_convert)

    s = sub.add_parser("export", help="one safetensors file of one state",
                       description="Write one state of every tensor into one safetensors file.")
    s.add_argument("src", help="source checkpoint")
    s.add_argument("out", help="the .safetensors file to write")
    s.add_argument("--state", default=None, help="state to export (default: the weights, fp32 else param)")
    s.add_argument("--dtype", default=None, help="cast to this dtype, e.g. bfloat16")
    s.add_argument("--overwrite", action="store_true", help="replace OUT once the new one is complete")
    _source_args(s)
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser("verify", help="check that every byte is there (and every checksum, when recorded)",
                       description="Read every fragment of a checkpoint of any format; universal checkpoints "
                                   "also have their commit marker and checksums checked. Exit 1 on problems.")
    s.add_argument("path", help="checkpoint file or directory")
    _source_args(s, rules=False)
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("diff", help="compare two checkpoints, any formats",
                       description="Compare two checkpoints tensor by tensor (streaming). Exit 1 if they differ.")
    s.add_argument("a", help="first checkpoint")
    s.add_argument("b", help="second checkpoint")
    s.add_argument("--json", action="store_true", help="one JSON list of rows")
    s.add_argument("--state", default=None, help="compare this state (default: each tensor's weights)")
    s.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bitwise)")
    s.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0)")
    s.add_argument("--format-b", default=None, metavar="NAME", help="format of B (--format is A's)")
    s.add_argument("--rules-b", default=None, metavar="FILE.json", help="mapping rules for B (--rules is A's)")
    _source_args(s)
    s.set_defaults(fn=cmd_diff)

    s = sub.add_parser("reshard", help="write a checkpoint in another format and layout",
                       description="Write SRC as format --to at DST, for a new layout.",
                       epilog=_writer_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("src", help="source checkpoint")
    s.add_argument("dst", help="destination (a file extension is added for single-file formats)")
    s.add_argument("--to", required=True, metavar="FORMAT", choices=_writable_names() or None,
                   help="format to write: " + ", ".join(_writable_names()))
    s.add_argument("--tp", type=int, default=None, help="tensor-parallel size (megatron)")
    s.add_argument("--pp", type=int, default=None, help="pipeline-parallel size (megatron)")
    s.add_argument("--dp", type=int, default=None, help="data-parallel size (megatron)")
    s.add_argument("--world-size", type=int, default=None, help="number of ranks / files (dcp)")
    s.add_argument("--zero-stage", type=int, default=None, help="ZeRO stage (formats that have one)")
    s.add_argument("--state", default=None, help="which weight state to write (dcp, orbax, safetensors)")
    s.add_argument("--overwrite", action="store_true", help="replace DST once the new one is complete")
    s.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a write option of the target format (repeatable; see below)")
    _launcher_args(s)
    _source_args(s)
    s.set_defaults(fn=cmd_reshard)

    s = sub.add_parser("merge", help="merge LoRA adapters into a base and write the result",
                       description="Write BASE with the PEFT LoRA ADAPTERs merged (W + weight * scaling * B @ A, "
                                   "per slice in float32, rounded once to the base dtype) as format --to at OUT.",
                       epilog=_writer_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("src", metavar="BASE", help="base checkpoint (HF safetensors)")
    s.add_argument("adapter", nargs="+", metavar="ADAPTER", help="PEFT adapter folder (adapter_config.json + "
                   "adapter_model.safetensors)")
    s.add_argument("dst", metavar="OUT", help="destination (a file extension is added for single-file formats)")
    s.add_argument("--to", required=True, metavar="FORMAT", choices=_writable_names() or None,
                   help="format to write: " + ", ".join(_writable_names()))
    s.add_argument("--weight", type=float, action="append", default=[], metavar="W",
                   help="one weight per adapter, in order (default 1 each)")
    s.add_argument("--overwrite", action="store_true", help="replace OUT once the new one is complete")
    s.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a write option of the target format (repeatable; see below)")
    _source_args(s, rules=False)
    s.set_defaults(fn=cmd_merge)

    s = sub.add_parser("recipe", help="list the model-family recipes, or print one as a rules file",
                       description="Print the rules that map a model family between naming schemes (hf, megatron, "
                                   "maxtext) as JSON, for --rules: `ckptbridge recipe llama hf maxtext --hf-config "
                                   "hf/config.json -c scan=true --out r.json`, then `ckptbridge reshard hf/ out "
                                   "--to safetensors --rules r.json`. Without arguments: the recipes there are.")
    s.add_argument("family", nargs="?", help="llama, qwen2, mixtral")
    s.add_argument("src", nargs="?", help="source scheme: hf, megatron, maxtext")
    s.add_argument("dst", nargs="?", help="destination scheme")
    s.add_argument("--hf-config", default=None, metavar="config.json",
                   help="read n_heads, n_kv_heads, head_dim, tie_embeddings, qkv_bias, rope from an HF config")
    s.add_argument("-c", "--config", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe config key (n_heads, n_kv_heads, head_dim, scan, rope, ...; repeatable)")
    s.add_argument("--out", default=None, metavar="R.json", help="write the rules here instead of stdout")
    s.set_defaults(fn=cmd_recipe)

    s = sub.add_parser("formats", help="list the formats, what they read and write, and their options",
                       description="List every registered format (plug-ins included) and its options.")
    s.add_argument("--json", action="store_true", help="one JSON list of formats with their options")
    s.set_defaults(fn=cmd_formats)
    return p
