"""megatron-core itself loads what ``ckptbridge reshard --to megatron`` writes, and trains on from it.

Runs in CI: needs only megatron-core 0.16.1 from PyPI (the ``megatron`` extra), no Megatron-LM
training code and no network. tools/megatron/core_loss.py (2 ranks, gloo, CPU) builds
megatron-core's ``GPTModel`` (local spec) from the args saved in each checkpoint, initialises
model parallelism at the checkpoint's TP/PP, loads this rank's ``model`` state dict strictly
(``load_state_dict(strict=True)``, after Megatron-LM's ``check_checkpoint_args`` checks) or, for
``dist:`` items, lets megatron-core's own ``dist_checkpointing.load`` reshard a ``torch_dist``
checkpoint onto the layout; runs the forward pass on fixed mock tokens through megatron-core's
schedule (``get_forward_backward_func``, pipelined for PP=2) and reports the lm loss; then
(``--train-step``, legacy checkpoints) wraps the model in megatron-core's DDP, loads the
checkpoint's ``optimizer`` and ``opt_param_scheduler`` into ``get_megatron_optimizer`` /
``OptimizerParamScheduler``, trains one step on the same tokens and reports grad norm, lr and the
loss after the step (as Megatron-LM's resume + ``train_step`` do).

What must hold (fp32 runs; the fixture layouts are Megatron's own reshards of one training run),
within rtol 1e-5, as a mean and token by token:

* a checkpoint ckptbridge wrote at a new layout (A: TP2/PP2 -> TP2/PP1, TP1/PP2, TP1/PP1; B, tied
  embeddings: TP1/PP2 -> TP2/PP1) loads strictly and its loss equals the TP1/PP1 reference's and
  the source's (A: Megatron resharding the source's torch_dist copy onto the same layout; B: the
  source at its own layout); the written A checkpoints are in fact bitwise equal, parameter by
  parameter, to Megatron's own reshard. Measured: mean loss identical, per token <= 1.8e-7;
* one training step from the written optimizer state gives the reference's grad norm (<= 1e-7),
  lr (equal) and post-step loss (<= 4.3e-8; per token <= 1.8e-7);
* negative controls, in a copy of the written TP1/PP2 checkpoint: QKV rows without the
  per-query-group interleave (layer 0), SwiGLU gate/up halves swapped (layer 1), Adam moments of
  two same-shape parameters swapped: each fails the checks (measured: mean loss 2.6e-5 / 2.5e-5 /
  0 off, per token 2.7e-2 / 8.9e-4 / 0, post-step loss 5.7e-5 / 3.4e-5 / 5.3e-4 off; the model is
  barely trained, its loss near ln 256, hence the small mean shifts); the embedding without
  its vocabulary padding: megatron-core refuses the load (size mismatch).

The stronger proof (Megatron-LM's own training loop resumes and trains two iterations, on its mock
dataset) is tests/test_megatron_e2e.py, opt-in: ``make test-megatron-lm`` (needs a git clone).
"""

from __future__ import annotations

import os
import shutil

import pytest
from _common import core_loss

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures", "megatron")
RTOL = 1e-5

# written checkpoint: (source fixture, tp, pp, reference fixture, "source" item at the same layout)
WRITTEN = {
    "A_tp2pp1": ("A/tp2pp2/torch", 2, 1, "A/tp1pp1/torch", "dist:{FIX}/A/tp2pp2/torch_dist:tp=2,pp=1"),
    "A_tp1pp2": ("A/tp2pp2/torch", 1, 2, "A/tp1pp1/torch", "dist:{FIX}/A/tp2pp2/torch_dist:tp=1,pp=2"),
    "A_tp1pp1": ("A/tp2pp2/torch", 1, 1, "A/tp1pp1/torch", "dist:{FIX}/A/tp2pp2/torch_dist:tp=1,pp=1"),
    "B_tp2pp1": ("B/tp1pp2/torch", 2, 1, "B/tp1pp1/torch", "{FIX}/B/tp1pp2/torch"),
}
CORRUPT = ("qkv_not_interleaved", "swiglu_halves_swapped", "vocab_not_padded", "optimizer_state_swapped")


