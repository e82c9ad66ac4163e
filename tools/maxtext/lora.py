"""MaxText 0.2.5's own LoRA code on tiny models, files in and out (``.maxtext/venv``).

MaxText 0.2.5 keeps a served LoRA adapter as a tree beside the base parameters
(``maxtext/utils/lora_utils.py``): ``get_lora_abstract_state_nnx(base, adapter_config)`` names and
shapes its leaves (``<module>/lora_a.kernel``, ``<module>/lora_b.kernel`` for the attention
modules ``target_modules`` names), ``apply_lora_on_base_params_nnx(base, lora, lora_alpha / r)``
merges them (``W + einsum("er,rnd->end", a, b) * scale``), as ``MaxEngine.apply_adapter`` does.
The 0.2.5 wheel has no ``hf_lora_to_maxtext.py`` / ``maxtext_to_hf_lora.py``: these two functions
are its LoRA format. One job (``tests/test_lora_maxtext.py`` drives it)::

    {"cmd": "lora-forward", "spec": {...}, "params": "base.safetensors", "lora": "lora.safetensors",
     "adapter_config": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", ...]},
     "tokens": "t.npy", "out": "logits.npy", "report": "r.json"}

writes MaxText's abstract LoRA tree and the given leaves (path -> shape) to ``report``, merges the
given leaves with MaxText's function and writes the forward's fp32 logits; ``{"cmd": "lora-tree", "spec", "adapter_config", "report"}`` writes the tree only
(scanned layers too, which MaxText's 2-D ``einsum`` merge cannot take); ``lora-grad`` (``spec``,
``params``, ``lora``, ``adapter_config``, ``tokens [b, s+1]``, ``out``) writes the loss's gradient
with respect to each adapter leaf through MaxText's merge and forward. ``qwix-forward`` is the
LoRA MaxText 0.2.5 TRAINS with (``train_sft.py``: ``lora_utils.apply_lora_to_model``, qwix's
``LoraProvider`` on the NNX decoder, ``nnx.LoRAParam`` leaves ``<module>/kernel_lora_a`` /
``kernel_lora_b`` beside each kernel); see :func:`qwix_forward`. ``qwix-restore`` puts saved qwix
leaves into that model with MaxText's ``restore_lora_from_path`` and runs it, and restores Tunix's
checkpoint onto MaxText's SFT optimizer (:func:`qwix_restore`). Every other job goes to
``harness.py`` (``convert-hf`` ...), in the same process::

    .maxtext/venv/bin/python tools/maxtext/lora.py jobs --jobs jobs.json --out results.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import harness  # tools/maxtext/harness.py (the script's own directory)


def lora_tree(built: harness.Built, adapter_config: dict[str, Any]) -> dict[str, list[int]]:
    """MaxText's abstract adapter tree for ``built``'s base: ``{path: shape}`` of its LoRA leaves."""
    import jax
    from maxtext.utils import lora_utils

    base = harness._nest({n: jax.ShapeDtypeStruct(harness._unboxed(v).shape, harness._unboxed(v).dtype)
                          for n, v in built.leaves.items()})
    state, _ = lora_utils.get_lora_abstract_state_nnx(base, adapter_config)
    return {p: list(v.shape) for p, v in harness._flat(state.params).items() if v is not None}


def lora_forward(job: dict[str, Any], built: harness.Built) -> dict[str, Any]:
    """``lora-forward`` (see the module doc)."""
    import jax
    import numpy as np
    from maxtext.utils import lora_utils

    cfg = job["adapter_config"]
    given = harness._read_safetensors(Path(job["lora"]))
    variables = harness.place_params(built, job["params"])
    params = jax.tree_util.tree_map(lambda x: x, variables["params"])  # dicts to merge into
    lora = harness._nest({n: jax.numpy.asarray(a) for n, a in given.items()})
    lora_utils.apply_lora_on_base_params_nnx(params, lora, float(cfg["lora_alpha"]) / int(cfg["r"]))
    logits = harness.forward(built, {"params": params}, np.load(job["tokens"], allow_pickle=False))
    np.save(job["out"], logits)
    report = {"lora_tree": lora_tree(built, cfg), "given": {n: list(a.shape) for n, a in given.items()}}
    harness._write_json(Path(job["report"]), report)
    return {"cmd": job["cmd"], "leaves": len(given)}


def lora_grad(job: dict[str, Any], built: harness.Built) -> dict[str, Any]:
    """``lora-grad``: the gradient of the mean next-token cross-entropy (tokens ``[b, s+1]``) with
    respect to the adapter's leaves, merged by MaxText's ``apply_lora_on_base_params_nnx``
    (``out``: a safetensors file of the leaves' gradients)."""
    import flax.linen as nn
    import jax
    import numpy as np
    from maxtext.utils import lora_utils

    cfg = job["adapter_config"]
    scale = float(cfg["lora_alpha"]) / int(cfg["r"])
    base = harness.place_params(built, job["params"])["params"]
    lora = {n: jax.numpy.asarray(a) for n, a in harness._read_safetensors(Path(job["lora"])).items()}
    tokens = np.load(job["tokens"], allow_pickle=False)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(leaves: dict[str, Any]) -> Any:
        params = jax.tree_util.tree_map(lambda v: v, base)
        lora_utils.apply_lora_on_base_params_nnx(params, harness._nest(leaves), scale)
        logits = built.model.apply({"params": params}, x, harness._positions(x), enable_dropout=False,
                                   model_mode="train")
        return harness._cross_entropy(logits, y)

    with built.mesh, nn.logical_axis_rules(built.config.logical_axis_rules):
        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(lora)
    harness._write_safetensors(Path(job["out"]), {n: np.asarray(g) for n, g in grads.items()})
    return {"cmd": job["cmd"], "loss": float(loss)}


@contextlib.contextmanager
def _restoring(cfg: Any, lora: Any) -> Iterator[None]:
    """``cfg.lora`` put back to ``lora`` on leaving."""
    try:
        yield
    finally:
        for key, value in lora:  # pydantic fields (the config itself is read-only)
            setattr(cfg.lora, key, value)


def _leaves(state: Any) -> dict[str, Any]:
    """``{path: ndarray}`` of an ``nnx.State`` (paths end in ``/value``)."""
    import jax
    import numpy as np

    return {harness._path_name(p): np.asarray(jax.device_get(v)) for p, v in jax.tree_util.tree_flatten_with_path(state)[0]}


def _logits_and_grads(model: Any, tokens: Any) -> tuple[Any, Any]:
    """MaxText's fp32 logits of ``tokens[:, :-1]`` and the gradient of their mean next-token
    cross-entropy (targets ``tokens[:, 1:]``) with respect to the ``nnx.LoRAParam`` leaves (one
    compiled function for every model of the same graph and batch)."""
    import jax
    import numpy as np

    x, y = tokens[:, :-1], tokens[:, 1:]
    grads, logits = _jitted_grad()(model, x, harness._positions(x), y)
    return np.asarray(jax.device_get(logits), dtype=np.float32), grads


@functools.cache
def _jitted_grad() -> Any:
    from flax import nnx

    def loss(model: Any, x: Any, positions: Any, y: Any) -> Any:
        out = model(x, positions, enable_dropout=False, model_mode="train")
        return harness._cross_entropy(out, y), out

    return nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True))


