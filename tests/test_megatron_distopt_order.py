"""The distributed optimizer's state of MLA, q/k-norm, MoE and MTP models: ckptbridge reads megatron-core's own
``torch_dist`` and legacy saves, at EP 1 and EP 2, and writes ``distrib_optim.pt`` files megatron-core loads,
all bitwise (issue #28).

Megatron's distributed optimizer keeps each rank's fp32 masters and Adam moments in flat buffers laid out
in the model's ``named_parameters()`` order; the default ``dp_reshardable`` save (and the legacy
``distrib_optim.pt``) stores those buffers without parameter names, so ckptbridge rebuilds that order from
the args (``_layout._param_sort_key``). megatron-core 0.16.1 registers, inside a layer, MLA's
``linear_proj`` first (``Attention.__init__``), then ``linear_q_proj`` or ``linear_q_down_proj`` /
``linear_q_up_proj``, ``linear_kv_down_proj``, ``linear_kv_up_proj``, ``q_layernorm`` (query LoRA only),
``kv_layernorm`` (``MLASelfAttention.__init__``); Qwen3's ``q_layernorm`` before ``k_layernorm``; a MoE
layer its router, the experts by number, the shared experts; an MTP layer ``enorm``, ``hnorm``,
``eh_proj``, its transformer layer and final norm, between the decoder's final norm and the output layer.
At EP > 1 the experts (``allreduce`` False) have an optimizer of their own (a ``ChainedOptimizer`` of the
dense and the expert one): ``chained_1.`` buffers indexed over the ``tp-ep-pp`` expert group in
``dp_reshardable``, the second entry of ``distrib_optim.pt``.

One ``tools/megatron/core_loss.py`` launch (megatron-core 0.16.1, 2 gloo ranks, CPU):

* ``train:`` items build tiny ``GPTModel`` models from Megatron args (``recipes.megatron_args`` of Qwen3 and
  DeepSeek-V3 configs; bf16, ``--use-distributed-optimizer``): Qwen3 (q/k norms) at TP 2; DeepSeek-V3 with
  a query LoRA (MLA, a dense layer then a MoE layer of 11 routed experts and a shared expert, an MTP layer
  that is a MoE layer too) at TP 2 (experts at ETP 2, sequence parallel), saved ``dp_reshardable``, then
  the same state ``fully_reshardable`` (state stored per parameter name) and as legacy files; DeepSeek-V3
  without a query LoRA at TP 1 (DP 2: each rank owns half of the buffer); DeepSeek-V3 with 4 routed
  experts at TP 2 x EP 2 with expert TP 1 (each rank: its dense TP half, two whole experts),
  ``dp_reshardable`` and as legacy files. Each takes one real training step from a seeded init
  (``DistributedDataParallel`` + ``get_megatron_optimizer``), dumps megatron-core's optimizer state (fp32
  master, exp_avg, exp_avg_sq: every DP-owned piece) and its parameter list (``named_parameters()`` order,
  experts under their global ids, local shapes, ``partition_dim``, the rank's EP and expert-TP place), and
  saves as Megatron-LM's ``save_checkpoint`` does (``torch_dist``: ``dist_checkpointing.save``, its
  sharded-state-dict metadata, the fully parallel save strategy; legacy: ``model_optim_rng.pt`` from the
  expert-DP rank 0 ranks and megatron-core's own ``save_parameter_state`` into ``distrib_optim.pt``);
* ``cli:`` items run ``reshard --to megatron`` (legacy files, ``distrib_optim.pt``) from the
  ``fully_reshardable`` MLA save at TP 2 and from the TP 1 save, and megatron-core loads each written
  checkpoint (strict model load, ``optimizer.load_state_dict``, ``load_parameter_state``) and dumps its
  optimizer state.

Asserted: ``ckptbridge.open`` of every save gives every parameter's three states bitwise equal to
megatron-core's dump (cut to each TP rank along megatron-core's ``partition_dim``, a routed expert to its
expert-TP rank; TP-replicated ones against TP rank 0, the replica megatron-core saves); the order ckptbridge
rebuilds (from the checkpoint's names and from the names sorted) is megatron-core's ``named_parameters()`` on
every rank; megatron-core's state after loading each written ``distrib_optim.pt`` is bitwise its state when it
saved the source. Negative control: the EP 2 save read with each expert buffer taken for the other EP rank's.

Measured on the old order (one ``self_attention.`` slot, ties in the caller's order, experts sorted apart):
the reader got 324 of the 462 state tensors compared of the MLA + MoE save wrong and 48 of 75 of the TP 1
one, Qwen3's order from sorted names put ``k_layernorm`` first (its states happened to be right: the save
lists q before k); megatron-core loaded 234 of its 516 rank-local state tensors wrong from the written MLA
``distrib_optim.pt`` and 18 of 75 from the TP 1 one.
"""

