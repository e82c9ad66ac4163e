"""Tiny Hugging Face causal LMs (random init, seeded, no hub access) saved by transformers itself.

::

    from hf_models import HFSpec, build, save, logits
    spec = HFSpec("llama", rope="llama3")
    model = build(spec)                       # LlamaForCausalLM, fp32, seeded
    save(model, tmp_path / "hf")              # save_pretrained: sharded safetensors + index
    out = logits(model, tokens)               # fp32 numpy [batch, seq, vocab]

Families: ``llama`` (GQA; ``rope`` ``default`` or ``llama3`` scaling with the constants
MaxText's ``LLaMARotaryEmbedding`` hard-codes), ``mistral``, ``qwen2`` (QKV biases),
``mixtral`` (MoE; ``save_pretrained`` writes ``block_sparse_moe.experts.N.w1/w2/w3``), ``qwen3``
(q/k norms), ``qwen3_moe`` (``mlp`` is each expert's width; ``save_pretrained`` writes
``mlp.experts.N.gate_proj/up_proj/down_proj``, the module holds them fused as
``mlp.experts.gate_up_proj`` / ``down_proj``).
``tied=True`` shares the embedding with the output layer.
DeepSeek-V3 has its own spec: ``build_deepseek(DeepseekSpec())`` (MLA, dense then MoE layers,
shared experts, router bias).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# MaxText's LLaMARotaryEmbedding._apply_scaling_factor hard-codes these (maxtext 0.2.5)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class HFSpec:
    """A tiny model: the same numbers go to MaxText (``maxtext_client.spec_from_hf``)."""

    family: str
    rope: str = "default"  # "default" | "llama3"
    tied: bool = False
    emb: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    mlp: int = 128
    vocab: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    experts: int = 4
    experts_per_tok: int = 2
    seed: int = 0
    norm_topk_prob: bool = True  # qwen3_moe


def config(spec: HFSpec) -> Any:
    """The transformers config object for ``spec``."""
    import transformers

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope == "llama3":
        if spec.family != "llama":
            raise ValueError(f"{spec.family}: llama3 rope scaling is a llama option")
        rope = {**LLAMA3_ROPE, "rope_theta": spec.rope_theta}
    elif spec.rope != "default":
        raise ValueError(f"unknown rope {spec.rope!r}")
    common = {
        "vocab_size": spec.vocab,
        "hidden_size": spec.emb,
        "intermediate_size": spec.mlp,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "rms_norm_eps": spec.norm_eps,
        "tie_word_embeddings": spec.tied,
        "max_position_embeddings": 16384,  # > the llama3 original length (transformers warns otherwise)
        "rope_parameters": rope,
    }
    if spec.family == "llama":
        return transformers.LlamaConfig(**common)
    if spec.family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if spec.family == "qwen2":
        return transformers.Qwen2Config(**common, use_sliding_window=False)
    if spec.family == "mixtral":
        return transformers.MixtralConfig(
            **common,
            num_local_experts=spec.experts,
            num_experts_per_tok=spec.experts_per_tok,
            router_aux_loss_coef=0.0,
            sliding_window=None,
        )
    if spec.family == "qwen3":
        return transformers.Qwen3Config(**common, attention_bias=False, use_sliding_window=False)
    if spec.family == "qwen3_moe":  # every layer MoE; the dense width (unused) differs from the experts'
        return transformers.Qwen3MoeConfig(
            **{**common, "intermediate_size": 2 * spec.mlp}, moe_intermediate_size=spec.mlp,
            num_experts=spec.experts, num_experts_per_tok=spec.experts_per_tok, norm_topk_prob=spec.norm_topk_prob,
            decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0, attention_bias=False,
            use_sliding_window=False)
    raise ValueError(f"unknown family {spec.family!r}")


def build(spec: HFSpec) -> Any:
    """A seeded fp32 ``*ForCausalLM`` in eval mode (random weights, std 0.02; norms randomised too)."""
    import transformers

    cls = {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    }[spec.family]
    return build_config(cls, config(spec), spec.seed)


def build_config(cls: Any, cfg: Any, seed: int = 0) -> Any:
    """A seeded fp32 ``cls(cfg)`` (a transformers ``*ForCausalLM``) in eval mode, norms and biases
    randomised (at 1 and 0 they would hide a mis-mapped norm or bias), and so are gpt-oss's
    attention ``sinks``, its experts' ``*_bias`` tensors and DeepSeek's router correction bias (a buffer)."""
    import torch

    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("sinks"):  # gpt-oss's per-head attention sink logits: O(1) when trained
                p.copy_(torch.randn(p.shape, generator=gen))
    return model


@dataclass(frozen=True)
class DeepseekSpec:
    """A tiny ``DeepseekV3ForCausalLM``: MLA with a query LoRA (``q_lora=None``: plain ``q_proj``),
    ``dense`` first dense layers, then MoE layers with routed and shared experts, grouped
    sigmoid routing with the correction bias, YaRN rotary (DeepSeek-V3's constants)."""

    emb: int = 48
    layers: int = 3
    dense: int = 1
    heads: int = 4
    q_lora: int | None = 24
    kv_lora: int = 20
    qk_nope: int = 12
    qk_rope: int = 8
    v_head: int = 10
    mlp: int = 80
    moe_mlp: int = 24
    experts: int = 16
    experts_per_tok: int = 4  # = 2 x topk_groups: megatron-core ranks groups by their top topk/group_topk
    shared: int = 1           # scores, DeepSeek (HF, MaxText) by their top 2
    groups: int = 4
    topk_groups: int = 2
    vocab: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    scaling: float = 2.5
    seed: int = 0

    def config(self) -> Any:
        """The transformers ``DeepseekV3Config``."""
        import transformers

        rope = {"rope_type": "yarn", "rope_theta": self.rope_theta, "factor": 40.0,
                "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale": 1.0, "mscale_all_dim": 1.0}
        return transformers.DeepseekV3Config(
            vocab_size=self.vocab, hidden_size=self.emb, intermediate_size=self.mlp,
            moe_intermediate_size=self.moe_mlp, num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.heads, n_shared_experts=self.shared, n_routed_experts=self.experts,
            routed_scaling_factor=self.scaling, kv_lora_rank=self.kv_lora, q_lora_rank=self.q_lora,
            qk_rope_head_dim=self.qk_rope, v_head_dim=self.v_head, qk_nope_head_dim=self.qk_nope,
            n_group=self.groups, topk_group=self.topk_groups, num_experts_per_tok=self.experts_per_tok,
            first_k_dense_replace=self.dense, norm_topk_prob=True, rms_norm_eps=self.norm_eps,
            max_position_embeddings=163840, rope_parameters=rope, rope_interleave=True,
            tie_word_embeddings=False, attention_bias=False)


def build_deepseek(spec: DeepseekSpec) -> Any:
    """A seeded fp32 ``DeepseekV3ForCausalLM`` in eval mode (norms and router bias randomised)."""
    import transformers

    return build_config(transformers.DeepseekV3ForCausalLM, spec.config(), spec.seed)


def save(model: Any, out: Path, max_shard_size: str = "100KB") -> Path:
    """``save_pretrained`` into ``out`` with small shards (so an index file is written)."""
    out = Path(out)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return out


def logits(model: Any, tokens: np.ndarray) -> np.ndarray:
    """fp32 logits ``[batch, seq, vocab]`` for int tokens ``[batch, seq]`` (no padding mask)."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.asarray(tokens, dtype=np.int64)), use_cache=False)
    return out.logits.to(torch.float32).numpy()


def tokens(batch: int, seq: int, vocab: int, seed: int = 0) -> np.ndarray:
    """Seeded random token ids ``[batch, seq]`` (int32)."""
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq), dtype=np.int32)


def logits_bf16_table(model: Any, tokens: np.ndarray) -> np.ndarray:
    """HF's final hidden states times the *bfloat16-rounded* tied embedding, in fp32.

    What MaxText computes for tied embeddings: its ``attend_on_embedding`` casts the table
    to bfloat16 whatever ``dtype`` says (maxtext 0.2.5, ``layers/embeddings.py``).
    """
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.asarray(tokens, dtype=np.int64)),
                    use_cache=False, output_hidden_states=True)
        table = model.get_input_embeddings().weight.to(torch.bfloat16).to(torch.float32)
        return (out.hidden_states[-1] @ table.T).numpy()


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean next-token cross-entropy (float64) of fp32 logits ``[b, s, v]`` against ``[b, s]``."""
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, targets[..., None].astype(np.int64), -1).mean())


