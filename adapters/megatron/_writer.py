"""Write a checkpoint as Megatron-LM's legacy ``--ckpt-format torch`` layout for a new TP/PP.

``dst/latest_checkpointed_iteration.txt`` + ``dst/iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt``
(+ ``distrib_optim.pt`` for the distributed optimizer). Each rank file holds
what Megatron-LM's ``save_checkpoint`` writes: ``args`` (the source's, with
the new TP/PP and padded vocabulary), ``checkpoint_version`` 3.0,
``iteration``, ``model`` (this rank's TP slices and pipeline-local layer
numbers; fused QKV and SwiGLU re-split per rank, vocabulary re-padded to
``make_vocab_size_divisible_by x TP``), ``optimizer`` (torch Adam state
numbered as mcore's ``_get_param_groups`` numbers it; bf16/fp16 runs add
``fp32_from_fp16_params``; the distributed optimizer writes its coalesced
buffers to ``distrib_optim.pt``), ``opt_param_scheduler`` and
``num_floating_point_operations_so_far``. RNG states are not written
(they are per-rank and do not carry over to another layout): resume
with ``--no-load-rng``.

Options: ``tp``, ``pp`` (default: the source's), ``ep``, ``etp`` (mixture of experts:
expert-parallel and expert-tensor-parallel sizes; files ``mp_rank_TT[_PPP]_EEE`` at EP > 1, the
optimizer a dense + expert ChainedOptimizer, see ``_write_moe.py``), ``dp`` (recorded in the args),
``distributed_optimizer`` (default: as the source; ``True`` writes
``distrib_optim.pt``), ``iteration``, ``optimizer`` (``false``: the model weights only, as
Megatron-LM's ``tools/checkpoint/convert.py`` writes them). The target has no virtual pipeline and
uniform stages. The fp16 loss-scaler state is not carried (Megatron restarts it).
Vocabulary rows beyond the tokenizer's size are taken from the source's padding
rows where it is a Megatron checkpoint (they are trained rows; Megatron's softmax
covers them), else zero. Without optimizer state in the source, no ``optimizer``
entry is written (resume with ``--no-load-optim``).

Reads only the boxes each rank needs; builds the checkpoint in a staging directory and
publishes it atomically (``ckptbridge.plugin.staged_dir``); refuses an existing ``dst``
unless ``overwrite``::

    write(ckptbridge.open("run_tp2"), "run_tp1pp2", MegatronWriteOptions(tp=1, pp=2))
    # ckptbridge reshard run_tp2 run_tp1pp2 --to megatron --tp 1 --pp 2
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from ckptbridge.adapters.torch_save import (
    TORCH_DTYPE_NAMES,
    Global,
    Object,
    Reduce,
    Tensor,
    save_torch,
)
from ckptbridge.plugin import (
    Box,
    Checkpoint,
    FormatError,
    LogicalTensor,
    OptionError,
    TensorNotFoundError,
    TensorView,
    fuse,
    staged_dir,
    storage,
)
from ckptbridge.plugin import dtypes as _dtypes

from ._common import rank_dir_name
from ._format import TRACKER, MegatronWriteOptions
from ._layout import MegatronConfig, true_vocab_size
from ._moe import EXPERT_RE, GROUPED_RE, check_moe_layers, grouped_experts, is_buffer
from ._optim import grad_buffer, group_order
from ._reader import index
from ._write_moe import RankParam, expert_groups, file_ranks, optimizer_split, rank_params

_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_GROUPED_BUFFER = {"linear_fc1.weight": "weight1", "linear_fc2.weight": "weight2"}  # legacy GroupedMLP's buffers


def _source_info(ckpt: Any, args_file: str | None = None) -> dict[str, Any]:
    """The source's Megatron run info (args, vocabulary, optimizer kind ...); ``args_file`` (JSON of
    Megatron args, e.g. ``ckptbridge.recipes.megatron_args`` of an HF config) supplies or overrides
    the args, for sources that are not Megatron checkpoints."""
    meg = dict((ckpt.extra or {}).get("megatron") or {})
    if args_file is not None:
        try:
            with open(args_file) as fh:
                given = json.load(fh)
        except (OSError, ValueError) as err:
            raise FormatError(f"{args_file}: cannot read Megatron args ({err})") from None
        if not isinstance(given, Mapping):
            raise FormatError(f"{args_file}: Megatron args must be a JSON object")
        meg["args"] = {**dict(meg.get("args") or {}), **given}
        if given.get("vocab_size") is not None:  # NullTokenizer's vocab_size leaves out its EOD token
            meg["vocab_size"] = true_vocab_size(meg["args"]) or int(given["vocab_size"])
    if not isinstance(meg.get("args"), Mapping):
        raise FormatError(
            f"{ckpt.path}: writing Megatron needs the run's Megatron args (model shape, vocab, "
            "optimizer settings); this checkpoint has none in extra['megatron']['args']: pass "
            "-o args=ARGS.json (for an HF model: ckptbridge.recipes.megatron_args(config.json))"
        )
    return meg


def _target_args(src: Mapping[str, Any], tp: int, pp: int, dp: int | None, dist_opt: bool,
                 padded: int, ep: int, etp: int) -> dict[str, Any]:
    args = dict(src)
    changed_pp = int(src.get("pipeline_model_parallel_size") or 1) != pp
    args.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                transformer_pipeline_model_parallel_size=pp, padded_vocab_size=padded,
                use_distributed_optimizer=dist_opt, virtual_pipeline_model_parallel_size=None,
                num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None,
                expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    if src.get("num_experts"):  # Megatron-LM requires sequence parallelism for MoE with TP > 1
        args["sequence_parallel"] = tp > 1
    if changed_pp:
        args.update(decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None)
    # the world must hold both grids: TP x DP = ETP x EP x expert-DP ranks per stage
    fits = [d for d in ((dp,) if dp is not None else (int(args.get("data_parallel_size") or 1),)) if (tp * d) % (ep * etp) == 0]
    if dp is not None and not fits:
        raise OptionError(f"format 'megatron' (write): TP={tp} x DP={dp} is not a multiple of EP={ep} x ETP={etp}")
    args["data_parallel_size"] = fits[0] if fits else math.lcm(tp, ep * etp) // tp
    args["world_size"] = tp * pp * int(args["data_parallel_size"])
    return args


def _to_namespace(args: Mapping[str, Any]) -> Object:
    """The ``argparse.Namespace`` Megatron unpickles: torch dtypes restored, library enums dropped."""
    out: dict[str, Any] = {}
    for k, v in args.items():
        if isinstance(v, str) and v.startswith("torch.") and v[6:] in TORCH_DTYPE_NAMES:
            out[k] = Global("torch", v[6:])
        elif isinstance(v, Mapping) and "__class__" in v:
            if v["__class__"] == "signal.Signals":
                out[k] = Reduce(Global("signal", "Signals"), (int(v["value"]),))
            # megatron enums (AttnBackend, ModelType) are not needed by the loader: left out
        else:
            out[k] = v
    return Object(Global("argparse", "Namespace"), out)


def _default_groups(args: Mapping[str, Any]) -> list[dict[str, Any]]:
    base = {"is_expert_parallel": False, "default_config": True, "lr_mult": 1.0, "is_decoupled_lr": False,
            "max_lr": args.get("lr"), "min_lr": args.get("min_lr"), "lr": args.get("lr"),
            "betas": (args.get("adam_beta1", 0.9), args.get("adam_beta2", 0.999)),
            "eps": args.get("adam_eps", 1e-8), "amsgrad": False, "maximize": False, "foreach": None,
            "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True}
    return [{**base, "wd_mult": 1.0, "weight_decay": args.get("weight_decay", 0.01)},
            {**base, "wd_mult": 0.0, "weight_decay": 0.0}]


class _Source:
    """Reads boxes of the source's logical tensors, re-fusing split views and re-padding vocab rows."""

    def __init__(self, ckpt: Any, info: Mapping[str, Any], cfg: MegatronConfig) -> None:
        self.ckpt, self.cfg = ckpt, cfg
        self.padded_src: Any = None
        if info.get("padding_stripped") and ckpt.format == "megatron" and storage.exists(ckpt.path):

            # the padding rows are real (trained) rows: carry them over where they fit
            self.padded_src = Checkpoint(index(ckpt.path, strip_padding=False, vocab_size=cfg.vocab),
                                         ckpt.files)
        self._fused: dict[str, Any] = {}

    def tensor(self, name: str) -> Any:
        if name == "output_layer.weight" and self.cfg.tied:
            name = "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
        if name in self.ckpt.tensors:
            return self.ckpt.tensors[name]
        if name in self._fused:
            return self._fused[name]
        e = EXPERT_RE.match(name)
        buf = f"{e.group(1)}.{_GROUPED_BUFFER.get(e.group(3))}" if e else ""
        if buf in self.ckpt.tensors:  # a grouped recipe's whole-layer GroupedMLP buffer: cut per expert
            t = self.ckpt.tensors[buf]
            per = {s: grouped_experts(buf, st, self.cfg.hidden, self.cfg.num_experts, 0) for s, st in t.states.items()}
            for k, (glob, _) in enumerate(next(iter(per.values()))):
                self._fused[glob] = LogicalTensor(glob, {s: v[k][1] for s, v in per.items()}, dict(t.scalars))
            return self._fused[name]
        m = name.rsplit(".", 1)
        parts = {"linear_qkv": ("q", "k", "v"), "linear_fc1": ("gate", "up")}.get(m[0].rsplit(".", 1)[-1])
        if parts and all(f"{m[0]}.{p}.{m[1]}" in self.ckpt.tensors for p in parts):
            ts = [self.ckpt.tensors[f"{m[0]}.{p}.{m[1]}"] for p in parts]
            groups = self.cfg.groups if parts[0] == "q" else 1
            states = {s: fuse([t.states[s] for t in ts], 0, groups) for s in ts[0].states
                      if all(s in t.states for t in ts)}
            self._fused[name] = LogicalTensor(name, states, dict(ts[0].scalars))
            return self._fused[name]
        raise TensorNotFoundError(f"{self.ckpt.path}: no tensor {name!r} to write")

    def has_state(self, name: str, state: str) -> bool:
        return state in self.tensor(name).states

    def read(self, name: str, state: str, box: Box, dtype: str) -> np.ndarray:
        src_name = "embedding.word_embeddings.weight" if name == "output_layer.weight" and self.cfg.tied else name
        t = self.tensor(src_name)
        view = TensorView(self.ckpt, t, state)
        if src_name in _VOCAB:
            if self.padded_src is not None and src_name in self.padded_src.tensors and \
                    state in self.padded_src.tensors[src_name].states:
                view = self.padded_src[src_name].state(state)
            rows = view.shape[0]
            out = np.zeros(box.shape, dtype=_np(dtype))
            lo, hi = box.offset[0], min(box.offset[0] + box.shape[0], rows)
            if hi > lo:
                sub = Box((lo, *box.offset[1:]), (hi - lo, *box.shape[1:]))
                out[: hi - lo] = view.read(sub, dtype)
            return out
        return view.read(box, dtype)


