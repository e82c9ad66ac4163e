"""Load Megatron checkpoints into megatron-core's own GPTModel and print the lm loss (CPU, gloo).

Needs only megatron-core 0.16.1 from PyPI (the ``megatron`` extra) -- no Megatron-LM training code.
For every checkpoint given, each of ``--world`` spawned ranks (gloo, CPU, tools/megatron/cpu_shim.py):

1. reads the run's saved Megatron args with ckptbridge's pickle-free reader (the same ``args``
   that ``ckptbridge.open(path).extra['megatron']['args']`` shows; the tensors are left to
   Megatron) and builds megatron-core's ``GPTModel`` with the local layer spec
   (``get_gpt_layer_local_spec``) from them, as Megatron-LM's ``core_transformer_config_from_args``
   and ``gpt_builders`` do (kernel fusions and dropout off: evaluation on CPU);
2. initialises model parallelism (``parallel_state.initialize_model_parallel``) at the checkpoint's
   TP/PP (a legacy ``--ckpt-format torch`` checkpoint: the TP/PP its args record; data parallelism
   fills the rest of ``--world``), or at ``tp=,pp=`` given after a ``dist:`` checkpoint;
3. loads the checkpoint the way Megatron-LM's ``load_checkpoint`` does: for the legacy layout this
   rank's ``mp_rank_TT[_PPP]/model_optim_rng.pt`` with ``torch.load(weights_only=False)`` (these are
   files we wrote or Megatron wrote) and ``model.load_state_dict(sd['model'], strict=True)``, after
   checking its ``args``/``checkpoint_version``; for ``dist:PATH`` (a ``torch_dist`` checkpoint)
   megatron-core's own ``dist_checkpointing.load(model.sharded_state_dict(), ...)``, i.e. Megatron
   resharding the checkpoint onto the requested layout itself;
4. runs a forward pass over fixed mock tokens through megatron-core's pipeline schedule
   (``get_forward_backward_func()``, ``forward_only=True``; pipelined for PP > 1) and reports the
   token-mean lm loss (``GPTModel``'s vocab-parallel cross entropy, as pretrain_gpt.py's loss_func),
   plus a SHA-256 of every local parameter (to compare two loads of one layout bitwise);
5. with ``--train-step`` (legacy checkpoints, and ``dist:...,optim=1`` ones): Megatron-LM's resume
   and one ``train_step`` from megatron-core's pieces -- its DDP wrapper, ``get_megatron_optimizer``
   (``Float16OptimizerWithFloat16Params`` for bf16/fp16 runs, whose model is wrapped in
   ``Float16Module`` as Megatron-LM's ``get_model`` does; the ``DistributedOptimizer`` when the run
   used one) and ``OptimizerParamScheduler`` loaded from the checkpoint's ``optimizer`` /
   ``opt_param_scheduler`` (+ ``distrib_optim.pt`` through ``load_parameter_state``; for
   ``torch_dist``, megatron-core's ``optimizer.sharded_state_dict`` through
   ``dist_checkpointing.load``), forward+backward on the same tokens, ``finalize_model_grads``,
   ``optimizer.step()`` -- and reports the grad norm, the lr used and the loss after the step;
6. with ``--dump DIR``: megatron-core's optimizer state right after the load (fp32 master,
   exp_avg, exp_avg_sq per parameter; the DP-owned pieces for the distributed optimizer) saved
   to ``DIR/<item index>/tpT_ppP_dpD.pt``;
7. ``save:PATH=OUT`` items: a legacy checkpoint loaded at its own layout (model, optimizer,
   scheduler), then saved by megatron-core as the ``torch_dist`` checkpoint OUT
   (``sharded_state_dict`` + ``dist_checkpointing.save``), which ``dist:OUT:...,optim=1`` items
   load back at another layout: Megatron's own reshard, optimizer state included;
   ``savemodel:PATH=OUT`` items the same for the model alone (a checkpoint without optimizer state,
   e.g. one converted from Hugging Face);
8. ``train:ARGS.json=OUT[,KIND:PATH...]`` items: no checkpoint: a seeded ``GPTModel`` built from the Megatron args in
   ARGS.json (JSON-plain, as ckptbridge shows saved args) at their TP/PP/EP/ETP, trained one step from
   scratch with their optimizer (the distributed one when ``use_distributed_optimizer``), its
   optimizer state after the step dumped (``--dump``), then saved by megatron-core as the
   ``torch_dist`` checkpoint OUT the way Megatron-LM's ``save_checkpoint`` does (its sharded-state-dict
   metadata: the distributed optimizer in ``dp_reshardable`` buffers, or ``fully_reshardable`` when
   ``dist_ckpt_optim_fully_reshardable``): a checkpoint whose optimizer state megatron-core wrote; the
   same state also saved in PATH for each ``,KIND:PATH``: ``torch`` (Megatron-LM's legacy ``--ckpt-format
   torch`` files, :func:`save_legacy`: ``distrib_optim.pt`` by megatron-core's own ``save_parameter_state``),
   ``dp_reshardable`` or ``fully_reshardable`` (``torch_dist`` with that sharding of the distributed optimizer);
9. ``cli:<JSON list>`` items: ckptbridge's command line run by rank 0 between two items (e.g.
   ``cli:["reshard", OUT, W, "--to", "megatron"]`` after ``train:ARGS.json=OUT``, then ``W`` as an item:
   the writer judged by megatron-core in the same launch), record ``{"cli", "rc"}``.

Prints one line per checkpoint, ``CORE_LOSS {"ckpt", "dist", "tp", "pp", "loss", "tokens",
"token_losses", "digests"[, "step": {"updated", "grad_norm", "lr", "after_loss",
"after_token_losses"}][, "dump"]}`` (``digests``: "tpTppP:<local name>" -> SHA-256 prefix), or
``{"ckpt", ..., "error"}`` when the load failed (the loss is then not computed). ``--dump DIR``
also writes ``DIR/<n>.npz`` for the n-th checkpoint: the tokens and labels evaluated, the per-token
losses and (PP 1) GPTModel's logits over the padded vocabulary, to compare with another framework::

    python tools/megatron/core_loss.py --world 2 --train-step tests/fixtures/megatron/A/tp1pp1/torch \\
        /tmp/written_tp1pp2 dist:tests/fixtures/megatron/A/tp2pp2/torch_dist:tp=2,pp=1
    python tools/megatron/core_loss.py --world 2 --train-step --dump /tmp/dump \\
        save:tests/fixtures/megatron/Abf16/tp2pp1/torch=/tmp/bf16_dist dist:/tmp/bf16_dist:tp=1,pp=2,optim=1

``--set ARG=JSON`` changes one of the saved args for every checkpoint (``--set moe_aux_loss_coeff=0``: the
train step without the router's load-balancing loss); an ``eval:`` item is evaluated without the train step.

Megatron-LM's own training loop is tools/megatron/verify_loss.py (needs setup.sh's git clone).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

# TransformerConfig fields forced for a CPU evaluation (kernel choices only: the math is the same).
EVAL_OVERRIDES = {
    "hidden_dropout": 0.0, "attention_dropout": 0.0, "masked_softmax_fusion": False,
    "bias_activation_fusion": False, "bias_dropout_fusion": False, "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False, "persist_layer_norm": False, "cross_entropy_loss_fusion": False,
    # perform_initialization: megatron-core sets the tensor_model_parallel attributes of TP-sharded
    # weights only while initialising them; without them the grad norm counts TP shards once
    # (the loaded checkpoint overwrites the random init anyway).
    "use_cpu_initialization": True, "perform_initialization": True, "sequence_parallel": False,
    "context_parallel_size": 1, "virtual_pipeline_model_parallel_size": None, "deallocate_pipeline_outputs": False,
    "barrier_with_L1_time": False, "cuda_graph_impl": "none", "enable_cuda_graph": False,
}


@dataclasses.dataclass(frozen=True)
class Item:
    """One checkpoint to evaluate: ``path`` (legacy layout; EP / ETP from its args),
    ``dist:path[:tp=N,pp=M[,ep=E,etp=X][,optim=1]]`` (EP default 1, ETP default TP)
    (``optim=1``: with ``--train-step``, also load the optimizer through megatron-core's
    ``sharded_state_dict``), or ``save:path=OUT`` (a legacy checkpoint at its own layout, model +
    optimizer + scheduler loaded, then saved by megatron-core as the ``torch_dist`` checkpoint OUT);
    ``eval:`` before any of these: evaluated only, no optimizer and no train step even with
    ``--train-step`` (a checkpoint without optimizer state beside others that have one);
    ``train:ARGS.json=OUT``: a fresh model from those args, one step, saved as OUT (``fresh``)."""

    path: str
    dist: bool = False
    tp: int | None = None
    pp: int | None = None
    optim: bool = False
    save_to: str | None = None
    model_only: bool = False  # savemodel:PATH=OUT: save the model alone
    ep: int | None = None
    etp: int | None = None
    train: bool = True
    fresh: bool = False  # train:ARGS.json=OUT: path is the args file
    also: tuple[tuple[str, str], ...] = ()  # train:ARGS.json=OUT,KIND:PATH...: the same state saved again

    @staticmethod
    def parse(text: str) -> Item:
        if text.startswith("eval:"):
            return dataclasses.replace(Item.parse(text[len("eval:"):]), train=False)
        if text.startswith("train:"):
            path, _, out = text[len("train:"):].rpartition("=")
            out, *also = out.split(",")
            return Item(path, save_to=out, fresh=True, also=tuple((k, v) for k, _, v in (a.partition(":") for a in also)))
        if text.startswith(("save:", "savemodel:")):
            kind, _, body = text.partition(":")
            path, _, out = body.rpartition("=")
            return Item(path, save_to=out, model_only=kind == "savemodel")
        if not text.startswith("dist:"):
            return Item(text)
        body = text[len("dist:"):]
        path, _, opts = body.rpartition(":") if "=" in body.rsplit(":", 1)[-1] else (body, "", "")
        kw = dict(o.split("=", 1) for o in opts.split(",") if o)
        return Item(path, True, int(kw.get("tp", 0)) or None, int(kw.get("pp", 0)) or None,
                    kw.get("optim", "0") == "1", ep=int(kw.get("ep", 0)) or None, etp=int(kw.get("etp", 0)) or None)


def saved_args(path: str) -> tuple[dict[str, Any], int | None]:
    """The run's saved Megatron args (JSON-plain) and the tokenizer's vocab size, read by ckptbridge's
    pickle-free reader from the checkpoint's first rank file (``common.pt`` for torch_dist).

    Only the args are read here, not the tensors: megatron-core alone judges the weights."""
    from ckptbridge.adapters.megatron._common import args_dict, plain, resolve_iter_dir
    from ckptbridge.adapters.megatron._format import is_dist_dir, rank_dirs
    from ckptbridge.adapters.megatron._layout import MegatronConfig
    from ckptbridge.adapters.torch_save import TorchArchive

    it_dir, _ = resolve_iter_dir(path)
    if is_dist_dir(it_dir):
        f = os.path.join(it_dir, "common.pt")
    else:
        f = os.path.join(rank_dirs(it_dir)[(0, 0)], "model_optim_rng.pt")
    args = args_dict(TorchArchive.open(f).obj.get("args"), f)
    return plain(args), MegatronConfig.from_args(args, where=f).vocab


def fresh_args(path: str) -> tuple[dict[str, Any], int | None]:
    """A ``train:`` item's Megatron args (a JSON file of JSON-plain args) and the tokenizer's vocab size."""
    from ckptbridge.adapters.megatron._layout import MegatronConfig

    with open(path) as fh:
        args = json.load(fh)
    return args, MegatronConfig.from_args(args, where=path).vocab


def _revive(v: Any) -> Any:
    """ckptbridge's JSON-plain arg values -> what Megatron's Namespace held (dtypes, megatron enums)."""
    import importlib

    import torch

    if isinstance(v, str) and v.startswith("torch.") and isinstance(getattr(torch, v[6:], None), torch.dtype):
        return getattr(torch, v[6:])
    if isinstance(v, dict) and "__class__" in v:
        mod, _, cls = v["__class__"].rpartition(".")
        if mod.startswith("megatron.core"):
            return getattr(importlib.import_module(mod), cls)(v["value"])
        return None
    return v


def transformer_config(args: Any, tp: int, pp: int, ep: int = 1, etp: int | None = None, train: bool = False) -> Any:
    """megatron-core ``TransformerConfig`` from the saved args (Megatron-LM's
    ``core_transformer_config_from_args``, core_v0.16.1, for the dense GPT cases). ``train`` with MoE at
    TP > 1: sequence parallelism on (megatron-core's MoELayer refuses to train without it)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    if getattr(args, "heterogeneous_layers_config_path", None):
        raise NotImplementedError("core_loss.py builds GPT models only (no heterogeneous layers)")
    mla = bool(getattr(args, "multi_latent_attention", False))
    freq = getattr(args, "moe_layer_freq", 1)
    every_layer = freq in (1, None) or (isinstance(freq, list) and all(freq))
    cls = MLATransformerConfig if mla else TransformerConfig  # MLA (+ MoE): DeepSeek-V3, see mla_cpu.py
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    kw.update(pipeline_dtype=args.params_dtype, batch_p2p_comm=not getattr(args, "overlap_p2p_comm", False),
              num_moe_experts=getattr(args, "num_experts", None) or None,
              **({} if mla or not every_layer else {"moe_layer_freq": 1}),
              rotary_interleaved=getattr(args, "rotary_interleaved", False),
              num_layers_in_first_pipeline_stage=getattr(args, "decoder_first_pipeline_num_layers", None),
              num_layers_in_last_pipeline_stage=getattr(args, "decoder_last_pipeline_num_layers", None),
              num_query_groups=args.num_query_groups if getattr(args, "group_query_attention", False) else None,
              tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
              expert_tensor_parallel_size=etp or tp, **EVAL_OVERRIDES)
    if train and tp > 1 and kw["num_moe_experts"]:
        kw["sequence_parallel"] = True
    if getattr(args, "swiglu", False):
        kw.update(activation_func=F.silu, gated_linear_unit=True)
    elif getattr(args, "squared_relu", False):
        from megatron.core.activations import squared_relu

        kw["activation_func"] = squared_relu
    if kw.get("rope_type") is None:
        kw.pop("rope_type", None)
    if isinstance(kw.get("cp_comm_type"), list) and len(kw["cp_comm_type"]) == 1:
        kw["cp_comm_type"] = kw["cp_comm_type"][0]
    kw.pop("pipeline_model_parallel_layout", None)
    if kw.get("params_dtype") not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"params_dtype {kw.get('params_dtype')!r} from the saved args is not a float dtype")
    return cls(**kw)


