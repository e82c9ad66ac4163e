"""The ``safetensors`` format: single files, folders of shards and HF ``*.safetensors.index.json``.

Opened in place (each tensor is one fragment pointing into its file; a quantized HF checkpoint,
one whose ``config.json`` has a ``quantization_config``, opens dequantized: see
``ckptbridge.adapters._quant``; a PEFT LoRA adapter folder names the base weight of each tensor, and
``adapters=[...]`` merges adapters lazily onto a base: see ``ckptbridge.adapters.lora._read``); written
as one consolidated file of one state (``reshard --to safetensors`` is
``ckptbridge.export``)::

    ckpt = ckptbridge.open("model.safetensors")
    ckpt = ckptbridge.open("hf_model/")                      # model.safetensors.index.json + shards
    ckptbridge.reshard("run/ckpt", "out/weights.safetensors", to="safetensors", state="fp32")
    ckpt = ckptbridge.open("hf_model/", adapters=["lora_a/", "lora_b/"], adapter_weights=[1.0, 0.5])
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ckptbridge
from ckptbridge.plugin import (
    CheckpointIndex,
    Entries,
    Format,
    FormatError,
    LazyTensors,
    LogicalTensor,
    MissingShardError,
    OpenOptions,
    OptionError,
    TensorSpec,
    TensorState,
    WriteOptions,
    contiguous_fragment,
    read_entries,
    read_header,
    storage,
    tensor_specs,
)

from ._hf import check_weight_map, index_json_of, is_peft_adapter, peft_weights_file, read_index
from ._quant import OUTPUT_DTYPES, dequantize, derivation_of, quantization_config

__all__ = ["FORMAT", "SafetensorsOpenOptions", "SafetensorsWriteOptions", "detect", "index", "write"]


def _specs(files: Sequence[str], entries: Sequence[Entries]) -> tuple[dict[str, TensorSpec], dict[str, str]]:
    """Every tensor of the shards ``files`` (their validated ``entries``), source ``(file, byte offset)``,
    and the file of each; a tensor in two shards is an error naming it."""
    def column(c: str) -> Iterator[Any]:
        return itertools.chain.from_iterable(map(operator.attrgetter(c), entries))

    names = list(column("names"))
    where = list(itertools.chain.from_iterable(map(itertools.repeat, files, (len(e.names) for e in entries))))
    specs = tensor_specs(names, column("dtypes"), column("shapes"), zip(where, column("offsets")))
    if len(specs) != len(names):
        seen: set[str] = set()
        for f, e in zip(files, entries):
            twice = next((n for n in e.names if n in seen), None)
            if twice is not None:
                raise FormatError(f"{f}: tensor {twice!r} appears in two shards")
            seen.update(e.names)
    return specs, dict(zip(names, where))


def _stored(name: str, spec: TensorSpec) -> LogicalTensor:
    frag = contiguous_fragment(spec.shape, spec.source[0], spec.source[1], spec.dtype)
    return LogicalTensor(name, {"param": TensorState(spec.dtype, spec.shape, (frag,))})


def _single_file_tensors(path: str) -> dict[str, LogicalTensor]:
    return {name: _stored(name, spec) for name, spec in _specs([path], [read_entries(path)])[0].items()}


def _index_files(path: str) -> tuple[list[str], dict[str, Any] | None]:
    """The shard files of ``path`` and, for an HF index, its ``weight_map``."""
    if storage.isdir(path):
        names = sorted(storage.listdir(path))
        idx = [f for f in names if f.endswith(".safetensors.index.json")]
        if idx:
            return read_index(storage.join(path, idx[0]))
        return [storage.join(path, f) for f in names if f.endswith(".safetensors")], None
    return read_index(path) if path.endswith(".index.json") else ([path], None)


def detect(path: str) -> bool:
    if storage.isfile(path):
        return path.endswith((".safetensors", ".safetensors.index.json"))
    if storage.isdir(path):
        return any(f.endswith((".safetensors", ".safetensors.index.json")) for f in storage.listdir(path))
    return False


@dataclass(frozen=True)
class SafetensorsOpenOptions(OpenOptions):
    """Opening safetensors files (options for quantized HF checkpoints).

    ``dequantize``: show quantized weights dequantized, their scales folded in (False: as stored).
    ``dequantize_dtype``: the dtype of dequantized weights: bfloat16, float16 or float32.
    ``adapters``: PEFT LoRA adapter folders to merge (lazily, per slice) into the weights they adapt.
    ``adapter_weights``: one weight per adapter (default 1 each): W + sum(weight * scaling * B @ A).
    """

    dequantize: bool = True
    dequantize_dtype: str = "bfloat16"
    adapters: tuple[str, ...] = ()
    adapter_weights: tuple[float, ...] = ()

    def validate(self) -> None:
        if self.dequantize_dtype not in OUTPUT_DTYPES:
            raise OptionError(f"dequantize_dtype {self.dequantize_dtype!r} is not one of {', '.join(OUTPUT_DTYPES)}")
        if self.adapter_weights and len(self.adapter_weights) != len(self.adapters):
            raise OptionError(f"{len(self.adapter_weights)} adapter_weights for {len(self.adapters)} adapters")


def index(path: str, options: OpenOptions | None = None) -> CheckpointIndex:
    """Open a safetensors file, an HF ``*.safetensors.index.json`` or a folder of shards."""
    opts = options if isinstance(options, SafetensorsOpenOptions) else SafetensorsOpenOptions()
    quant = quantization_config(path) if opts.dequantize else None
    derivation = derivation_of(*quant) if quant else None  # an unsupported method fails before any read
    files, weight_map = _index_files(path)
    for f in files:
        if not storage.exists(f):
            raise MissingShardError(f"{f}: shard listed by {path} is missing")
    specs, found = _specs(files, [read_entries(f) for f in files])
    check_weight_map(index_json_of(path, ".safetensors.index.json"), found, weight_map)
    tensors: Mapping[str, LogicalTensor] = LazyTensors(specs, _stored)  # built when used: see LazyTensors
    if derivation is not None:
        tensors = dequantize(tensors, derivation, opts.dequantize_dtype, found)
    extra: dict[str, object] = {}
    if len(files) == 1:
        meta = read_header(files[0])[0].get("__metadata__") or {}
        extra = {"metadata": meta} if meta else {}
    peft = is_peft_adapter(path)
    if opts.adapters or peft:
        tensors = _lora_tensors(path, peft, tensors, opts, extra)
    return CheckpointIndex("safetensors", path, tensors, extra=extra)


def _lora_tensors(path: str, peft: bool, tensors: Mapping[str, LogicalTensor], opts: SafetensorsOpenOptions,
                  extra: dict[str, object]) -> Mapping[str, LogicalTensor]:
    """A PEFT adapter folder's notes (``peft``: ``path`` is one; which base weight each tensor adapts)
    and ``adapters=`` merged in, into ``extra["lora"]`` (imported here: the other opens need neither it
    nor the rule language)."""
    from .lora import _read as _lora

    if peft:
        extra["lora"] = _lora.adapter_notes(_lora.read(path, tensors))
    if opts.adapters:
        adapters = [_lora.read(a, _single_file_tensors(peft_weights_file(a))) for a in opts.adapters]
        tensors, extra["lora"] = _lora.merge(tensors, adapters, opts.adapter_weights or (1.0,) * len(adapters), path)
    return tensors


@dataclass(frozen=True)
class SafetensorsWriteOptions(WriteOptions):
    """Writing one safetensors file.

    ``state``: which state to write (default: each tensor's weights, ``fp32`` else ``param``).
    ``dtype``: cast every tensor to this dtype (e.g. ``bfloat16``).
    """

    state: str | None = None
    dtype: str | None = None


def write(ckpt: ckptbridge.Checkpoint, dst: str, options: SafetensorsWriteOptions) -> str:
    return ckptbridge.export(ckpt, dst, state=options.state, dtype=options.dtype, overwrite=options.overwrite)


FORMAT = Format("safetensors", detect=detect, index=index, write=write,
                open_options=SafetensorsOpenOptions, write_options=SafetensorsWriteOptions, priority=80, suffix=".safetensors",
                description="safetensors files and HF shard indexes (one state per file)")
