"""HF PEFT LoRA adapters: read with their base weights named, merged lazily (``adapters=[...]``).

The oracle is PEFT itself (``peft`` 0.21): ``get_peft_model`` on a transformers tiny Llama (LoRA on
attention and MLP, rsLoRA, a ``rank_pattern`` and an ``alpha_pattern``, ``lm_head`` in
``modules_to_save``), its ``save_pretrained`` adapter, its layers' ``scaling``, its adapter-on
logits and its ``merge_and_unload()`` weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ckptbridge
from ckptbridge.plugin import FormatError, OptionError, ShapeMismatchError

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
from hf_models import HFSpec, build, logits, save, tokens  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = tokens(2, 12, 256)


def _lora(seed: int, **kw):
    """PEFT's config: rsLoRA, a rank and an alpha pattern (random A and B, seeded)."""
    cfg = peft.LoraConfig(r=8, lora_alpha=16, use_rslora=True, target_modules=TARGETS, init_lora_weights=False,
                          rank_pattern={"layers.1.self_attn.q_proj": 4}, alpha_pattern={"down_proj": 7}, **kw)
    torch.manual_seed(seed)
    return cfg


def _bits(a) -> np.ndarray:
    a = a.detach().contiguous() if hasattr(a, "detach") else np.ascontiguousarray(a)
    if hasattr(a, "view") and hasattr(a, "numpy"):
        return a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32).numpy()
    return a.view(np.int16 if a.dtype.itemsize == 2 else np.int32)


def _peft_model(base: Path, adapters: list[Path], dtype, weights: list[float] | None = None):
    model = __import__("transformers").LlamaForCausalLM.from_pretrained(base, dtype=dtype).eval()
    pm = peft.PeftModel.from_pretrained(model, adapters[0], adapter_name="a0")
    for i, a in enumerate(adapters[1:], 1):
        pm.load_adapter(a, adapter_name=f"a{i}")
    for i, w in enumerate(weights or []):
        for module in pm.modules():
            if isinstance(module, peft.tuners.lora.LoraLayer) and f"a{i}" in module.scaling:
                module.scaling[f"a{i}"] *= w
    return pm


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora")
    model = build(HFSpec("llama"))
    save(model, root / "base")
    model.to(torch.bfloat16).save_pretrained(root / "base_bf16")
    for i in range(2):
        pm = peft.get_peft_model(build(HFSpec("llama")), _lora(10 + i, modules_to_save=["lm_head"] if i == 0 else None))
        pm.save_pretrained(root / f"adapter{i}")
    return {"root": root, "base": root / "base", "bf16": root / "base_bf16",
            "adapters": [root / "adapter0", root / "adapter1"]}


