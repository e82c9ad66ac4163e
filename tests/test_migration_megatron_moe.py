"""A Megatron expert-parallel run continued in MaxText with its expert sharding, through the ``mixtral`` recipe.

The source is Megatron-LM's own checkpoint ``tests/fixtures/megatron_moe/D/tp1ep2dp4`` (``pretrain_gpt.py``,
fp32, 2 layers, 4 SequentialMLP experts top-2 with a softmax router, GQA 4/2, SwiGLU, RMSNorm, RoPE, untied,
no q/k norm, no shared expert: Mixtral's architecture; the distributed optimizer over DP 4, expert-DP 2;
iteration 5, ``torch_dist``).

1. ckptbridge reads it at its EP 2 layout (each expert under its global id; the weights and both Adam
   moments out of the distributed optimizer's buffers), the ``mixtral`` recipe maps megatron -> maxtext
   (the composition through the HF names; the vocabulary padding kept, ``strip_padding=False``, so MaxText's
   softmax runs over Megatron's 64 rows) and ``ckptbridge.adapters.flax.load`` puts the weights, ``mu``,
   ``nu`` and ``count`` onto MaxText 0.2.5's own Mixtral decoder on a 2-device mesh whose ``expert`` axis
   is 2 (MaxText's logical-axis rule ``exp -> expert``). ``jax.Array.sharding`` shows every MoE kernel and
   its moments split on the expert axis: each device holds 2 of the 4 experts.
2. The reference is megatron-core's own: ``tools/megatron/core_loss.py`` (2 gloo ranks, EP 2) builds
   ``GPTModel`` from the run's args, loads the same checkpoint and its distributed optimizer through
   ``dist_checkpointing.load``, dumps its logits, and takes one Megatron ``train_step``.
3. MaxText's logits are megatron-core's (1e-4), its loss is megatron-core's, and after one optax AdamW step
   with Megatron's hyperparameters its next loss is megatron-core's after its step (``LOSS_TOL``: fp32
   sums in two orders, measured ~1e-7). The hyperparameters: the learning rate of iteration 6 from
   Megatron's scheduler args (cosine; computed here, and equal to the lr megatron-core used), betas, eps
   and weight decay from the args, the decay not applied to the norms on either side (megatron-core's
   ``get_standard_config_overrides``: 1-D parameters; MaxText's ``adamw_mask``); gradient clipping at 1.0
   does not act (megatron-core's grad norm is below it, asserted); the load-balancing loss off on both
   sides (the run's coefficient 0.01 set to 0 with ``core_loss.py --set``: HF/MaxText/Megatron weigh it
   differently; MaxText's ``load_balance_loss_weight`` is 0); MaxText's query kernel holds
   ``c = 1/sqrt(head_dim)`` (the recipe's ``Scale``, moments ``mu/c`` and ``nu/c**2``), so its Adam
   direction is scaled by ``c`` (the harness's ``update_scale``) to take Megatron's step.
4. Negative control: experts 0 and 2 (one on each EP rank) swapped while reading: the logits move by 1.7e-3,
   4e4 times the measured agreement (4.5e-8) and 17 times the tolerance (the experts of a run trained 5
   iterations from a 0.02-std init are still alike, so a permutation moves the logits by 0.6% of their size).
5. HF -> Megatron EP 2: a tiny random ``MixtralForCausalLM`` written by ``reshard --to megatron -o ep=2``
   (the inverse recipe; args from ``recipes.megatron_args`` over the D run's) loads strictly in
   megatron-core (in the same core_loss.py run, ``eval:``: each EP rank's ``mp_rank_00_00E`` file,
   ``load_state_dict(strict=True)``) with HF's logits (1e-4) and loss; read back through the recipe every
   tensor is HF's, bitwise, and ``recipes.hf_config`` of the written args gives the original's recipe config.

Measured (fp32): logits 4.5e-8 apart, loss 4.8e-7 and next loss 2.4e-7 (one ulp of ~4.17; the step moves
it by 2.8e-3, and by 8.2e-3 more without the moments); megatron-core's grad norm 0.49. What this loss
cannot see: the query's update scale, the norms' decay mask and the run's aux-loss coefficient 0.01 each
move the next loss by <= 1e-6 in this tiny model; they are matched by construction (above), not detected.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import numpy as np
import pytest
from _common import core_loss

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_models as hf
import maxtext_client as mx

import ckptbridge
from ckptbridge import OptionError, Rename, recipes

HERE = os.path.dirname(os.path.abspath(__file__))
D = os.path.join(HERE, "fixtures", "megatron_moe", "D", "tp1ep2dp4", "torch_dist")
TOL = 1e-4  # logits
LOSS_TOL = 1e-5  # losses (~4.2): fp32 sums in two orders, measured <= 5e-7
MICRO, MBS = 2, 2  # megatron-core's 2 micro-batches of 2 sequences: MaxText's batch of 4
EP = 2
HF_SPEC = hf.HFSpec("mixtral", emb=32, mlp=24, heads=4, kv_heads=2, head_dim=8)


def _megatron_lr(args: dict[str, Any], iteration: int) -> float:
    """Megatron's ``OptimizerParamScheduler.get_lr`` (linear warmup, cosine decay) in ``iteration``:
    its schedule after the ``iteration - 1`` steps before (``num_steps`` counts samples)."""
    assert args["lr_decay_style"] == "cosine" and args["lr_warmup_fraction"] is None
    gbs = int(args["global_batch_size"])
    steps, warmup, decay = (iteration - 1) * gbs, int(args["lr_warmup_iters"]) * gbs, int(args["lr_decay_iters"]) * gbs
    top, low, init = float(args["lr"]), float(args["min_lr"]), float(args["lr_warmup_init"])
    if warmup > 0 and steps <= warmup:
        return init + (top - init) * steps / warmup
    ratio = (steps - warmup) / (decay - warmup)
    return low + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (top - low)


def _swap_experts(a: int, b: int) -> tuple[Rename, ...]:
    """Rules (before the recipe) that give global expert ``a`` the name of ``b`` and back."""
    at = r"^(?P<pre>decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)"
    return (Rename(at + rf"{a}\.(?P<rest>.*)$", r"\g<pre>swap.\g<rest>"),
            Rename(at + rf"{b}\.(?P<rest>.*)$", rf"\g<pre>{a}.\g<rest>"),
            Rename(at + r"swap\.(?P<rest>.*)$", rf"\g<pre>{b}.\g<rest>"))


def _hf_to_megatron(work: Any, template: dict[str, Any]) -> tuple[Any, Any]:
    """A tiny HF Mixtral written to Megatron at EP 2 with the CLI; (the model, its directory)."""
    from ckptbridge._cli import main as cli

    model = hf.build(HF_SPEC)
    hf_dir = hf.save(model, work / "hf")
    cfg_file = hf_dir / "config.json"
    (work / "args.json").write_text(json.dumps(recipes.megatron_args(cfg_file, template=template)))
    rules = recipes.rules("mixtral", src="hf", dst="megatron", **recipes.config_from_hf(cfg_file))
    (work / "rules.json").write_text(json.dumps(ckptbridge.rules_to_json(rules)))
    argv = ["reshard", str(hf_dir), str(work / "mg_ep2"), "--to", "megatron", "--tp", "1", "--pp", "1",
            "--rules", str(work / "rules.json"), "-o", f"args={work / 'args.json'}", "-o", f"ep={EP}"]
    assert cli(argv) == 0, argv
    return model, hf_dir


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("migration_megatron_moe")
    src = ckptbridge.open(D)
    mg = src.extra["megatron"]
    args, padded = mg["args"], mg["padded_vocab_size"]
    hf_model, hf_dir = _hf_to_megatron(work, args)
    # megatron-core: D at its EP 2 with its distributed optimizer + one train step; the HF export evaluated
    items = [f"dist:{D}:tp=1,pp=1,ep={EP},optim=1", f"eval:{work / 'mg_ep2'}"]
    recs = core_loss(items, "--microbatches", str(MICRO), "--micro-batch-size", str(MBS), "--train-step",
                     "--set", "moe_aux_loss_coeff=0", "--dump", str(work / "dump"))
    for rec in recs:
        assert "error" not in rec, rec
    dumps = [dict(np.load(r["dump"])) for r in recs]
    tokens, labels = dumps[0]["tokens"], dumps[0]["labels"]
    assert (labels[:, :-1] == tokens[:, 1:]).all()
    np.save(work / "tokens.npy", tokens.astype(np.int32))
    np.save(work / "train.npy", np.concatenate([tokens, labels[:, -1:]], axis=1).astype(np.int32))
    # MaxText's Mixtral for the run's HF config, over the padded vocabulary (Megatron's softmax runs over it)
    config = recipes.hf_config(args, vocab_size=padded, family="mixtral")
    cfg = recipes.config_from_hf(config)
    spec = mx.spec_from_hf(config, mesh={"expert": EP}, batch=tokens.shape[0], seq=tokens.shape[1])
    spec["extra"] = {"adamw_mask": "['_norm/scale']"}  # megatron-core decays no 1-D parameter: the norms
    rules = recipes.rules("mixtral", src="megatron", dst="maxtext", **cfg)
    lr = _megatron_lr(args, int(src.step) + 1)
    hp = {"lr": lr, "b1": float(args["adam_beta1"]), "b2": float(args["adam_beta2"]), "eps": float(args["adam_eps"]),
          "wd": float(args["weight_decay"])}
    keep = {"strip_padding": False}
    jobs = [mx.load_job(spec, D, rules, opt=True, open_options=keep, tokens=work / "tokens.npy",
                        logits=work / "mt.logits.npy", train_tokens=work / "train.npy", steps=2,
                        update_scale={"query/kernel$": 1.0 / math.sqrt(cfg["head_dim"])}, report=work / "mt.json",
                        **hp),
            mx.load_job(spec, D, _swap_experts(0, 2) + rules, open_options=keep, tokens=work / "tokens.npy",
                        logits=work / "swapped.logits.npy")]
    results = mx.run_jobs(jobs)
    return {"work": work, "ref": recs[0], "hf_rec": recs[1], "dumps": dumps, "args": args, "lr": lr, "src": src,
            "losses": results[0]["load"]["losses"], "report": json.loads((work / "mt.json").read_text()),
            "hf_model": hf_model, "hf_dir": hf_dir}


def _err(a: Any, b: Any) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


@pytest.mark.heavy
def test_megatron_ep2_run_continues_in_maxtext_with_its_expert_sharding(run: dict[str, Any]) -> None:
    ref, args, report = run["ref"], run["args"], run["report"]
    assert run["src"].extra["megatron"]["moe"]["ep"] == EP and (ref["ep"], ref["tp"]) == (EP, 1)
    assert report["not_boxed"] == [] and report["not_maxtext_sharding"] == [] and report["devices"] == EP
    assert report["count"] == run["src"].step == 5  # Megatron's iteration: Adam's bias correction goes on
    # every expert kernel and its moments split on the expert axis only: each device holds 2 of the 4 experts
    moe = {n: s for n, s in report["shards"].items() if n.endswith(("MoeBlock_0/wi_0", "MoeBlock_0/wi_1",
                                                                    "MoeBlock_0/wo"))}
    assert len(moe) == 9, sorted(moe)  # weights, mu, nu
    for name, shards in moe.items():
        assert [(dev, dims[0]) for dev, dims in shards] == [(0, [0, 2]), (1, [2, 4])], (name, shards)
        assert all(dims[1:] == [[0, 2], [0, 16], [0, 16]] for _dev, dims in shards), (name, shards)
    # MaxText's logits and loss are megatron-core's
    want = run["dumps"][0]["logits"]
    got = np.load(run["work"] / "mt.logits.npy")
    assert got.shape == want.shape == (MICRO * MBS, 32, 64)
    assert _err(got, want) < TOL
    first, nxt = run["losses"]
    assert abs(first - ref["loss"]) < LOSS_TOL, (first, ref["loss"])
    # one step with Megatron's hyperparameters: the lr of its scheduler, clipping at 1.0 not acting
    step = ref["step"]
    assert step["updated"] and abs(step["lr"] - run["lr"]) <= 1e-12 * run["lr"], (step["lr"], run["lr"])
    assert step["grad_norm"] < float(args["clip_grad"]), step
    assert abs(nxt - step["after_loss"]) < LOSS_TOL, (nxt, step["after_loss"])
    assert nxt < first - 100 * LOSS_TOL  # the step trained


@pytest.mark.heavy
def test_experts_swapped_across_ep_ranks_miss_by_far(run: dict[str, Any]) -> None:
    want = run["dumps"][0]["logits"]
    right = _err(np.load(run["work"] / "mt.logits.npy"), want)
    swapped = _err(np.load(run["work"] / "swapped.logits.npy"), want)
    assert swapped > 10 * TOL and swapped > 1000 * right, (swapped, right)


@pytest.mark.heavy
def test_hf_mixtral_written_at_ep2_loads_strictly_in_megatron_core_with_hfs_logits(run: dict[str, Any]) -> None:
    rec, dump = run["hf_rec"], run["dumps"][1]
    assert (rec["tp"], rec["pp"], rec["ep"]) == (1, 1, EP)
    mg_dir = run["work"] / "mg_ep2"
    files = sorted(p.name for p in (mg_dir / "iter_0000000").iterdir())
    assert files == ["mp_rank_00_000", "mp_rank_00_001"], files
    got = hf.logits(run["hf_model"], dump["tokens"])
    assert _err(got, dump["logits"]) < TOL
    loss = hf.cross_entropy(got, dump["labels"])
    assert abs(loss - rec["loss"]) <= 1e-5 * loss, (loss, rec["loss"])
    # back through the recipe: HF's tensors bitwise, and the written args give Mixtral's recipe config
    cfg_file = run["hf_dir"] / "config.json"
    back = ckptbridge.open(mg_dir, rules=recipes.rules("mixtral", src="megatron", dst="hf",
                                                       **recipes.config_from_hf(cfg_file)))
    orig = ckptbridge.open(run["hf_dir"])
    assert sorted(back) == sorted(orig)
    for key in orig:
        assert back[key].read().tobytes() == orig[key].read().tobytes(), key
    meta = back.extra["megatron"]
    assert meta["moe"]["ep"] == EP
    config = recipes.hf_config(meta["args"], meta["vocab_size"], family="mixtral")
    assert recipes.config_from_hf(config) == recipes.config_from_hf(cfg_file)


def test_mixtral_megatron_router_args_and_what_hf_cannot_express() -> None:
    """HF Mixtral renormalises its top-k softmax weights: megatron-core's top-k-then-softmax router
    (``pre_softmax=False``); Megatron args without a Mixtral equivalent are refused by name."""
    mixtral = {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 256,
               "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}
    args = recipes.megatron_args(mixtral)
    assert args["moe_router_pre_softmax"] is False and args["moe_router_score_function"] == "softmax"
    assert args["num_experts"] == 4 and args["moe_router_topk"] == 2 and args["moe_ffn_hidden_size"] == 24
    assert args["moe_layer_freq"] == [1, 1] and args["moe_aux_loss_coeff"] == 0.0
    cfg = recipes.hf_config(args, family="mixtral")
    assert cfg["model_type"] == "mixtral" and cfg["num_local_experts"] == 4 and cfg["intermediate_size"] == 24
    for bad in ({"moe_router_pre_softmax": True}, {"moe_router_score_function": "sigmoid"},
                {"moe_shared_expert_intermediate_size": 16}, {"qk_layernorm": True}, {"moe_layer_freq": [0, 1]}):
        with pytest.raises(OptionError, match=next(iter(bad))):
            recipes.hf_config({**args, **bad}, family="mixtral")
    with pytest.raises(OptionError, match="sliding_window"):
        recipes.megatron_args({**mixtral, "sliding_window": 4096})
    with pytest.raises(OptionError, match="hf_experts='split'"):
        recipes.rules("mixtral", src="megatron", dst="hf", n_heads=4, n_kv_heads=2, head_dim=8, hf_experts="fused")
