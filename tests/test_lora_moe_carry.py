"""PEFT's LoRA on Qwen3-MoE's 3-D experts carried, Adam moments included, to Megatron-Bridge's
per-expert names through the ``qwen3_moe`` recipe, and back.

The adapter is PEFT 0.21's own (``get_peft_model`` on a transformers tiny ``Qwen3MoeForCausalLM``,
one torch Adam step of its training): LoRA on attention (``target_modules``) and, through
``target_parameters`` (``lora.ParamWrapper``), on both expert parameters (``mlp.experts.gate_up_proj
[E, 2F, H]``, ``down_proj [E, H, F]``: expert ``e`` adapted by ``B[:, e::E] @ A[e*r:(e+1)*r]``) and
the router (``mlp.gate.weight``), a rank pattern on layer 1's ``gate_up_proj``. Through the recipe's
hf -> megatron rules for transformers' fused experts (``hf_experts="fused"``), each expert's pair
becomes Megatron-Bridge's ``LoRALinear`` adapter on megatron-core's ``SequentialMLP`` expert
(``local_experts.N.linear_fc1.adapter.linear_in.weight [r, H]``, ``linear_out.weight [2F, r]``,
``[gate; up]`` rows as ``linear_fc1``'s), the router's its ``LoRATopKRouter`` adapter
(``mlp.router.adapter.linear_in/linear_out``). The references are outside ckptbridge: Megatron-Bridge's
merge formula (``W + alpha / dim * linear_out @ linear_in``) into the Megatron weights, megatron-core's
own ``GPTModel`` on them (``tools/megatron/core_module.py``) against PEFT's adapter-on logits, and
PEFT's ``merge_and_unload`` of the adapter carried back.

Megatron-Bridge's grouped expert LoRA wraps TransformerEngine's ``TEGroupedMLP`` (``linear_fc1.weightN``),
not the recipe's grouped form (the legacy ``GroupedMLP``'s ``weight1`` / ``weight2`` buffers), and
MaxText 0.2.5 has no LoRA form for its MoE kernels: both are refused by name.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import ckptbridge
from ckptbridge import recipes
from ckptbridge.adapters import lora
from ckptbridge.plugin import FormatError

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
import hf_models as hf  # noqa: E402
from lora_refs import MOMENTS, adam_step, bridge_merge, core_module, peft_merged, with_moments  # noqa: E402
from safetensors.numpy import save_file as save_numpy  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match")
SPEC = hf.HFSpec("qwen3_moe", mlp=24)  # 2 layers, 4 experts of width 24 (top 2), hidden 64
E, R, ALPHA = 4, 4, 8.0
EXPERTS = "base_model.model.model.layers.{}.mlp.experts."
LOCAL = "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc{}.adapter.linear_{}.weight"


def _model(base: Path):
    return __import__("transformers").Qwen3MoeForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


def _rules(cfg: dict, src: str, dst: str, **extra) -> tuple:
    return recipes.rules("qwen3_moe", src=src, dst=dst, **cfg, **extra)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora_moe_carry")
    base = hf.save(hf.build(SPEC), root / "base")
    config = peft.LoraConfig(r=R, lora_alpha=ALPHA, init_lora_weights=False,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"],
                             rank_pattern={"layers.1.mlp.experts.gate_up_proj": 2})
    torch.manual_seed(3)
    model = peft.get_peft_model(hf.build(SPEC), config)
    adam_step(model, hf.tokens(2, 13, 256, seed=4), root)
    model.save_pretrained(root / "adapter")
    cfg = recipes.config_from_hf(base / "config.json")
    carried = lora.carry(with_moments(root / "adapter", root), _rules(cfg, "hf", "megatron", hf_experts="fused"))
    return {"root": root, "base": base, "cfg": cfg, "carried": carried,
            "peft": load_file(str(root / "adapter" / "adapter_model.safetensors")),
            "moments": {k: load_file(str(root / f"{k}.safetensors")) for k in MOMENTS}}


def test_expert_adapters_carry_to_megatron_per_expert_and_back(made: dict, tmp_path: Path) -> None:
    """Per expert, exactly: Megatron-Bridge's merge of the carried pairs into the Megatron weights,
    loaded by megatron-core's GPTModel, gives PEFT's adapter-on logits (negative control: each
    expert's ``B`` columns read as a block ``B[:, e*r:(e+1)*r]`` moves them far); its Adam moments are
    PEFT's, sliced as the pairs are (the rank-pattern pair's ``B`` over its fold of 2, its moments over
    2 and 4); back to PEFT (nested wrappers, ``target_parameters``) PEFT's ``merge_and_unload`` is the
    original's, bitwise, and the moments come back."""
    cfg, carried, stored = made["cfg"], made["carried"], made["peft"]
    dim, alpha = carried.extra["lora"]["r"], carried.extra["lora"]["lora_alpha"]
    assert dim == 3 * R and alpha == ALPHA / R * dim  # the fused QKV's summed rank; PEFT's scaling alpha / r
    fc1_in = carried[LOCAL.format(1, 2, 1, "in")]
    assert fc1_in.shape == (dim, 64) and carried[LOCAL.format(1, 2, 1, "out")].shape == (48, dim)
    assert carried[LOCAL.format(0, 3, 2, "in")].shape == (dim, 24) and carried[LOCAL.format(0, 3, 2, "out")].shape == (64, dim)
    assert carried["decoder.layers.0.mlp.router.adapter.linear_out.weight"].shape == (E, dim)
    assert len(carried) == 2 * 2 * (3 + 2 * E)  # 2 layers of pairs: qkv, proj, router, fc1 and fc2 of 4 experts

    # moments: expert e's pair is A[e*r:(e+1)*r] and B[:, e::E] (zero-padded to the carried rank) in every state
    for layer, rank, fold in ((0, R, 1.0), (1, 2, 2.0)):
        a, b = f"{EXPERTS.format(layer)}base_layer.lora_A.weight", f"{EXPERTS.format(layer)}base_layer.lora_B.weight"
        for e in range(E):
            got_a, got_b = carried[LOCAL.format(layer, e, 1, "in")], carried[LOCAL.format(layer, e, 1, "out")]
            for state, power in (("param", 0), ("exp_avg", 1), ("exp_avg_sq", 2)):
                src = made["moments"][state] if state != "param" else stored
                want_a, want_b = src[a][e * rank:(e + 1) * rank].numpy(), src[b][:, e::E].numpy()
                scale = fold if state == "param" else fold ** -power
                np.testing.assert_array_equal(got_a.state(state).read()[:rank], want_a)
                np.testing.assert_array_equal(got_b.state(state).read()[:, :rank], want_b * np.float32(scale))
                assert not got_a.state(state).read()[rank:].any() and not got_b.state(state).read()[:, rank:].any()

    # the negative control: the adapter's expert B stored so that the strided reading takes contiguous blocks
    bad = tmp_path / "blocks"
    shutil.copytree(made["root"] / "adapter", bad)
    blocks = {n: t.reshape(t.shape[0], E, -1).transpose(1, 2).reshape(t.shape).contiguous()
              if ".mlp.experts." in n and n.endswith("lora_B.weight") else t for n, t in stored.items()}
    save_file(blocks, str(bad / "adapter_model.safetensors"))
    to_meg = _rules(cfg, "hf", "megatron", hf_experts="fused")
    weights = ckptbridge.open(made["base"], rules=_rules(cfg, "hf", "megatron")).state_dict()  # save_pretrained's
    source = {f"{label}.{n}": v for label, f in (("good", carried.state_dict()),
                                                 ("bad", lora.carry(ckptbridge.open(bad), to_meg).state_dict()))
              for n, v in bridge_merge(weights, f, alpha, dim).items()}
    save_numpy(source, str(tmp_path / "merged.safetensors"))
    tokens = hf.tokens(2, 12, 256, seed=6)
    got = core_module(tmp_path, made["base"] / "config.json", tmp_path / "merged.safetensors", ["good", "bad"], tokens)
    want = hf.logits(peft.PeftModel.from_pretrained(_model(made["base"]), made["root"] / "adapter").eval(), tokens)
    assert "error" not in got["good"] and sorted(got["good"]["unplaced"]) == sorted(n for n in source if n[:4] == "bad.")
    np.testing.assert_allclose(got["good"]["logits"][..., :256], want, atol=1e-4, rtol=0)
    assert np.abs(got["bad"]["logits"][..., :256] - want).max() > 0.1  # measured 0.48 (good: 2e-6)
    assert got["good"]["experts"] == "SequentialMLP"
    assert np.abs(want - hf.logits(_model(made["base"]), tokens)).max() > 1e-2  # the adapter moves the logits

    # back to PEFT: the experts stacked again into PEFT's layout and nesting, the router a target parameter
    back = lora.carry(carried, _rules(cfg, "megatron", "hf", hf_experts="fused"))
    assert back.extra["lora"]["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    assert sorted(back) == sorted(stored)
    lora.save_peft(back, tmp_path / "back", target_parameters=["mlp.gate.weight"])
    merged = {k: peft_merged(lambda: _model(made["base"]), p) for k, p in (("peft", made["root"] / "adapter"),
                                                                           ("back", tmp_path / "back"))}
    assert merged["back"].keys() == merged["peft"].keys()
    for name, w in merged["peft"].items():
        np.testing.assert_array_equal(merged["back"][name], w, err_msg=name)
    a = f"{EXPERTS.format(0)}lora_A.weight"  # down_proj's (the outer wrapper), padded from rank 4 to 12 per expert
    for k in MOMENTS:
        np.testing.assert_array_equal(back[a].state(k).read().reshape(E, dim, -1)[:, :R],
                                      made["moments"][k][a].numpy().reshape(E, R, -1))


def test_grouped_megatron_experts_and_maxtext_expert_kernels_are_refused_by_name(made: dict) -> None:
    adapter = ckptbridge.open(made["root"] / "adapter")
    with pytest.raises(FormatError, match=r"expert parameter 'model\.layers\.0\.mlp\.experts\.down_proj'.*"
                                          r"hf_experts='fused'"):  # the recipe for save_pretrained's per-expert names
        lora.carry(adapter, _rules(made["cfg"], "hf", "megatron"))
    grouped = _rules(made["cfg"], "hf", "megatron", hf_experts="fused", megatron_experts="grouped")
    with pytest.raises(FormatError, match=r"experts\\\\.weight[12].*legacy GroupedMLP.*megatron_experts='sequential'"):
        lora.carry(adapter, grouped)
    to_maxtext = _rules(made["cfg"], "hf", "maxtext", hf_experts="fused", scan=False)
    with pytest.raises(FormatError, match=r"moe_block/wi_0'.*MaxText 0\.2\.5 has no LoRA form for its MoE expert kernels"):
        lora.carry(adapter, to_maxtext)
