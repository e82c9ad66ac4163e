"""Megatron-LM / Megatron-Core checkpoints: read in place, write for a new TP/PP layout.

Reads a run directory (with ``latest_checkpointed_iteration.txt``), an
``iter_XXXXXXX`` directory, or a dist-checkpoint directory, in either
format Megatron-LM saves:

* legacy ``--ckpt-format torch``: ``mp_rank_TT[_PPP]/model_optim_rng.pt`` per
  (TP, PP) rank, plus ``distrib_optim.pt`` with the distributed optimizer;
* Megatron-Core ``torch_dist``: ``.metadata`` + ``__R_K.distcp`` + ``common.pt``.

Either way the logical tensors carry Megatron's legacy parameter names with
global layer numbers (``decoder.layers.3.mlp.linear_fc1.weight``),
consolidated across TP and PP, vocabulary padding stripped; the states are
``fp32`` (fp32 master weights: the weights themselves in fp32 runs),
``param`` (bf16/fp16 model weights in mixed-precision runs), ``exp_avg``,
``exp_avg_sq``, and the Adam ``step`` scalar. Nothing is copied: every
fragment points into the native files. The layout is written as rules
(``Shard``, ``Replicate``, ``Fuse``, ``Pad``, ``Renumber``) in ``ckpt.rules``::

    ckpt = ckptbridge.open("checkpoints/gpt")                 # latest iteration
    ckpt["decoder.layers.3.self_attention.linear_qkv.weight"].state("exp_avg")[:8]
    ckpt = ckptbridge.open("checkpoints/gpt", split_fused=True)  # q/k/v and gate/up apart
    write(ckpt, "out/gpt_tp1", tp=1, pp=2)                    # legacy layout, new TP/PP

Options of :func:`index`: ``split_fused`` (expose ``...linear_qkv.{q,k,v}.weight``
and ``...linear_fc1.{gate,up}.weight``), ``strip_padding`` (default True),
``vocab_size`` (the tokenizer's size when the args do not record it: Megatron-LM
stores only ``padded_vocab_size``; for ``NullTokenizer`` it is ``vocab_size + 1``;
without it the padding is kept), ``check_replicas`` (read replicated tensors on
every TP rank and require them equal).

Supported: GPT models of megatron-core (verified on the local spec; the
Transformer-Engine spec's fused-norm names ``linear_qkv.layer_norm_weight`` map
the same way but no real TE checkpoint was tested, and TE's ``_extra_state``
objects may need safe-loader support),
GQA/MHA, SwiGLU or plain MLP, tied or untied embeddings, biases, uniform or
uneven pipeline stages, virtual pipeline (reading), fp32 / bf16 / fp16 runs,
torch Adam, the distributed optimizer (``distrib_optim.pt``, torch_dist
``dp_reshardable`` and ``fully_reshardable``). Mixture-of-experts, read (see
``_moe.py``): expert parallelism with or without ``--expert-tensor-parallel-size``,
``SequentialMLP`` and legacy ``GroupedMLP`` experts, shared experts, the router and
its expert bias, torch Adam / Float16 / distributed optimizers (a ChainedOptimizer of a dense and an
expert optimizer at EP > 1: ``distrib_optim.pt`` ``[dense, expert]``, torch_dist ``chained_0.`` /
``chained_1.`` buffers), both formats; every expert is one logical tensor under its global id
(``decoder.layers.L.mlp.experts.local_experts.E.linear_fc1.weight``)::

    ckpt = ckptbridge.open("moe_run")                         # written at TP 2 x EP 2
    ckpt["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"].state("exp_avg")

Writing MoE (legacy per-rank files, see ``_write_moe.py``): ``SequentialMLP`` / ``GroupedMLP`` experts at a new
TP / PP / EP / ETP (options ``ep``, ``etp``), shared experts, the router and its expert bias, torch
Adam / Float16 / distributed optimizer state (a ChainedOptimizer of a dense and an expert optimizer at
EP > 1; ``distrib_optim.pt`` holds ``[dense, expert]``, the dense part in the dense-DP rank 0 file)::

    write(ckptbridge.open("moe_run"), "moe_ep1", MegatronWriteOptions(tp=1, ep=1))
    # ckptbridge reshard moe_run moe_tp2ep2 --to megatron -o tp=2 -o ep=2 -o etp=1

Legacy ``GroupedMLP`` (``--moe-grouped-gemm``, local spec) is written as its ``experts.weight1`` /
``weight2`` buffers (each local expert's shard transposed, stacked: megatron-core's view); a source
that names a layer's experts as one whole GroupedMLP buffer (a recipe's ``megatron_experts="grouped"``)
is cut per expert first. Dense layers between MoE layers (``moe_layer_freq``) follow the dense layout.
Refused with a clear error: legacy layouts whose expert-data-parallel rank 0 ranks miss a TP rank (EP x ETP < TP: Megatron-LM's
legacy save would lose those shards); MoE at EP 1 with expert TP != TP in torch_dist ``dp_reshardable``
(megatron-core's dense buffers hold no single state of those experts, see ``_dist._dp_reshardable``),
Transformer Engine's ``TEGroupedMLP``, multi-latent attention at TP > 1,
``--pipeline-model-parallel-layout``, several grad buffers per rank in the
distributed optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptbridge.plugin import CheckpointIndex, Format, LazyNames

from ._format import MegatronOpenOptions, MegatronWriteOptions, detect

if TYPE_CHECKING:  # the reader's and writer's names, imported on first use (see LazyNames)
    from ._reader import index as index
    from ._reader import split_rules as split_rules
    from ._writer import write as write


def _open(path: str, o: MegatronOpenOptions) -> CheckpointIndex:
    from . import index

    return index(path, split_fused=o.split_fused, strip_padding=o.strip_padding, vocab_size=o.vocab_size,
                 check_replicas=o.check_replicas)


FORMAT = Format("megatron", detect=detect, index=_open, write=LazyNames.deferred(__name__, "write"),
                open_options=MegatronOpenOptions, write_options=MegatronWriteOptions, priority=30, extra="torch",
                description="Megatron-LM legacy per-rank checkpoints and Megatron-Core torch_dist")
__getattr__ = LazyNames(__name__, FORMAT.extra)

__all__ = ["FORMAT", "MegatronOpenOptions", "MegatronWriteOptions", "detect", "index", "split_rules", "write"]