def train_adamw(model: Any, batch: np.ndarray, steps: int, *, lr: float = 1e-3,
                betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, wd: float = 0.1,
                optimizer: Any = None) -> tuple[list[float], Any]:
    """``steps`` torch AdamW steps on the next-token loss of ``batch`` ``[b, s+1]`` (mean over
    all positions, no ignore index); returns (losses before each update, the optimizer)."""
    import torch

    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd)
    x = torch.as_tensor(np.asarray(batch[:, :-1], dtype=np.int64))
    y = torch.as_tensor(np.asarray(batch[:, 1:], dtype=np.int64))
    losses = []
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        logits = model(input_ids=x, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses, opt


def save_moments(model: Any, optimizer: Any, out: Path) -> tuple[Path, Path, int]:
    """torch AdamW's ``exp_avg`` / ``exp_avg_sq`` as two HF-named checkpoint directories
    (``config.json`` + ``model.safetensors``: what MaxText's converter reads), and the step."""
    import torch
    from safetensors.torch import save_file

    dirs = []
    steps = set()
    for key in ("exp_avg", "exp_avg_sq"):
        d = Path(out) / key
        d.mkdir(parents=True, exist_ok=True)
        model.config.to_json_file(str(d / "config.json"))
        tensors = {}
        for name, p in model.named_parameters():
            state = optimizer.state[p]
            tensors[name] = state[key].detach().to(torch.float32).contiguous().clone()
            steps.add(int(state["step"]))
        save_file(tensors, str(d / "model.safetensors"))
        dirs.append(d)
    if len(steps) != 1:
        raise ValueError(f"parameters at different AdamW steps {sorted(steps)}")
    return dirs[0], dirs[1], steps.pop()


def load_with_adamw(hf_dir: Path, moments: tuple[Path, Path] | None = None, step: int = 0, *,
                    lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                    wd: float = 0.1) -> tuple[Any, Any]:
    """The model in ``hf_dir`` (``config.json`` + safetensors, every weight required) and a
    torch AdamW whose ``exp_avg`` / ``exp_avg_sq`` / ``step`` come from ``moments`` (two
    directories with the same tensor names), ready to continue a run."""
    import torch
    import transformers
    from safetensors.numpy import load_file

    def tensors(d: Path) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            out |= {k: torch.from_numpy(v.copy()) for k, v in load_file(str(f)).items()}
        return out

    cfg = transformers.AutoConfig.from_pretrained(str(hf_dir))
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    model.load_state_dict(tensors(hf_dir), strict=True)
    model.eval()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd)
    if moments is not None:
        mu, nu = (tensors(d) for d in moments)
        for name, p in model.named_parameters():
            opt.state[p] = {"step": torch.tensor(float(step)), "exp_avg": mu[name].clone(),
                            "exp_avg_sq": nu[name].clone()}
    return model, opt


