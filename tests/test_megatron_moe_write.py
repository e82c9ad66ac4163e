"""Mixture-of-experts written by ckptbridge at a new TP / EP, resumed by megatron-core as its own reshard is.

The source is Megatron-LM's own checkpoint ``M/tp2ep2etp1`` (tests/fixtures/megatron_moe: fp32,
SequentialMLP, shared expert, router expert bias, torch Adam as a ChainedOptimizer of a dense and an
expert optimizer; TP 2 x EP 2 with expert-TP 1), read from its legacy per-rank files. ckptbridge writes
(``ckptbridge reshard --to megatron``, legacy per-rank files):

* ``ep1``: TP 1 x EP 1 (TP 2 -> 1, EP 2 -> 1: one optimizer, experts ordinary params);
* ``tp2ep2etp1``: TP 2 x EP 2 with expert-TP 1, from ``ep1`` (TP 1 -> 2, EP 1 -> 2: the files
  ``mp_rank_00_000`` and ``mp_rank_01_001`` of the expert-data-parallel rank 0 ranks, a dense + expert
  optimizer; megatron-core trains it with sequence parallelism);
* from ``D/tp1ep2dp4`` (the distributed optimizer, its ``torch_dist`` copy), ``dist_opt_ep1``: EP 2 -> 1
  (``distrib_optim.pt`` of one optimizer; megatron-core itself cannot make this reshard);
* from ``G/tp2ep2etp1`` (bf16, legacy GroupedMLP: each layer's experts in ``experts.weight1`` /
  ``weight2``, Float16 optimizer with fp32 masters; Megatron-LM's own legacy files), ``g_ep1``: TP 1 x
  EP 1, and from it ``g_tp1ep2``: TP 1 x EP 2 (megatron-core builds the GroupedMLP with
  ``MEGATRON_CPU_SHIM_GG=1``: tools/megatron/cpu_shim.py's pure-torch grouped GEMM); the reference is
  megatron-core's ``dist_checkpointing`` reshard of ``G/tp2ep2etp1/torch_dist`` to each layout (it can
  reshard GroupedMLP, optimizer included: the fixtures themselves were made so).

``tools/megatron/core_loss.py`` (megatron-core 0.16.1, 2 gloo ranks) loads each written checkpoint
strictly (``load_state_dict(strict=True)`` of this rank's ``mp_rank_TT_EEE`` file, the optimizer through
``ChainedOptimizer.load_state_dict``), evaluates the loss, runs one training step (Megatron-LM's
``train_step`` from megatron-core's pieces) and evaluates again; the reference is megatron-core's own
reshard of the same source (its ``torch_dist`` copy through ``dist_checkpointing.load`` at the same
TP / EP, optimizer included). What must hold: the same per-token losses before and after the step,
the same logits, and the same grad norm (measured bitwise equal).

Negative controls, written the same way at TP 2 x EP 2: every EP rank given global experts 0.. (the
local index read as global), and one expert's gate/up halves swapped; each moves the logits by > 1000x
the tolerance (relative 1.2e-2 and 1.5e-3; the per-token losses by 4e-4 and 3e-5: the experts of a model
trained 5 iterations are still alike, and top-2 routing with a shared expert dilutes one expert). For
GroupedMLP at TP 1 x EP 2: the local index read as global, and one layer's ``weight1`` of EP rank 1 stored
untransposed (each expert's ``[fc1, hidden]`` rows where megatron-core views ``[hidden, fc1]``): logits
moved by 1.1e-2 each, the per-token losses by 3.8e-4 and 3.5e-4.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import numpy as np
import pytest
from _common import core_loss

import ckptbridge
from ckptbridge.adapters.megatron import _write_moe, _writer

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "fixtures", "megatron_moe", "M", "tp2ep2etp1")
G_SRC = os.path.join(HERE, "fixtures", "megatron_moe", "G", "tp2ep2etp1")
RTOL = 1e-6  # measured 0.0 (bitwise equal); the negative controls move the logits by > 1e-3


def _reshard(src: str, dst: str, *opts: str) -> None:
    from ckptbridge._cli import main as cli

    argv = ["reshard", src, dst, "--to", "megatron", *[a for o in opts for a in ("-o", o)]]
    assert cli(argv) == 0, argv


def _swap_gate_up(src: str, dst: str) -> None:
    """A copy of ``src`` (written by ckptbridge) with global expert 3's gate and up halves swapped."""
    import torch

    shutil.copytree(src, dst)
    f = os.path.join(dst, "iter_0000005", "mp_rank_01_001", "model_optim_rng.pt")
    sd = torch.load(f, map_location="cpu", weights_only=False)  # a file this test wrote
    key = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
    gate, up = sd["model"][key].chunk(2, 0)
    sd["model"][key] = torch.cat([up, gate]).contiguous()
    torch.save(sd, f)