from __future__ import annotations

import glob
import json
import os
import sys

import numpy as np
import pytest
from _common import core_loss

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_models as hf

import ckptbridge
from ckptbridge import recipes

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE = os.path.join(HERE, "fixtures", "megatron", "A", "tp1pp1", "torch")  # a real run's args
QWEN3 = hf.HFSpec("qwen3", layers=2, emb=32, mlp=48, heads=4, kv_heads=2, head_dim=8)
MLA = hf.DeepseekSpec(layers=2, dense=1, emb=32, experts=11, experts_per_tok=2, groups=1, topk_groups=1,
                      moe_mlp=8, mlp=40)
MLA_NOQ = hf.DeepseekSpec(layers=1, dense=1, emb=32, q_lora=None, mlp=40)
MLA_EP = hf.DeepseekSpec(layers=2, dense=1, emb=32, experts=4, experts_per_tok=2, groups=1, topk_groups=1,
                         moe_mlp=8, mlp=40)
# label: (config, TP, EP, expert TP, the same state saved again as: "torch" legacy files in <label>_legacy,
# "fully_reshardable" torch_dist in <label>_fully); <label> itself: dp_reshardable torch_dist
CASES = {"qwen3_tp2": (QWEN3, 2, 1, 2, ()), "mla_tp2": (MLA, 2, 1, 2, ("torch", "fully_reshardable")),
         "mla_noq_tp1": (MLA_NOQ, 1, 1, 1, ()), "mla_tp2ep2etp1": (MLA_EP, 2, 2, 1, ("torch",))}
SUFFIX = {"torch": "_legacy", "fully_reshardable": "_fully"}
# written: (source case, TP): ``reshard --to megatron`` (legacy files with distrib_optim.pt) at the source's TP
WRITTEN = {"mla_tp2_written": ("mla_tp2_fully", 2), "mla_noq_tp1_written": ("mla_noq_tp1", 1)}
TRAIN = {"bf16": True, "params_dtype": "torch.bfloat16", "use_distributed_optimizer": True,
         "accumulate_allreduce_grads_in_fp32": True, "lr_warmup_iters": 0, "overlap_grad_reduce": False,
         "pipeline_model_parallel_size": 1, "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 1e-2,
         "seq_length": 16, "micro_batch_size": 2, "global_batch_size": 8}


def _config(spec: object) -> object:
    return spec.config() if isinstance(spec, hf.DeepseekSpec) else hf.config(spec)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """One ``core_loss.py`` launch (2 ranks): every ``CASES`` model trained one step and saved, then each
    ``WRITTEN`` checkpoint written by ``reshard --to megatron`` from its save (a ``cli:`` item) and loaded by
    megatron-core with its optimizer (``--train-step``). Label -> record + ``dir`` + ``dump``."""
    work = tmp_path_factory.mktemp("distopt_order")
    template = ckptbridge.open(TEMPLATE).extra["megatron"]["args"]
    items: dict[str, str] = {}
    for label, (spec, tp, ep, etp, also) in CASES.items():
        args = {**recipes.megatron_args(_config(spec), template={**template, "tensor_model_parallel_size": tp}),
                **TRAIN, "tensor_model_parallel_size": tp, "expert_tensor_parallel_size": etp,
                "expert_model_parallel_size": ep, "dist_ckpt_optim_fully_reshardable": False}
        (work / f"{label}.json").write_text(json.dumps(args))
        items[label] = f"train:{work / label}.json={work / label}" + "".join(
            f",{kind}:{work / label}{SUFFIX[kind]}" for kind in also)
    for label, (src, tp) in WRITTEN.items():
        argv = ["reshard", str(work / src), str(work / label), "--to", "megatron", "--tp", str(tp), "--pp", "1"]
        items[f"cli:{label}"] = "cli:" + json.dumps(argv)
        items[label] = str(work / label)
    recs = core_loss(list(items.values()), "--train-step", "--dump", str(work / "dump"))
    out = {}
    for i, (label, rec) in enumerate(zip(items, recs)):
        assert "error" not in rec and rec.get("rc", 0) == 0, (label, rec)
        out[label] = {**rec, "dir": str(work / label), "dump": str(work / "dump" / str(i))}
        for kind in CASES[label][4] if label in CASES else ():  # the same state, saved again
            out[label + SUFFIX[kind]] = {**out[label], "dir": str(work / f"{label}{SUFFIX[kind]}")}
    return out