def build_model(args: Any, tp: int, pp: int, ep: int = 1, etp: int | None = None, train: bool = False) -> Any:
    """megatron-core ``GPTModel`` with the local spec, as Megatron-LM's gpt_builders builds it (its MoE
    layers' experts: ``SequentialMLP``, or with ``moe_grouped_gemm`` the legacy ``GroupedMLP``, whose
    grouped GEMM needs ``MEGATRON_CPU_SHIM_GG=1`` on CPU: see cpu_shim.py; dense layers between MoE layers
    as ``moe_layer_freq`` says: ``get_gpt_decoder_block_spec``), and with ``mtp_num_layers``
    its multi-token-prediction block (``get_gpt_mtp_block_spec``: the last decoder layer's spec)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )

    config = transformer_config(args, tp, pp, ep, etp, train)
    if config.multi_latent_attention:  # dense and MoE layers, MLA on CPU
        from mla_cpu import mla_local_spec

        spec = mla_local_spec(config)
    elif config.num_moe_experts and config.moe_layer_freq != 1:  # dense layers between MoE layers
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization)
    else:
        spec = get_gpt_layer_local_spec(normalization=args.normalization, num_experts=config.num_moe_experts,
                                        qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
                                        moe_grouped_gemm=bool(getattr(args, "moe_grouped_gemm", False)))
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if config.mtp_num_layers else None
    model = GPTModel(
        config=config, transformer_layer_spec=spec, mtp_block_spec=mtp, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(), fp16_lm_cross_entropy=bool(args.fp16_lm_cross_entropy),
        parallel_output=True, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base)
    if config.bf16 or config.fp16:  # Megatron-LM's get_model: the whole module in 16 bits (norms too)
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    model.eval()
    return model


def load_legacy(model: Any, path: str, args: Any, tp: int, pp: int, ep: int = 1) -> dict[str, Any]:
    """Megatron-LM ``load_checkpoint`` for ``--ckpt-format torch``: this rank's file
    (``mp_rank_TT[_PPP][_EEE]``, EEE its expert-parallel rank when EP > 1), strict load."""
    import torch
    from megatron.core import parallel_state as ps

    from ckptbridge.adapters.megatron._common import rank_dir_name, resolve_iter_dir

    it_dir, _ = resolve_iter_dir(path)
    f = os.path.join(it_dir, rank_dir_name(ps.get_tensor_model_parallel_rank(),
                                           ps.get_pipeline_model_parallel_rank(), pp,
                                           ps.get_expert_model_parallel_rank() if ep > 1 else None), "model_optim_rng.pt")
    sd = torch.load(f, map_location="cpu", weights_only=False)  # a file ckptbridge (or Megatron) wrote
    ck = sd.get("args")
    if ck is None or float(sd.get("checkpoint_version", 0)) < 3.0:
        raise ValueError(f"{f}: no args / checkpoint_version {sd.get('checkpoint_version')} < 3.0")
    # Megatron-LM's check_checkpoint_args, plus the layout this file must be for
    for name in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
        want = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                "expert_model_parallel_size": ep}.get(name, getattr(args, name))
        if (getattr(ck, name, None) or 1) != want:
            raise ValueError(f"{f}: args.{name} = {getattr(ck, name)}, the model needs {want}")
    if "model" not in sd:
        raise ValueError(f"{f}: no 'model' state dict (virtual pipeline checkpoints are not evaluated here)")
    model.load_state_dict(sd["model"], strict=True)
    sd["__file__"] = f  # where distrib_optim.pt is (this rank's directory)
    return sd


def load_dist(model: Any, path: str) -> None:
    """megatron-core's own ``dist_checkpointing.load`` (it reshards onto this model's layout)."""
    from megatron.core import dist_checkpointing

    from ckptbridge.adapters.megatron._common import resolve_iter_dir

    it_dir, _ = resolve_iter_dir(path)
    sharded = model.sharded_state_dict()
    loaded = dist_checkpointing.load(sharded, it_dir)  # + the common state (args, iteration, ...)
    inner = getattr(model, "module", model)  # Float16Module.load_state_dict returns no key lists
    missing, unexpected = inner.load_state_dict({k: loaded[k] for k in sharded}, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"{it_dir}: dist_checkpointing.load missing {missing} unexpected {unexpected}")


def mock_batches(seed: int, n: int, mbs: int, seq: int, vocab: int) -> list[dict[str, Any]]:
    """``n`` fixed micro-batches of random tokens in [0, vocab) (same on every rank and layout)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        data = torch.randint(0, vocab, (mbs, seq + 1), generator=g)
        mask = torch.ones(mbs, seq)
        attn = torch.tril(torch.ones(1, 1, seq, seq)) < 0.5  # True = masked (causal)
        pos = torch.arange(seq).unsqueeze(0).expand(mbs, seq).contiguous()
        out.append({"tokens": data[:, :-1].contiguous(), "labels": data[:, 1:].contiguous(), "loss_mask": mask,
                    "attention_mask": attn, "position_ids": pos})
    return out