def _reshard_local_as_global(src: str, dst: str, *opts: str) -> None:
    """``_reshard`` with every EP rank given global experts 0.. (the local index read as global)."""
    right = _write_moe.rank_params

    def local_as_global(cfg: Any, args: Any, names: Any, shapes: Any, rank: Any, pp: int) -> Any:
        return right(cfg, args, names, shapes, _write_moe.RankFile(rank.tp, 0, rank.etp), pp)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_writer, "rank_params", local_as_global)
        _reshard(src, dst, *opts)


def _untranspose_weight1(src: str, dst: str) -> None:
    """A copy of ``src`` (GroupedMLP, written by ckptbridge) with layer 1's ``experts.weight1`` of EP rank 1
    laid out wrongly: megatron-core views the buffer as ``[local experts, hidden, fc1]`` (expert K's
    fc1 weight transposed); here each expert's ``[fc1, hidden]`` rows are stored flat, untransposed."""
    import torch

    shutil.copytree(src, dst)
    f = os.path.join(dst, "iter_0000005", "mp_rank_00_001", "model_optim_rng.pt")
    sd = torch.load(f, map_location="cpu", weights_only=False)  # a file this test wrote
    key = "decoder.layers.1.mlp.experts.weight1"
    w, args = sd["model"][key], sd["args"]
    local = w.view(args.num_experts // args.expert_model_parallel_size, w.shape[0], -1)
    sd["model"][key] = local.transpose(1, 2).contiguous().view(w.shape)
    torch.save(sd, f)


@pytest.fixture(scope="module")
def losses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    work = tmp_path_factory.mktemp("moe_write")
    src = os.path.join(SRC, "torch")
    _reshard(src, str(work / "ep1"), "tp=1", "ep=1")
    _reshard(str(work / "ep1"), str(work / "tp2ep2etp1"), "tp=2", "ep=2", "etp=1")
    _reshard_local_as_global(str(work / "ep1"), str(work / "local_as_global"), "tp=2", "ep=2", "etp=1")
    _swap_gate_up(str(work / "tp2ep2etp1"), str(work / "gate_up_swapped"))
    d_src = os.path.join(HERE, "fixtures", "megatron_moe", "D", "tp1ep2dp4", "torch_dist")
    _reshard(d_src, str(work / "dist_opt_ep1"), "ep=1")
    # GroupedMLP (bf16, Float16 optimizer): TP 2 x EP 2 -> TP 1 x EP 1 -> TP 1 x EP 2
    _reshard(os.path.join(G_SRC, "torch"), str(work / "g_ep1"), "tp=1", "ep=1")
    _reshard(str(work / "g_ep1"), str(work / "g_tp1ep2"), "tp=1", "ep=2")
    _reshard(str(work / "g_ep1"), str(work / "g_tp1ep2_distopt"), "tp=1", "ep=2", "distributed_optimizer=true")
    _reshard_local_as_global(str(work / "g_ep1"), str(work / "g_local_as_global"), "tp=1", "ep=2")
    _untranspose_weight1(str(work / "g_tp1ep2"), str(work / "g_weight1_untransposed"))
    dist, g_dist = os.path.join(SRC, "torch_dist"), os.path.join(G_SRC, "torch_dist")
    items = {"ref:dist_opt_ep2": f"dist:{d_src}:tp=1,pp=1,ep=2,optim=1", "dist_opt_ep1": str(work / "dist_opt_ep1"),
             "ref:ep1": f"dist:{dist}:tp=1,pp=1,ep=1,optim=1", "ep1": str(work / "ep1"),
             "ref:tp2ep2etp1": f"dist:{dist}:tp=2,pp=1,ep=2,etp=1,optim=1", "tp2ep2etp1": str(work / "tp2ep2etp1"),
             "local_as_global": str(work / "local_as_global"), "gate_up_swapped": str(work / "gate_up_swapped"),
             "ref:g_ep1": f"dist:{g_dist}:tp=1,pp=1,ep=1,optim=1", "g_ep1": str(work / "g_ep1"),
             "ref:g_tp1ep2": f"dist:{g_dist}:tp=1,pp=1,ep=2,optim=1", "g_tp1ep2": str(work / "g_tp1ep2"),
             "g_tp1ep2_distopt": str(work / "g_tp1ep2_distopt"),
             "g_local_as_global": str(work / "g_local_as_global"),
             "g_weight1_untransposed": str(work / "g_weight1_untransposed")}
    dump = str(work / "dump")
    recs = core_loss(list(items.values()), "--microbatches", "1", "--train-step", "--dump", dump,
                     env={"MEGATRON_CPU_SHIM_GG": "1"})
    result = dict(zip(items, recs))
    for i, label in enumerate(items):
        with np.load(os.path.join(dump, f"{i}.npz")) as z:
            result[label]["logits"] = z["logits"]
        result[label]["state"] = os.path.join(dump, str(i))  # megatron-core's optimizer state after the load
    return result


def _token_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))