def _megatron_state(dump: str) -> tuple[dict[str, dict], dict[str, list]]:
    """megatron-core's state per TP rank: ``{"tpT": {(name, state): flat fp32 array}}`` (the DP pieces
    joined) and its parameters ``{"tpT": [[name, local shape, partition dim], ...]}`` (routed experts under
    their global ids)."""
    import torch

    pieces: dict[str, dict] = {}
    for f in glob.glob(os.path.join(dump, "*.pt")):
        rank = os.path.basename(f).split("_")[0]
        for k, v in torch.load(f, weights_only=True).items():
            name, state, start = k.split("|")
            pieces.setdefault(rank, {}).setdefault((name, state), []).append((int(start), v.numpy()))
    joined = {}
    for rank, by in pieces.items():
        joined[rank] = {}
        for key, parts in by.items():
            parts.sort(key=lambda p: p[0])
            at = 0
            for start, v in parts:
                assert start == at, (rank, key)  # the DP ranks' pieces tile the parameter
                at += v.size
            joined[rank][key] = np.concatenate([v for _, v in parts])
    params = {}
    for f in glob.glob(os.path.join(dump, "*.params.json")):
        with open(f) as fh:
            params[os.path.basename(f).split("_")[0]] = json.load(fh)
    return joined, params


def _tp_piece(full: np.ndarray, name: str, dim: int | None, tp: int, rank: int) -> np.ndarray:
    """TP rank ``rank``'s piece of a full tensor, as megatron-core's ``partition_dim`` splits it
    (a gated ``linear_fc1``: each rank holds its rows of the gate and of the up projection)."""
    if dim is None or tp == 1:
        return full
    if name.endswith("linear_fc1.weight"):
        return np.concatenate([np.array_split(h, tp, 0)[rank] for h in np.array_split(full, 2, 0)], 0)
    return np.array_split(full, tp, dim)[rank]


def _compare(rec: dict, tp: int, c: ckptbridge.Checkpoint) -> tuple[int, int, int]:
    """(state tensors compared, those not bitwise megatron-core's, ranks whose parameter order ckptbridge
    rebuilds differently from megatron-core's ``named_parameters()``, from the checkpoint's names and from
    the names sorted) for one save. Each rank's parameters are compared with its own state, a routed
    expert's cut to its expert-TP rank; a TP-replicated parameter with TP rank 0's state: the replica
    megatron-core's ``sharded_state_dict`` saves (``replica_id`` 0; the MoE router's fp32 master differs on
    TP rank 1 in megatron-core's own CPU run). ``c``: the save opened with ``strip_padding=False``."""
    from ckptbridge.adapters.megatron._layout import MegatronConfig
    from ckptbridge.adapters.megatron._write_moe import RankFile, rank_params

    state, params = _megatron_state(rec["dump"])
    assert sorted(state) == sorted(params) == [f"tp{r}" for r in range(tp)]
    args = c.extra["megatron"]["args"]
    cfg = MegatronConfig.from_args(args)
    names = list(c)
    shapes = {n: tuple(c[n].shape) for n in names}
    compared = wrong = misordered = 0
    full: dict[tuple[str, str], np.ndarray] = {}
    for r in range(tp):
        with open(os.path.join(rec["dump"], f"tp{r}_pp0.ranks.json")) as fh:
            ranks = json.load(fh)
        ep, (etp, etp_size) = ranks["ep"][0], ranks["etp"]
        for given in (names, sorted(names)):  # the order rebuilt whatever order the names come in
            mine = [(p.name, list(p.shape)) for p in rank_params(cfg, args, given, shapes, RankFile(r, ep, etp), 0)
                    if not p.buffer]  # router buffers: in no optimizer
            misordered += mine != [(n, s) for n, s, _ in params[f"tp{r}"]]
        for name, _, dim in params[f"tp{r}"]:
            size, at = (etp_size, etp) if ".mlp.experts." in name else (tp, r)
            if dim is None and at > 0:
                continue
            for st in ("fp32", "exp_avg", "exp_avg_sq"):
                want = state[f"tp{r}"][(name, st)]
                if (name, st) not in full:
                    full[(name, st)] = c[name].state(st).read()
                got = _tp_piece(full[(name, st)], name, dim, size, at).reshape(-1)
                assert got.dtype == want.dtype == np.float32 and got.size == want.size, (name, st)
                assert np.any(want != 0), (name, st)  # a real step's moments
                compared += 1
                wrong += got.tobytes() != want.tobytes()
    return compared, wrong, misordered