def forward_loss(model: Any, args: Any, batches: list[dict[str, Any]],
                 train: bool = False) -> tuple[float, float, list[float]] | None:
    """Token-sum lm loss, token count and the per-token losses over ``batches``, on the last pipeline
    stage (None elsewhere). ``train``: forward and backward, as Megatron-LM's ``train_step`` runs it."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator: Any, model: Any) -> Any:
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

        def loss_func(output_tensor: Any) -> Any:
            losses = output_tensor.view(-1).float()
            lm = b["loss_mask"].view(-1).float()
            s = torch.sum(losses * lm)
            n = lm.sum()
            report = {"lm loss": torch.cat([s.detach().view(1), n.view(1)]), "tokens": losses.detach()}
            return s, n.to(torch.int), report  # pretrain_gpt.py's loss_func (sum, tokens, report)

        return out, loss_func

    with contextlib.nullcontext() if train else torch.no_grad():
        reports = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=args.seq_length,
            micro_batch_size=batches[0]["tokens"].shape[0], forward_only=not train)
    if not ps.is_pipeline_last_stage():
        return None
    tot = torch.stack([r["lm loss"] for r in reports]).double().sum(0)
    return float(tot[0]), float(tot[1]), torch.cat([r["tokens"] for r in reports]).tolist()


def _from_args(cls: Any, args: Any, **over: Any) -> Any:
    """A megatron-core config dataclass filled from same-named args (Megatron-LM's way)."""
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    kw.update(over)
    return cls(**kw)


def make_optimizer(model: Any, args: Any) -> tuple[Any, Any, Any]:
    """Megatron-LM's training setup from megatron-core's pieces: its DDP wrapper (the distributed
    optimizer's grad buffer when the run used one), ``get_megatron_optimizer`` and
    ``OptimizerParamScheduler``, configured from the run's args. Returns (ddp, optimizer, scheduler)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import (
        AdamOptimizerConfig,
        get_megatron_optimizer,
        get_standard_config_overrides,
    )
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if getattr(args, "optimizer", "adam") != "adam":
        raise NotImplementedError("train step: Adam checkpoints only")
    config = model.config
    # overlap_grad_reduce off: one bucket per grad buffer, as Megatron-LM's get_model sets it
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=bool(args.accumulate_allreduce_grads_in_fp32), overlap_grad_reduce=False,
        use_distributed_optimizer=bool(args.use_distributed_optimizer), check_for_nan_in_grad=False,
        bucket_size=None), model)
    opt_config = _from_args(AdamOptimizerConfig, args)
    optimizer = get_megatron_optimizer(opt_config, [ddp], get_standard_config_overrides(opt_config))
    gbs = int(args.global_batch_size)
    decay = int(args.lr_decay_iters or args.train_iters) * gbs
    warmup = (args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
              else int(args.lr_warmup_iters) * gbs)
    sched = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay, wd_incr_steps=int(args.train_iters) * gbs,
        wd_incr_style=args.weight_decay_incr_style, use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False)
    return ddp, optimizer, sched


def load_optimizer_legacy(optimizer: Any, sched: Any, sd: dict[str, Any], args: Any) -> None:
    """Megatron-LM's ``load_checkpoint`` for the optimizer of a ``--ckpt-format torch`` checkpoint:
    ``optimizer.load_state_dict(sd['optimizer'])``, then (distributed optimizer) the rank
    directory's ``distrib_optim.pt`` through ``load_parameter_state``, and the scheduler."""
    if "optimizer" not in sd or "opt_param_scheduler" not in sd:
        raise ValueError("train step: the checkpoint has no optimizer / opt_param_scheduler state")
    optimizer.load_state_dict(sd["optimizer"])
    if args.use_distributed_optimizer:
        optimizer.load_parameter_state(os.path.join(os.path.dirname(sd["__file__"]), "distrib_optim.pt"))
    sched.load_state_dict(sd["opt_param_scheduler"])


def load_optimizer_dist(model: Any, optimizer: Any, sched: Any, path: str) -> None:
    """Megatron-LM's ``load_checkpoint`` for the optimizer of a ``torch_dist`` checkpoint:
    megatron-core's ``optimizer.sharded_state_dict`` (with the content metadata the checkpoint
    was saved with, e.g. the distributed optimizer's sharding type) loaded by
    ``dist_checkpointing.load``, resharded by megatron-core onto this layout."""
    from megatron.core import dist_checkpointing

    from ckptbridge.adapters.megatron._common import resolve_iter_dir

    it_dir, _ = resolve_iter_dir(path)
    meta = dist_checkpointing.load_content_metadata(it_dir)
    sharded = {"optimizer": optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True,
                                                         **({"metadata": meta} if meta else {}))}
    loaded = dist_checkpointing.load(sharded, it_dir)
    optimizer.load_state_dict(loaded["optimizer"])
    sched.load_state_dict(loaded["opt_param_scheduler"])