def _logit_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest difference of GPTModel's logits (the same tokens), relative to the largest logit."""
    assert a["logits"].shape == b["logits"].shape
    return float(np.max(np.abs(a["logits"] - b["logits"])) / np.max(np.abs(b["logits"])))


def _resumes_as_reference(losses: dict[str, dict[str, Any]], label: str, layout: tuple[int, int, int]) -> None:
    """``label`` (written by ckptbridge) and ``ref:label`` (megatron-core's own reshard) at ``layout``
    (TP, EP, ETP): the same logits and per-token losses, grad norm, lr and losses after one step."""
    got, ref = losses[label], losses[f"ref:{label}"]
    assert "error" not in got and "error" not in ref, (got.get("error"), ref.get("error"))
    assert (got["tp"], got["ep"], got["etp"]) == (ref["tp"], ref["ep"], ref["etp"]) == layout
    assert _token_diff(got["token_losses"], ref["token_losses"]) <= RTOL, label
    assert _logit_diff(got, ref) <= RTOL, label
    assert got["step"]["updated"] and ref["step"]["updated"]
    assert abs(got["step"]["grad_norm"] - ref["step"]["grad_norm"]) <= RTOL * ref["step"]["grad_norm"], label
    assert got["step"]["lr"] == ref["step"]["lr"]
    assert _token_diff(got["step"]["after_token_losses"], ref["step"]["after_token_losses"]) <= RTOL, label
    assert got["step"]["after_loss"] < got["loss"]  # the step trained (Adam moments carried over)


def _reads_back_as(written: str, source: str, ep: int) -> None:
    """What ckptbridge wrote reads back bitwise equal to the source, every expert, master weight and Adam moment."""
    src = ckptbridge.open(source)
    back = ckptbridge.open(written)
    assert set(back.tensors) == set(src.tensors) and back.extra["megatron"]["moe"]["ep"] == ep
    for name, t in src.tensors.items():
        assert set(back[name].states) == set(t.states), name
        for state in t.states:
            assert (back[name].state(state)[...] == src[name].state(state)[...]).all(), (name, state)


@pytest.mark.heavy
def test_written_moe_layouts_resume_in_megatron_core_as_its_own_reshard(losses: dict[str, dict[str, Any]]) -> None:
    for label, layout in (("ep1", (1, 1, 1)), ("tp2ep2etp1", (2, 2, 1))):
        _resumes_as_reference(losses, label, layout)
    _reads_back_as(losses["tp2ep2etp1"]["ckpt"], os.path.join(SRC, "torch"), 2)


@pytest.mark.heavy
def test_written_grouped_mlp_resumes_at_a_new_ep_as_megatron_cores_own_reshard(
        losses: dict[str, dict[str, Any]]) -> None:
    """``G/tp2ep2etp1`` (bf16 legacy GroupedMLP: ``experts.weight1`` / ``weight2``, Float16 optimizer with
    fp32 masters) written at TP 1 x EP 1, and from that at TP 1 x EP 2: megatron-core's GPTModel with
    ``moe_grouped_gemm`` (the shim's pure-torch grouped GEMM) loads each strictly, optimizer included,
    and continues exactly as after its own ``dist_checkpointing`` reshard of the source's ``torch_dist``
    copy to that layout (measured bitwise: logits, losses, grad norm, losses after the step)."""
    for label, layout in (("g_ep1", (1, 1, 1)), ("g_tp1ep2", (1, 2, 1))):
        _resumes_as_reference(losses, label, layout)
    _reads_back_as(losses["g_tp1ep2"]["ckpt"], os.path.join(G_SRC, "torch"), 2)