@pytest.mark.heavy
def test_distributed_optimizer_state_is_megatron_cores_own_bitwise(run: dict) -> None:
    """Every parameter's fp32 master, exp_avg and exp_avg_sq as ckptbridge reads each save equal
    megatron-core's own optimizer state after the step, bit for bit; the parameter order ckptbridge
    rebuilds is megatron-core's ``named_parameters()`` order on every rank."""
    for label, (_, tp, ep, etp, also) in CASES.items():
        for kind in ("dp_reshardable", *also):
            saved = label + SUFFIX.get(kind, "")
            c = ckptbridge.open(run[saved]["dir"], strip_padding=False)
            meg = c.extra["megatron"]
            moe = meg.get("moe") or {"ep": 1, "etp": etp}  # (a dense model)
            assert run[saved]["step"]["updated"] and (moe["ep"], moe["etp"]) == (ep, etp), saved
            assert meg["optimizer_kind"] == "distributed"
            assert (meg["format"], meg.get("dist_optim_sharding")) == (("torch", None) if kind == "torch" else
                                                                      ("torch_dist", kind)), saved
            compared, wrong, misordered = _compare(run[saved], tp, c)
            assert compared >= 3 * 16 and wrong == misordered == 0, (saved, compared, wrong, misordered)


@pytest.mark.heavy
def test_written_distrib_optim_loads_as_the_sources_state_bitwise(run: dict) -> None:
    """The writer lays the distributed optimizer's buffers out in the same rebuilt order: megatron-core loads
    ``distrib_optim.pt`` written from each save and holds every parameter's fp32 master, exp_avg and exp_avg_sq
    exactly as it held them when it saved the source (its own two dumps compared, all ranks; a TP-replicated
    parameter with TP rank 0's, the replica the source saved)."""
    for label, (src, tp) in WRITTEN.items():
        got, got_params = _megatron_state(run[label]["dump"])
        want, want_params = _megatron_state(run[src]["dump"])
        assert got_params == want_params and sorted(got) == [f"tp{r}" for r in range(tp)], label
        assert run[label]["step"]["updated"]
        for rank, states in got.items():
            assert set(states) == set(want[rank]) and len(states) >= 3 * 19, label
            dims = {name: dim for name, _, dim in want_params[rank]}
            wrong = [(n, st) for (n, st), v in states.items()
                     if v.tobytes() != want["tp0" if dims[n] is None else rank][(n, st)].tobytes()]
            assert not wrong, (label, rank, len(wrong), len(states), wrong[:3])


@pytest.mark.heavy
def test_negative_control_expert_buffers_of_the_other_ep_rank_fail(run: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dp_reshardable save at TP 2 x EP 2 read with each expert buffer (``chained_1...dp_group_idx_I``)
    taken for the other EP rank's: every routed expert's state is megatron-core's state of another expert
    (measured: all 48 of the 246 state tensors compared that are routed experts' wrong), and an EP 1 save whose args
    say expert TP 1 != TP 2 is refused by name (megatron-core keeps such experts in the dense buffers, where
    TP 2 x ETP 1 ranks hold diverging copies of each expert and TP 1 x ETP 2 ranks keep half of each expert's
    state nowhere: both measured with megatron-core 0.16.1 on CPU)."""
    import dataclasses

    from ckptbridge.adapters.megatron import _dist

    right = _dist._buffer_rank

    def other_ep(cfg: object, opt: int, idx: int) -> tuple[object, int]:
        rank, pp = right(cfg, opt, idx)
        return (dataclasses.replace(rank, ep=1 - rank.ep) if opt else rank), pp

    rec = run["mla_tp2ep2etp1"]
    with monkeypatch.context() as m:
        m.setattr(_dist, "_buffer_rank", other_ep)
        compared, wrong, misordered = _compare(rec, 2, ckptbridge.open(rec["dir"], strip_padding=False))
    assert compared == 246 and misordered == 0 and wrong == 48, (compared, wrong)

    args = _dist.args_dict  # the TP 2 x EP 1 MLA save, its args saying expert TP 1
    monkeypatch.setattr(_dist, "args_dict", lambda *a: {**args(*a), "expert_tensor_parallel_size": 1})
    with pytest.raises(ckptbridge.FormatError, match=r"MoE at EP 1 with expert TP 1 != TP 2 .* diverging copies"):
        ckptbridge.open(run["mla_tp2"]["dir"])