def train_step(model: Any, ddp: Any, optimizer: Any, sched: Any, args: Any,
               batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Megatron-LM's ``train_step``, once, from the loaded optimizer and scheduler: forward+backward
    over ``batches`` (``finalize_model_grads``: DP and tied-embedding grad reduction),
    ``optimizer.step()``, ``scheduler.step()``. Returns the grad norm, the learning rate used and
    the model after."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    config = model.config
    gbs = int(args.global_batch_size)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = ddp.no_sync
    ddp.train()
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    forward_loss(ddp, args, batches, train=True)
    ok, grad_norm, _ = optimizer.step()
    lr = optimizer.param_groups[0]["lr"]
    sched.step(increment=gbs)
    ddp.eval()
    return {"updated": bool(ok), "grad_norm": None if grad_norm is None else float(grad_norm), "lr": float(lr),
            "model": ddp}


def _global_name(model: Any, name: str) -> str:
    """A local parameter name with this pipeline stage's layer number made global, and a ``SequentialMLP``'s
    local expert ``K`` its global id (megatron-core's ``local_expert_indices_offset + K``)."""
    import re

    m = re.match(r"((.*\.mlp)\.experts\.local_experts\.)(\d+)(\..*)", name)
    if m:  # the MoELayer's local_expert_indices: its EP rank's global ids
        offset = model.get_submodule(m.group(2)).local_expert_indices[0]
        name = f"{m.group(1)}{int(m.group(3)) + offset}{m.group(4)}"
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if not m:
        return name
    return f"decoder.layers.{model.decoder.layers[int(m.group(1))].layer_number - 1}.{m.group(2)}"


def optimizer_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """megatron-core's own optimizer state, per parameter of this rank: ``{"<global name>|<state>":
    tensor}`` with states ``fp32`` (the fp32 master; the weights themselves in fp32 runs),
    ``exp_avg``, ``exp_avg_sq``, each shaped like the local parameter; for the distributed
    optimizer, the flat piece this DP rank owns, keyed ``"<name>|<state>|<start>"`` (its first
    element in the flattened local parameter)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner_model = getattr(model, "module", model)  # Float16Module wraps 16-bit models
    names = {id(p): _global_name(inner_model, n) for n, p in inner_model.named_parameters()}
    out: dict[str, Any] = {}
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in chained:
        if isinstance(opt, DistributedOptimizer):
            for gbuf in opt.gbuf_ranges:
                for per_bucket in gbuf.values():
                    for bucket in per_bucket:
                        for p, r in bucket["param_map"].items():
                            t = opt._get_main_param_and_optimizer_states(p)
                            start = r["param"].start
                            for key, state in (("param", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                                out[f"{names[id(p)]}|{state}|{start}"] = t[key].detach().clone()
            continue
        inner = opt.optimizer
        if hasattr(opt, "float16_groups"):  # Float16OptimizerWithFloat16Params: fp32 masters
            pairs = [(m, f) for mg, fg in zip(opt.float16_groups, opt.fp32_from_float16_groups)
                     for m, f in zip(mg, fg)]
            pairs += [(p, p) for g in getattr(opt, "fp32_from_fp32_groups", []) for p in g]
        else:  # FP32Optimizer: the model's params are the optimizer's
            pairs = [(p, p) for g in inner.param_groups for p in g["params"]]
        for model_p, main_p in pairs:
            st = inner.state.get(main_p, {})
            name = names[id(model_p)]
            out[f"{name}|fp32"] = main_p.detach().clone()
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    out[f"{name}|{k}"] = st[k].detach().clone()
    return out


def sharded_metadata(args: Any) -> dict[str, Any]:
    """Megatron-LM's ``_build_sharded_state_dict_metadata`` (training/checkpointing.py, core_v0.16.1) for
    a ``torch_dist`` save: the distributed optimizer's sharding type from the args."""
    from megatron.core import parallel_state as ps

    meta: dict[str, Any] = {}
    if args.use_distributed_optimizer:
        full = bool(getattr(args, "dist_ckpt_optim_fully_reshardable", False))
        meta["distrib_optim_sharding_type"] = "fully_reshardable" if full else "dp_reshardable"
        if full:
            meta["distrib_optim_fully_reshardable_mem_efficient"] = bool(
                getattr(args, "distrib_optim_fully_reshardable_mem_efficient", False))
    meta.update(singleton_local_shards=False, chained_optim_avoid_prefix=True,
                dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True))
    return meta