def _np(dtype: str) -> np.dtype:
    return _dtypes.to_numpy(dtype)


def write(ckpt: Any, dst: str, options: MegatronWriteOptions | None = None) -> str:
    """Write ``ckpt`` (any format with Megatron args in ``extra``) as a legacy Megatron checkpoint."""
    o = options or MegatronWriteOptions()
    dst = os.path.abspath(os.fspath(dst))
    with staged_dir(dst, overwrite=o.overwrite) as stage:
        _write(ckpt, stage, o)
    return dst


def _layout(src_args: Mapping[str, Any], src_cfg: MegatronConfig, o: MegatronWriteOptions) -> tuple[int, int, int, int]:
    """The target's TP, PP, EP and ETP (ETP: the source's while TP and EP stay and it is <= TP, else TP)."""
    tp = int(o.tp or src_args.get("tensor_model_parallel_size") or 1)
    pp = int(o.pp or src_args.get("pipeline_model_parallel_size") or 1)
    if not src_cfg.num_experts:
        if (o.ep or 1) > 1 or (o.etp is not None and o.etp != tp):
            raise OptionError("format 'megatron' (write): ep/etp options need a mixture-of-experts model")
        return tp, pp, 1, tp
    ep = int(o.ep or src_cfg.ep)
    kept = tp == src_cfg.tp and ep == src_cfg.ep
    etp = int(o.etp or (src_cfg.etp if kept and src_cfg.etp <= tp else tp))  # (ETP > TP: args of another run)
    if src_cfg.num_experts % ep or (src_cfg.moe_ffn and src_cfg.moe_ffn % etp):
        raise FormatError(f"EP={ep} must divide the {src_cfg.num_experts} experts and ETP={etp} the expert FFN "
                          f"size ({src_cfg.moe_ffn})")
    return tp, pp, ep, etp