def test_adapter_opens_with_each_tensors_base_weight_and_peft_scaling(made: dict) -> None:
    ckpt = ckptbridge.open(made["adapters"][0])
    pm = _peft_model(made["base"], made["adapters"][:1], torch.float32)
    lora = ckpt.extra["lora"]
    assert set(lora) == set(ckpt)
    seen = 0
    for name, module in pm.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            base = name.removeprefix("base_model.model.") + ".weight"
            a = f"{name}.lora_A.weight"
            assert lora[a] == {"base": base, "part": "A", "rank": module.r["a0"], "scaling": module.scaling["a0"]}
            assert lora[a.replace("lora_A", "lora_B")]["base"] == base
            seen += 1
    assert seen == 2 * len(TARGETS)
    assert lora["base_model.model.lm_head.weight"] == {"base": "lm_head.weight", "part": "modules_to_save"}
    assert ckpt["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].shape == (4, 64)  # rank_pattern


def _assert_matches_peft(ckpt, base: Path, adapters: list[Path], weights: list[float], dtype: str) -> None:
    """Every tensor of ``ckpt`` against PEFT's ``merge_and_unload`` of ``adapters`` on the HF model at
    ``base``: adapted weights within float32 BLAS order (1e-6 of the largest) or one bfloat16 ulp,
    most of them bitwise; the rest bitwise."""
    pm = _peft_model(base, adapters, getattr(torch, dtype), weights=weights)
    ref = pm.merge_and_unload(adapter_names=[f"a{i}" for i in range(len(adapters))]).state_dict()
    plain = ckptbridge.open(base)
    assert sorted(ckpt) == sorted(ref)
    equal = total = 0
    for name, t in ref.items():
        got = ckpt[name].read()
        assert str(got.dtype) == dtype, name
        if "merged" not in ckpt.extra["lora"].get(name, {}):
            np.testing.assert_array_equal(_bits(got), _bits(t), err_msg=name)
            continue
        theirs = t.float().numpy()
        if dtype == "float32":
            np.testing.assert_allclose(got, theirs, rtol=0, atol=1e-6 * np.abs(theirs).max(), err_msg=name)
        else:
            assert np.abs(_bits(got).astype(np.int32) - _bits(t)).max() <= 1, name
        equal += int((_bits(got) == _bits(t)).sum())
        total += got.size
        # negative control: the merge moved the weight far more than the tolerance
        assert np.abs(plain[name].read().astype(np.float32) - theirs).max() > 1e3 * 1e-6 * np.abs(theirs).max()
    assert total and equal > 0.75 * total


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merged_weights_equal_peft_merge_and_unload(made: dict, dtype: str) -> None:
    """Against PEFT's ``merge_and_unload`` of the same: float32, two adapters, the second weighted
    0.5; bfloat16, one adapter weighted 0.5 (PEFT rounds the weight after each adapter, ckptbridge
    once after all: with two adapters they differ by more than an ulp where values cancel).

    PEFT adds the float32 delta ``(B @ A) * scaling`` of float32 adapters to the weight and rounds
    once, as ckptbridge does; but numpy's BLAS sums the rank-r products of ``B @ A`` in another
    order than torch's matmul, so float32 weights agree within 1e-6 of the largest weight (most
    bitwise), bfloat16 weights within one bfloat16 ulp (most bitwise)."""
    base, adapters, weights = ((made["base"], made["adapters"], [1.0, 0.5]) if dtype == "float32"
                               else (made["bf16"], made["adapters"][1:], [0.5]))
    ckpt = ckptbridge.open(base, adapters=adapters, adapter_weights=weights)
    _assert_matches_peft(ckpt, base, adapters, weights, dtype)
    merged = ckpt.extra["lora"]["model.layers.0.mlp.down_proj.weight"]["merged"]
    assert [m["weight"] for m in merged] == weights
    if dtype == "float32":
        assert ckpt.extra["lora"]["lm_head.weight"]["replaced_by"].endswith("base_model.model.lm_head.weight")


def test_the_comparison_catches_a_wrong_scaling(made: dict, tmp_path: Path) -> None:
    """Negative control: the same adapter read without rsLoRA (scaling alpha/r) fails the PEFT check."""
    src, ad = made["adapters"][1], tmp_path / "plain_lora"
    ad.mkdir()
    (ad / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    config = json.loads((src / "adapter_config.json").read_text())
    (ad / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": False}))
    ckpt = ckptbridge.open(made["base"], adapters=[ad])
    with pytest.raises(AssertionError):
        _assert_matches_peft(ckpt, made["base"], [src], [1.0], "float32")
    _assert_matches_peft(ckptbridge.open(made["base"], adapters=[src]), made["base"], [src], [1.0], "float32")


def test_merge_onto_a_block_fp8_base_dequantizes_first(made: dict, tmp_path: Path) -> None:
    """The bfloat16 Llama block-fp8-quantized (config ``quantization_config``): the merge onto it equals
    PEFT's merge onto DeepSeek's ``weight_dequant`` of it; a row slice reads its fp8 rows and scales."""
    from safetensors.torch import load_file
    from test_quantized import BLOCK, block_quant, save_shards, weight_dequant

    stored = {}
    for f in sorted(made["bf16"].glob("*.safetensors")):
        stored.update(load_file(str(f)))
    config = json.loads((made["bf16"] / "config.json").read_text())
    fp8, dequantized, scales = dict(stored), dict(stored), {}
    for name, t in stored.items():
        if name.split(".")[-2] in TARGETS:
            fp8[name], scales[name + "_scale_inv"] = block_quant(t, BLOCK)
            dequantized[name] = weight_dequant(fp8[name], scales[name + "_scale_inv"], BLOCK, torch.bfloat16)
    save_shards(tmp_path / "ref", [dequantized], config)
    save_shards(tmp_path / "fp8", [fp8, scales], {**config, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}})
    ckpt = ckptbridge.open(tmp_path / "fp8", adapters=made["adapters"][1:], adapter_weights=[0.5])
    _assert_matches_peft(ckpt, tmp_path / "ref", made["adapters"][1:], [0.5], "bfloat16")
    ckpt.stats.reset()
    ckpt["model.layers.1.mlp.down_proj.weight"][16:32]  # 64 x 128, blocks 16 x 24
    shards = {str(tmp_path / "fp8" / f"model-0000{k}-of-00002.safetensors") for k in (1, 2)}
    adapter = str(made["adapters"][1] / "adapter_model.safetensors")
    assert dict(ckpt.stats.per_file) == {**dict(zip(sorted(shards), (16 * 128, 4 * 6))),
                                         adapter: 16 * 8 * 4 + 8 * 128 * 4}


def test_merged_model_gives_the_adapter_on_logits(made: dict, tmp_path: Path) -> None:
    """The merged weights written by ``ckptbridge merge`` load into transformers with the logits of
    PEFT's adapter-on model (unmerged: the adapter's own forward); the base alone does not."""
    out = tmp_path / "merged"
    out.mkdir()
    (out / "config.json").write_text((made["base"] / "config.json").read_text())
    cmd = [sys.executable, "-m", "ckptbridge", "merge", str(made["base"]), str(made["adapters"][0]),
           str(out / "model.safetensors"), "--to", "safetensors"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    transformers = __import__("transformers")
    merged = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    on = _peft_model(made["base"], made["adapters"][:1], torch.float32)
    with torch.no_grad():
        want = on(input_ids=torch.as_tensor(TOKENS, dtype=torch.int64)).logits.numpy()
    got = logits(merged, TOKENS)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    plain = logits(transformers.LlamaForCausalLM.from_pretrained(made["base"], dtype=torch.float32).eval(), TOKENS)
    assert np.abs(plain - want).max() > 1e-2  # the adapter matters at this tolerance


def test_row_slice_of_a_4096_square_merge_reads_only_its_rows_of_b(tmp_path: Path) -> None:
    rank, n = 16, 4096
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, n, generator=gen).to(torch.bfloat16)
    a, b = torch.randn(rank, n, generator=gen) * 0.01, torch.randn(n, rank, generator=gen) * 0.01
    save_file({"model.layers.0.self_attn.q_proj.weight": w}, str(tmp_path / "model.safetensors"))
    ad = tmp_path / "adapter"
    ad.mkdir()
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": a, f"{prefix}.lora_B.weight": b}, str(ad / "adapter_model.safetensors"))
    (ad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 32,
                                                        "target_modules": ["q_proj"]}))
    ckpt = ckptbridge.open(tmp_path / "model.safetensors", adapters=[ad])
    ckpt.stats.reset()
    got = ckpt["model.layers.0.self_attn.q_proj.weight"][1000:1008]
    want = (w[1000:1008].float() + (b[1000:1008] @ a) * 2.0).to(torch.bfloat16)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    assert dict(ckpt.stats.per_file) == {str(tmp_path / "model.safetensors"): 8 * n * 2,
                                         str(ad / "adapter_model.safetensors"): 8 * rank * 4 + rank * n * 4}


