"""LoRA on a MoE model's 3-D expert parameters (PEFT's ``target_parameters``), merged lazily.

The oracle is PEFT itself (``peft`` 0.21) on a transformers tiny ``Qwen3MoeForCausalLM``, whose
experts are one ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and one ``down_proj`` ``[E, H, I]``
(``save_pretrained`` writes them per expert: ``mlp.experts.<e>.gate_proj/up_proj/down_proj``):
``get_peft_model`` with LoRA on attention (``target_modules``) and on both expert parameters and
the router's ``mlp.gate.weight`` (``target_parameters``: ``lora.ParamWrapper``, nested on the
experts), rsLoRA, a rank pattern keyed on a 3-D parameter and an alpha pattern; its wrappers'
``r`` / ``scaling``, its ``merge_and_unload()`` + ``save_pretrained`` and its adapter-on logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import ckptbridge
from ckptbridge.plugin import FormatError

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
from hf_models import HFSpec, build, logits, save, tokens  # noqa: E402
from lora_refs import bits as _bits  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

# PEFT 0.21 checks rank_pattern / alpha_pattern keys against the targeted modules only and warns that
# these "did not match", though its ParamWrappers use them (their r and scaling are asserted below)
pytestmark = pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match")
SPEC = HFSpec("qwen3_moe", mlp=24)  # 2 layers, 4 experts of width 24, hidden 64
EXPERTS = "model.layers.{}.mlp.experts"
TOKENS = tokens(2, 12, 256)


def _model(base: Path):
    return __import__("transformers").Qwen3MoeForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora_moe")
    save(build(SPEC), root / "base")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, init_lora_weights=False,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                          target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"],
                          rank_pattern={"layers.1.mlp.experts.gate_up_proj": 2}, alpha_pattern={"down_proj": 5})
    torch.manual_seed(3)
    peft.get_peft_model(build(SPEC), cfg).save_pretrained(root / "adapter")
    on = peft.PeftModel.from_pretrained(_model(root / "base"), root / "adapter").eval()
    with torch.no_grad():
        want = on(input_ids=torch.as_tensor(TOKENS, dtype=torch.int64)).logits.numpy()
    wrappers = {name: (m.parameter_name, m.r["default"], m.scaling["default"], m.num_experts)
                for name, m in on.named_modules() if isinstance(m, peft.tuners.lora.ParamWrapper)}
    fused = {k: v.clone() for k, v in _model(root / "base").state_dict().items()}  # experts as 3-D tensors
    unloaded = on.merge_and_unload()
    merged_3d = {k: v.clone() for k, v in unloaded.state_dict().items()}
    unloaded.save_pretrained(root / "peft_merged")
    merged = {}
    for f in sorted((root / "peft_merged").glob("*.safetensors")):
        merged.update(load_file(str(f)))
    return {"root": root, "base": root / "base", "adapter": root / "adapter", "logits": want,
            "wrappers": wrappers, "merged": merged, "fused": fused, "merged_3d": merged_3d}


def _assert_equals_peft(ckpt, made: dict) -> None:
    """Every tensor of ``ckpt`` bitwise equal to PEFT's ``merge_and_unload()`` as transformers saves it
    (per expert), and each adapted one moved by the merge."""
    ref, plain = made["merged"], ckptbridge.open(made["base"])
    assert sorted(ckpt) == sorted(ref)
    adapted = 0
    for name, t in ref.items():
        np.testing.assert_array_equal(_bits(ckpt[name].read()), _bits(t), err_msg=name)
        if "merged" in ckpt.extra["lora"].get(name, {}):
            adapted += 1
            assert np.abs(plain[name].read() - t.numpy()).max() > 1e-3, name
    assert adapted == 2 * (4 + 1 + 3 * 4)  # per layer: q/k/v/o, the router, gate/up/down of 4 experts


def test_expert_lora_merges_as_peft_merge_and_unload(made: dict, tmp_path: Path) -> None:
    """PEFT's wrappers name the weight, rank and scaling of each stored pair (the down_proj wrapper
    outermost, gate_up_proj under ``base_layer``); the merge equals PEFT's bitwise (float32: PEFT
    computes ``einsum("o r e, e r i -> e o i", B, A) * scaling`` in float32 and adds it once, as
    ckptbridge does per expert); the merged checkpoint gives PEFT's adapter-on logits; an expert's
    row slice reads only its rows, its ``A`` rows and its ``B`` columns."""
    adapter = ckptbridge.open(made["adapter"])
    notes = adapter.extra["lora"]
    for module, (param, rank, scaling, experts) in made["wrappers"].items():
        base = f"{module.removeprefix('base_model.model.').replace('.base_layer', '')}.{param}"
        assert notes[f"{module}.lora_A.weight"] == {"base": base, "part": "A", "rank": rank, "scaling": scaling,
                                                    **({"experts": experts} if experts > 1 else {})}
        assert notes[f"{module}.lora_B.weight"]["base"] == base
    assert len(made["wrappers"]) == 2 * 3
    assert notes[f"base_model.model.{EXPERTS.format(1)}.base_layer.lora_A.weight"]["rank"] == 2  # rank_pattern
    assert notes[f"base_model.model.{EXPERTS.format(0)}.lora_A.weight"]["scaling"] == 5 / 2  # alpha_pattern, rsLoRA

    merged = ckptbridge.open(made["base"], adapters=[made["adapter"]])
    _assert_equals_peft(merged, made)
    assert merged.extra["lora"][f"{EXPERTS.format(1)}.2.up_proj.weight"]["of"] == \
        f"{EXPERTS.format(1)}.gate_up_proj[2, 24:48]"

    out = tmp_path / "merged"
    out.mkdir()
    shutil.copy(made["base"] / "config.json", out / "config.json")
    ckptbridge.reshard(merged, str(out / "model.safetensors"), to="safetensors")
    np.testing.assert_allclose(logits(_model(out), TOKENS), made["logits"], rtol=0, atol=1e-5)
    assert np.abs(logits(_model(made["base"]), TOKENS) - made["logits"]).max() > 1e-2  # the adapter matters

    # expert 2's up_proj rows 3..4 of layer 1 (rank 2): its W rows, B[24+3:24+5, 2::4], A[2*2:3*2]
    merged.stats.reset()
    name = f"{EXPERTS.format(1)}.2.up_proj.weight"
    np.testing.assert_array_equal(merged[name][3:5], made["merged"][name][3:5].numpy())
    shard = json.loads((made["base"] / "model.safetensors.index.json").read_text())["weight_map"][name]
    assert dict(merged.stats.per_file) == {str(made["base"] / shard): 2 * 64 * 4,
                                           str(made["adapter"] / "adapter_model.safetensors"): 2 * 2 * 4 + 2 * 64 * 4}


def test_inspect_shows_the_adapter_beside_its_3d_weight(made: dict, capsys) -> None:
    from ckptbridge._cli import main

    assert main(["inspect", "--json", str(made["adapter"])]) == 0
    rows = {t["name"]: t for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert rows[f"base_model.model.{EXPERTS.format(0)}.base_layer.lora_B.weight"]["lora"] == {
        "base": f"{EXPERTS.format(0)}.gate_up_proj", "part": "B", "rank": 4, "scaling": 4.0, "experts": 4}
    assert main(["inspect", str(made["base"]), "-O", f"adapters={made['adapter']}"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(f"{EXPERTS.format(0)}.3.down_proj"))
    assert "merged" in line and "adapter_model.safetensors (r=4" in line


def test_the_comparison_catches_experts_read_the_other_way(made: dict, tmp_path: Path) -> None:
    """Negative control: each expert's ``B`` columns taken as a block ``B[:, e*r:(e+1)*r]`` (instead of
    PEFT's ``B[:, e::E]``; the adapter's ``B`` stored permuted so that ckptbridge reads it so) fails
    the PEFT check by far."""
    ad = tmp_path / "blocks"
    shutil.copytree(made["adapter"], ad)
    stored = load_file(str(ad / "adapter_model.safetensors"))
    for name, t in stored.items():
        if ".mlp.experts." in name and name.endswith("lora_B.weight"):  # [out, E*r] by blocks -> [out, r*E]
            stored[name] = t.reshape(t.shape[0], 4, -1).transpose(1, 2).reshape(t.shape).contiguous()
    save_file(stored, str(ad / "adapter_model.safetensors"))
    with pytest.raises(AssertionError) as err:
        _assert_equals_peft(ckptbridge.open(made["base"], adapters=[ad]), made)
    assert "experts" in str(err.value)
    wrong = ckptbridge.open(made["base"], adapters=[ad])[f"{EXPERTS.format(0)}.1.down_proj.weight"].read()
    assert np.abs(wrong - made["merged"][f"{EXPERTS.format(0)}.1.down_proj.weight"].numpy()).max() > 1e-3


def test_nesting_that_target_parameters_do_not_explain_fails(made: dict, tmp_path: Path) -> None:
    ad = tmp_path / "ad"
    shutil.copytree(made["adapter"], ad)
    config = json.loads((ad / "adapter_config.json").read_text())
    (ad / "adapter_config.json").write_text(json.dumps({**config, "target_parameters": ["mlp.experts.down_proj"]}))
    with pytest.raises(FormatError, match=r"adapter_model\.safetensors.*experts\.base_layer\.lora_A.*nested 1 deep"):
        ckptbridge.open(ad)


def test_a_base_storing_3d_experts_merges_in_either_orientation(made: dict, tmp_path: Path) -> None:
    """A base that stores the experts as transformers holds them (``gate_up_proj [E, 2I, H]``) merges
    to PEFT's ``merge_and_unload().state_dict()`` bitwise; stored ``[E, in, out]`` (the layout of
    transformers' ``is_transposed`` experts), the merge is the same, transposed."""
    for flip in (False, True):
        base = tmp_path / f"fused{int(flip)}"
        base.mkdir()
        shutil.copy(made["base"] / "config.json", base / "config.json")
        stored = {k: v.transpose(1, 2).contiguous() if flip and v.ndim == 3 else v for k, v in made["fused"].items()}
        save_file(stored, str(base / "model.safetensors"))
        merged = ckptbridge.open(base, adapters=[made["adapter"]])
        assert sorted(merged) == sorted(made["merged_3d"])
        for name, t in made["merged_3d"].items():
            want = t.transpose(1, 2) if flip and t.ndim == 3 else t
            np.testing.assert_array_equal(_bits(merged[name].read()), _bits(want), err_msg=name)
        name = f"{EXPERTS.format(1)}.gate_up_proj"
        assert merged.extra["lora"][name]["merged"][0]["experts"] == 4
        merged.stats.reset()  # expert 2, outputs 3..4 (rank 2): B[3:5, 2::4] and A[4:6]
        ref = made["merged_3d"][name].transpose(1, 2) if flip else made["merged_3d"][name]
        index = (slice(2, 3), slice(None), slice(3, 5)) if flip else (slice(2, 3), slice(3, 5))
        np.testing.assert_array_equal(_bits(merged[name][index]), _bits(ref[index]))
        assert merged.stats.per_file[str(made["adapter"] / "adapter_model.safetensors")] == 2 * 2 * 4 + 2 * 64 * 4