def _rank_file(ckpt: str, tp: int, pp: int, pp_size: int) -> str:
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as fh:
        it = int(fh.read())
    rank = f"mp_rank_{tp:02d}" if pp_size == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
    return os.path.join(ckpt, f"iter_{it:07d}", rank, "model_optim_rng.pt")


def _corrupt(src: str, dst: str, how: str) -> None:
    """A copy of the ckptbridge-written ``src`` with one deliberate layout bug in one rank file."""
    import torch

    shutil.copytree(src, dst)
    f = _rank_file(dst, 0, 0, 2)  # src is the TP1/PP2 checkpoint: stage 0 holds layers 0-1 + embedding
    sd = torch.load(f, map_location="cpu", weights_only=False)  # a file ckptbridge just wrote
    m, a = sd["model"], sd["args"]
    if how == "qkv_not_interleaved":  # [q q k v | q q k v] per group -> [q q q q | k k | v v]
        w = m["decoder.layers.0.self_attention.linear_qkv.weight"]
        groups, d = a.num_query_groups, a.kv_channels or a.hidden_size // a.num_attention_heads
        per = w.view(groups, -1, d, w.shape[-1])
        q, k, v = per[:, :-2], per[:, -2:-1], per[:, -1:]
        w.copy_(torch.cat([q.reshape(-1, w.shape[-1]), k.reshape(-1, w.shape[-1]), v.reshape(-1, w.shape[-1])]))
    elif how == "swiglu_halves_swapped":
        w = m["decoder.layers.1.mlp.linear_fc1.weight"]
        gate, up = w.chunk(2, 0)
        m["decoder.layers.1.mlp.linear_fc1.weight"] = torch.cat([up, gate]).contiguous()
    elif how == "optimizer_state_swapped":  # Adam moments given to another parameter of the same shape
        state = sd["optimizer"]["state"]
        by_shape: dict[tuple, list] = {}
        for i, st in state.items():
            by_shape.setdefault(tuple(st["exp_avg"].shape), []).append(i)
        i, j = next(ix for shape, ix in by_shape.items() if len(shape) == 2 and len(ix) >= 2)[:2]
        state[i], state[j] = state[j], state[i]
    elif how == "vocab_not_padded":
        import ckptbridge as cb_open

        vocab = cb_open.open(src).extra["megatron"]["vocab_size"]  # the tokenizer's rows, padding stripped
        m["embedding.word_embeddings.weight"] = m["embedding.word_embeddings.weight"][:vocab].clone()
    torch.save(sd, f)


@pytest.fixture(scope="module")
def losses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """One core_loss.py run (2 ranks) over the references, sources, written and corrupted checkpoints."""
    from ckptbridge._cli import main as cli

    work = tmp_path_factory.mktemp("core_e2e")
    items: dict[str, str] = {}
    for label, (src, tp, pp, ref, source) in WRITTEN.items():
        dst = str(work / label)
        argv = ["reshard", os.path.join(FIX, src), dst, "--to", "megatron", "--tp", str(tp), "--pp", str(pp)]
        assert cli(argv) == 0, argv
        items[label] = dst
        items[f"ref:{ref}"] = os.path.join(FIX, ref)
        items[f"source:{label}"] = source.format(FIX=FIX)
    for how in CORRUPT:
        _corrupt(items["A_tp1pp2"], str(work / how), how)
        items[how] = str(work / how)
    labels = list(items)
    recs = core_loss(list(items.values()), "--train-step")
    return dict(zip(labels, recs))


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * abs(b)


def _token_diff(a: dict, b: dict, key: str = "token_losses") -> float:
    """Largest relative difference of the per-token losses (the same tokens in the same order)."""
    assert len(a[key]) == len(b[key]) == 2 * 2 * 32
    return max(abs(x - y) / abs(y) for x, y in zip(a[key], b[key]))


