"""Megatron's parallel layout of a GPT model, from its own ``args``, as rules of the checkpoint language.

Everything here is pure (no I/O): the model/parallel configuration read from
the saved ``argparse.Namespace`` (:class:`MegatronConfig`), how each
parameter is laid over tensor-parallel ranks (:func:`tp_layout`), the
rules that say so (:func:`layout_rules`), and the transforms that put
per-rank pieces together (:func:`consolidate`) or cut a full tensor into
them (:func:`shard_box`).

Tensor parallelism (megatron/core/tensor_parallel/layers.py, ``partition_dim``):

* column-parallel (``linear_qkv``, ``linear_fc1``, their biases, the output
  layer) and the vocab-parallel embedding: split along dim 0;
* row-parallel (``linear_proj``, ``linear_fc2`` weights): split along dim 1;
  their biases and all norms are replicated;
* fused QKV rows are per query group ``[q heads of g | k_g | v_g]``; TP splits
  dim 0 contiguously, so rank r holds groups ``r*ng/TP ...``: the full tensor
  is the plain concatenation (``Fuse`` with ``groups=ng`` + ``Shard``);
* SwiGLU ``linear_fc1`` holds ``[gate_r ; up_r]`` per rank, the full tensor is
  ``[gate_0..gate_{TP-1} ; up_0..up_{TP-1}]`` (``Fuse`` with ``groups=1`` +
  ``Shard``: a Shard after a Fuse shards every fused part; a rank's local
  tensor is the fuse of its part slices);
* vocabulary rows are padded to a multiple of ``make_vocab_size_divisible_by x TP``
  (``Pad``; stripped on read, re-padded on write).

Multi-latent attention (megatron/core/transformer/multi_latent_attention.py, ``MLASelfAttention``):

* ``linear_q_proj`` (no query LoRA), ``linear_q_up_proj`` and ``linear_kv_up_proj`` are
  column-parallel (``gather_output=False``): rows are heads x per-head width, split by heads,
  the full tensor is the plain concatenation;
* ``linear_q_down_proj`` / ``linear_kv_down_proj`` depend on the layer spec: Transformer
  Engine's ``TELinear`` with ``parallel_mode="duplicated"`` (its ``sharded_state_dict`` passes
  no TP axis map: replicated on every TP rank), but the local spec
  (``get_gpt_layer_local_spec``, ``transformer_impl="local"``) builds them as
  ``ColumnParallelLinear``: split along dim 0, the output gathered over TP in ``forward``;
* ``q_layernorm`` / ``kv_layernorm`` (or the ``layer_norm_weight`` TE fuses into the up
  projections) are replicated; ``linear_proj`` is row-parallel.

A multi-token-prediction layer (multi_token_prediction.py) adds ``eh_proj``, column-parallel
(``gather_output=False``, its output gathered over TP), and replicated norms.

Pipeline stages number their layers from 0; the global number adds the
stage's offset (``Renumber`` with ``axis="pp=<stage>"`` or
``"pp=<stage>,vpp=<chunk>"``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptbridge.plugin import (
    Box,
    FormatError,
    Fuse,
    Pad,
    Renumber,
    Replicate,
    Rule,
    ShapeMismatchError,
    Shard,
    TensorState,
    concat,
    crop,
)

from ._moe import moe_fields, moe_rules

LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")

# Local-spec names <-> the names mcore's dist-checkpointing uses (sharded_state_dict_keys_map).
LOCAL_TO_DIST = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                 ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))

_COLUMN = ("linear_qkv", "linear_fc1", "linear_q", "linear_kv", "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj",
           "eh_proj")  # the multi-token-prediction layer's projection: ColumnParallelLinear, output gathered
_MLA_DOWN = ("linear_q_down_proj", "linear_kv_down_proj")  # column-parallel in the local spec, else duplicated
_ROW = ("linear_proj", "linear_fc2")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class MegatronConfig:
    """The parts of Megatron's args that decide the checkpoint layout."""

    tp: int
    pp: int
    vpp: int | None
    num_layers: int
    hidden: int
    heads: int
    groups: int
    kv_channels: int
    ffn: int
    swiglu: bool
    padded_vocab: int
    vocab: int | None  # the tokenizer's size, None if the args do not say
    divisible_by: int
    tied: bool
    transformer_impl: str
    bf16: bool
    fp16: bool
    distributed_optimizer: bool
    dp: int
    num_experts: int = 0  # 0: a dense model
    ep: int = 1  # expert-model-parallel size
    etp: int = 1  # expert-tensor-parallel size (Megatron's default: the TP size)
    moe_ffn: int = 0  # each routed expert's FFN width
    grouped_gemm: bool = False  # legacy GroupedMLP: experts.weight1 / weight2 buffers
    shared_ffn: int = 0  # the shared expert's FFN width (0: none)

    @staticmethod
    def from_args(args: Mapping[str, Any], vocab_size: int | None = None, where: str = "args") -> MegatronConfig:
        def need(key: str) -> Any:
            if args.get(key) is None:
                raise FormatError(f"{where}: Megatron args lack {key!r}; cannot lay out the checkpoint")
            return args[key]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        groups = int(args.get("num_query_groups") or heads) if args.get("group_query_attention") else heads
        moe = moe_fields(args, where)
        if args.get("pipeline_model_parallel_layout"):
            raise FormatError(f"{where}: --pipeline-model-parallel-layout is not supported yet")
        return MegatronConfig(
            tp=int(args.get("tensor_model_parallel_size") or 1),
            pp=int(args.get("pipeline_model_parallel_size") or 1),
            vpp=args.get("virtual_pipeline_model_parallel_size"),
            num_layers=int(need("num_layers")),
            hidden=hidden,
            heads=heads,
            groups=groups,
            kv_channels=int(args.get("kv_channels") or hidden // heads),
            ffn=int(args.get("ffn_hidden_size") or 4 * hidden),
            swiglu=bool(args.get("swiglu")),
            padded_vocab=int(need("padded_vocab_size")),
            vocab=vocab_size if vocab_size is not None else true_vocab_size(args),
            divisible_by=int(args.get("make_vocab_size_divisible_by") or 128),
            tied=not bool(args.get("untie_embeddings_and_output_weights")),
            transformer_impl=str(args.get("transformer_impl") or "transformer_engine"),
            bf16=bool(args.get("bf16")),
            fp16=bool(args.get("fp16")),
            distributed_optimizer=bool(args.get("use_distributed_optimizer")),
            dp=int(args.get("data_parallel_size") or 1),
            **moe,
        )

    def padded_vocab_for(self, tp: int) -> int | None:
        """``_vocab_size_with_padding`` of Megatron-LM's tokenizer module for another TP size."""
        if self.vocab is None:
            return None
        multiple = self.divisible_by * tp
        return int(math.ceil(self.vocab / multiple) * multiple)


def true_vocab_size(args: Mapping[str, Any]) -> int | None:
    """The tokenizer's vocabulary size, where the args say it.

    Megatron-LM stores only ``padded_vocab_size``; ``vocab_size`` is the CLI value
    used by ``NullTokenizer`` (which adds one EOD token). Other tokenizers' sizes
    are not in the args: pass ``vocab_size=`` to :func:`index` for them.
    """
    tok = args.get("tokenizer_type")
    if tok == "NullTokenizer" and args.get("vocab_size") is not None:
        return int(args["vocab_size"]) + 1
    return None


# ------------------------------------------------------------------ per-parameter TP layout


@dataclass(frozen=True)
class TpLayout:
    """How one parameter is split over TP ranks: ``kind`` in
    ``replicated | column | row | glu | vocab``; ``dim`` the partition dim."""

    kind: str
    dim: int | None = None


def tp_layout(name: str, cfg: MegatronConfig, ndim: int) -> TpLayout:
    """The TP layout of parameter ``name`` (legacy name, any layer number)."""
    if name in _VOCAB:
        return TpLayout("vocab", 0)
    leaf = name.rsplit(".", 2)
    module, attr = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", name)
    if attr.startswith("layer_norm_") or "norm" in module or module.endswith("layernorm") or module == "router":
        return TpLayout("replicated")  # the MoE router too (megatron-core's TopKRouter is not TP-split)
    if module in _MLA_DOWN and attr == "weight":
        return TpLayout("column", 0) if cfg.transformer_impl == "local" else TpLayout("replicated")
    if module in _COLUMN and attr in ("weight", "bias"):
        if module == "linear_fc1" and cfg.swiglu:
            return TpLayout("glu", 0)
        return TpLayout("column", 0)
    if module in _ROW:
        return TpLayout("row", 1) if attr == "weight" else TpLayout("replicated")
    if name.startswith("embedding.position_embeddings") or ndim <= 1 or cfg.tp == 1:
        return TpLayout("replicated")  # (at TP 1 every tensor is whole: MoE, MLA)
    raise FormatError(
        f"parameter {name!r}: unknown tensor-parallel layout (not a known Megatron GPT module); "
        "open with tp_layouts={name: 'column'|'row'|'replicated'} to say how it is split"
    )


def consolidate(name: str, parts: Sequence[TensorState], layout: TpLayout, cfg: MegatronConfig) -> TensorState:
    """The full tensor from its TP pieces (one per rank, rank order); no data is read."""
    if layout.kind == "replicated" or (len(parts) == 1 and layout.kind != "glu"):
        return parts[0]
    if layout.kind in ("column", "row", "vocab"):
        return concat(parts, layout.dim or 0)
    if layout.kind == "glu":
        halves = []
        for p in parts:
            n = p.shape[0]
            if n % 2:
                raise ShapeMismatchError(f"{name}: SwiGLU shard has an odd number of rows ({n})")
            rest = p.shape[1:]
            halves.append((crop(p, Box((0,) * len(p.shape), (n // 2, *rest))),
                           crop(p, Box((n // 2,) + (0,) * len(rest), (n // 2, *rest)))))
        return concat([h[0] for h in halves] + [h[1] for h in halves], 0)
    raise FormatError(f"{name}: unknown layout {layout.kind!r}")


def shard_box(shape: Sequence[int], layout: TpLayout, tp: int, rank: int) -> list[Box]:
    """The boxes of the full tensor that TP ``rank`` holds, in its local order (row-major concat)."""
    shape = tuple(shape)
    if layout.kind == "replicated" or (tp == 1 and layout.kind != "glu"):
        return [Box.full(shape)]
    d = layout.dim or 0
    if layout.kind == "glu":
        half = shape[0] // 2
        if half % tp:
            raise ShapeMismatchError(f"SwiGLU rows {half} do not split over TP={tp}")
        w = half // tp
        rest = shape[1:]
        return [Box((rank * w,) + (0,) * len(rest), (w, *rest)),
                Box((half + rank * w,) + (0,) * len(rest), (w, *rest))]
    if shape[d] % tp:
        raise ShapeMismatchError(f"dim {d} of size {shape[d]} does not split over TP={tp}")
    w = shape[d] // tp
    off = tuple(rank * w if i == d else 0 for i in range(len(shape)))
    return [Box(off, tuple(w if i == d else s for i, s in enumerate(shape)))]


# ------------------------------------------------------------------ pipeline stages


def layers_per_chunk(cfg: MegatronConfig, first: int | None = None, last: int | None = None,
                     account_embedding: bool = False, account_loss: bool = False) -> dict[tuple[int, int], int]:
    """Number of decoder layers in each (vp_stage, pp_rank) chunk, following mcore's
    ``get_num_layers_to_build`` (uniform, uneven first/last stage, embedding/loss accounted)."""
    vpp = cfg.vpp or 1
    out: dict[tuple[int, int], int] = {}
    for p in range(cfg.pp):
        if first is not None or last is not None:
            rest, stages = cfg.num_layers, cfg.pp
            if first is not None:
                rest, stages = rest - first, stages - 1
            if last is not None:
                rest, stages = rest - last, stages - 1
            n = rest // stages if stages > 0 else 0
            if p == 0 and first is not None:
                n = first
            if p == cfg.pp - 1 and last is not None:
                n = last
        else:
            total = cfg.num_layers + int(account_embedding) + int(account_loss)
            n = total // cfg.pp
            if account_embedding and p == 0:
                n -= 1
            if account_loss and p == cfg.pp - 1:
                n -= 1
        for v in range(vpp):
            out[(v, p)] = n // vpp
    return out


def layout_rules(cfg: MegatronConfig, offsets: Mapping[tuple[int, int], int],
                 strip_vocab: bool) -> list[Rule]:
    """The rules (as data) that map Megatron's per-rank pieces to the logical tensors."""
    rules: list[Rule] = []
    qkv_w = (cfg.heads // cfg.groups * cfg.kv_channels, cfg.kv_channels, cfg.kv_channels)
    rules.append(Fuse(r"self_attention\.linear_qkv\.(weight|bias)$", dim=0, parts=("q", "k", "v"),
                      widths=qkv_w, groups=cfg.groups))
    if cfg.swiglu:
        rules.append(Fuse(r"mlp\.linear_fc1\.(weight|bias)$", dim=0, parts=("gate", "up"),
                          widths=(cfg.ffn, cfg.ffn), groups=1))
    column = r"linear_qkv|linear_fc1|linear_q_proj|linear_q_up_proj|linear_kv_up_proj|eh_proj"
    mla_down = r"\.(linear_q_down_proj|linear_kv_down_proj)\.weight$"
    if cfg.transformer_impl == "local":
        column += "|linear_q_down_proj|linear_kv_down_proj"
    else:
        rules.append(Replicate(mla_down, axis="tp", check="equal"))
    rules += [
        Shard(r"^(embedding\.word_embeddings|output_layer)\.weight$", axis="tp", dim=0),
        Shard(rf"\.({column})\.(weight|bias)$", axis="tp", dim=0),
        Shard(r"\.(linear_proj|linear_fc2)\.weight$", axis="tp", dim=1),
        Replicate(r"(norm[^.]*\.(weight|bias)|layer_norm_(weight|bias)|\.(linear_proj|linear_fc2)\.bias"
                  r"|position_embeddings\.weight)$", axis="tp", check="equal"),
    ]
    if cfg.num_experts:
        rules += moe_rules(cfg.num_experts, cfg.ep)
    if strip_vocab and cfg.vocab is not None and cfg.vocab != cfg.padded_vocab:
        rules.append(Pad(r"^(embedding\.word_embeddings|output_layer)\.weight$", dim=0,
                         size=cfg.vocab, padded=cfg.padded_vocab))
    for (v, p), off in sorted(offsets.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if cfg.pp > 1 or (cfg.vpp or 1) > 1:
            axis = f"pp={p}" if not cfg.vpp else f"pp={p},vpp={v}"
            rules.append(Renumber(r"^decoder\.layers\.(\d+)\.", axis=axis, offset=off))
    return rules



def from_dist_key(key: str, layer: int | None, local_spec: bool) -> str:
    """Dist-checkpoint key (+ layer index) -> legacy per-layer name."""
    if layer is None:
        return key
    rest = key[len("decoder.layers."):]
    if local_spec:
        for a, b in LOCAL_TO_DIST:
            if rest.startswith(b):
                rest = a + rest[len(b):]
    return f"decoder.layers.{layer}.{rest}"


# Every module and parameter name of a megatron-core 0.16.1 GPTModel in the order its ``__init__``s register
# them: one table for every level (siblings keep this relative order under each parent). GPTModel: embedding,
# decoder, mtp, output_layer; TransformerBlock: layers, final_layernorm; an MTP layer (multi_token_prediction.py):
# enorm, hnorm, eh_proj, transformer_layer, final_layernorm; TransformerLayer: input_layernorm, self_attention,
# pre_cross_attn_layernorm, cross_attention, pre_mlp_layernorm, mlp; SelfAttention (attention.py): linear_proj
# (Attention.__init__), linear_qkv, q_layernorm, k_layernorm; MLASelfAttention (multi_latent_attention.py):
# linear_proj, linear_q_proj | linear_q_down_proj + linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj,
# q_layernorm (query LoRA only), kv_layernorm; MLP: linear_fc1, linear_fc2; MoELayer: router, experts
# (SequentialMLP's local_experts.N, legacy GroupedMLP's weight1, weight2), shared_experts (an MLP, then its
# gate_weight); Transformer Engine's fused norm + linear: layer_norm_weight, layer_norm_bias, weight, bias.
# Numbered children (layers.N, local_experts.N) go by number; ``weightN`` / ``biasN`` by N after their stem.
_REGISTRATION_ORDER = (
    "embedding", "word_embeddings", "position_embeddings", "decoder", "layers", "mtp", "enorm", "hnorm", "eh_proj",
    "transformer_layer", "final_layernorm", "output_layer",
    "input_layernorm", "self_attention", "pre_cross_attn_layernorm", "cross_attention", "pre_mlp_layernorm", "mlp",
    "linear_proj", "linear_qkv", "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
    "linear_kv_up_proj", "q_layernorm", "k_layernorm", "kv_layernorm",
    "router", "experts", "local_experts", "shared_experts", "linear_fc1", "linear_fc2", "gate_weight",
    "layer_norm_weight", "layer_norm_bias", "weight", "bias", "expert_bias",
)
_RANK = {name: i for i, name in enumerate(_REGISTRATION_ORDER)}
_NUMBERED = re.compile(r"^(weight|bias)?(\d+)$")


def _param_sort_key(name: str) -> tuple[tuple[int, int], ...]:
    """GPTModel ``named_parameters()`` order: each dotted part ranked by :data:`_REGISTRATION_ORDER`
    (numbers by value); an unknown part after the known ones, ties keeping the caller's order (stable sort).

    >>> sorted(["decoder.layers.0.self_attention.k_layernorm.weight",
    ...         "decoder.layers.0.self_attention.q_layernorm.weight"], key=_param_sort_key)[0]
    'decoder.layers.0.self_attention.q_layernorm.weight'
    """
    key = []
    for part in name.split("."):
        m = _NUMBERED.match(part)
        if m:
            key.append((_RANK[m.group(1)] if m.group(1) else -1, int(m.group(2))))
        else:
            key.append((_RANK.get(part, len(_RANK)), 0))
    return tuple(key)


def stage_layers(cfg: MegatronConfig, args: Mapping[str, Any]) -> dict[int, range]:
    """Global decoder layers held by each pipeline stage (no virtual pipeline)."""
    counts = layers_per_chunk(cfg, args.get("decoder_first_pipeline_num_layers"),
                              args.get("decoder_last_pipeline_num_layers"),
                              bool(args.get("account_for_embedding_in_pipeline_split")),
                              bool(args.get("account_for_loss_in_pipeline_split")))
    if sum(counts.values()) != cfg.num_layers:
        raise FormatError(f"{cfg.num_layers} layers do not split over PP={cfg.pp} as the args say")
    out, at = {}, 0
    for p in range(cfg.pp):
        n = sum(c for (v, q), c in counts.items() if q == p)
        out[p] = range(at, at + n)
        at += n
    return out


def local_params(cfg: MegatronConfig, args: Mapping[str, Any], names: Sequence[str],
                 shapes: Mapping[str, tuple[int, ...]], tp: int, pp: int
                 ) -> list[tuple[str, tuple[int, ...], list[Box]]]:
    """A (TP, PP) rank's parameters in GPTModel ``named_parameters()`` order: (global name,
    local shape, boxes of the full tensor it holds). ``shapes`` are full (padded-vocab) shapes.

    Order: megatron-core's module registration (:func:`_param_sort_key`): word/position embeddings
    (first stage), decoder layers, final norm, MTP layers and output layer (last stage; with tied
    embeddings and PP>1 the last stage holds its own ``output_layer.weight`` copy).
    """
    layers = stage_layers(cfg, args)[pp]
    picked = []
    for n in names:
        m = LAYER_RE.match(n)
        if m:
            if int(m.group(1)) in layers:
                picked.append(n)
        elif n.startswith("embedding."):
            if pp == 0:
                picked.append(n)
        elif pp == cfg.pp - 1:
            picked.append(n)
    picked.sort(key=_param_sort_key)
    if cfg.tied and cfg.pp > 1 and pp == cfg.pp - 1 and "output_layer.weight" not in picked:
        picked.append("output_layer.weight")
    out = []
    for n in picked:
        shape = tuple(shapes.get(n) or shapes["embedding.word_embeddings.weight"])
        lay = tp_layout(n, cfg, len(shape))
        boxes = shard_box(shape, lay, cfg.tp, tp)
        local = list(boxes[0].shape)
        local[0] = sum(b.shape[0] for b in boxes)  # SwiGLU ranks hold two boxes stacked on dim 0
        out.append((n, tuple(local), boxes))
    return out