def test_bfloat16_merge_is_within_one_ulp_of_peft(made: dict, tmp_path: Path) -> None:
    """bfloat16 base, float32 adapter: attention (PEFT's ``lora.Linear``, which adds the float32 delta
    and rounds once, as ckptbridge does) bitwise; the parameters PEFT merges through
    ``lora.ParamWrapper`` (experts, router) within one bfloat16 ulp of the larger of the weight and
    the delta: ``ParamWrapper.get_delta_weight`` rounds the delta to bfloat16 before adding it to the
    bfloat16 weight (two roundings), ckptbridge adds in float32 and rounds once."""
    model = _model(made["base"]).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    pm = peft.PeftModel.from_pretrained(model, made["adapter"])
    pm.merge_and_unload().save_pretrained(tmp_path / "ref")
    ref = {}
    for f in sorted((tmp_path / "ref").glob("*.safetensors")):
        ref.update(load_file(str(f)))
    merged, plain = ckptbridge.open(tmp_path / "bf16", adapters=[made["adapter"]]), ckptbridge.open(tmp_path / "bf16")
    rounded_twice = 0
    for name, t in ref.items():
        got = merged[name].read()
        assert str(got.dtype) == "bfloat16", name
        if ".experts." not in name and ".mlp.gate." not in name:
            np.testing.assert_array_equal(_bits(got), _bits(t), err_msg=name)
            continue
        want, w = t.float().numpy(), plain[name].read().astype(np.float32)
        bound = 2.0 ** -7 * np.maximum(np.abs(want - w), np.abs(want))  # one bfloat16 ulp of the larger
        assert (np.abs(got.astype(np.float32) - want) <= bound).all(), name
        rounded_twice += int((_bits(got) != _bits(t)).sum())
    assert rounded_twice > 0  # the two roundings do show


