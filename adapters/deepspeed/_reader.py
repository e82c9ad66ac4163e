"""Index a DeepSpeed tag folder: ZeRO stage 0-3 flat partitions become fragments (see the package docs)."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ckptbridge.adapters.torch_save import (
    TensorRef,
    TorchArchive,
    iter_tensors,
    read_scalar,
    unpickled_to_json,
)
from ckptbridge.plugin import (
    Box,
    CheckpointIndex,
    FlatPartition,
    FormatError,
    Fragment,
    LogicalTensor,
    MissingShardError,
    Pad,
    Replicate,
    Rule,
    Shard,
    TensorState,
    c_strides,
    check_name,
    concat,
    contiguous_fragment,
    crop,
    flat_range_fragments,
    rules_to_json,
)

from ._common import FORMAT, as_int, get, hyper, open_archive, shape_of
from ._files import TagFiles, list_tag_files, require_grid, resolve_tag_dir
from ._moe import edp_members, global_expert, moe_group_ep
from ._universal_read import index_universal
from ._zero import FlatBuffer, RankPartition, zero3_fragments, zero12_fragments

ADAM_STATES = ("exp_avg", "exp_avg_sq")
# model_states keys DeepSpeed itself writes; everything else is client state.
_DS_MODEL_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
    "shared_params", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info",
}


def index(path: str, tag: str | None = None) -> CheckpointIndex:
    """Index a DeepSpeed checkpoint (root or tag folder); ``tag`` picks a tag under a root."""
    tag_dir = resolve_tag_dir(os.fspath(path), tag)
    files = list_tag_files(tag_dir)
    if files.universal:
        return index_universal(files)
    return _Reader(files).index()


# ------------------------------------------------------------------ helpers


def _buffer(archive: TorchArchive, ref: Any, what: str) -> FlatBuffer:
    if not isinstance(ref, TensorRef):
        raise FormatError(f"{archive.path}: {what} is {type(ref).__name__}, expected a tensor")
    n = math.prod(ref.shape)
    frag = archive.fragment(ref, what)
    strides = [st for st, sz in zip(ref.stride, ref.shape) if sz != 1]
    if n > 1 and strides != [st for st, sz in zip(c_strides(ref.shape), ref.shape) if sz != 1]:
        raise FormatError(f"{archive.path}: {what} is not stored contiguously (strides {ref.stride})")
    return FlatBuffer(archive.path, frag.location.offset, ref.dtype, n)



# ------------------------------------------------------------------ reader


class _Reader:
    """Builds the index of one tag folder (ZeRO stage 0-3)."""

    def __init__(self, files: TagFiles) -> None:
        self.files = files
        self.where = files.tag_dir
        self._model0: Mapping[str, Any] = {}  # rank 0's model states (set by index)

    # -- model states -------------------------------------------------------

    def _model_states(self) -> dict[int, TorchArchive]:
        f = self.files
        if f.model:
            return {mp: open_archive(p, f"model states of mp rank {mp}") for mp, p in sorted(f.model.items())}
        if f.zero3_model:
            mps = sorted({mp for mp, _ in f.zero3_model})
            out = {}
            for mp in mps:
                dp0 = f.zero3_model.get((mp, 0))
                if dp0 is None:
                    raise FormatError(f"{self.where}: no zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt")
                out[mp] = open_archive(dp0, f"model states of mp rank {mp}, dp rank 0")
            return out
        raise FormatError(
            f"{self.where}: no *_model_states.pt file; a DeepSpeed tag folder has "
            "mp_rank_00_model_states.pt (ZeRO-0/1/2) or zero_pp_rank_0_mp_rank_00_model_states.pt (ZeRO-3)"
        )

    def index(self) -> CheckpointIndex:
        models = self._model_states()
        m0 = models[min(models)].obj
        self._model0 = m0
        if not isinstance(m0, Mapping):
            raise FormatError(f"{self.where}: model states are not a dict")
        dims = get(m0, "checkpoint_parallel_dimensions") or {}
        tp = int(get(dims, "tp_degree", 0) or 0)
        pp = int(get(dims, "pp_degree", 0) or 0)
        if not tp or not pp:  # older checkpoints: every mp slot is a tp rank
            tp, pp = max(len(models), int(get(m0, "mp_world_size", 1) or 1)), 1
        mp_degree = tp * pp
        if len(models) != mp_degree:
            missing = [mp for mp in range(mp_degree) if mp not in models]

            raise MissingShardError(
                f"{self.where}: model states for mp ranks {missing} are missing "
                f"(tp={tp} x pp={pp}; expected mp_rank_XX_model_states.pt for XX in 00..{mp_degree - 1:02d})"
            )
        dp = int(get(m0, "dp_world_size", 0) or 0)
        if not self.files.optim:
            return self._no_zero(models, m0, tp, pp)
        if not dp:
            dp = 1 + max(d for _, d in self.files.optim)
        require_grid(self.files, mp_degree, dp)

        step_by_mp: dict[int, dict[str, LogicalTensor]] = {}
        info: dict[str, Any] = {}
        for mp in range(mp_degree):
            ranks = [open_archive(self.files.optim[(mp, r)], f"dp rank {r}, mp rank {mp}") for r in range(dp)]
            osds = [self._osd(a) for a in ranks]
            shapes = self._param_shapes(models[mp], mp)
            stage_v = osds[0].get("zero_stage")
            stage = as_int(stage_v) if stage_v is not None else None
            if stage is not None and stage >= 3:
                tensors, meta = self._zero3(ranks, osds, shapes, mp)
            else:
                tensors, meta = self._zero12(ranks, osds, shapes, mp, stage)
            self._add_module_weights(tensors, models[mp], mp % tp)
            self._add_frozen(tensors, models[mp], mp, stage, dp)
            self._add_buffers(tensors, models[mp])
            step_by_mp[mp] = tensors
            if mp == 0:
                info = meta
        tensors, rules = self._merge_model_parallel(step_by_mp, models, tp, pp)
        self._add_shared(tensors, m0)
        rules = [*rules, FlatPartition(".*", axis="dp", alignment=info.get("alignment", 1))]
        extra = self._extra(m0, info, tp, pp, dp)
        return CheckpointIndex(
            format=FORMAT,
            path=self.files.tag_dir,
            tensors=tensors,
            step=int(get(m0, "global_steps", 0) or 0) if get(m0, "global_steps") is not None else None,
            extra=extra,
            rules=tuple(rules_to_json(rules)),
            provenance={
                "source_format": FORMAT,
                "tag": self.files.tag,
                "zero_stage": info.get("zero_stage"),
                "optimizer_wrapper": info.get("wrapper"),
                "dp": dp, "tp": tp, "pp": pp,
                "ds_version": get(m0, "ds_version"),
                "layout": "zero",
            },
        )

    # -- optimizer files ----------------------------------------------------

    def _osd(self, archive: TorchArchive) -> dict[str, Any]:
        obj = archive.obj
        osd = get(obj, "optimizer_state_dict")
        if not isinstance(osd, Mapping):
            raise FormatError(f"{archive.path}: no 'optimizer_state_dict' in a ZeRO optimizer file")
        return dict(osd)

    def _param_shapes(self, model: TorchArchive, mp: int) -> list[list[tuple[str, tuple[int, ...]]]]:
        ps = get(model.obj, "param_shapes")
        if ps is None:
            raise FormatError(f"{model.path}: no 'param_shapes' (needed to place parameters in the flat groups)")
        if isinstance(ps, Mapping):  # very old checkpoints: a single dict
            ps = [ps]
        out = []
        for group in ps:
            out.append([(check_name(str(k), model.path), shape_of(v)) for k, v in group.items()])
        return out

    def _zero12(self, ranks: Sequence[TorchArchive], osds: Sequence[dict[str, Any]],
                shapes: list[list[tuple[str, tuple[int, ...]]]], mp: int,
                stage: int | None) -> tuple[dict[str, LogicalTensor], dict[str, Any]]:
        o0 = osds[0]
        stripped = stage is not None  # DeepSpeedZeroOptimizer strips group padding from fp32; BF16_Optimizer keeps it
        fp32_groups: list[Any] = [o.get("single_partition_of_fp32_groups") for o in osds]
        if any(not isinstance(g, (list, tuple)) for g in fp32_groups):
            raise FormatError(f"{ranks[0].path}: no 'single_partition_of_fp32_groups' list")
        n_groups = len(fp32_groups[0])
        if len(shapes) != n_groups:
            raise FormatError(
                f"{self.where}: model states list {len(shapes)} param groups, optimizer files {n_groups}"
            )
        bos0 = o0.get("base_optimizer_state")
        elastic = isinstance(bos0, (list, tuple))
        align = o0.get("param_alignment_paddings")
        tensors: dict[str, LogicalTensor] = {}
        groups_hyper = []
        pgs = (bos0.get("param_groups") or []) if isinstance(bos0, Mapping) else []
        num_experts = get(self._model0, "num_experts") or []
        if elastic and num_experts:
            raise FormatError(f"{ranks[0].path}: MoE with elastic_checkpoint is not supported yet")
        for g in range(n_groups):
            ep = moe_group_ep(pgs[g]) if g < len(pgs) and isinstance(pgs[g], Mapping) else None
            # an MoE group is partitioned over each expert-parallel rank's expert-data-parallel group
            blocks = edp_members(len(ranks), ep).items() if ep else [(0, list(range(len(ranks))))]
            for e, members in blocks:
                parts, step = self._group_parts(ranks, osds, members, g, n_groups, stripped)
                group_align = list(align[g]) if isinstance(align, (list, tuple)) else [0] * len(shapes[g])
                frags = zero12_fragments(shapes[g], group_align, parts, where=f"{self.where} group {g}")
                for name, shape in shapes[g]:
                    states = {
                        k: TensorState(parts[0].buffers[k].dtype, shape, frags[name].get(k, ()))
                        for k in parts[0].buffers
                    }
                    scalars = {} if step is None else {"step": step}
                    glob = global_expert(name, e, self._local_experts(num_experts, ep)) if ep else name
                    tensors[glob] = LogicalTensor(glob, states, scalars)
            if not elastic and isinstance(bos0, Mapping):
                pg = bos0.get("param_groups") or []
                groups_hyper.append(hyper(pg[g]) if g < len(pg) else {})
        wrapper = "DeepSpeedZeroOptimizer" if stripped else "BF16_Optimizer"
        pcount = o0.get("partition_count")
        align_to = 2 * len(ranks) if stripped else None
        cfg_stage = get(get(self._ds_config(ranks[0]), "zero_optimization") or {}, "stage")
        meta = {
            "zero_stage": stage if stage is not None else int(cfg_stage or 0),
            "wrapper": wrapper,
            "elastic_checkpoint": elastic,
            "param_groups": groups_hyper or None,
            "partition_count": unpickled_to_json(pcount),
            "alignment": align_to or 1,
            "optimizer": unpickled_to_json({k: v for k, v in o0.items() if k in (
                "loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "ds_version")}),
            "parameter_alignment": any(any(int(x) for x in a) for a in align) if isinstance(align, list) else False,
        }
        return tensors, meta

    def _group_parts(self, ranks: Sequence[TorchArchive], osds: Sequence[dict[str, Any]], members: Sequence[int],
                     g: int, n_groups: int, stripped: bool) -> tuple[list[RankPartition], Any]:
        """The flat partitions of group ``g`` held by ``members`` (in partition order), and the Adam step."""
        parts = []
        partition = None
        step = None
        fp32_groups: list[Any] = [o.get("single_partition_of_fp32_groups") for o in osds]
        for i, r in enumerate(members):
            arch, o = ranks[r], osds[r]
            pads = o.get("group_paddings")
            if not isinstance(pads, (list, tuple)) or len(pads) != n_groups:
                raise FormatError(f"{arch.path}: 'group_paddings' missing or of the wrong length")
            pad = int(pads[g])
            fp32 = _buffer(arch, fp32_groups[r][g], f"single_partition_of_fp32_groups[{g}]")
            size = fp32.numel + (pad if stripped else 0)
            if partition is None:
                partition = size
            elif size != partition:
                raise FormatError(
                    f"{arch.path}: group {g} partition of {size} elements, rank {members[0]} has {partition} "
                    "(files from different runs?)"
                )
            st = self._group_state(o, g, arch.path)
            bufs = {"fp32": fp32}
            for k in ADAM_STATES:
                if k in st:
                    bufs[k] = _buffer(arch, st[k], f"{k} of group {g}")
            if i == 0 and "step" in st:
                step = read_scalar(arch, st["step"])
            elif i == 0 and o.get("base_optimizer_state_step") is not None:
                step = read_scalar(arch, o["base_optimizer_state_step"])
            parts.append(RankPartition(r, i * size, size - pad, bufs))
        return parts, step

    def _local_experts(self, num_experts: Any, ep: int) -> int:
        counts = {as_int(n) for n in num_experts} if isinstance(num_experts, (list, tuple)) else {as_int(num_experts)}
        if len(counts) != 1 or next(iter(counts)) % ep:
            raise FormatError(f"{self.where}: MoE layers with experts {num_experts} do not split over EP={ep}")
        return next(iter(counts)) // ep

    @staticmethod
    def _ds_config(archive: TorchArchive) -> Mapping[str, Any]:
        cfg = get(archive.obj, "ds_config")
        return cfg if isinstance(cfg, Mapping) else {}

    def _group_state(self, osd: Mapping[str, Any], g: int, path: str) -> Mapping[str, Any]:
        bos = osd.get("base_optimizer_state")
        if isinstance(bos, (list, tuple)):  # elastic_checkpoint: one lean state dict per group
            st = bos[g] if g < len(bos) else None
        elif isinstance(bos, Mapping):
            st = (bos.get("state") or {}).get(g, {})
        else:
            raise FormatError(f"{path}: no 'base_optimizer_state'")
        if not isinstance(st, Mapping):
            raise FormatError(f"{path}: optimizer state of group {g} is {type(st).__name__}")
        return st

    def _zero3(self, ranks: Sequence[TorchArchive], osds: Sequence[dict[str, Any]],
               shapes: list[list[tuple[str, tuple[int, ...]]]], mp: int,
               ) -> tuple[dict[str, LogicalTensor], dict[str, Any]]:
        o0 = osds[0]
        if o0.get("ds_zero_partition_groups"):
            raise FormatError(
                f"{ranks[0].path}: ZeRO-3 with per-group partitioning (AutoEP) is not supported yet"
            )
        world = as_int(o0.get("partition_count", len(ranks)))
        if world != len(ranks):
            raise FormatError(f"{ranks[0].path}: partition_count {world} but {len(ranks)} rank files")
        inner0 = o0.get("optimizer_state_dict") or {}
        param_groups = inner0.get("param_groups") or []
        sg_to_group = {}
        for gi, pg in enumerate(param_groups):
            for sg in (pg.get("params") or []) if isinstance(pg, Mapping) else []:
                sg_to_group[int(sg)] = gi
        tensors: dict[str, LogicalTensor] = {}
        for sg, sg_shapes in enumerate(shapes):
            per_rank = []
            step = None
            for r, (arch, o) in enumerate(zip(ranks, osds)):
                flat = o.get("fp32_flat_groups")
                state = ((o.get("optimizer_state_dict") or {}).get("state") or {}).get(sg, {})
                if not isinstance(flat, (list, tuple)) or sg >= len(flat):
                    raise FormatError(f"{arch.path}: no fp32_flat_groups[{sg}]")
                bufs = {"fp32": _buffer(arch, flat[sg], f"fp32_flat_groups[{sg}]")}
                for k in ADAM_STATES:
                    if k in state:
                        bufs[k] = _buffer(arch, state[k], f"{k} of sub-group {sg}")
                if r == 0 and "step" in state:
                    step = read_scalar(arch, state["step"])
                per_rank.append(bufs)
            frags = zero3_fragments(sg_shapes, per_rank, where=f"{self.where} sub-group {sg}")
            for name, shape in sg_shapes:
                states = {
                    k: TensorState(per_rank[0][k].dtype, shape, frags[name].get(k, ()))
                    for k in per_rank[0]
                }
                tensors[name] = LogicalTensor(name, states, {} if step is None else {"step": step})
        meta = {
            "zero_stage": 3,
            "wrapper": "DeepSpeedZeroOptimizer_Stage3",
            "param_groups": [hyper(pg) for pg in param_groups] or None,
            "sub_groups": {str(sg): sg_to_group.get(sg) for sg in range(len(shapes))},
            "partition_count": world,
            "alignment": 1,
            "optimizer": unpickled_to_json({k: v for k, v in o0.items() if k in (
                "loss_scaler", "dynamic_loss_scale", "overflow")}),
        }
        return tensors, meta

    # -- weights as the module holds them ------------------------------------

    def _add_module_weights(self, tensors: dict[str, LogicalTensor], model: TorchArchive, tp: int) -> None:
        """Add the ``param`` state (bf16/fp16 weights) from ``module`` or pipeline layer files.

        Pipeline layer ``i``'s file holds ``layer.state_dict()``; its parameters are
        ``f"{i}.{key}"`` in the ``PipelineModule`` (the names in ``param_shapes``).
        """
        module = get(model.obj, "module")
        refs: dict[str, tuple[TorchArchive, TensorRef]] = {}
        if isinstance(module, Mapping):
            for name, ref in module.items():
                if isinstance(ref, TensorRef):
                    refs[str(name)] = (model, ref)
        for (layer, ltp), path in sorted(self.files.layers.items()):
            if ltp != tp:
                continue
            arch = open_archive(path, f"pipeline layer {layer}, tp rank {tp}")
            for key, ref in iter_tensors(arch.obj):
                refs[f"{layer}.{key}"] = (arch, ref)
        for name, t in list(tensors.items()):
            got = refs.get(name)
            if got is None:
                continue
            arch, ref = got
            if ref.shape != t.shape or ref.dtype == t.state().dtype:
                continue  # ZeRO-3 placeholders (shape [0]) or the same fp32 values as the master
            frag = arch.fragment(ref, name)
            tensors[name] = LogicalTensor(
                name, {**t.states, "param": TensorState(ref.dtype, ref.shape, (frag,))}, t.scalars
            )

    def _add_buffers(self, tensors: dict[str, LogicalTensor], model: TorchArchive) -> None:
        """Module buffers (``buffer_names``), as zero_to_fp32 includes them."""
        module = get(model.obj, "module")
        if not isinstance(module, Mapping):
            return
        for name in get(model.obj, "buffer_names") or []:
            ref = module.get(name)
            if str(name) in tensors or not isinstance(ref, TensorRef):
                continue
            state = "fp32" if ref.dtype == "float32" else "param"
            frag = model.fragment(ref, str(name))
            tensors[str(name)] = LogicalTensor(str(name), {state: TensorState(ref.dtype, ref.shape, (frag,))})

    def _add_frozen(self, tensors: dict[str, LogicalTensor], model: TorchArchive, mp: int,
                    stage: int | None, dp: int) -> None:
        shapes = get(model.obj, "frozen_param_shapes") or {}
        if not shapes:
            return
        if stage is not None and stage >= 3:
            missing = [r for r in range(dp) if (mp, r) not in self.files.zero3_model]
            if missing:
                raise MissingShardError(
                    f"{self.where}: frozen parameters need zero_pp_rank_{{r}}_mp_rank_{mp:02d}_model_states.pt "
                    f"for every dp rank; missing for dp ranks {missing}"
                )
            archives = [
                open_archive(self.files.zero3_model[(mp, r)], f"model states of dp rank {r}, mp rank {mp}")
                for r in range(dp)
            ]
        else:
            archives = [model]
        for name, shp in shapes.items():
            name, shape = str(name), shape_of(shp)
            n = math.prod(shape)
            frags: list[Fragment] = []
            dtype = None
            p = math.ceil(n / len(archives)) if archives else 0
            for r, arch in enumerate(archives):
                ref = (get(arch.obj, "frozen_param_fragments") or {}).get(name)
                if ref is None:
                    ref = (get(arch.obj, "module") or {}).get(name)
                if not isinstance(ref, TensorRef):
                    raise FormatError(f"{arch.path}: frozen parameter {name!r} has no stored fragment")
                dtype = ref.dtype
                if len(archives) == 1:
                    frags = [arch.fragment(ref, name)]
                    if ref.shape != shape:  # stored flat
                        buf = _buffer(arch, ref, name)
                        frags = [contiguous_fragment(shape, buf.file, buf.byte_offset, dtype)]
                    break

                buf = _buffer(arch, ref, name)
                a, b = r * p, min(n, (r + 1) * p)
                if a < b:
                    frags.extend(flat_range_fragments(shape, a, b, buf.file, buf.byte_offset, dtype))
            state = "fp32" if dtype == "float32" else "param"
            tensors[name] = LogicalTensor(name, {state: TensorState(dtype or "float32", shape, tuple(frags))})

    # -- model parallelism ----------------------------------------------------

    def _merge_model_parallel(self, by_mp: dict[int, dict[str, LogicalTensor]],
                              models: dict[int, TorchArchive], tp: int, pp: int,
                              ) -> tuple[dict[str, LogicalTensor], list[Rule]]:
        if tp == 1 and pp == 1:
            return by_mp[0], []
        uc = get(models[0].obj, "universal_checkpoint_info") or {}
        pp_repl = list(uc.get("pipeline_replicated_parameter_patterns", []) or [])
        tp_repl = list(uc.get("tp_replicated_parameter_patterns", []) or [])
        row = list(uc.get("parameter_with_row_parallelism_patterns", []) or [])
        vocab = list(uc.get("vocabulary_parameter_patterns", []) or [])
        two_sub = list(uc.get("parameter_with_2_sub_params_cat_dim_0", []) or [])
        avg = list(uc.get("parameter_to_average_patterns", []) or [])
        other = [k for k in ("parameter_with_sub_params", "affine_map") if uc.get(k)]
        if other:
            raise FormatError(
                f"{self.where}: universal_checkpoint_info uses {other}; merging such tensor-parallel "
                "layouts is not supported yet"
            )

        def match(patterns: list[str], name: str) -> bool:
            return any(re.match(p, name) for p in patterns)

        rules: list[Rule] = []
        padded: dict[str, tuple[int, int]] = {}
        out: dict[str, LogicalTensor] = {}
        for p_idx in range(pp):
            names = list(by_mp[p_idx * tp])
            for name in names:
                if p_idx > 0 and match(pp_repl, name):
                    continue
                slices = [by_mp[p_idx * tp + t][name] for t in range(tp) if name in by_mp[p_idx * tp + t]]
                if len(slices) != tp:
                    raise FormatError(f"{self.where}: {name!r} is missing on some tensor-parallel ranks")
                if match(avg, name):
                    raise FormatError(
                        f"{self.where}: {name!r} is averaged over tensor-parallel ranks; "
                        "that is not a fragment mapping and is not supported"
                    )
                if tp == 1 or match(tp_repl, name):
                    merged = slices[0]
                else:
                    merged = self._cat_tp(name, slices, 1 if match(row, name) else 0, match(two_sub, name))
                if match(vocab, name):
                    size = int(uc["original_vocab_size"])
                    merged = LogicalTensor(name, {
                        k: crop(s, Box((0,) * len(s.shape), (size, *s.shape[1:]))) for k, s in merged.states.items()
                    }, merged.scalars)
                    padded[name] = (size, slices[0].shape[0] * tp)
                out[name] = merged
        # the layout as rules: the checkpoint's own patterns, first match wins (as ds_to_universal)
        def anchored(p: str) -> str:  # DeepSpeed uses re.match; Rule.matches uses re.search
            return p if p.startswith("^") else f"^(?:{p})"

        if tp > 1:
            rules += [Replicate(anchored(p), axis="tp", check="first") for p in tp_repl]
            rules += [Shard(anchored(p), axis="tp", dim=1) for p in row]
            rules += [Shard(".*", axis="tp", dim=0)]
        rules += [Pad(f"^{re.escape(n)}$", dim=0, size=a, padded=b) for n, (a, b) in padded.items()]
        if pp > 1:
            rules += [Replicate(anchored(p), axis="pp", check="first") for p in pp_repl]
        return out, rules

    @staticmethod
    def _cat_tp(name: str, slices: list[LogicalTensor], dim: int, two_sub: bool) -> LogicalTensor:
        states = {}
        for k in slices[0].states:
            parts = [s.states[k] for s in slices]
            if two_sub:
                halves = []
                for half in (0, 1):
                    for p in parts:
                        h = p.shape[0] // 2
                        halves.append(crop(p, Box((half * h, *([0] * (len(p.shape) - 1))), (h, *p.shape[1:]))))
                states[k] = concat(halves, 0)
            else:
                states[k] = concat(parts, dim)
        return LogicalTensor(name, states, slices[0].scalars)

    def _add_shared(self, tensors: dict[str, LogicalTensor], m0: Mapping[str, Any]) -> None:
        for alias, target in (get(m0, "shared_params") or {}).items():
            t = tensors.get(str(target))
            if t is not None and str(alias) not in tensors:
                tensors[str(alias)] = LogicalTensor(str(alias), t.states, dict(t.scalars))

    # -- no ZeRO optimizer files ----------------------------------------------

    def _no_zero(self, models: dict[int, TorchArchive], m0: Mapping[str, Any], tp: int, pp: int
                 ) -> CheckpointIndex:
        """ZeRO stage 0 / weights-only: the module state dict of each mp rank (tp=pp=1 only)."""
        if len(models) != 1:
            raise FormatError(f"{self.where}: no ZeRO optimizer files and {len(models)} model-parallel ranks")
        arch = models[min(models)]
        tensors = {}
        module = get(arch.obj, "module") or {}
        for name, ref in iter_tensors(module):
            frag = arch.fragment(ref, name)
            state = "fp32" if ref.dtype == "float32" else "param"
            tensors[name] = LogicalTensor(name, {state: TensorState(ref.dtype, ref.shape, (frag,))})
        return CheckpointIndex(
            format=FORMAT, path=self.files.tag_dir, tensors=tensors,
            step=get(m0, "global_steps"), extra=self._extra(m0, {}, tp, pp, 1),
            provenance={"source_format": FORMAT, "tag": self.files.tag, "zero_stage": 0, "layout": "module"},
        )

    # -- non-tensor state -------------------------------------------------------

    def _extra(self, m0: Mapping[str, Any], info: Mapping[str, Any], tp: int, pp: int, dp: int) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "zero_stage": info.get("zero_stage"),
            "optimizer_wrapper": info.get("wrapper"),
            "param_groups": info.get("param_groups"),
            "dp_world_size": dp, "tp_degree": tp, "pp_degree": pp,
        }
        for k in ("sub_groups", "partition_count", "elastic_checkpoint", "parameter_alignment"):
            if k in info:
                extra[k] = info[k]
        if info.get("optimizer"):
            extra["optimizer"] = info["optimizer"]
        for k in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler", "data_sampler",
                  "random_ltd", "ds_config", "ds_version", "buffer_names", "shared_params",
                  "universal_checkpoint_info", "mp_world_size"):
            if k in m0:
                extra[k] = unpickled_to_json(m0[k])
        client = {str(k): unpickled_to_json(v) for k, v in m0.items() if k not in _DS_MODEL_KEYS}
        if client:
            extra["client_state"] = client
        return extra