def test_mismatches_fail_naming_the_file_and_tensor(made: dict, tmp_path: Path) -> None:
    ad = tmp_path / "ad"
    ad.mkdir()
    src = made["adapters"][1]
    (ad / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    config = json.loads((src / "adapter_config.json").read_text())
    (ad / "adapter_config.json").write_text(json.dumps({**config, "rank_pattern": {}}))
    with pytest.raises(ShapeMismatchError, match=r"adapter_model\.safetensors.*layers\.1\.self_attn\.q_proj\.lora_A"):
        ckptbridge.open(ad)
    (ad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(FormatError, match=r"adapter_config\.json: DoRA"):
        ckptbridge.open(made["base"], adapters=[ad])
    with pytest.raises(OptionError, match="2 adapter_weights for 1 adapters"):
        ckptbridge.open(made["base"], adapters=[src], adapter_weights=[1, 2])
    small = build(HFSpec("llama", layers=1))
    save(small, tmp_path / "small")
    with pytest.raises(FormatError, match=r"adapter_model\.safetensors.*layers\.1\..*lora_A.*does not have"):
        ckptbridge.open(tmp_path / "small", adapters=[src])
    wide = build(HFSpec("llama", emb=32, head_dim=8))
    save(wide, tmp_path / "wide")
    with pytest.raises(ShapeMismatchError, match=r"adapter_model\.safetensors.*lora_B"):
        ckptbridge.open(tmp_path / "wide", adapters=[src])


def test_cli_merge_with_weights_writes_what_the_api_reads(made: dict, tmp_path: Path) -> None:
    from ckptbridge._cli import main

    out = tmp_path / "cli.safetensors"
    args = ["merge", str(made["base"]), *map(str, made["adapters"]), str(out), "--to", "safetensors",
            "--weight", "1", "--weight", "0.5"]
    assert main(args) == 0
    api = ckptbridge.open(made["base"], adapters=made["adapters"], adapter_weights=[1.0, 0.5])
    assert all(r.equal for r in ckptbridge.diff(api, out))
    other = ckptbridge.open(made["base"], adapters=made["adapters"])  # weights 1, 1: not the same file
    assert [r.name for r in ckptbridge.diff(other, out) if not r.equal]
    assert main(["merge", str(made["base"]), str(made["adapters"][0]), str(tmp_path / "x"), "--to", "safetensors",
                 "--weight", "1", "--weight", "2"]) == 2


def test_inspect_shows_the_adapted_base_weights(made: dict) -> None:
    run = [sys.executable, "-m", "ckptbridge", "inspect", "--json"]
    info = json.loads(subprocess.run([*run, str(made["adapters"][0])], check=True, capture_output=True,
                                     text=True).stdout)
    rows = {t["name"]: t for t in info["tensors"]}
    assert rows["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"]["lora"]["base"] == \
        "model.layers.0.mlp.up_proj.weight"
    table = subprocess.run([sys.executable, "-m", "ckptbridge", "inspect", str(made["base"]), "-O",
                            f"adapters={made['adapters'][0]}"], check=True, capture_output=True, text=True).stdout
    line = next(ln for ln in table.splitlines() if ln.startswith("model.layers.0.mlp.up_proj.weight"))
    assert "lora" in line and "adapter0" in line