def gemma3(*, emb: int = 64, layers: int = 8, heads: int = 4, kv_heads: int = 2, head_dim: int = 32,
           mlp: int = 96, vocab: int = 256, window: int = 4, seed: int = 0) -> Any:
    """A tiny ``Gemma3ForCausalLM`` (``gemma3_text``): tied embeddings, q/k norms, pre/post norms,
    layers in Gemma 3's pattern (5 sliding, 1 global; 8 layers: one block of 6 and 2 left over),
    ``query_pre_attn_scalar = head_dim`` (MaxText's ``gemma3-4b`` query scale), the global layers'
    rotary linearly scaled by 8 (as Gemma 3 4B)."""
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=emb, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, sliding_window=window,
        query_pre_attn_scalar=head_dim, max_position_embeddings=4096, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    return build_config(transformers.Gemma3ForCausalLM, cfg, seed)


def gpt_oss(*, emb: int = 64, layers: int = 4, heads: int = 4, kv_heads: int = 2, head_dim: int = 24, mlp: int = 48,
            experts: int = 4, experts_per_tok: int = 2, vocab: int = 256, window: int = 4, seed: int = 0) -> Any:
    """A tiny ``GptOssForCausalLM``: sliding and full attention alternating (window 4), attention
    biases and sinks, a router with bias, experts with biases and a fused ``gate_up_proj`` whose
    gate and up columns interleave; the default rotary (MaxText's ``rope_type=default``)."""
    import transformers

    cfg = transformers.GptOssConfig(
        vocab_size=vocab, hidden_size=emb, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, sliding_window=window,
        num_local_experts=experts, num_experts_per_tok=experts_per_tok, router_aux_loss_coef=0.0,
        max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 150_000.0})
    return build_config(transformers.GptOssForCausalLM, cfg, seed)