def _adam_checkpoint(job: dict[str, Any], model: Any, grads: Any) -> None:
    """One Adam step (optax ``adam``, ``betas``) of ``grads`` on ``model``'s LoRA leaves: a Tunix
    ``PeftTrainer``-like checkpoint at ``train_ckpt/1`` with items ``model_params`` (the LoRA leaves
    the gradient was taken at) and ``optimizer_state`` (``nnx.state(nnx.Optimizer(model, tx,
    wrt=nnx.LoRAParam), OptState)``)."""
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx

    params = _leaves(nnx.state(model, nnx.LoRAParam))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3, *job["betas"]), wrt=nnx.LoRAParam)
    optimizer.update(model, grads)
    state = _leaves(nnx.state(optimizer, nnx.optimizer.OptState))
    with ocp.CheckpointManager(Path(job["train_ckpt"]).absolute(), item_names=("model_params", "optimizer_state")) as mgr:
        mgr.save(1, args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(harness._nest(params)),
                                            optimizer_state=ocp.args.PyTreeSave(harness._nest(state))))


@contextlib.contextmanager
def _qwix_model(job: dict[str, Any], built: harness.Built) -> Iterator[Any]:
    """MaxText's NNX decoder with the base ``params``, LoRA put on it by MaxText's own
    ``lora_utils.apply_lora_to_model`` (``lora.enable_lora``, ``lora_rank`` / ``lora_alpha`` from
    ``rank`` / ``alpha``, the default ``lora_module_path``), inside its mesh and axis rules; the
    cached build's config is put back on leaving."""
    import flax.linen as nn
    import jax
    from flax import nnx
    from maxtext.layers import quantizations
    from maxtext.models import models
    from maxtext.utils import lora_utils

    cfg = built.config
    before = cfg.lora.model_copy()  # the cached build's config is shared by later jobs: put back after
    cfg.lora.enable_lora, cfg.lora.lora_rank, cfg.lora.lora_alpha = True, int(job["rank"]), float(job["alpha"])
    base = harness._read_safetensors(Path(job["params"]))
    with built.mesh, nn.logical_axis_rules(cfg.logical_axis_rules), _restoring(cfg, before):
        model = models.Transformer(cfg, built.mesh, quantizations.configure_quantization(cfg), rngs=nnx.Rngs(0),
                                   model_mode="train")
        model = lora_utils.apply_lora_to_model(model, built.mesh, cfg)
        params = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
        names = {harness._path_name(p).removesuffix("/value") for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
        if names != set(base):
            raise SystemExit(f"{job['params']}: NNX params differ: {sorted(names ^ set(base))[:6]}")
        nnx.update(model, jax.tree_util.tree_map_with_path(lambda p, v: base[harness._path_name(p).removesuffix("/value")],
                                                           params))
        yield model


def qwix_forward(job: dict[str, Any], built: harness.Built) -> dict[str, Any]:
    """``qwix-forward`` (``spec``, ``params``, ``rank``, ``alpha``, ``seed``, ``tokens [b, s+1]``,
    ``betas``, ``out``, ``ckpt``, ``train_ckpt``, ``report``): :func:`_qwix_model`, every
    ``kernel_lora_b`` drawn non-zero (``seed``). Writes the fp32 logits of ``tokens[:, :-1]``
    (``out``); ``nnx.state(model, nnx.LoRAParam)`` as an Orbax PyTree at ``ckpt`` (leaves ``{"value":
    array}``, the tree MaxText's ``restore_lora_from_path`` restores); with ``train_ckpt``, one Adam
    step's checkpoint there (:func:`_adam_checkpoint`); and to ``report`` the LoRA leaves (path -> shape) and
    their largest difference after ``restore_lora_from_path`` put ``ckpt`` back into the model, its
    LoRA leaves zeroed first (0.0: MaxText reads it back)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx
    from maxtext.utils import lora_utils

    tokens = np.load(job["tokens"], allow_pickle=False)
    with _qwix_model(job, built) as model:
        lora = nnx.state(model, nnx.LoRAParam)
        rng = np.random.default_rng(int(job["seed"]))
        drawn = jax.tree_util.tree_map_with_path(
            lambda p, v: rng.normal(0, 0.2, v.shape).astype(v.dtype) if "kernel_lora_b" in harness._path_name(p)
            else np.asarray(v), lora)
        nnx.update(model, drawn)
        tree = _leaves(drawn)
        ocp.PyTreeCheckpointer().save(Path(job["ckpt"]).absolute(), harness._nest(tree))
        got, grads = _logits_and_grads(model, tokens)
        if job.get("train_ckpt"):
            _adam_checkpoint(job, model, grads)
        nnx.update(model, jax.tree_util.tree_map(np.zeros_like, drawn))  # then MaxText's restore puts them back
        built.config.lora.lora_restore_path = str(Path(job["ckpt"]).absolute())
        again = _leaves(nnx.state(lora_utils.restore_lora_from_path(model, built.config), nnx.LoRAParam))
    np.save(job["out"], got)
    harness._write_json(Path(job["report"]), {"leaves": {n: list(a.shape) for n, a in tree.items()},
                                              "restored_max_diff": max(float(np.abs(again[n] - a).max()) for n, a in tree.items())})
    return {"cmd": job["cmd"], "leaves": len(tree)}


def qwix_restore(job: dict[str, Any], built: harness.Built) -> dict[str, Any]:
    """``qwix-restore`` (``spec``, ``params``, ``rank``, ``alpha``, ``lora`` and ``out`` (lists),
    ``tokens [b, s+1]``, ``report``; ``train_ckpt``, ``betas``): :func:`_qwix_model`, its LoRA
    leaves restored from each Orbax directory in ``lora`` in turn by MaxText's
    ``restore_lora_from_path`` (``lora.lora_restore_path``, as ``train_sft.py`` does), the fp32
    logits of ``tokens[:, :-1]`` written to the ``out`` beside it. To ``report``: the leaves the
    first restored (path -> shape) and the custom metadata MaxText reads from its path
    (``checkpointing.load_checkpoint_metadata``, where ``sync_lora_metadata`` takes ``lora_rank`` /
    ``lora_alpha``). With ``train_ckpt`` (Tunix's ``PeftTrainer`` checkpoint root), restored the way
    Tunix's ``CheckpointManager.maybe_restore`` does (Orbax v1 ``training.Checkpointer``
    ``load_checkpointables`` of ``model_params`` and ``optimizer_state`` onto ``nnx.state(model,
    nnx.LoRAParam)`` and ``nnx.state(nnx.Optimizer(model, tx, wrt=nnx.LoRAParam), OptState)``, ``tx``
    MaxText's SFT optimizer, :func:`_tunix_restore`), the report gets its step, leaf names and counters, the
    largest difference of its ``model_params`` from the first restored leaves, and of its ``mu`` /
    ``nu`` from the moments of one Adam step MaxText itself takes from those leaves on ``tokens``
    (over the largest moment)."""
    import numpy as np
    from flax import nnx
    from maxtext.common import checkpointing
    from maxtext.utils import lora_utils

    tokens = np.load(job["tokens"], allow_pickle=False)
    report: dict[str, Any] = {}
    with _qwix_model(job, built) as model:
        for k, (lora_dir, out) in enumerate(zip(job["lora"], job["out"], strict=True)):
            built.config.lora.lora_restore_path = str(Path(lora_dir).absolute())
            restored = _leaves(nnx.state(lora_utils.restore_lora_from_path(model, built.config), nnx.LoRAParam))
            np.save(out, _logits_and_grads(model, tokens)[0])
            if k == 0:
                report = {"leaves": {n: list(a.shape) for n, a in restored.items()},
                          "metadata": checkpointing.load_checkpoint_metadata(built.config.lora.lora_restore_path)}
                first = restored
        if job.get("train_ckpt"):  # the first adapter back in the model, for its Adam step
            built.config.lora.lora_restore_path = str(Path(job["lora"][0]).absolute())
            lora_utils.restore_lora_from_path(model, built.config)
            report["tunix"] = _tunix_restore(job, built, model, first, tokens)
    harness._write_json(Path(job["report"]), report)
    return {"cmd": job["cmd"], "restored": len(job["lora"])}


def _tunix_restore(job: dict[str, Any], built: harness.Built, model: Any, restored: dict[str, Any],
                   tokens: Any) -> dict[str, Any]:
    """Tunix's restore of ``train_ckpt`` onto ``model`` compared with ``restored`` (its LoRA leaves)
    and with MaxText's own first Adam step from them (see :func:`qwix_restore`). The optimizer is
    MaxText's SFT one: ``optimizers.get_optimizer``'s AdamW (``betas``, a constant schedule) behind
    ``clip_by_global_norm`` as ``train_sft.setup_trainer_state`` chains it (a threshold that clips
    nothing: one step's moments are then ``(1 - b1) g``, ``(1 - b2) g^2``)."""
    import numpy as np
    import optax
    from flax import nnx
    from orbax.checkpoint import v1 as ocp

    b1, b2 = job["betas"]
    tx = optax.chain(optax.clip_by_global_norm(1e9), harness._tx(built, harness.AdamW(b1=b1, b2=b2)))
    _, grads = _logits_and_grads(model, tokens)
    own = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    own.update(model, grads)  # MaxText's own first step from the restored leaves
    want = _leaves(nnx.state(own, nnx.optimizer.OptState))
    carried = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    with ocp.training.Checkpointer(Path(job["train_ckpt"]).absolute()) as ckpt:
        step = ckpt.latest.step
        back = ckpt.load_checkpointables(step, {"model_params": nnx.state(model, nnx.LoRAParam),
                                                "optimizer_state": nnx.state(carried, nnx.optimizer.OptState)})
    params, opt = _leaves(back["model_params"]), _leaves(back["optimizer_state"])

    def rel(key: str) -> float:
        names = [n for n in want if f"/{key}/" in n]
        return max(float(np.abs(opt[n] - want[n]).max()) for n in names) / max(float(np.abs(want[n]).max()) for n in names)

    return {"step": step, "names": sorted(opt), "counts": {n: int(a) for n, a in opt.items() if not a.shape},
            "params_max_diff": max(float(np.abs(params[n] - a).max()) for n, a in restored.items()),
            "moments_rel_diff": {key: rel(key) for key in ("mu", "nu")}}


def run_batch(jobs: list[dict[str, Any]], cache: dict[str, harness.Built]) -> list[dict[str, Any]]:
    """Every job in order: the LoRA jobs here, every other one by ``harness.run_job``."""
    results = []
    for job in jobs:
        if job["cmd"] not in ("lora-forward", "lora-tree", "lora-grad", "qwix-forward", "qwix-restore"):
            results.append(harness.run_job(job, cache))
            continue
        t0 = time.time()
        model = harness.built_model(harness.Spec.from_json(job["spec"]), cache)
        if job["cmd"] in ("qwix-forward", "qwix-restore"):
            result = (qwix_forward if job["cmd"] == "qwix-forward" else qwix_restore)(job, model)
        elif job["cmd"] == "lora-tree":
            harness._write_json(Path(job["report"]), {"lora_tree": lora_tree(model, job["adapter_config"])})
            result = {"cmd": "lora-tree"}
        else:
            result = (lora_forward if job["cmd"] == "lora-forward" else lora_grad)(job, model)
        results.append({**result, "seconds": round(time.time() - t0, 2)})
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lora.py", description=__doc__.split("\n\n")[0])
    p.add_argument("cmd", choices=["jobs", "serve"])  # harness.py's command lines, so maxtext_client drives both
    p.add_argument("--jobs")
    p.add_argument("--out")
    p.add_argument("--reply-fd", type=int)
    args = p.parse_args(argv)
    if args.cmd == "serve":
        return harness.serve(run_batch, args.reply_fd)
    jobs = json.loads(Path(args.jobs).read_text())
    harness.set_devices(harness._devices_for(jobs))  # before jax initialises its backend, as harness.main does
    harness._write_json(Path(args.out), run_batch(jobs, {}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