def _write(ckpt: Any, tmp: str, o: MegatronWriteOptions) -> None:
    info = _source_info(ckpt, o.args)
    src_args = dict(info["args"])
    src_cfg = MegatronConfig.from_args(src_args, info.get("vocab_size"), where=ckpt.path)
    tp, pp, ep, etp = _layout(src_args, src_cfg, o)
    vocab = src_cfg.vocab
    if vocab is None:
        vocab = ckpt["embedding.word_embeddings.weight"].shape[0]
    multiple = src_cfg.divisible_by * tp
    padded = int(math.ceil(vocab / multiple) * multiple)
    kind = info.get("optimizer_kind")
    dist_opt = o.distributed_optimizer if o.distributed_optimizer is not None else kind == "distributed"
    args = _target_args(src_args, tp, pp, int(o.dp) if o.dp else None, dist_opt, padded, ep, etp)
    cfg = MegatronConfig.from_args(args, vocab, where=tmp)
    if cfg.heads % tp or cfg.groups % tp or cfg.ffn % tp:
        raise FormatError(f"TP={tp} must divide the heads ({cfg.heads}), query groups ({cfg.groups}) and "
                          f"FFN size ({cfg.ffn})")
    iteration = o.iteration
    it = int(iteration if iteration is not None else (ckpt.step if ckpt.step is not None else info.get("iteration") or 0))
    src = _Source(ckpt, info, cfg)

    # Full shapes of every parameter at the target layout (vocab re-padded), in a stable order.
    names = [n for n in _fused_names(ckpt.tensors, cfg.num_experts) if n != "output_layer.weight" or not cfg.tied]
    if cfg.num_experts:
        check_moe_layers(names, args, ckpt.path)
    mtp = int(args.get("mtp_num_layers") or 0)  # megatron-core's strict load needs every MTP layer's tensors
    lacking = [f"'mtp.layers.{k}.*'" for k in range(mtp) if not any(n.startswith(f"mtp.layers.{k}.") for n in names)]
    if lacking:
        raise FormatError(f"{ckpt.path}: the Megatron args say mtp_num_layers={mtp} but there is no tensor "
                          f"{', '.join(lacking)} (recipes.megatron_args(<checkpoint directory>) counts the MTP "
                          "layers the tensors have)")
    shapes = {}
    for n in names:
        shape = tuple(src.tensor(n).shape)
        shapes[n] = (padded, *shape[1:]) if n in _VOCAB else shape
    weight_dtype = "bfloat16" if cfg.bf16 else "float16" if cfg.fp16 else "float32"
    mixed = cfg.bf16 or cfg.fp16
    have_opt = o.optimizer and all(src.has_state(n, "exp_avg") and src.has_state(n, "exp_avg_sq")
                                   for n in names if not is_buffer(n))
    groups_src = [dict(g) for g in (info.get("param_groups") or [])] or _default_groups(args)
    for g in groups_src:
        g.pop("step", None)
        g["is_expert_parallel"] = False
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
    step = next((src.tensor(n).scalars.get("step") for n in names if "step" in src.tensor(n).scalars), it)

    it_dir = os.path.join(tmp, f"iter_{it:07d}")
    ns = _to_namespace(args)
    for p in range(pp):
        for rank in file_ranks(tp, ep, etp):
            model: OrderedDict[str, Any] = OrderedDict()
            values: dict[str, dict[str, Tensor]] = {}  # read when the file is written, one at a time
            params = rank_params(cfg, args, names, shapes, rank, p)
            for rp in params:
                first = rp.parts[0].name if rp.parts else rp.name  # a GroupedMLP buffer: its experts' states
                values[rp.local_name] = {key: Tensor(_reader(src, rp, state, dtype), dtype, rp.shape)
                                         for key, state, dtype in _states(src, first, mixed, have_opt and not rp.buffer)}
                model[rp.local_name] = values[rp.local_name]["weights"]
                if rp.local_name.endswith(".weight") and _has_extra_state(rp.local_name):
                    model[rp.local_name[: -len("weight")] + "_extra_state"] = None
            state_dict: dict[str, Any] = {
                "args": ns, "checkpoint_version": 3.0, "iteration": it, "model": model,
                "num_floating_point_operations_so_far": info.get("num_floating_point_operations_so_far", 0),
            }
            if info.get("opt_param_scheduler") is not None:
                state_dict["opt_param_scheduler"] = dict(info["opt_param_scheduler"])
            rank_dir = os.path.join(it_dir, rank_dir_name(rank.tp, p, pp, rank.ep if ep > 1 else None))
            os.makedirs(rank_dir)
            if have_opt:
                entries, states = [], []
                held = [rp for rp in params if not rp.buffer]
                for i, part in enumerate(optimizer_split(held, ep, lambda rp: rp.expert)):  # [all] or [dense, expert]
                    local_list = [(rp.local_name, rp.shape) for rp in part]
                    groups = groups_src if i == 0 else expert_groups(groups_src)
                    order = group_order(local_list, groups, args, rank_dir) if i or not dist_opt else [[]] * len(groups)
                    used = [(g, o_) for g, o_ in zip(groups, order) if o_ or i == 0]
                    if dist_opt:  # the dense state only in the file of dense-DP rank 0 (Megatron's dp-zero gather)
                        entries.append({"optimizer": {"param_groups": [{**g, "step": float(step)} for g, _ in used]}})
                        states.append(_distrib_state(rank_dir, cfg, args, p, local_list, values, weight_dtype, i == 0)
                                      if i or rank.dp == 0 else None)
                    else:
                        entries.append(_adam_state([g for g, _ in used], [o_ for _, o_ in used], values, step, mixed))
                state_dict["optimizer"] = entries[0] if len(entries) == 1 else entries
                if dist_opt:
                    save_torch(states[0] if len(states) == 1 else states, os.path.join(rank_dir, "distrib_optim.pt"))
            save_torch(state_dict, os.path.join(rank_dir, "model_optim_rng.pt"))
    with open(os.path.join(tmp, TRACKER), "w") as fh:
        fh.write(str(it))