def _optimizer_pieces(dump: str) -> list[tuple[int, str, str, int, Any]]:
    """megatron-core's optimizer state after a load: (DP rank, name, state, first element, flat values) per
    piece (the whole local parameter for a Float16 optimizer, dumped from DP rank 0 only; the DP-owned piece
    for the distributed optimizer, from every rank)."""
    import glob

    import torch

    out = []
    for f in sorted(glob.glob(os.path.join(dump, "*.pt"))):
        dp = int(os.path.basename(f)[:-3].rsplit("_dp", 1)[1])
        for k, v in torch.load(f, weights_only=True).items():
            name, state, *start = k.split("|")
            out.append((dp, name, state, int(start[0]) if start else 0, v.reshape(-1).numpy()))
    return out


@pytest.mark.heavy
def test_written_grouped_mlp_distributed_optimizer_loads_as_megatron_cores_own_state(
        losses: dict[str, dict[str, Any]]) -> None:
    """``G`` (bf16 GroupedMLP) written at TP 1 x EP 2 with the distributed optimizer (``distrib_optim.pt``:
    ``[dense, expert]`` buffers, ``experts.weight1`` / ``weight2`` in the expert one): the fp32 masters and
    Adam moments megatron-core holds after ``load_parameter_state`` are bitwise those its own
    ``dist_checkpointing`` reshard of the source to TP 1 x EP 2 (Float16 optimizer, dumped from rank 0: DP 0,
    EP 0) holds -- every dense piece of both DP ranks and EP rank 0's experts (DP rank r is EP rank r here) --
    and ckptbridge reads the written files back bitwise equal to the source."""
    got, ref = losses["g_tp1ep2_distopt"], losses["ref:g_tp1ep2"]
    assert "error" not in got, got.get("error")
    want = {(name, st): v for _, name, st, _, v in _optimizer_pieces(ref["state"])}
    compared = wrong = 0
    for dp, name, st, start, v in _optimizer_pieces(got["state"]):
        if dp == 1 and ".mlp.experts." in name:
            continue  # EP rank 1's experts: not in the reference's dump
        compared += v.size
        wrong += v.tobytes() != want[(name, st)][start:start + v.size].tobytes()
    expert_and_dense = sum(v.size for v in want.values())
    assert compared == expert_and_dense and wrong == 0, (compared, expert_and_dense, wrong)
    assert got["step"]["updated"] and _logit_diff(got, ref) <= RTOL
    _reads_back_as(got["ckpt"], os.path.join(G_SRC, "torch"), 2)


@pytest.mark.heavy
def test_distributed_optimizer_moe_written_at_ep1_resumes_as_megatron_cores_own_ep2_load(
        losses: dict[str, dict[str, Any]]) -> None:
    """``D`` (distributed optimizer, expert buffers over expert-DP) written from its ``torch_dist`` copy at
    EP 1 (its EP 2 files equal Megatron-LM's own: test_written_ep2_files_are_megatron_lms_own):
    megatron-core (``load_parameter_state`` of ``distrib_optim.pt``) continues it with the logits and
    next-step losses of megatron-core's own EP 2 load. (megatron-core cannot reshard this checkpoint to EP 1 itself: ``KeyError: 'state'``
    in ``ChainedOptimizer.load_state_dict``, tools/megatron/make_moe_ckpts.sh.)"""
    ref = losses["ref:dist_opt_ep2"]
    assert "error" not in ref, ref.get("error")
    got = losses["dist_opt_ep1"]
    assert "error" not in got, got.get("error")
    assert (got["ep"], ref["ep"]) == (1, 2) and got["step"]["updated"]
    assert _logit_diff(got, ref) <= RTOL and _token_diff(got["token_losses"], ref["token_losses"]) <= RTOL
    assert abs(got["step"]["grad_norm"] - ref["step"]["grad_norm"]) <= RTOL * ref["step"]["grad_norm"]
    assert _token_diff(got["step"]["after_token_losses"], ref["step"]["after_token_losses"]) <= RTOL


@pytest.mark.heavy
@pytest.mark.parametrize("label,ref", [("local_as_global", "tp2ep2etp1"), ("gate_up_swapped", "tp2ep2etp1"),
                                       ("g_local_as_global", "g_tp1ep2"), ("g_weight1_untransposed", "g_tp1ep2")])
