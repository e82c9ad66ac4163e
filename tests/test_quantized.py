"""Quantized HF checkpoints open dequantized, lazily (issue 28, item 1 and the quantized part of 3).

Checkpoints are made here in each release's layout: a DeepSeek-V3-style block-fp8 one from
transformers' own ``DeepseekV3ForCausalLM`` (``save_pretrained``'s per-expert names, weights and
their ``weight_scale_inv`` in different shards, ragged edge blocks of a 16 x 24 block) and a
gpt-oss-style MXFP4 one (``*_blocks`` / ``*_scales`` in different shards). The references are
independent of ckptbridge: DeepSeek's ``weight_dequant`` written out below (one float32 product
per element, rounded once, block by block as its Triton kernel's grid goes) and transformers' own
``convert_moe_packed_tensors``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

import ckptbridge
from ckptbridge.plugin import Box, CheckpointIndex, FormatError, LogicalTensor, derived_state
from ckptbridge.rules import Interleave, Reshape, Stack, Transpose

BLOCK = (16, 24)
TINY_V3 = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
               n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
               q_lora_rank=32, kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
               max_position_embeddings=64)
QUANTIZED = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ------------------------------------------------------------------ independent references


def weight_dequant(x: torch.Tensor, s: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """DeepSeek-V3's ``weight_dequant`` (inference/kernel.py), written out: each program of its
    grid ``(cdiv(M, b0), cdiv(N, b1))`` loads a block (masked at the ragged edges) as float32,
    multiplies by the block's scale and stores it in the output dtype."""
    m, n = x.shape
    y = torch.empty(m, n, dtype=dtype)
    for i in range(math.ceil(m / block[0])):
        for j in range(math.ceil(n / block[1])):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            y[rows, cols] = (x[rows, cols].to(torch.float32) * s[i, j]).to(dtype)
    return y