def _step(rec: dict) -> dict:
    assert "error" not in rec, rec["error"]
    assert rec["step"]["updated"], rec["step"]
    return rec["step"]


def _loss(rec: dict) -> float:
    assert "error" not in rec, rec["error"]
    return rec["loss"]


@pytest.mark.heavy
@pytest.mark.parametrize("label", list(WRITTEN))
def test_megatron_core_loads_written_layout_with_reference_loss(losses: dict[str, dict], label: str) -> None:
    _, tp, pp, ref, _ = WRITTEN[label]
    rec = losses[label]
    got = _loss(rec)
    assert (rec["tp"], rec["pp"]) == (tp, pp)
    assert {k.split(":")[0] for k in rec["digests"]} == {f"tp{t}pp{p}" for t in range(tp) for p in range(pp)}
    assert rec["tokens"] == 2 * 2 * 32  # 2 micro-batches x micro_batch_size 2 x seq_length 32 (the saved args)
    want = _loss(losses[f"ref:{ref}"])
    source = _loss(losses[f"source:{label}"])
    assert 1.0 < want < 10.0  # a trained-a-little model on random tokens (ln 256 = 5.55)
    assert _close(got, want), (got, want)
    assert _close(got, source), (got, source)
    # and token by token (a sharper check than the mean: the model is barely trained)
    assert _token_diff(rec, losses[f"ref:{ref}"]) <= RTOL
    assert _token_diff(rec, losses[f"source:{label}"]) <= RTOL


@pytest.mark.heavy
@pytest.mark.parametrize("label", list(WRITTEN))
def test_megatron_core_resumes_written_optimizer_and_trains_one_step_like_reference(losses: dict[str, dict],
                                                                                    label: str) -> None:
    """The written optimizer + scheduler state, loaded into megatron-core's optimizer, gives the
    reference's grad norm, learning rate and post-step loss (it pins exp_avg/exp_avg_sq, step, lr)."""
    _, _, _, ref, _ = WRITTEN[label]
    got, want = _step(losses[label]), _step(losses[f"ref:{ref}"])
    assert got["lr"] == want["lr"] > 0
    assert _close(got["grad_norm"], want["grad_norm"]), (got["grad_norm"], want["grad_norm"])
    assert _close(got["after_loss"], want["after_loss"]), (got["after_loss"], want["after_loss"])
    assert _token_diff(got, want, "after_token_losses") <= RTOL
    assert got["after_loss"] < _loss(losses[label])  # the step did train


@pytest.mark.heavy
@pytest.mark.parametrize("label", ["A_tp2pp1", "A_tp1pp2", "A_tp1pp1"])
def test_written_weights_equal_megatrons_own_reshard_bitwise(losses: dict[str, dict], label: str) -> None:
    mine, megatrons = losses[label], losses[f"source:{label}"]
    assert megatrons["dist"] and (megatrons["tp"], megatrons["pp"]) == (mine["tp"], mine["pp"])
    assert mine["digests"] == megatrons["digests"]


@pytest.mark.heavy
@pytest.mark.parametrize("how", CORRUPT)
def test_negative_control_layout_bug_fails_the_check(losses: dict[str, dict], how: str) -> None:
    rec, ref = losses[how], losses["ref:A/tp1pp1/torch"]
    if how == "vocab_not_padded":
        assert "size mismatch for embedding.word_embeddings.weight" in rec["error"], rec
        return
    if how == "optimizer_state_swapped":  # the weights are intact: only the training step shows it
        assert _close(_loss(rec), _loss(ref)) and _token_diff(rec, ref) <= RTOL
    else:
        got, want = _loss(rec), _loss(ref)
        assert not _close(got, want), (how, got, want)  # the mean-loss check fails ...
        assert _token_diff(rec, ref) > 10 * RTOL, (how, _token_diff(rec, ref))  # ... and per token, well outside
    got, want = _step(rec)["after_loss"], _step(ref)["after_loss"]
    assert not _close(got, want), (how, got, want)  # after one training step too