def test_negative_controls_wrong_expert_or_swapped_gate_up_fail_by_far(losses: dict, label: str, ref: str) -> None:
    """Wrong experts (every EP rank given global experts 0..), one expert's gate/up halves swapped, one
    GroupedMLP ``weight1`` stored untransposed: megatron-core loads each and its logits move by far."""
    got, ref = losses[label], losses[f"ref:{ref}"]
    assert "error" not in got, got.get("error")
    # measured 1.2e-2 (wrong experts), 1.5e-3 (swapped); GroupedMLP: 1.1e-2 (wrong experts, untransposed weight1)
    assert _logit_diff(got, ref) > 1000 * RTOL, label
    assert _token_diff(got["token_losses"], ref["token_losses"]) > 10 * RTOL, label


def _same(a: Any, b: Any, where: str) -> None:
    """Two unpickled trees hold the same keys (in the same order, but inside Adam slots), values and
    tensors (bitwise)."""
    import torch

    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):  # (an Adam slot's step / exp_avg / exp_avg_sq in any order)
        same_keys = list(a) == list(b) if "/state/" not in where else set(a) == set(b)
        assert isinstance(b, dict) and same_keys, (where, list(a), list(b))
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("fam,src_fmt", [("M/tp1ep2", "torch"), ("D/tp1ep2dp4", "torch_dist"),
                                         ("G/tp2ep2etp1", "torch")])
def test_written_ep2_files_are_megatron_lms_own(tmp_path: Any, fam: str, src_fmt: str) -> None:
    """EP 2 -> EP 2: every rank file ckptbridge writes holds what Megatron-LM's own legacy save wrote:
    the same model keys in the same order and tensors; ``M`` (torch Adam): the ChainedOptimizer's two
    Adam state dicts, param groups and slot numbering; ``G`` (bf16 GroupedMLP, TP 2 x EP 2 x ETP 1):
    each layer's ``experts.weight1`` / ``weight2`` buffers built from the global experts, the Float16
    optimizers' fp32 masters; ``D`` (distributed optimizer, written from its
    ``torch_dist`` copy): both optimizers' param groups and ``distrib_optim.pt`` -- ``[dense, expert]``
    coalesced buffers, the dense one only in the file of dense-DP rank 0 (``None`` in EP rank 1's)."""
    import pickle
    import types

    import torch

    class Opaque:
        def __init__(self, *args: Any) -> None:
            self.args = args

    class NoMegatron(pickle.Unpickler):  # the saved args' megatron enums, without importing megatron-core
        def find_class(self, module: str, name: str) -> Any:
            return Opaque if module.startswith("megatron") else super().find_class(module, name)

    unpickle = types.ModuleType("unpickle_no_megatron")
    unpickle.Unpickler = NoMegatron  # type: ignore[attr-defined]
    unpickle.load = pickle.load  # type: ignore[attr-defined]
    mine, theirs = str(tmp_path / "ep2"), os.path.join(HERE, "fixtures", "megatron_moe", fam, "torch")
    _reshard(os.path.join(HERE, "fixtures", "megatron_moe", fam, src_fmt), mine)
    files = ["model_optim_rng.pt"] + (["distrib_optim.pt"] if fam.startswith("D") else [])
    ranks = sorted(os.listdir(os.path.join(theirs, "iter_0000005")))
    assert ranks == sorted(os.listdir(os.path.join(mine, "iter_0000005"))) and len(ranks) == 2
    for rank in ranks:
        for f in files:
            a, b = (torch.load(os.path.join(d, "iter_0000005", rank, f), map_location="cpu", weights_only=False,
                               pickle_module=unpickle) for d in (theirs, mine))  # files Megatron-LM / this test wrote
            if f == "model_optim_rng.pt":
                assert isinstance(b["optimizer"], list) and len(b["optimizer"]) == 2
                a, b = {k: a[k] for k in ("model", "optimizer")}, {k: b[k] for k in ("model", "optimizer")}
            else:
                assert (a[0] is None) == (rank == "mp_rank_00_001")
            _same(a, b, f"{rank}/{f}")


def test_legacy_layouts_that_would_lose_shards_are_refused(tmp_path: Any) -> None:
    from ckptbridge.adapters.megatron import MegatronWriteOptions, write

    src = ckptbridge.open(os.path.join(SRC, "torch"))
    with pytest.raises(ckptbridge.FormatError, match=r"TP=2 EP=1 ETP=1: .*expert-data-parallel rank 0"):
        write(src, str(tmp_path / "bad"), MegatronWriteOptions(tp=2, ep=1, etp=1))
    with pytest.raises(ckptbridge.FormatError, match=r"TP=1 EP=2 ETP=2: .*several ranks would write one file"):
        write(src, str(tmp_path / "bad2"), MegatronWriteOptions(tp=1, ep=2, etp=2))