def save_dist(model: Any, optimizer: Any, sched: Any, sd: dict[str, Any], out: str,
              metadata: dict[str, Any] | None = None, fully_parallel: bool = False) -> None:
    """Save the loaded model and optimizer (None: the model alone) as a ``torch_dist`` checkpoint with
    megatron-core's own ``sharded_state_dict`` and ``dist_checkpointing.save`` (what Megatron-LM's
    ``--ckpt-convert-format torch_dist`` does), so that megatron-core itself can reshard it; ``metadata``
    (:func:`sharded_metadata`): passed to both ``sharded_state_dict`` calls and saved as the content
    metadata, as Megatron-LM's ``save_checkpoint`` does, and with ``fully_parallel`` its default
    ``FullyParallelSaveStrategyWrapper`` (``--ckpt-fully-parallel-save``: the DP ranks share the writing of
    replicated tensors)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

    it = int(sd.get("iteration", 0))
    it_dir = os.path.join(out, f"iter_{it:07d}")
    if dist.get_rank() == 0:
        os.makedirs(it_dir)
    dist.barrier()
    kw = {} if metadata is None else {"metadata": metadata}
    model_sd = model.sharded_state_dict(**kw)
    state = {"model": model_sd, "args": sd["args"], "checkpoint_version": 3.0,
             "iteration": it, "num_floating_point_operations_so_far": sd.get("num_floating_point_operations_so_far", 0)}
    if optimizer is not None:
        state.update(optimizer=optimizer.sharded_state_dict(model_sd, **kw), opt_param_scheduler=sched.state_dict())
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"),
                                                ps.get_data_parallel_group(with_context_parallel=True)) \
        if fully_parallel else None
    dist_checkpointing.save(state, it_dir, strategy, content_metadata=_clean_metadata_for_serialization(metadata))
    if dist.get_rank() == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(it))
    dist.barrier()


def save_legacy(model: Any, optimizer: Any, sched: Any, args: Any, iteration: int, out: str) -> None:
    """Megatron-LM's ``save_checkpoint`` for ``--ckpt-format torch`` (training/checkpointing.py, core_v0.16.1):
    into ``iter_N/mp_rank_TT[_PPP][_EEE]`` (its ``get_checkpoint_name``: PPP when PP > 1, EEE the EP rank when
    EP > 1), every rank's ``optimizer.save_parameter_state(distrib_optim.pt)`` (the distributed optimizer:
    megatron-core's own gather of each optimizer's buffers on its DP rank 0; a ``ChainedOptimizer`` writes
    ``[dense, expert]``, ``None`` for a part whose DP rank 0 is another rank), then, from the ranks whose
    expert-data-parallel rank is 0, ``model_optim_rng.pt`` (its ``generate_state_dict``: args, the model's
    ``state_dict_for_save_checkpoint()``, ``optimizer.state_dict()``, the scheduler)."""
    import copy

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    if ps.get_expert_model_parallel_world_size() > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    d = os.path.join(out, f"iter_{iteration:07d}", name)
    os.makedirs(d, exist_ok=True)
    if args.use_distributed_optimizer:
        optimizer.save_parameter_state(os.path.join(d, "distrib_optim.pt"))
    if ps.get_expert_data_parallel_rank() == 0:
        saved = copy.copy(args)
        saved.ckpt_format = "torch"
        torch.save({"args": saved, "checkpoint_version": 3.0, "iteration": iteration,
                    "model": model.state_dict_for_save_checkpoint(), "optimizer": optimizer.state_dict(),
                    "opt_param_scheduler": sched.state_dict(), "num_floating_point_operations_so_far": 0},
                   os.path.join(d, "model_optim_rng.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(iteration))


def digests(model: Any) -> dict[str, str]:
    import torch

    return {k: hashlib.sha256(v.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:32]
            for k, v in model.state_dict().items() if torch.is_tensor(v)}


def _all_agree_on_error(err: str) -> str:
    """Every rank's error (or ""), joined: all ranks take the same branch afterwards."""
    import torch.distributed as dist

    errs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    return "; ".join(e for e in errs if e)