def _reader(src: _Source, rp: RankParam, state: str, dtype: str) -> Callable[[], np.ndarray]:
    """This rank's slice of one state of ``rp`` (its boxes stacked on dim 0; a GroupedMLP buffer: its
    experts' slices transposed, stacked and viewed as the buffer's shape), read when called."""
    def read() -> np.ndarray:
        if rp.parts:
            out = np.stack([_reader(src, q, state, dtype)().T for q in rp.parts]).reshape(rp.shape)
        else:
            pieces = [src.read(rp.name, state, b, dtype) for b in rp.boxes]
            out = np.concatenate(pieces, 0) if len(pieces) > 1 else pieces[0]
        if tuple(out.shape) != rp.shape:
            raise FormatError(f"{rp.name} ({state}): local shard {tuple(out.shape)} != {rp.shape}")
        return out.view(np.uint16) if dtype == "bfloat16" and out.dtype != np.uint16 else out

    return read


def _fused_names(tensors: Mapping[str, Any], num_experts: int) -> list[str]:
    """The source's parameters as the writer lays them out: split q/k/v and gate/up fused back, a
    whole-layer GroupedMLP buffer (a grouped recipe's ``experts.weight1`` / ``weight2``) as its experts."""
    out: dict[str, None] = {}
    for n in tensors:
        m = n.rsplit(".", 2)
        g = GROUPED_RE.match(n)
        if g:
            leaf = next(k for k, v in _GROUPED_BUFFER.items() if v == g.group(2))
            out.update({f"{g.group(1)}.local_experts.{k}.{leaf}": None for k in range(num_experts)})
        elif len(m) == 3 and m[1] in ("q", "k", "v", "gate", "up") and m[0].endswith(("linear_qkv", "linear_fc1")):
            out[f"{m[0]}.{m[2]}"] = None
        else:
            out[n] = None
    return list(out)


