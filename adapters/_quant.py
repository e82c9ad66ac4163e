"""Quantized Hugging Face checkpoints, opened dequantized (lazily, slice by slice).

A checkpoint whose ``config.json`` has a ``quantization_config`` shows each quantized weight as one
logical tensor of the output dtype (bfloat16 unless the open option asks for float32 or float16);
its scale tensors are folded in and not listed. Every tensor is a derived tensor
(``ckptbridge.plugin.derived_state``): reading a slice reads only the blocks it covers and their
scales, wherever the shard index put them. The formats:

* block fp8 (``quant_method: "fp8"``, ``weight_block_size: [b0, b1]``; DeepSeek-V3/R1, Qwen3-FP8):
  ``<name>`` (float8) with ``<name>_scale_inv`` (float32, ``ceil(rows/b0) x ceil(cols/b1)``, ragged
  edge blocks included); value = ``float32(weight) * scale`` rounded once to the output dtype, as
  DeepSeek's ``weight_dequant`` does;
* MXFP4 (``quant_method: "mxfp4"``; gpt-oss): ``<name>_blocks`` (uint8 ``[E, R, G, 16]``, two e2m1
  values per byte, low nibble first) with ``<name>_scales`` (uint8 e8m0 ``[E, R, G]``, bias 127),
  shown as ``<name>`` ``[E, G * 32, R]``, the shape and axis order transformers' own
  ``convert_moe_packed_tensors`` gives the dequantized parameter (each value is
  ``ldexp(e2m1, scale - 127)`` in float32, rounded once; every e8m0 byte 0..255 as transformers reads it).

Any other method fails when the checkpoint is opened, naming it, before any tensor is read::

    ckpt = ckptbridge.open("DeepSeek-V3/")                   # dequantized bfloat16
    ckpt["model.layers.3.mlp.experts.7.up_proj.weight"][:128]
    ckptbridge.open("DeepSeek-V3/", dequantize_dtype="float32")
    ckptbridge.open("DeepSeek-V3/", dequantize=False)         # the stored fp8 weights and scales
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptbridge.plugin import (
    Box,
    FormatError,
    LazyTensors,
    LogicalTensor,
    ShapeMismatchError,
    TensorSpec,
    derived_state,
    spec_of,
    tensor_specs,
)

from ._hf import hf_config

__all__ = ["OUTPUT_DTYPES", "BlockFp8", "Mxfp4", "dequantize", "derivation_of", "quantization_config"]

OUTPUT_DTYPES = ("bfloat16", "float16", "float32")
_SUPPORTED = "'fp8' (with weight_block_size) and 'mxfp4'"
_FP8 = ("float8_e4m3fn", "float8_e5m2")
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                 dtype=np.float32)
# Both e2m1 values of every byte (low nibble first), so one gather decodes a byte.
_E2M1_PAIRS = np.stack([_E2M1[np.arange(256) & 0xF], _E2M1[np.arange(256) >> 4]], axis=-1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_range(lo: int, n: int, block: int) -> tuple[int, int]:
    """The blocks of size ``block`` that elements ``[lo, lo + n)`` fall in: ``(first, count)``."""
    first = lo // block
    return first, _cdiv(lo + n, block) - first


@dataclass(frozen=True)
class BlockFp8:
    """Block fp8: ``value[i, j] = float32(weight[i, j]) * scale_inv[i // b0, j // b1]``, rounded once."""

    block: tuple[int, int]

    def describe(self) -> str:
        return f"fp8 block {self.block[0]}x{self.block[1]}"

    def source_boxes(self, box: Box) -> tuple[Box, ...]:
        (r0, c0), (nr, nc) = box.offset, box.shape
        (br, nbr), (bc, nbc) = _block_range(r0, nr, self.block[0]), _block_range(c0, nc, self.block[1])
        return box, Box((br, bc), (nbr, nbc))

    def compute(self, box: Box, sources: Sequence[np.ndarray], out: np.ndarray) -> None:
        weight, scale = sources
        lut = np.arange(256, dtype=np.uint8).view(weight.dtype).astype(np.float32)
        b0, b1 = self.block
        (r0, c0), (nr, nc) = box.offset, box.shape
        # the scale of each requested column, one row per block-row the request touches
        cols = np.repeat(scale, b1, axis=1)[:, c0 % b1 : c0 % b1 + nc]
        codes = weight.view(np.uint8)
        lo = 0
        for k in range(scale.shape[0]):  # one block-row at a time: the float32 temporary stays small
            hi = min(nr, (r0 // b0 + k + 1) * b0 - r0)
            vals = lut[codes[lo:hi]]
            np.multiply(vals, cols[k], out=vals)
            out[lo:hi] = vals
            lo = hi


@dataclass(frozen=True)
class Mxfp4:
    """MXFP4 blocks ``[E, R, G, 16]`` and scales ``[E, R, G]`` as transformers' dequantized ``[E, G*32, R]``."""

    def describe(self) -> str:
        return "mxfp4"

    def source_boxes(self, box: Box) -> tuple[Box, ...]:
        (e0, k0, r0), (ne, nk, nr) = box.offset, box.shape
        g0, ng = _block_range(k0, nk, 32)
        return Box((e0, r0, g0, 0), (ne, nr, ng, 16)), Box((e0, r0, g0), (ne, nr, ng))

    def compute(self, box: Box, sources: Sequence[np.ndarray], out: np.ndarray) -> None:
        blocks, scales = sources
        ne, nr, ng, _ = blocks.shape
        k0 = box.offset[1] % 32
        nk = box.shape[1]
        vals = _E2M1_PAIRS[blocks].reshape(ne, nr, ng, 32)
        # exact scaling by 2 ** (scale - 127), as torch.ldexp: 0 stays 0 and 0.5 * 2 ** 128 is finite
        with np.errstate(over="ignore"):  # 6 * 2 ** 128 is inf there too
            np.ldexp(vals, (scales.astype(np.int32) - 127)[..., None], out=vals)
        vals = vals.reshape(ne, nr, ng * 32)[:, :, k0 : k0 + nk]
        np.copyto(out, vals.transpose(0, 2, 1), casting="unsafe")


def quantization_config(path: str) -> tuple[str, Mapping[str, Any]] | None:
    """``(config.json path, its quantization_config)`` of the HF checkpoint at ``path`` (a folder, or a
    file in one), or None when it has none."""
    found = hf_config(path)
    if found is None:
        return None
    cfg, config = found
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise FormatError(f"{cfg}: quantization_config is not an object: {qc!r}")
    return cfg, qc


def derivation_of(cfg: str, qc: Mapping[str, Any]) -> BlockFp8 | Mxfp4:
    """The derivation a ``quantization_config`` names; :class:`FormatError` naming an unsupported one."""
    method = qc.get("quant_method")
    if method == "mxfp4":
        return Mxfp4()
    if method == "fp8":
        block = qc.get("weight_block_size")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise FormatError(f"{cfg}: quantization_config quant_method 'fp8' with weight_block_size {block!r} "
                              "is not supported (only block fp8, two positive block sizes); "
                              "open with dequantize=False to see the stored tensors")
        return BlockFp8((int(block[0]), int(block[1])))
    raise FormatError(f"{cfg}: quantization_config quant_method {method!r} is not supported (ckptbridge "
                      f"dequantizes {_SUPPORTED}); open with dequantize=False to see the stored tensors")


def dequantize(tensors: Mapping[str, LogicalTensor], derivation: BlockFp8 | Mxfp4, dtype: str,
               files: Mapping[str, str]) -> LazyTensors[TensorSpec]:
    """``tensors`` (as stored; ``files`` names each one's shard) with every quantized weight and its
    scales replaced by one dequantized tensor of ``dtype`` (in the weight's place). Every pair is
    checked here (partners present, dtypes, shapes: in bulk, then pair by pair to name a bad one);
    the tensors are built when used. The passes over the names are C loops (``map``, ``compress``, dict
    operations): DeepSeek-V3 has 92k stored tensors."""
    names = list(tensors)
    if isinstance(derivation, BlockFp8):
        scales = list(itertools.compress(names, map(str.endswith, names, itertools.repeat("_scale_inv"))))
        stored = list(map(str.__getitem__, scales, itertools.repeat(slice(None, -len("_scale_inv")))))
        logical = stored
    else:
        stored = list(itertools.compress(names, map(str.endswith, names, itertools.repeat("_blocks"))))
        logical = list(map(str.__getitem__, stored, itertools.repeat(slice(None, -len("_blocks")))))
        scales = list(map(str.__add__, logical, itertools.repeat("_scales")))
    specs_in = (tensors.specs if isinstance(tensors, LazyTensors)
                else types.MappingProxyType({n: spec_of(tensors, n) for n in names}))
    if not all(map(specs_in.__contains__, stored if logical is stored else scales)):  # the others are listed
        for name, scale in zip(stored, scales):
            for one, partner in ((name, scale), (scale, name)):
                if one not in tensors:
                    raise FormatError(f"{files.get(partner, '?')}: {partner!r} has no partner tensor {one!r} in any shard")
    weights, grids = list(map(specs_in.__getitem__, stored)), list(map(specs_in.__getitem__, scales))
    check: Callable[..., tuple[int, ...]] = _fp8_shape if isinstance(derivation, BlockFp8) else _mxfp4_shape
    shapes = (_fp8_shapes(weights, grids, derivation.block) if isinstance(derivation, BlockFp8)
              else _mxfp4_shapes(weights, grids))
    if shapes is None:  # not plainly right: check pair by pair, naming the first bad one
        shapes = [check(n, w, s, g, derivation, files) for n, w, s, g in zip(logical, weights, scales, grids)]
    quantized = tensor_specs(logical, itertools.repeat(dtype), shapes, zip(stored, scales))
    if logical is stored:  # each weight keeps its name and place: drop the scales, replace the weights
        specs = specs_in.copy()
        collections.deque(map(specs.__delitem__, scales), 0)
        specs.update(quantized)
    else:
        to_logical = dict(zip(stored, logical))
        folded = set(scales)
        specs = {to_logical.get(n, n): quantized[to_logical[n]] if n in to_logical else specs_in[n]
                 for n in names if n not in folded}

    def build(name: str, spec: TensorSpec) -> LogicalTensor:
        if name not in quantized:
            return tensors[name]
        weight, scale = spec.source
        state = derived_state(derivation, (tensors[weight].state(), tensors[scale].state()), spec.shape, dtype,
                              (f"{files[weight]}: {weight}", f"{files[scale]}: {scale}"))
        return LogicalTensor(name, {"param": state})

    return LazyTensors(specs, build)


def _check(name: str, file: str, state: TensorSpec, dtypes: Sequence[str], shape: Sequence[int] | None,
           ndim: int) -> None:
    if state.dtype not in dtypes or len(state.shape) != ndim or (shape is not None and state.shape != tuple(shape)):
        want = f"{'/'.join(dtypes)} of shape {tuple(shape) if shape is not None else f'{ndim} dims'}"
        raise ShapeMismatchError(f"{file}: quantized tensor {name!r}: expected {want}, "
                                 f"found {state.dtype} of shape {state.shape}")


def _fp8_shape(name: str, weight: TensorSpec, scale_name: str, scale: TensorSpec, derivation: Any,
               files: Mapping[str, str]) -> tuple[int, ...]:
    """The dequantized shape of a block-fp8 weight (its own), its scales' grid checked."""
    _check(name, files[name], weight, _FP8, None, 2)
    rows, cols = weight.shape
    grid = (_cdiv(rows, derivation.block[0]), _cdiv(cols, derivation.block[1]))
    _check(scale_name, files[scale_name], scale, ("float32", "bfloat16"), grid, 2)
    return weight.shape


def _mxfp4_shape(name: str, blocks: TensorSpec, scale_name: str, scales: TensorSpec, derivation: Any,
                 files: Mapping[str, str]) -> tuple[int, ...]:
    """The dequantized shape ``[E, G * 32, R]`` of MXFP4 ``[E, R, G, 16]`` blocks, their scales checked."""
    blocks_name = name + "_blocks"
    _check(blocks_name, files[blocks_name], blocks, ("uint8",), None, 4)
    if blocks.shape[3] != 16:
        raise ShapeMismatchError(f"{files[blocks_name]}: quantized tensor {blocks_name!r}: expected 16 bytes "
                                 f"(32 values) per group in its last dim, found shape {blocks.shape}")
    _check(scale_name, files[scale_name], scales, ("uint8",), blocks.shape[:3], 3)
    experts, rows, groups, _ = blocks.shape
    return experts, groups * 32, rows


def _fp8_shapes(weights: Sequence[TensorSpec], grids: Sequence[TensorSpec], block: tuple[int, int]
                ) -> list[tuple[int, ...]] | None:
    """The dequantized shapes of block-fp8 weights whose dtypes and scale grids are all right (one numpy
    comparison), else None."""
    dtype, shape = operator.itemgetter(0), operator.itemgetter(1)
    ws, gs = list(map(shape, weights)), list(map(shape, grids))
    if (set(map(dtype, weights)) - set(_FP8) or set(map(dtype, grids)) - {"float32", "bfloat16"}
            or set(map(len, ws)) - {2} or set(map(len, gs)) - {2}):
        return None
    flat = functools.partial(np.fromiter, dtype=np.int64, count=2 * len(ws))
    if ws and not np.array_equal(-(-flat(itertools.chain.from_iterable(ws)).reshape(-1, 2) // np.array(block)),
                                 flat(itertools.chain.from_iterable(gs)).reshape(-1, 2)):
        return None
    return ws


def _mxfp4_shapes(weights: Sequence[TensorSpec], grids: Sequence[TensorSpec]) -> list[tuple[int, ...]] | None:
    """The dequantized shapes ``[E, G * 32, R]`` of MXFP4 blocks whose dtypes and scales are all right, else None."""
    ws, gs = [w.shape for w in weights], [g.shape for g in grids]
    if ({w.dtype for w in weights} | {g.dtype for g in grids}) - {"uint8"} or set(map(len, ws)) - {4} \
            or any(w[3] != 16 or w[:3] != g for w, g in zip(ws, gs)):
        return None
    return [(e, g * 32, r) for e, r, g, _ in ws]
