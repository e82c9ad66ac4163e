"""The MaxText harness's families (``tools/maxtext/registry.py``): every ``tools/maxtext/<module>.py``
registers its families one way (a ``FAMILIES`` tuple of ``MaxTextFamily``), each once, and the harness
asks the registry for a spec family's MaxText keys and converter. No MaxText needed: the family modules
import nothing but the registry."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "maxtext")


@pytest.fixture(scope="module")
def registry():
    sys.path.insert(0, TOOLS)  # the family modules import ``registry`` as the harness script does
    try:
        import registry as reg

        yield reg
    finally:
        sys.path.remove(TOOLS)


def test_every_family_once_each_with_its_keys_and_converter(registry):
    fams = registry.families()
    assert sorted(fams) == ["deepseek_v3", "gemma3", "gpt_oss", "llama", "mistral", "mixtral", "qwen2", "qwen3",
                            "qwen3_moe"]
    assert sorted(n for n, f in fams.items() if f.moe) == ["deepseek_v3", "gpt_oss", "mixtral", "qwen3_moe"]
    spec = SimpleNamespace(family="qwen3_moe", rope_type="default", norm_topk_prob=True, extra={})
    assert fams["qwen3_moe"].overrides(spec) == {"decoder_block": "qwen3_moe", "use_qk_norm": True,
                                                 "attention_bias": False, "norm_topk_prob": True}
    assert fams["llama"].converter_key(spec) == ("llama3.1-8b", True)  # rotate-half: no adjust_rope
    assert fams["llama"].converter_key(SimpleNamespace(rope_type="llama3.1")) == ("llama3.1-8b", False)
    assert fams["qwen3"].converter_key(spec) == ("qwen3-0.6b", False)
    with pytest.raises(SystemExit, match="mixtral: MaxText's converter has no rotary permutation"):
        fams["mixtral"].converter_key(SimpleNamespace(rope_type="llama3.1"))
    gemma = fams["gemma3"]
    assert gemma.hf_name("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert gemma.converter_config({"a": 1})["text_config"] == {"a": 1} and fams["qwen2"].converter_config({"a": 1}) == {"a": 1}
    with pytest.raises(SystemExit, match=r"family 'nope' is not one of \['deepseek_v3', "):
        registry.family("nope")