def test_square_experts_follow_the_base_model_type(tmp_path) -> None:
    """gpt-oss stores its experts ``[E, in, out]`` (transformers' ``is_transposed``), and its real
    ``down_proj`` is square (hidden = intermediate = 2880), so the shape cannot tell: the merge follows
    the base's ``model_type``, bitwise PEFT's ``merge_and_unload()``; without a config.json it refuses."""
    import transformers
    from hf_models import gpt_oss

    save(gpt_oss(mlp=64, layers=2), tmp_path / "base")  # down_proj [4, 64, 64]

    def model():
        return transformers.GptOssForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()

    cfg = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_parameters=["mlp.experts.down_proj"])
    torch.manual_seed(5)
    peft.get_peft_model(model(), cfg).save_pretrained(tmp_path / "adapter")
    want = peft.PeftModel.from_pretrained(model(), tmp_path / "adapter").merge_and_unload().state_dict()
    got = ckptbridge.open(tmp_path / "base", adapters=[tmp_path / "adapter"])
    base = ckptbridge.open(tmp_path / "base")
    for layer in range(2):
        name = f"{EXPERTS.format(layer)}.down_proj"
        assert got[name].shape == (4, 64, 64)
        assert (_bits(got[name].read()) == _bits(want[name])).all(), name
        assert not np.array_equal(base[name].read(), want[name].numpy())  # the adapter moved it
    (tmp_path / "base" / "config.json").unlink()
    with pytest.raises(FormatError, match=r"down_proj: square experts \(4, 64, 64\)"):
        ckptbridge.open(tmp_path / "base", adapters=[tmp_path / "adapter"])