def logits(model: Any, batches: list[dict[str, Any]]) -> Any:
    """GPTModel's logits ``[micro-batches x micro_batch_size, seq, padded vocab]`` for ``batches``
    (no pipeline: PP 1; the vocab-parallel shards gathered over TP), fp32 numpy."""
    import torch
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    inner = getattr(model, "module", model)
    seen: list[Any] = []
    # megatron-core 0.16.1's GPTModel runs its MTP block only with labels, and then returns the loss:
    # the main logits are then its output layer's last output ([s, b, vocab / tp]; the MTP's come first),
    # copied (its cross entropy turns them into probabilities in place)
    hook = inner.output_layer.register_forward_hook(lambda _m, _i, o: seen.append(o[0].clone())) \
        if getattr(inner, "mtp_process", False) else None
    out = []
    with torch.no_grad():
        for b in batches:
            if hook is None:
                local = model(b["tokens"], b["position_ids"], b["attention_mask"])  # [b, s, vocab / tp]
            else:
                model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
                local = seen[-1].transpose(0, 1)
            out.append(gather_from_tensor_model_parallel_region(local.contiguous()).float())
    if hook is not None:
        hook.remove()
    return torch.cat(out).numpy()


def dump(path: str, batches: list[dict[str, Any]], rec: dict[str, Any], lg: Any) -> None:
    """The tokens, labels and per-token losses of an evaluation (and its logits) as one ``.npz``."""
    import numpy as np

    arrays = {"tokens": np.concatenate([b["tokens"].numpy() for b in batches]),
              "labels": np.concatenate([b["labels"].numpy() for b in batches]),
              "token_losses": np.asarray(rec.get("token_losses", []), dtype=np.float64)}
    if lg is not None:
        arrays["logits"] = lg
    np.savez(path, **arrays)


