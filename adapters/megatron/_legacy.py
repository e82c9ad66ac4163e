"""Read Megatron-LM's legacy ``--ckpt-format torch`` iteration directory in place.

``iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per (TP, PP[, EP]) rank (+
``distrib_optim.pt`` with ``--use-distributed-optimizer``: a ChainedOptimizer's ``[dense, expert]``
buffers at EP > 1, see :func:`_read_distrib_optim`). Returns, per
global parameter name, each state's per-TP-rank pieces (zero copy
fragments), which ``megatron.index`` consolidates with the layout rules::

    raw = read_legacy("run/iter_0000005")
    raw.pieces["decoder.layers.3.mlp.linear_fc1.weight"]["exp_avg"]  # {tp_rank: TensorState}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptbridge.adapters.torch_save import TensorRef, TorchArchive, read_scalar
from ckptbridge.plugin import (
    FormatError,
    MissingShardError,
    TensorState,
    contiguous_fragment,
    storage,
)

from ._common import args_dict, rank_dir_name
from ._format import rank_dirs
from ._layout import LAYER_RE, MegatronConfig
from ._moe import GROUPED_RE, global_expert_name, grouped_experts, is_buffer, is_expert, rank_grid
from ._optim import grad_buffer, group_order
from ._write_moe import optimizer_split


@dataclass
class RawCheckpoint:
    """Per-rank pieces before TP consolidation (or, for torch_dist, already global)."""

    args: dict[str, Any]
    iteration: int | None
    pieces: dict[str, dict[str, dict[int, TensorState]]] = field(default_factory=dict)
    scalars: dict[str, dict[str, float | int]] = field(default_factory=dict)
    offsets: dict[tuple[int, int], int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)


def _state_of(archive: TorchArchive, ref: TensorRef, name: str) -> TensorState:
    return TensorState(ref.dtype, ref.shape, (archive.fragment(ref, name),))


def _model_chunks(obj: Mapping[str, Any], where: str) -> list[Mapping[str, Any]]:
    if "model" in obj:
        return [obj["model"]]
    chunks: list[Mapping[str, Any]] = []
    while f"model{len(chunks)}" in obj:
        chunks.append(obj[f"model{len(chunks)}"])
    if not chunks:
        raise FormatError(f"{where}: no 'model' entry (saved with --no-save-model?)")
    return chunks


def _params(model_sd: Mapping[str, Any]) -> list[tuple[str, TensorRef]]:
    return [(k, v) for k, v in model_sd.items() if isinstance(v, TensorRef) and not k.endswith("_extra_state")]


def _rank_files(cfg: MegatronConfig, args: Mapping[str, Any], ranks: Mapping[tuple[int, ...], str],
                it_dir: str) -> dict[tuple[int, int, int], tuple[str, int]]:
    """The rank directories the args say Megatron-LM wrote: (tp, pp, ep) -> (directory, expert-TP rank).

    Dense runs: one per (tp, pp). Expert parallelism: one per rank whose expert-data-parallel
    rank is 0 (Megatron-LM's ``save_checkpoint``), named by its dense TP, PP and its EP rank."""
    want: dict[tuple[int, int, int], tuple[tuple[int, ...], int]]
    if cfg.ep == 1:
        want = {(t, p, 0): ((t, p), t) for t in range(cfg.tp) for p in range(cfg.pp)}
    else:
        world = int(args.get("world_size") or cfg.tp * cfg.pp * cfg.dp)
        want = {}
        for c in rank_grid(cfg.tp, cfg.pp, cfg.ep, cfg.etp, world):
            if c.edp == 0:
                if (c.tp, c.pp, c.ep) in want:
                    raise FormatError(f"{it_dir}: two ranks write {rank_dir_name(c.tp, c.pp, cfg.pp, c.ep)} "
                                      f"(expert TP {cfg.etp} > TP {cfg.tp}): Megatron-LM kept only one of them")
                want[(c.tp, c.pp, c.ep)] = ((c.tp, c.pp, c.ep) if cfg.pp > 1 else (c.tp, c.ep), c.etp)
    missing = [rank_dir_name(t, p, cfg.pp, e if cfg.ep > 1 else None)
               for (t, p, e), (key, _) in sorted(want.items()) if key not in ranks]
    if missing:
        raise MissingShardError(
            f"{it_dir}: the args say TP={cfg.tp} PP={cfg.pp} EP={cfg.ep} but rank directories {missing} are "
            "missing (incomplete copy?)"
        )
    extra = sorted(set(ranks) - {key for key, _ in want.values()})
    if extra:
        raise FormatError(f"{ranks[extra[0]]}: rank outside TP={cfg.tp} PP={cfg.pp} EP={cfg.ep} from the args")
    return {k: (ranks[key], etp) for k, (key, etp) in want.items()}


def read_legacy(it_dir: str, iteration: int | None) -> RawCheckpoint:
    ranks = rank_dirs(it_dir)
    if not ranks:
        raise FormatError(f"{it_dir}: no mp_rank_* directories")
    first = ranks.get((0, 0)) or ranks.get((0, 0, 0))
    if first is None:
        raise MissingShardError(f"{it_dir}/mp_rank_00[_000]: rank 0 directory missing")
    arch0 = TorchArchive.open(storage.join(first, "model_optim_rng.pt"))
    args = args_dict(arch0.obj.get("args"), arch0.path)
    cfg = MegatronConfig.from_args(args, where=arch0.path)
    files = _rank_files(cfg, args, ranks, it_dir)
    archives: dict[tuple[int, int, int], TorchArchive] = {}
    for slot, (d, _) in sorted(files.items()):
        f = storage.join(d, "model_optim_rng.pt")
        if not storage.isfile(f):
            raise MissingShardError(f"{f}: rank file missing")
        archives[slot] = arch0 if d == first else TorchArchive.open(f)
    raw = RawCheckpoint(args, iteration if iteration is not None else arch0.obj.get("iteration"))
    raw.files = [a.path for a in archives.values()]

    # Pipeline: layer offsets from the cumulative layer counts of chunks in (vp, pp) order.
    counts: dict[tuple[int, int], int] = {}
    for p in range(cfg.pp):
        for v, chunk in enumerate(_model_chunks(archives[(0, p, 0)].obj, archives[(0, p, 0)].path)):
            layers = {int(m.group(1)) for k in chunk if (m := LAYER_RE.match(k))}
            counts[(v, p)] = max(layers) + 1 if layers else 0
    total, offsets = 0, {}
    for key in sorted(counts):
        offsets[key] = total
        total += counts[key]
    if total != cfg.num_layers:
        raise FormatError(f"{it_dir}: stages hold {total} decoder layers, the args say {cfg.num_layers}")
    raw.offsets = offsets

    dist_opt = cfg.distributed_optimizer or storage.isfile(storage.join(first, "distrib_optim.pt"))
    opt_kind = None
    dense_read: set[tuple[int, int]] = set()  # (TP, PP) ranks whose dense distributed-optimizer state was read
    num_local = cfg.num_experts // cfg.ep
    for (t, p, e), arch in sorted(archives.items()):
        etp = files[(t, p, e)][1]
        chunks = _model_chunks(arch.obj, arch.path)
        named: list[tuple[str, str, TensorRef]] = []  # (local name, global name, ref)
        keys: dict[str, int] = {}  # global name -> the TP (expert-TP) rank its piece stands for
        for v, chunk in enumerate(chunks):
            for local, ref in _params(chunk):
                m = LAYER_RE.match(local)
                glob = f"decoder.layers.{int(m.group(1)) + offsets[(v, p)]}.{m.group(2)}" if m else local
                if is_expert(glob):
                    glob = global_expert_name(glob, e, num_local)
                    # GroupedMLP buffers hold all local experts: keep the EP rank until they are split
                    keys[glob] = e * cfg.etp + etp if cfg.grouped_gemm else etp
                else:
                    keys[glob] = t
                if not is_buffer(glob):
                    named.append((local, glob, ref))
                # dense parameters repeat in every EP rank's file: keep the first
                raw.pieces.setdefault(glob, {}).setdefault("model", {}).setdefault(keys[glob], _state_of(arch, ref, glob))
        opt = arch.obj.get("optimizer")
        if opt is None:
            continue
        if dist_opt:
            opt_kind = "distributed"
            if _read_distrib_optim(raw, cfg, args, (t, p, e), named, keys, arch, it_dir):
                dense_read.add((t, p))
            continue
        # a ChainedOptimizer (EP > 1) saves [dense optimizer, expert optimizer]
        subs = list(opt) if isinstance(opt, list) else [opt]
        parts = [[n for n in named if not is_expert(n[1])], [n for n in named if is_expert(n[1])]] \
            if len(subs) == 2 and cfg.num_experts else [named]
        if len(parts) != len(subs):
            raise FormatError(f"{arch.path}: {len(subs)} chained optimizers, expected {len(parts)}")
        for sub, part in zip(subs, parts):
            opt_kind = _read_optimizer(raw, args, keys, part, arch, sub)
    if opt_kind == "distributed" and (lack := sorted({(t, p) for t, p, _ in archives} - dense_read)):
        raise MissingShardError(f"{it_dir}: no distrib_optim.pt holds the dense optimizer's state of TP rank "
                                f"{lack[0][0]} PP rank {lack[0][1]} (written by its data-parallel rank 0)")
    if cfg.grouped_gemm:
        _split_grouped(raw, cfg)
    raw.extra["optimizer_kind"] = opt_kind
    raw.extra["layers_per_chunk"] = {f"{v},{p}": n for (v, p), n in sorted(counts.items())}
    o = arch0.obj.get("optimizer")
    if isinstance(o, list) and o:
        o = o[0]
    if isinstance(o, Mapping):
        inner = o.get("optimizer", o) if "state" not in o else o
        raw.extra["param_groups"] = [
            {k: v for k, v in g.items() if k != "params"} for g in (inner.get("param_groups") or [])
        ]
    for extra_key in ("opt_param_scheduler", "num_floating_point_operations_so_far", "checkpoint_version"):
        if extra_key in arch0.obj:
            raw.extra[extra_key] = arch0.obj[extra_key]
    return raw


def _read_optimizer(raw: RawCheckpoint, args: Mapping[str, Any], keys: Mapping[str, int],
                    named: list[tuple[str, str, TensorRef]], arch: TorchArchive, opt: Any) -> str:
    """One (non-distributed) optimizer's state dict; returns its kind."""
    if isinstance(opt, Mapping) and "fp32_from_fp16_params" in opt:
        _read_torch_adam(raw, args, keys, named, arch, opt["optimizer"], opt["fp32_from_fp16_params"])
        return "float16"
    if isinstance(opt, Mapping) and "state" in opt:
        _read_torch_adam(raw, args, keys, named, arch, opt, None)
        return "fp32"
    if isinstance(opt, Mapping) and isinstance(opt.get("optimizer"), Mapping) and "state" in opt["optimizer"]:
        _read_torch_adam(raw, args, keys, named, arch, opt["optimizer"], None)
        return "fp32"
    raise FormatError(f"{arch.path}: unrecognised optimizer entry")


def _split_grouped(raw: RawCheckpoint, cfg: MegatronConfig) -> None:
    """Legacy GroupedMLP ``experts.weight1/weight2`` pieces (keyed ``ep * ETP + etp``) -> per-expert pieces."""
    for name in [n for n in raw.pieces if GROUPED_RE.match(n)]:
        states = raw.pieces.pop(name)
        scalars = raw.scalars.pop(name, {})
        for state, parts in states.items():
            for key, piece in parts.items():
                ep, etp = divmod(key, cfg.etp)
                for glob, st in grouped_experts(name, piece, cfg.hidden, cfg.num_experts // cfg.ep, ep):
                    raw.pieces.setdefault(glob, {}).setdefault(state, {})[etp] = st
                    if scalars:
                        raw.scalars[glob] = dict(scalars)


def _read_torch_adam(raw: RawCheckpoint, args: Mapping[str, Any], keys: Mapping[str, int],
                     named: list[tuple[str, str, TensorRef]], arch: TorchArchive, inner: Mapping[str, Any],
                     fp32_from_16: Any) -> None:
    groups = inner.get("param_groups") or []
    state = inner.get("state") or {}
    by_glob = {glob: ref for _, glob, ref in named}
    # model chunks (virtual pipeline) reuse local names; the global names are unique
    order = group_order([(glob, ref.shape) for _, glob, ref in named], groups, args, arch.path)
    for gi, (g, names) in enumerate(zip(groups, order)):
        for j, (idx, glob) in enumerate(zip(g["params"], names)):
            ref = by_glob[glob]
            st = state.get(idx)
            slots = raw.pieces[glob]
            if st:
                for key in ("exp_avg", "exp_avg_sq"):
                    r = st.get(key)
                    if isinstance(r, TensorRef):
                        if r.shape != ref.shape:
                            raise FormatError(
                                f"{arch.path}: optimizer slot {idx} ({key}) has shape {r.shape} but "
                                f"{glob!r} is {ref.shape}: param-group order differs from Megatron's"
                            )
                        slots.setdefault(key, {}).setdefault(keys[glob], _state_of(arch, r, glob))
                if "step" in st:
                    raw.scalars.setdefault(glob, {})["step"] = read_scalar(arch, st["step"])
            if fp32_from_16 is not None:
                r = fp32_from_16[gi][j]
                if not isinstance(r, TensorRef) or r.shape != ref.shape:
                    raise FormatError(f"{arch.path}: fp32 master copy of {glob!r} missing or mis-shaped")
                slots.setdefault("fp32_master", {}).setdefault(keys[glob], _state_of(arch, r, glob))


def _read_distrib_optim(raw: RawCheckpoint, cfg: MegatronConfig, args: Mapping[str, Any], rank: tuple[int, int, int],
                        named: list[tuple[str, str, TensorRef]], keys: Mapping[str, int], arch: TorchArchive,
                        it_dir: str) -> bool:
    """One rank file's ``distrib_optim.pt``: megatron-core's ``save_parameter_state``, the coalesced fp32 buffers
    of each optimizer gathered on its data-parallel rank 0 -- one optimizer, or at EP > 1 a ``ChainedOptimizer``'s
    ``[dense, expert]`` (``None`` where another rank's file holds it: the dense part is written by dense-DP rank
    0, the expert part by expert-DP rank 0, which writes this file). The parameters of each buffer are this
    file's, split as megatron-core splits its optimizers (``_write_moe.optimizer_split``, the writer's own).
    Returns whether the dense part was here."""
    t, p, e = rank
    path = storage.join(it_dir, rank_dir_name(t, p, cfg.pp, e if cfg.ep > 1 else None), "distrib_optim.pt")
    if not storage.isfile(path):
        raise MissingShardError(
            f"{path}: distributed-optimizer state missing (the run used --use-distributed-optimizer)"
        )
    dopt = TorchArchive.open(path)
    raw.files.append(path)
    parts = optimizer_split(named, cfg.ep, lambda n: is_expert(n[1]))
    entry = arch.obj["optimizer"]
    subs = entry if isinstance(entry, list) else [entry]
    bufs = dopt.obj if isinstance(dopt.obj, list) else [dopt.obj]
    if not len(parts) == len(subs) == len(bufs):
        raise FormatError(f"{path}: {len(bufs)} optimizers' buffers ({arch.path}: {len(subs)} optimizer states), "
                          f"expected {len(parts)} (EP={cfg.ep})")
    for i, (part, sub, buf) in enumerate(zip(parts, subs, bufs)):
        if buf is None:
            continue
        groups = ((sub or {}).get("optimizer") or {}).get("param_groups") or []
        step = next((g["step"] for g in groups if "step" in g), None)
        _read_buffers(raw, cfg, args, p, part, keys, dopt, buf, step, i == 0)
    return bufs[0] is not None


def _read_buffers(raw: RawCheckpoint, cfg: MegatronConfig, args: Mapping[str, Any], pp: int,
                  named: list[tuple[str, str, TensorRef]], keys: Mapping[str, int], dopt: TorchArchive,
                  obj: Mapping[Any, Any], step: Any, dense: bool) -> None:
    """One optimizer's coalesced buffers (fp32 master, exp_avg, exp_avg_sq) as zero-copy pieces of ``named``."""
    path = dopt.path
    if not isinstance(obj, Mapping) or not obj.get("buckets_coalesced", False):
        raise FormatError(f"{path}: pre-coalesced distributed-optimizer format is not supported")
    gbufs = [k for k in obj if isinstance(k, int)]
    if len(gbufs) != 1:
        raise FormatError(f"{path}: {len(gbufs)} grad buffers (several model chunks or dtypes) are not supported yet")
    per_dtype = obj[gbufs[0]]
    if len(per_dtype) != 1:
        raise FormatError(f"{path}: several dtypes in one grad buffer are not supported yet")
    (dtypes, flat), = per_dtype.items()
    params = [(glob, ref.shape) for _, glob, ref in named]
    want = int(flat["numel_unpadded"])
    slots = None
    for align in (64, 1):  # params start 64-aligned since mcore 0.8; unaligned before
        cand, sizes = grad_buffer(params, args, pp, dense and cfg.tied and cfg.pp > 1, align)
        if sum(sizes) == want:
            slots = cand
            break
    if slots is None:
        raise FormatError(
            f"{path}: buffer of {want} elements does not match Megatron's layout of this rank's "
            f"{len(params)} {'dense' if dense else 'expert'} params; unknown megatron-core version?"
        )
    for key, state in (("param", "fp32_master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
        ref = flat.get(key)
        if not isinstance(ref, TensorRef) or ref.shape != (want,):
            raise FormatError(f"{path}: buffer {key!r} missing or not {want} long")
        start, _ = dopt.storage_offsets[ref.storage.key]
        if ref.dtype != "float32":
            raise FormatError(f"{path}: buffer {key!r} is {ref.dtype}, expected float32")
        for s in slots:
            frag = contiguous_fragment(s.shape, path, start + (ref.offset + s.start) * 4, ref.dtype)
            raw.pieces[s.name].setdefault(state, {})[keys[s.name]] = TensorState(ref.dtype, s.shape, (frag,))
    if step is not None:
        for s in slots:
            raw.scalars.setdefault(s.name, {})["step"] = int(step) if float(step).is_integer() else step
    raw.extra["distributed_optimizer_dtype"] = [d.name if hasattr(d, "name") else str(d) for d in dtypes]


__all__ = ["RawCheckpoint", "read_legacy"]