def _has_extra_state(local_name: str) -> bool:
    mod = local_name.rsplit(".", 2)[-2] if local_name.count(".") else ""
    return mod in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")


def _states(src: _Source, name: str, mixed: bool, have_opt: bool) -> list[tuple[str, str, str]]:
    """(key in the rank's values, source state, dtype) to read; ``weights`` is the model tensor."""
    t = src.tensor(name)
    if mixed:
        half = "bfloat16" if src.cfg.bf16 else "float16"
        out = [("weights", "param" if "param" in t.states else t.weight_state, half)]
        if have_opt:
            out.append(("fp32_master", "fp32" if "fp32" in t.states else t.weight_state, "float32"))
    else:
        out = [("weights", t.weight_state, "float32")]
    if have_opt:
        out += [("exp_avg", "exp_avg", "float32"), ("exp_avg_sq", "exp_avg_sq", "float32")]
    return out


def _adam_state(groups: list[dict[str, Any]], order: list[list[str]], values: Mapping[str, Mapping[str, Tensor]],
                step: Any, mixed: bool) -> dict[str, Any]:
    state: dict[int, Any] = {}
    param_groups = []
    idx = 0
    masters = []
    for g, names in zip(groups, order):
        ids = []
        gm = []
        for n in names:
            v = values[n]
            state[idx] = {"step": Tensor(np.array(float(step), np.float32), "float32"),
                          "exp_avg": v["exp_avg"], "exp_avg_sq": v["exp_avg_sq"]}
            ids.append(idx)
            idx += 1
            if mixed:
                gm.append(v["fp32_master"])
        param_groups.append({**g, "params": ids})
        masters.append(gm)
    adam = {"state": state, "param_groups": param_groups}
    return {"optimizer": adam, "fp32_from_fp16_params": masters} if mixed else adam