def evaluate(item: Item, opts: argparse.Namespace, index: int = 0) -> dict[str, Any] | None:
    """Every rank runs this; rank 0 returns the JSON record."""
    import argparse as ap

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    world = dist.get_world_size()
    try:
        plain, vocab = fresh_args(item.path) if item.fresh else saved_args(item.path)
        err = ""
    except Exception as e:  # the same files on every rank: every rank fails alike
        err = f"{type(e).__name__}: {e}"
    if err:
        return {"ckpt": item.path, "error": err} if dist.get_rank() == 0 else None
    args = ap.Namespace(**{k: _revive(v) for k, v in plain.items()})
    for key, value in opts.set:  # --set: the run's args changed for this evaluation (e.g. its aux loss off)
        setattr(args, key, value)
    tp = item.tp or int(args.tensor_model_parallel_size or 1)
    pp = item.pp or int(args.pipeline_model_parallel_size or 1)
    if item.dist and item.tp and vocab is not None:  # Megatron-LM pads the tokenizer's vocab for the run's TP
        mult = int(args.make_vocab_size_divisible_by) * tp
        args.padded_vocab_size = -(-vocab // mult) * mult
    # expert parallelism: a dist: item's ep=/etp= (default EP 1, ETP = TP when it names a layout), else the run's
    ep = item.ep or (1 if item.tp or item.pp else int(getattr(args, "expert_model_parallel_size", None) or 1))
    etp = item.etp or (tp if item.tp or item.pp or item.ep else
                       int(getattr(args, "expert_tensor_parallel_size", None) or tp))
    if world % (tp * pp) or world % (ep * etp * pp):
        return {"ckpt": item.path, "error": f"TP{tp} x PP{pp} (EP{ep} x ETP{etp}) does not divide --world {world}"}
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    model_parallel_cuda_manual_seed(opts.seed)
    err = ""
    model = sd = None
    try:
        model = build_model(args, tp, pp, ep, etp, bool(opts.train_step or item.fresh))
        if item.dist:
            load_dist(model, item.path)
        elif not item.fresh:
            sd = load_legacy(model, item.path, args, tp, pp, ep)
    except Exception as e:  # reported (all ranks agree below), not raised: the next item still runs
        err = f"rank {dist.get_rank()}: {type(e).__name__}: {e}"
        if opts.verbose:
            traceback.print_exc()
    rec: dict[str, Any] = {"ckpt": item.path, "dist": item.dist, "tp": tp, "pp": pp, "ep": ep, "etp": etp}
    err = _all_agree_on_error(err)
    if err:
        rec["error"] = err
    else:
        batches = mock_batches(opts.seed, opts.microbatches, opts.micro_batch_size or int(args.micro_batch_size),
                               int(args.seq_length), int(vocab or args.padded_vocab_size))
        res = forward_loss(model, args, batches)
        lg = logits(model, batches) if opts.dump and pp == 1 else None
        first_dp = ps.get_data_parallel_rank() == 0
        mine = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), res,
                digests(model) if first_dp else None)
        allr: list[Any] = [None] * world
        dist.all_gather_object(allr, mine)
        rec.update(_agree(allr))
        if opts.dump and dist.get_rank() == 0:
            os.makedirs(opts.dump, exist_ok=True)
            rec["dump"] = os.path.join(opts.dump, f"{index}.npz")
            dump(rec["dump"], batches, rec, lg)
        rec["digests"] = {f"tp{t}pp{p}:{k}": h for t, p, _, d in allr if d for k, h in d.items()}
        if item.model_only and "error" not in rec:
            save_dist(model, None, None, sd or {}, str(item.save_to))
            rec["saved"] = item.save_to
        if item.fresh and "error" not in rec:
            # what the run's args say
            args.world_size, args.data_parallel_size, args.ckpt_format = world, world // (tp * pp), "torch_dist"
            ddp, optimizer, sched = make_optimizer(model, args)
            rec["step"] = train_step(model, ddp, optimizer, sched, args, batches)
            del rec["step"]["model"]
            dump_optimizer(opts, index, model, optimizer, args)
            fully_parallel = bool(getattr(args, "ckpt_fully_parallel_save", True))
            save_dist(model, optimizer, sched, {"args": args, "iteration": 1}, str(item.save_to), sharded_metadata(args),
                      fully_parallel)
            rec["saved"] = item.save_to
            for kind, out in item.also:  # the same state in another format
                if kind == "torch":
                    save_legacy(model, optimizer, sched, args, 1, out)
                else:  # as if run with(out) --dist-ckpt-optim-fully-reshardable
                    other = argparse.Namespace(**{**vars(args), "dist_ckpt_optim_fully_reshardable":
                                                  kind == "fully_reshardable"})
                    save_dist(model, optimizer, sched, {"args": other, "iteration": 1}, out, sharded_metadata(other),
                              fully_parallel)
                rec.setdefault("also", []).append(out)
        want_optimizer = not item.fresh and ((item.save_to and not item.model_only)
                          or (opts.train_step and item.train and (item.optim or not item.dist)))
        if want_optimizer and "error" not in rec:
            try:
                ddp, optimizer, sched = make_optimizer(model, args)
                if item.dist:
                    load_optimizer_dist(model, optimizer, sched, item.path)
                else:
                    load_optimizer_legacy(optimizer, sched, sd, args)
                err = ""
            except Exception as e:  # e.g. an optimizer state that does not fit: reported
                err = f"rank {dist.get_rank()}: optimizer: {type(e).__name__}: {e}"
                if opts.verbose:
                    traceback.print_exc()
            err = _all_agree_on_error(err)
            if err:
                rec["error"] = err
            else:
                if item.save_to:
                    save_dist(model, optimizer, sched, sd, item.save_to)
                    rec["saved"] = item.save_to
                dump_optimizer(opts, index, model, optimizer, args)
                if opts.train_step:
                    step = train_step(model, ddp, optimizer, sched, args, batches)  # the next iteration
                    after = forward_loss(step.pop("model"), args, batches)
                    dist.all_gather_object(allr, (ps.get_tensor_model_parallel_rank(),
                                                  ps.get_pipeline_model_parallel_rank(), after, None))
                    rec["step"] = {**step, **{f"after_{k}": v for k, v in _agree(allr).items()}}
    ps.destroy_model_parallel()
    return rec if dist.get_rank() == 0 else None