def block_quant(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 weights and float32 ``scale_inv`` per block (amax / 448), ragged edges included."""
    m, n = w.shape
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(m / block[0]), math.ceil(n / block[1]), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
            s[i, j] = part.abs().max().clamp(min=1e-12) / 448.0
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (part / s[i, j]).to(q.dtype)
    return q, s


def bits(a: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.contiguous().view({2: torch.int16, 4: torch.int32}[a.element_size()]).numpy()
    return np.asarray(a).view({2: np.uint16, 4: np.uint32}[np.asarray(a).dtype.itemsize])


def save_shards(root: Path, shards: list[dict[str, torch.Tensor]], config: dict) -> None:
    """Safetensors shards ``model-0000k-of-0000n.safetensors`` + the HF index + config.json."""
    root.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for k, tensors in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(root / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(config))


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny DeepSeek-V3 in the release's fp8 layout; the fp8 weights and scales it holds."""
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("ds")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**TINY_V3)).to(torch.bfloat16)
    model.save_pretrained(root / "bf16")
    stored = load_file(str(root / "bf16" / "model.safetensors"))
    config = json.loads((root / "bf16" / "config.json").read_text())
    fp8: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    weights, scales = {}, {}
    for name, t in stored.items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
            fp8[name] = block_quant(t, BLOCK)
            weights[name], scales[name + "_scale_inv"] = fp8[name]
        else:
            weights[name] = t
    names = sorted(weights)
    half = len(names) // 2  # weights in two shards, every scale in a third
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(BLOCK)}
    save_shards(root / "fp8", [{n: weights[n] for n in names[:half]}, {n: weights[n] for n in names[half:]},
                               scales], config)
    return {"root": root, "path": root / "fp8", "fp8": fp8, "stored": stored, "config": config}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A gpt-oss-style MXFP4 checkpoint (2 layers, 4 experts, hidden 64, intermediate 96)."""
    root = tmp_path_factory.mktemp("oss")
    gen = torch.Generator().manual_seed(1)
    experts, hidden, inter = 4, 64, 96
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(2):
        pre = f"model.layers.{layer}.mlp.experts."
        for proj, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            tensors[pre + proj + "_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen,
                                                            dtype=torch.uint8)
            low, high = (110, 135) if layer == 0 else (0, 256)  # layer 1: every e8m0 byte, the extremes too
            tensors[pre + proj + "_scales"] = torch.randint(low, high, (experts, rows, cols // 32), generator=gen,
                                                            dtype=torch.uint8)
            tensors[pre + proj + "_bias"] = torch.randn(experts, rows, generator=gen).to(torch.bfloat16)
    shards = [{n: t for n, t in tensors.items() if not n.endswith("_scales")},
              {n: t for n, t in tensors.items() if n.endswith("_scales")}]
    config = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4",
                                                               "modules_to_not_convert": ["model.layers.*.self_attn"]}}
    save_shards(root, shards, config)
    return {"path": root, "tensors": tensors}


# ------------------------------------------------------------------ block fp8


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_every_tensor_equals_deepseeks_dequantizer(deepseek: dict, dtype: str) -> None:
    opts = {} if dtype == "bfloat16" else {"dequantize_dtype": dtype}
    ckpt = ckptbridge.open(deepseek["path"], **opts)
    assert sorted(ckpt) == sorted(deepseek["stored"])  # scales folded in, not listed
    assert not [n for n in ckpt if n.endswith("_scale_inv")]
    ragged = 0
    for name, (q, s) in deepseek["fp8"].items():
        view = ckpt[name]
        assert (view.dtype, view.shape) == (dtype, tuple(q.shape))
        ref = weight_dequant(q, s, BLOCK, getattr(torch, dtype))
        np.testing.assert_array_equal(bits(view.read()), bits(ref), err_msg=name)
        ragged += q.shape[0] % BLOCK[0] != 0 or q.shape[1] % BLOCK[1] != 0
    assert ragged >= 4  # kv_a_proj_with_mqa (28 rows), kv_b_proj (20 columns), every 64-wide input
    for name, t in deepseek["stored"].items():  # everything else as stored
        if name not in deepseek["fp8"]:
            np.testing.assert_array_equal(bits(ckpt[name].read()), bits(t), err_msg=name)


def test_fp8_slices_read_only_their_blocks(deepseek: dict) -> None:
    ckpt = ckptbridge.open(deepseek["path"])
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # 28 x 64: ragged in both dims
    q, s = deepseek["fp8"][name]
    full = weight_dequant(q, s, BLOCK, torch.bfloat16)
    index = json.loads((deepseek["path"] / "model.safetensors.index.json").read_text())["weight_map"]
    wfile, sfile = (str(deepseek["path"] / index[n]) for n in (name, name + "_scale_inv"))
    assert wfile != sfile
    for rows, cols in ((slice(16, 28), slice(24, 40)), (slice(3, 5), slice(50, 64)), (slice(0, 28), slice(0, 64))):
        ckpt.stats.reset()
        got = ckpt[name][rows, cols]
        np.testing.assert_array_equal(bits(got), bits(full[rows, cols]))
        nr, nc = rows.stop - rows.start, cols.stop - cols.start
        blocks = (math.ceil(rows.stop / BLOCK[0]) - rows.start // BLOCK[0]) * (
            math.ceil(cols.stop / BLOCK[1]) - cols.start // BLOCK[1])
        assert dict(ckpt.stats.per_file) == {wfile: nr * nc, sfile: 4 * blocks}


def test_fp8_deepseek_v3_expert_128_row_slice_reads_its_blocks_only(tmp_path: Path) -> None:
    """One DeepSeek-V3 expert at its real shape (``up_proj`` 2048 x 7168 fp8, 128 x 128 blocks; the
    weight and its ``weight_scale_inv`` in different shards): rows 128..255 read 128 x 7168 fp8 bytes
    and one row of 56 float32 scales, nothing else, and equal DeepSeek's ``weight_dequant`` of them."""
    rng = np.random.default_rng(1)
    codes = np.zeros((2048, 7168), dtype=np.uint8)  # random in the slice's block-row and its neighbours
    codes[:384] = rng.integers(0, 0x7E, size=(384, 7168), dtype=np.uint8) | (rng.integers(0, 2, (384, 7168), np.uint8) << 7)
    q = torch.from_numpy(codes).view(torch.float8_e4m3fn)
    s = torch.from_numpy(rng.uniform(1e-4, 1e-2, size=(16, 56))).float()
    name = "model.layers.10.mlp.experts.7.up_proj.weight"
    save_shards(tmp_path, [{name: q}, {name + "_scale_inv": s}], {"model_type": "deepseek_v3", "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}})
    ckpt = ckptbridge.open(tmp_path)
    ckpt.stats.reset()
    got = ckpt[name][128:256]
    np.testing.assert_array_equal(bits(got), bits(weight_dequant(q[128:256], s[1:2], (128, 128), torch.bfloat16)))
    assert dict(ckpt.stats.per_file) == {str(tmp_path / "model-00001-of-00002.safetensors"): 128 * 7168,
                                         str(tmp_path / "model-00002-of-00002.safetensors"): 56 * 4}


def test_fp8_through_rules_convert_and_diff(deepseek: dict, tmp_path: Path) -> None:
    """Rules see an ordinary tensor: a transpose and an expert stack are views of the dequantized
    values; convert writes them; diff against the reference finds nothing."""
    src = ckptbridge.open(deepseek["path"])
    pattern = r"^model\.layers\.1\.mlp\.experts\.(?P<e>\d+)\.up_proj\.weight$"
    seen = src.with_rules([Stack(pattern, to="up_stacked", index="e"), Transpose("^up_stacked$", perm=(0, 2, 1))])
    ref = np.stack([bits(weight_dequant(*deepseek["fp8"][f"model.layers.1.mlp.experts.{e}.up_proj.weight"],
                                        BLOCK, torch.bfloat16)) for e in range(4)]).transpose(0, 2, 1)
    np.testing.assert_array_equal(bits(seen["up_stacked"].read()), ref)
    np.testing.assert_array_equal(bits(seen["up_stacked"][2, 10:40, 5:21]), ref[2, 10:40, 5:21])
    ckptbridge.convert(src, tmp_path / "universal")
    reference = {n: weight_dequant(q, s, BLOCK, torch.bfloat16) for n, (q, s) in deepseek["fp8"].items()}
    save_file({**{n: t for n, t in deepseek["stored"].items() if n not in reference}, **reference},
              str(tmp_path / "ref.safetensors"))
    rows = ckptbridge.diff(tmp_path / "universal", tmp_path / "ref.safetensors")
    assert len(rows) == len(deepseek["stored"]) and all(r.equal for r in rows)
    bad = dict(reference)
    bad["model.layers.0.self_attn.o_proj.weight"] = reference["model.layers.0.self_attn.o_proj.weight"] * 1.01
    save_file({**{n: t for n, t in deepseek["stored"].items() if n not in bad}, **bad},
              str(tmp_path / "bad.safetensors"))
    unequal = [r.name for r in ckptbridge.diff(src, tmp_path / "bad.safetensors") if not r.equal]
    assert unequal == ["model.layers.0.self_attn.o_proj.weight"]  # the negative control is seen


def test_fp8_dequantize_false_shows_the_stored_tensors(deepseek: dict) -> None:
    ckpt = ckptbridge.open(deepseek["path"], dequantize=False)
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    q, s = deepseek["fp8"][name]
    assert ckpt[name].dtype == "float8_e4m3fn" and ckpt[name + "_scale_inv"].shape == tuple(s.shape)
    np.testing.assert_array_equal(ckpt[name].read().view(np.uint8), q.view(torch.uint8).numpy())
    np.testing.assert_array_equal(ckpt[name + "_scale_inv"].read(), s.numpy())
    assert len(ckpt) == len(deepseek["stored"]) + len(deepseek["fp8"])


def test_fp8_model_gives_the_dequantized_models_logits(deepseek: dict, tmp_path: Path) -> None:
    """ckptbridge's dequantized tensors, written by ``reshard --to safetensors``, load into
    transformers' ``DeepseekV3ForCausalLM`` with the logits of the model loaded from DeepSeek's own
    dequantization; a model with one block's scale changed gives other logits (negative control)."""
    config = {k: v for k, v in deepseek["config"].items() if k != "quantization_config"}
    reference = {n: weight_dequant(q, s, BLOCK, torch.bfloat16) for n, (q, s) in deepseek["fp8"].items()}

    def load(folder: Path, tensors: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
        if tensors is not None:
            save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        model = transformers.DeepseekV3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            return model(torch.arange(24).reshape(2, 12) % 128).logits

    ckptbridge.reshard(deepseek["path"], tmp_path / "cb" / "model.safetensors", to="safetensors")
    ours = load(tmp_path / "cb")
    theirs = load(tmp_path / "ref", {**{n: t for n, t in deepseek["stored"].items() if n not in reference},
                                     **reference})
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    q, s = deepseek["fp8"]["model.layers.1.mlp.shared_experts.down_proj.weight"]
    s = s.clone()
    s[0, 0] *= 4
    off = dict(reference, **{"model.layers.1.mlp.shared_experts.down_proj.weight": weight_dequant(
        q, s, BLOCK, torch.bfloat16)})
    other = load(tmp_path / "off", {**{n: t for n, t in deepseek["stored"].items() if n not in off}, **off})
    assert (other - theirs).abs().max() > 1e-3


def test_unsupported_method_fails_by_name_before_any_read(tmp_path: Path) -> None:
    """The config is judged before a shard is touched: the shard here is not even safetensors."""
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq", "bits": 4}}))
    with pytest.raises(FormatError, match=r"quant_method 'awq' is not supported.*config\.json|config\.json.*'awq'"):
        ckptbridge.open(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(FormatError, match="'fp8' with weight_block_size None is not supported"):
        ckptbridge.open(tmp_path)
    save_file({"w": torch.zeros(2, 3)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq", "bits": 4}}))
    assert list(ckptbridge.open(tmp_path, dequantize=False)) == ["w"]
    with pytest.raises(ckptbridge.OptionError, match="dequantize_dtype 'int8'"):
        ckptbridge.open(tmp_path, dequantize=False, dequantize_dtype="int8")


def test_mismatched_scale_shape_names_the_tensor(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(40, 30).to(torch.float8_e4m3fn), "w_scale_inv": torch.ones(2, 2)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8",
                                                                              "weight_block_size": [16, 16]}}))
    with pytest.raises(ckptbridge.ShapeMismatchError, match=r"'w_scale_inv': expected .*\(3, 2\), found .*\(2, 2\)"):
        ckptbridge.open(tmp_path)
    save_file({"v_scale_inv": torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(FormatError, match=r"model\.safetensors: 'v_scale_inv' has no partner tensor 'v'"):
        ckptbridge.open(tmp_path)


# ------------------------------------------------------------------ MXFP4


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mxfp4_every_tensor_equals_transformers_dequantization(gpt_oss: dict, dtype: str) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    opts = {} if dtype == "bfloat16" else {"dequantize_dtype": dtype}
    ckpt = ckptbridge.open(gpt_oss["path"], **opts)
    tensors = gpt_oss["tensors"]
    bases = sorted(n.removesuffix("_blocks") for n in tensors if n.endswith("_blocks"))
    assert sorted(ckpt) == sorted(bases + [n for n in tensors if n.endswith("_bias")])
    for name in bases:
        ref = convert_moe_packed_tensors(tensors[name + "_blocks"], tensors[name + "_scales"],
                                         dtype=getattr(torch, dtype))
        assert (ckpt[name].shape, ckpt[name].dtype) == (tuple(ref.shape), dtype)
        np.testing.assert_array_equal(bits(ckpt[name].read()), bits(ref), err_msg=name)
        np.testing.assert_array_equal(bits(ckpt[name][2, 40:75, 7:50]), bits(ref[2, 40:75, 7:50]), err_msg=name)


def test_mxfp4_slices_read_only_their_blocks(gpt_oss: dict) -> None:
    ckpt = ckptbridge.open(gpt_oss["path"])
    name = "model.layers.1.mlp.experts.gate_up_proj"  # [4, 64, 192] from blocks [4, 192, 2, 16]
    files = {str(gpt_oss["path"] / f"model-0000{k}-of-00002.safetensors") for k in (1, 2)}
    blocks_file, scales_file = sorted(files)
    for index, groups in (((1, slice(40, 50), slice(10, 30)), 1), ((slice(0, 2), slice(20, 40), slice(0, 5)), 2)):
        ckpt.stats.reset()
        got = ckpt[name][index]
        experts = 1 if isinstance(index[0], int) else index[0].stop - index[0].start
        rows = index[2].stop - index[2].start
        assert got.shape[-1] == rows
        assert dict(ckpt.stats.per_file) == {blocks_file: experts * rows * groups * 16,
                                             scales_file: experts * rows * groups}


def test_mxfp4_dequantize_false(gpt_oss: dict) -> None:
    ckpt = ckptbridge.open(gpt_oss["path"], dequantize=False)
    assert sorted(ckpt) == sorted(gpt_oss["tensors"])
    name = "model.layers.0.mlp.experts.down_proj_blocks"
    np.testing.assert_array_equal(ckpt[name].read(), gpt_oss["tensors"][name].numpy())


def test_bfloat16_read_as_float32_widens_the_rounded_values(deepseek: dict) -> None:
    """A dequantized bfloat16 tensor read as float32 is its bfloat16 values widened (one rounding)."""
    ckpt = ckptbridge.open(deepseek["path"])
    name = "model.layers.0.mlp.down_proj.weight"
    wide = ckpt[name].read(dtype="float32")
    np.testing.assert_array_equal(wide, ckpt[name].read().astype(np.float32))
    assert wide.dtype == np.float32


# ------------------------------------------------------------------ the core mechanism, format-agnostic


@dataclass(frozen=True)
class _Sum:
    """A toy derivation: ``a + 10 * b`` elementwise (the sources' boxes are the request's)."""

    def source_boxes(self, box: Box) -> tuple[Box, ...]:
        return box, box

    def compute(self, box: Box, sources: list[np.ndarray], out: np.ndarray) -> None:
        np.copyto(out, sources[0] + 10 * sources[1], casting="unsafe")

    def describe(self) -> str:
        return "a + 10 b"


def test_derived_tensor_through_views_reads_only_what_each_slice_needs(tmp_path: Path) -> None:
    a, b = np.arange(96, dtype=np.float32).reshape(8, 12), np.arange(96, 192, dtype=np.float32).reshape(8, 12)
    save_file({"a": torch.from_numpy(a), "b": torch.from_numpy(b)}, str(tmp_path / "x.safetensors"))
    stored = ckptbridge.open(tmp_path / "x.safetensors")
    state = derived_state(_Sum(), (stored.tensors["a"].state(), stored.tensors["b"].state()), (8, 12), "float32",
                          ("a", "b"))
    index = CheckpointIndex("toy", str(tmp_path), {"s": LogicalTensor("s", {"fp32": state})})
    ckpt = ckptbridge.Checkpoint(index, stored.files)
    want = a + 10 * b
    ckpt.stats.reset()
    np.testing.assert_array_equal(ckpt["s"][2:5, 3:7], want[2:5, 3:7])
    assert ckpt.stats.bytes_read == 2 * 3 * 4 * 4  # the box of each source, nothing more
    seen = ckpt.with_rules([Transpose("^s$", perm=(1, 0)), Interleave("^s$", dim=0, block=6),
                            Reshape("^s$", shape=(2, 6, 8))])
    np.testing.assert_array_equal(seen["s"].read(),
                                  want.T.reshape(2, 2, 3, 8).transpose(0, 2, 1, 3).reshape(2, 6, 8))
    np.testing.assert_array_equal(seen["s"][1, 2:4, 5:], seen["s"].read()[1, 2:4, 5:])


def test_mxfp4_onto_a_jax_mesh_reads_each_devices_blocks(gpt_oss: dict) -> None:
    """The device loader sees an ordinary tensor: each device of a 2 x 2 mesh gets its box of the
    dequantized experts (transformers' values), and the reads are the blocks of those boxes."""
    jax = pytest.importorskip("jax")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from ckptbridge.adapters.jax import load_arrays

    name = "model.layers.1.mlp.experts.down_proj"  # [4, 96, 64] from blocks [4, 64, 3, 16]
    ckpt = ckptbridge.open(gpt_oss["path"])
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    sharding = NamedSharding(mesh, PartitionSpec(None, "x", "y"))
    ckpt.stats.reset()
    (arr,) = load_arrays(ckpt, [(name, sharding, "bfloat16", (4, 96, 64))])
    ref = convert_moe_packed_tensors(gpt_oss["tensors"][name + "_blocks"], gpt_oss["tensors"][name + "_scales"])
    for shard in arr.addressable_shards:
        np.testing.assert_array_equal(bits(np.asarray(shard.data)), bits(ref[shard.index]))
    # rows 0..47 need groups 0..1, rows 48..95 groups 1..2: 2 groups x 64 rows x 4 experts per row half
    assert ckpt.stats.bytes_read == 2 * (4 * 64 * 2 * 16 + 4 * 64 * 2)