def _distrib_state(rank_dir: str, cfg: MegatronConfig, args: Mapping[str, Any], pp: int,
                   local_list: list[tuple[str, tuple[int, ...]]], values: Mapping[str, Mapping[str, Tensor]],
                   weight_dtype: str, dense: bool = True) -> dict[Any, Any]:
    """One optimizer's part of ``distrib_optim.pt`` (``dense``: the dense grad buffer, else the expert
    one): its coalesced fp32 buffers (master, exp_avg, exp_avg_sq), each written piece by piece as the
    parameters' slots come (one parameter's state in memory at a time)."""
    slots, sizes = grad_buffer(local_list, args, pp, dense and cfg.tied and cfg.pp > 1)
    total = sum(sizes)
    ordered = sorted(slots, key=lambda s: s.start)

    def pieces(key: str) -> Iterator[np.ndarray]:
        at = 0
        for s in ordered:
            v = values[s.name]
            src = v.get("fp32_master", v["weights"]) if key == "param" else v[key]
            if s.start < at:
                raise FormatError(f"{rank_dir}: buffer slots of {s.name} overlap the previous parameter's")
            if s.start > at:
                yield np.zeros(s.start - at, np.float32)
            yield np.asarray(src.array(), np.float32).reshape(-1)  # every value is read when called
            at = s.start + math.prod(s.shape)
        if total > at:
            yield np.zeros(total - at, np.float32)

    bufs = {k: Tensor(lambda k=k: pieces(k), "float32", (total,)) for k in ("param", "exp_avg", "exp_avg_sq")}
    pdt = Global("torch", weight_dtype)
    gdt = Global("torch", "float32") if (weight_dtype == "float32" or args.get("accumulate_allreduce_grads_in_fp32")) \
        else pdt
    return {"buckets_coalesced": True, 0: {(pdt, gdt): {**bufs, "numel_unpadded": total}}}