def dump_optimizer(opts: argparse.Namespace, index: int, model: Any, optimizer: Any, args: Any) -> None:
    """With ``--dump``: this rank's :func:`optimizer_state` as ``DIR/<index>/tpT_ppP_dpD.pt`` (DP rank 0
    only, but every DP rank with the distributed optimizer: each holds its own piece), and from DP rank 0
    the rank's parameters as megatron-core holds them, in ``named_parameters()`` order, as
    ``DIR/<index>/tpT_ppP.params.json``: ``[[global name, local shape, TP partition dim or null], ...]``
    (megatron-core's ``tensor_model_parallel`` / ``partition_dim`` attributes; a routed expert under its global
    id, split over the expert-TP group), and ``tpT_ppP.ranks.json``: ``{"ep": [rank, size], "etp": [rank, size]}``."""
    import torch
    from megatron.core import parallel_state as ps

    if not opts.dump:
        return
    d = os.path.join(opts.dump, str(index))
    rank = f"tp{ps.get_tensor_model_parallel_rank()}_pp{ps.get_pipeline_model_parallel_rank()}"
    os.makedirs(d, exist_ok=True)
    if ps.get_data_parallel_rank() == 0 or args.use_distributed_optimizer:
        torch.save(optimizer_state(model, optimizer), os.path.join(d, f"{rank}_dp{ps.get_data_parallel_rank()}.pt"))
    if ps.get_data_parallel_rank() == 0:
        inner = getattr(model, "module", model)
        params = [[_global_name(inner, n), list(p.shape),
                   p.partition_dim if getattr(p, "tensor_model_parallel", False) else None]
                  for n, p in inner.named_parameters()]
        with open(os.path.join(d, f"{rank}.params.json"), "w") as fh:
            json.dump(params, fh)
        with open(os.path.join(d, f"{rank}.ranks.json"), "w") as fh:  # the experts' place: [rank, size]
            json.dump({"ep": [ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()],
                       "etp": [ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()]}, fh)


def run_cli(argv: list[str]) -> dict[str, Any] | None:
    """A ``cli:["reshard", SRC, DST, ...]`` item: rank 0 runs ckptbridge's command line in this process (e.g.
    to write a checkpoint from what an earlier ``train:`` item saved, for the items after it: one launch instead
    of two), the other ranks wait; rank 0 returns ``{"cli": argv, "rc": exit status}`` (or ``"error"``)."""
    import torch.distributed as dist

    rec: dict[str, Any] = {"cli": argv}
    if dist.get_rank() == 0:
        from ckptbridge._cli import main as cli

        try:
            rec["rc"] = cli(list(argv))
        except Exception as e:  # reported like a failed load
            rec["error"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    return rec if dist.get_rank() == 0 else None


def _agree(allr: list[Any]) -> dict[str, Any]:
    """The loss the last-stage ranks report (they must agree)."""
    losses = {(t, p): r for t, p, r, _ in allr if r is not None}
    vals = {round(r[0] / r[1], 12) for r in losses.values()}
    if len(vals) != 1:
        return {"error": f"last-stage ranks disagree on the loss: {vals}"}
    s, n, per_token = next(iter(losses.values()))
    return {"loss": s / n, "tokens": n, "token_losses": per_token}


def worker(rank: int, world: int, port: int, opts: argparse.Namespace) -> None:
    import datetime

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHDYNAMO_DISABLE="1")
    sys.path.insert(0, HERE)
    import cpu_shim  # patches torch.cuda for CPU before megatron is imported

    cpu_shim.patch_megatron_rng()
    # megatron-core 0.16.1's DistributedOptimizer on the torch-Adam (no Apex/TE) path cannot load
    # a checkpoint without these (cpu_shim.py says why; the fixtures' Megatron-LM runs had them too)
    cpu_shim.patch_distopt_state_dict()
    cpu_shim.patch_distopt_load()
    cpu_shim.patch_moe_no_te()
    # expert parallelism on CPU/gloo (the fixtures' Megatron-LM runs had these too; cpu_shim.py says why)
    cpu_shim.patch_moe_cpu_splits()
    cpu_shim.patch_gloo_uneven_all_gather()
    cpu_shim.patch_chained_optimizer_ep_reshard()
    cpu_shim.patch_torch_norm_sequence_parallel()  # the local spec's norms under sequence parallelism (MoE, TP > 1)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=opts.timeout))
    try:
        for i, text in enumerate(opts.ckpt):
            rec = run_cli(json.loads(text[len("cli:"):])) if text.startswith("cli:") else evaluate(Item.parse(text), opts, i)
            if rec is not None:
                print("CORE_LOSS " + json.dumps(rec), flush=True)
    finally:
        dist.destroy_process_group()


def _arg_override(text: str) -> tuple[str, Any]:
    """``--set`` ``ARG=JSON`` -> (ARG, its value)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected ARG=JSON")
    return key, json.loads(value)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ckpt", nargs="+", help="checkpoint dirs (legacy layout), dist:PATH[:tp=N,pp=M[,ep=E,etp=X][,optim=1]] "
                                            "or save:PATH=OUT or savemodel:PATH=OUT; eval:<any of these>: no "
                                            "train step")
    ap.add_argument("--world", type=int, default=2, help="ranks to spawn (gloo); TP x PP must divide it")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--micro-batch-size", type=int, default=0, help="default: the run's micro_batch_size")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--train-step", action="store_true",
                    help="legacy checkpoints (and dist: ones with optim=1): also load the optimizer and scheduler "
                         "state into megatron-core's optimizer, train one step on the same tokens and report the "
                         "loss after it")
    ap.add_argument("--dump", default="", metavar="DIR",
                    help="per checkpoint (n: its position): DIR/<n>.npz with tokens, labels, token_losses and the "
                         "logits over the padded vocabulary (PP 1 only); with the optimizer loaded, its state as "
                         "megatron-core holds it in DIR/<n>/tpT_ppP_dpD.pt (see optimizer_state)")
    ap.add_argument("--timeout", type=int, default=300, help="gloo collective timeout (s)")
    ap.add_argument("--set", type=_arg_override, action="append", default=[], metavar="ARG=JSON",
                    help="override one of the run's saved Megatron args for every checkpoint, the value as JSON "
                         "(e.g. moe_aux_loss_coeff=0: the router's load-balancing loss off in the train step)")
    ap.add_argument("-v", "--verbose", action="store_true")
    opts = ap.parse_args(argv)
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(worker, args=(opts.world, port, opts), nprocs=opts.world, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
