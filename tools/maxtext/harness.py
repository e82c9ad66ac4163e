"""Run MaxText's own model and converter code on tiny configs, files in and out.

Runs inside ``.maxtext/venv`` (Python 3.12, ``maxtext==0.2.5``, jax[cpu]; built by
``tools/maxtext/setup.sh``). The 3.11 test venv drives it through
``tests/maxtext_client.py``. Every subcommand reads and writes plain files:

- a **spec** (JSON) names the model: ``family`` (llama|mistral|qwen2|mixtral|qwen3|qwen3_moe|
  deepseek_v3|gemma3|gpt_oss: each registered by a ``tools/maxtext/<module>.py``, see
  ``tools/maxtext/registry.py``, with its MaxText keys and converter; ``extra`` adds more), ``emb``,
  ``layers``, ``heads``, ``kv_heads``, ``head_dim``, ``mlp``, ``vocab``, ``scan``,
  ``rope_type`` (default|llama3.1), ``rope_theta``, ``norm_eps``, ``tied``, ``experts``,
  ``experts_per_tok``, ``extra`` (family-specific MaxText keys: ``deepseek_v3``'s MLA and MoE shapes,
  see ``tools/maxtext/deepseek.py``), ``mesh`` (``{"fsdp": 4, "tensor": 2}``: MaxText ``ici_*_parallelism``),
  ``batch``, ``seq`` (the shapes MaxText initialises with), ``weight_dtype`` (default float32);
- **params** are a safetensors file whose keys are MaxText's Linen parameter paths joined
  by ``/`` without the leading ``params`` (``decoder/layers/self_attention/query/kernel``),
  or anything ``ckptbridge.open`` reads (a universal directory ...), loaded with
  ``ckptbridge.adapters.jax.load`` straight onto MaxText's shardings;
- **optimizer state** is a safetensors file with ``mu/<path>``, ``nu/<path>`` and a scalar
  ``count`` (optax ``ScaleByAdamState``);
- tokens and logits are ``.npy`` (int32 tokens ``[batch, seq]``; fp32 logits
  ``[batch, seq, vocab]``); reports are JSON.

Subcommands::

    harness.py tree       --spec s.json --out tree.json
    harness.py convert-hf --spec s.json --hf-dir hf/ --out params.safetensors [--report r.json]
                          [--from-unscanned]  # scan=True built from MaxText's unscanned conversion
    harness.py convert-to-hf --spec s.json --params p.safetensors --hf-config config.json --out hf/
                          [--prefix mu/]      # MaxText's own to_huggingface hooks; one file + config
    harness.py forward    --spec s.json --params p.safetensors --tokens t.npy --out logits.npy
    harness.py train      --spec s.json --params p.safetensors --tokens t.npy --steps 3 --out dir/
                          [--opt-state o.safetensors | --mu m.safetensors --nu n.safetensors --count N]
                          [--lr 1e-3 --b1 .9 --b2 .95 --eps 1e-8 --wd .1]
    harness.py load       --spec s.json --source CKPT --rules rules.json [--open-options '{...}'] [--opt] [--dump d.safetensors]
                          [--tokens t.npy --logits l.npy] [--train-tokens tt.npy --steps N --train-out dir/]
                          [--update-scale '{"query/kernel$": 0.17}'] [--save-universal dir/] [--report r.json]
    harness.py jobs       --jobs jobs.json   # several of the above in one process (one import)
    harness.py serve      --reply-fd N       # batches of jobs named on stdin, one process (see serve())

``tree`` builds MaxText's decoder (``models.transformer_as_linen``) and lists every leaf
with its shape, dtype and the logical axis names of its ``nn.LogicallyPartitioned`` box.
``forward`` places the params on a multi-device CPU mesh with MaxText's own logical-axis
rules (``nn.logical_to_mesh_sharding``) and writes fp32 logits. ``convert-hf`` runs
MaxText's own converter (``maxtext.checkpoint_conversion.to_maxtext``: its
``PARAM_MAPPING``/``HOOK_FNS`` and its loading, stacking and shape checks) on a Hugging
Face directory. ``load`` opens any checkpoint with ``ckptbridge.open(source, rules=...)`` (e.g. an
HF directory through ``ckptbridge.recipes``) and loads it with ``ckptbridge.adapters.flax.load`` onto
MaxText's own abstract boxed tree (and with ``--opt`` into its optax AdamW state), reporting any leaf
not boxed or not sharded as MaxText's rules say. ``train`` runs optax AdamW built by MaxText's ``optimizers.get_optimizer``
(constant learning rate, no clipping) on MaxText's forward plus a plain next-token
cross-entropy. See ``tools/maxtext/NOTES.md`` for what these show.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import registry  # tools/maxtext/registry.py (the script's own directory): the families

EXTRA_COLLECTIONS = ("MoEBiasVar",)  # MaxText's DeepSeek router correction bias (layers/moe.py MoEBiasVar)
ROPE_TYPES = ("default", "llama3.1")


@dataclass(frozen=True)
class Spec:
    """A tiny model for MaxText: what the CLI's ``--spec`` JSON holds."""

    family: str
    emb: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    mlp: int = 128
    vocab: int = 256
    scan: bool = True
    rope_type: str = "default"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tied: bool = False
    experts: int = 0
    experts_per_tok: int = 0
    mesh: dict[str, int] = field(default_factory=lambda: {"fsdp": 4, "tensor": 2})
    batch: int = 8
    seq: int = 16
    weight_dtype: str = "float32"  # MaxText's weight_dtype (the parameter tree's dtype); compute stays fp32
    norm_topk_prob: bool = False  # qwen3_moe: renormalise the top-k router weights
    extra: dict[str, Any] = field(default_factory=dict)  # more MaxText overrides (deepseek_v3's MLA and
    # MoE shapes, gemma3's window ...)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Spec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SystemExit(f"spec: unknown keys {unknown} (known: {sorted(known)})")
        spec = cls(**data)
        family = registry.family(spec.family)
        if spec.rope_type not in ROPE_TYPES:
            raise SystemExit(f"spec: rope_type {spec.rope_type!r} is not one of {ROPE_TYPES}")
        if family.moe != (spec.experts > 0):
            moe = sorted(name for name, fam in registry.families().items() if fam.moe)
            raise SystemExit(f"spec: experts > 0 exactly when family is one of {moe}")
        return spec

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())


def maxtext_overrides(spec: Spec) -> list[str]:
    """MaxText ``key=value`` overrides (on top of its ``base.yml``) for ``spec`` on CPU."""
    ov = {
        "run_name": "ckptbridge",
        "base_output_directory": os.path.join(tempfile.gettempdir(), "ckptbridge-maxtext"),
        "hardware": "cpu",
        "skip_jax_distributed_system": True,
        "enable_checkpointing": False,
        "dataset_type": "synthetic",
        "model_name": "default",
        "base_emb_dim": spec.emb,
        "base_num_query_heads": spec.heads,
        "base_num_kv_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "base_mlp_dim": spec.mlp,
        "base_num_decoder_layers": spec.layers,
        "vocab_size": spec.vocab,
        "mlp_activations": "['silu','linear']",
        "enable_dropout": False,
        "logits_via_embedding": spec.tied,
        "normalize_embedding_logits": False,
        "normalization_layer_epsilon": spec.norm_eps,
        "dtype": "float32",
        "weight_dtype": spec.weight_dtype,
        "matmul_precision": "highest",
        "attention": "dot_product",
        "scan_layers": spec.scan,
        "rope_type": spec.rope_type,
        "rope_use_scale": True,
        "rope_max_timescale": spec.rope_theta,
        "max_target_length": spec.seq,
        "per_device_batch_size": spec.batch / spec.devices,
        "opt_type": "adamw",
        "mu_dtype": "float32",
        "gradient_clipping_threshold": 0.0,
    }
    for axis in ("data", "fsdp", "tensor", "expert"):
        ov[f"ici_{axis}_parallelism"] = spec.mesh.get(axis, 1)
    unknown = set(spec.mesh) - {"data", "fsdp", "tensor", "expert"}
    if unknown:
        raise SystemExit(f"spec: mesh axes {sorted(unknown)} are not supported (data, fsdp, tensor, expert)")
    ov |= registry.family(spec.family).overrides(spec) | spec.extra
    if spec.experts:  # dense (non-megablox) experts, no token dropping: runs on XLA:CPU
        ov = {
            "num_experts": spec.experts,
            "num_experts_per_tok": spec.experts_per_tok,
            "base_moe_mlp_dim": spec.mlp,
            "capacity_factor": -1,
            "sparse_matmul": False,
            "megablox": False,
        } | ov  # a family's own keys (deepseek_v3's base_moe_mlp_dim) win
    return [f"{k}={v}" for k, v in ov.items()]


# ----------------------------------------------------------------------------- MaxText


@dataclass(frozen=True)
class Built:
    """MaxText's config, mesh and Linen-wrapped model, with its abstract boxed tree."""

    config: Any
    mesh: Any
    model: Any
    leaves: dict[str, Any]  # path -> nn.LogicallyPartitioned (or ShapeDtypeStruct)
    shardings: dict[str, Any]  # path -> NamedSharding from MaxText's logical axis rules
    abstract: Any = None  # MaxText's abstract boxed tree ({"params": ...}, nn.LogicallyPartitioned leaves)


def _path_name(path: Sequence[Any]) -> str:
    parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    if parts and parts[0] == "params":
        parts = parts[1:]
    return "/".join(parts)


def build(spec: Spec) -> Built:
    """Build MaxText's decoder for ``spec`` (pyconfig + ``transformer_as_linen``), abstractly."""
    import flax.linen as nn
    import jax
    import maxtext
    from maxtext.configs import pyconfig
    from maxtext.layers import quantizations
    from maxtext.models import models
    from maxtext.utils import maxtext_utils

    base = str(Path(maxtext.__file__).parent / "configs" / "base.yml")
    config = pyconfig.initialize([sys.argv[0], base, *maxtext_overrides(spec)])
    mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(config), config.mesh_axes)
    quant = quantizations.configure_quantization(config)
    model = models.transformer_as_linen(config, mesh, quant=quant, model_mode="train")
    abstract = maxtext_utils.get_abstract_param(model, config)
    if "params" not in abstract or set(abstract) - {"params", *EXTRA_COLLECTIONS}:
        raise SystemExit(f"unexpected MaxText collections {sorted(abstract)} (expected 'params', {EXTRA_COLLECTIONS})")
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_box)[0]
    leaves = {_path_name(p): leaf for p, leaf in flat}
    specs = nn.get_partition_spec(abstract)
    mesh_shardings = nn.logical_to_mesh_sharding(specs, mesh, config.logical_axis_rules)
    flat_sh = jax.tree_util.tree_flatten_with_path(mesh_shardings)[0]
    shardings = {_path_name(p): s for p, s in flat_sh}
    return Built(config, mesh, model, leaves, shardings, abstract)


def _unboxed(leaf: Any) -> Any:
    return leaf.value if hasattr(leaf, "names") and hasattr(leaf, "value") else leaf


def tree_report(built: Built) -> dict[str, Any]:
    """The parameter tree: path -> shape, dtype, logical axes (``None`` when not boxed)."""
    out = []
    for name, leaf in built.leaves.items():
        value = _unboxed(leaf)
        names = getattr(leaf, "names", None)
        out.append(
            {
                "path": name,
                "shape": list(value.shape),
                "dtype": str(value.dtype),
                "axes": list(names) if names is not None else None,
                "mesh_spec": [
                    list(a) if isinstance(a, tuple) else a for a in built.shardings[name].spec
                ],
            }
        )
    cfg = built.config
    return {
        "maxtext_version": _maxtext_version(),
        "leaves": out,
        "param_scan_axis": cfg.param_scan_axis,
        "mesh": {k: int(v) for k, v in built.mesh.shape.items() if v > 1},
        "logical_axis_rules": [[r[0], r[1]] for r in cfg.logical_axis_rules],
    }


def _maxtext_version() -> str:
    from importlib.metadata import version

    return version("maxtext")


# ----------------------------------------------------------------------------- params I/O


def _read_safetensors(path: Path) -> dict[str, Any]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def _write_safetensors(path: Path, arrays: dict[str, Any]) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(path))


def place_params(built: Built, source: str, state: str | None = None) -> Any:
    """MaxText's ``{'params': tree}`` on its mesh, from a params file (see module doc).

    A ``.safetensors`` file is read with safetensors and put on the devices with
    ``jax.device_put``; anything else goes through ``ckptbridge.adapters.jax.load``.
    Shapes and dtypes must equal MaxText's exactly.
    """
    import jax
    import numpy as np

    names = list(built.leaves)
    if str(source).endswith(".safetensors"):
        arrays = _read_safetensors(Path(source))
        missing = [n for n in names if n not in arrays]
        extra = sorted(set(arrays) - set(names))
        if missing or extra:
            raise SystemExit(f"{source}: missing {missing}, unexpected {extra}")
        placed = {}
        for n in names:
            want = _unboxed(built.leaves[n])
            a = arrays[n]
            if tuple(a.shape) != tuple(want.shape) or np.dtype(a.dtype) != np.dtype(want.dtype):
                raise SystemExit(
                    f"{source}: {n} is {a.dtype}{list(a.shape)}, MaxText wants {want.dtype}{list(want.shape)}"
                )
            placed[n] = jax.device_put(a, built.shardings[n])
    else:
        from ckptbridge.adapters import jax as cbjax

        placed = cbjax.load(source, {n: built.shardings[n] for n in names}, state=state)
    return {"params": _nest(placed)}


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        node = tree
        *head, last = name.split("/")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def _flat(tree: Any) -> dict[str, Any]:
    import jax

    return {_path_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


# ----------------------------------------------------------------------------- forward / train


def _positions(tokens: Any) -> Any:
    import numpy as np

    b, s = tokens.shape
    return np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()


def forward(built: Built, variables: Any, tokens: Any) -> Any:
    """fp32 logits of MaxText's model (train mode, no dropout) for int tokens ``[b, s]``."""
    import flax.linen as nn
    import jax
    import numpy as np

    tokens = np.asarray(tokens, dtype=np.int32)
    cfg = built.config

    @jax.jit
    def run(v: Any, x: Any, pos: Any) -> Any:
        return built.model.apply(v, x, pos, enable_dropout=False, model_mode="train")

    with built.mesh, nn.logical_axis_rules(cfg.logical_axis_rules):
        logits = run(variables, tokens, _positions(tokens))
    return np.asarray(jax.device_get(logits), dtype=np.float32)


def _cross_entropy(logits: Any, targets: Any) -> Any:
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


@dataclass(frozen=True)
class AdamW:
    """Hyper-parameters of the AdamW run (MaxText's ``adam_*`` keys; constant learning rate)."""

    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    wd: float = 0.1


def _with_adam(cfg: Any, hp: AdamW) -> Any:
    """A view of MaxText's config whose ``adam_*`` values are ``hp``'s."""

    class _View:
        def __getattr__(self, name: str) -> Any:
            over = {"adam_b1": hp.b1, "adam_b2": hp.b2, "adam_eps": hp.eps,
                    "adam_weight_decay": hp.wd, "adam_eps_root": 0.0, "opt_type": "adamw"}
            return over[name] if name in over else getattr(cfg, name)

    return _View()


def _replace_adam(opt_state: Any, fn: Callable[[Any], Any]) -> Any:
    import jax
    import optax

    return jax.tree_util.tree_map(
        lambda x: fn(x) if isinstance(x, optax.ScaleByAdamState) else x,
        opt_state,
        is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState),
    )


def _adam_of(opt_state: Any) -> Any:
    import jax
    import optax

    states = [
        x
        for x in jax.tree_util.tree_leaves(
            opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)
        )
        if isinstance(x, optax.ScaleByAdamState)
    ]
    if len(states) != 1:
        raise SystemExit(f"expected one optax ScaleByAdamState in MaxText's optimizer, found {len(states)}")
    return states[0]


def train(built: Built, variables: Any, tokens: Any, steps: int, hp: AdamW,
          opt_in: dict[str, Any] | None, tx: Any = None, opt_state: Any = None) -> tuple[list[float], Any, Any]:
    """``steps`` AdamW steps; returns (losses before each update, params, opt_state).

    ``tokens`` is ``[b, s+1]`` (the same batch every step) or ``[steps, b, s+1]``;
    the loss is the mean next-token cross-entropy of MaxText's logits. ``tx`` / ``opt_state``:
    an optimizer and its state already loaded (default: MaxText's AdamW, fresh or ``opt_in``).
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    tokens = np.asarray(tokens, dtype=np.int32)
    batches = [tokens] * steps if tokens.ndim == 2 else list(tokens)
    if len(batches) != steps:
        raise SystemExit(f"tokens hold {len(batches)} batches for {steps} steps")
    tx = tx if tx is not None else _tx(built, hp)
    params = variables["params"]
    cfg = built.config
    with built.mesh, nn.logical_axis_rules(cfg.logical_axis_rules):
        if opt_state is None:
            opt_state = jax.jit(tx.init)(params)
        if opt_in is not None:
            names = list(built.leaves)
            count = jnp.asarray(opt_in["count"], dtype=jnp.int32).reshape(())

            def load(prefix: str) -> Any:
                arrays = {}
                for n in names:
                    key = f"{prefix}/{n}"
                    if key not in opt_in:
                        raise SystemExit(f"optimizer state: {key} missing")
                    arrays[n] = jax.device_put(
                        np.asarray(opt_in[key], dtype=np.float32), built.shardings[n]
                    )
                return _nest(arrays)

            mu, nu = load("mu"), load("nu")
            opt_state = _replace_adam(opt_state, lambda s: optax.ScaleByAdamState(count=count, mu=mu, nu=nu))
            opt_state = jax.tree_util.tree_map(
                lambda x: jnp.asarray(count, x.dtype) if getattr(x, "ndim", 1) == 0 and x.dtype in (jnp.int32, jnp.int64) else x,
                opt_state,
            )

        def loss_fn(p: Any, x: Any, pos: Any, y: Any) -> Any:
            logits = built.model.apply({"params": p}, x, pos, enable_dropout=False, model_mode="train")
            return _cross_entropy(logits, y)

        @jax.jit
        def step(p: Any, s: Any, x: Any, pos: Any, y: Any) -> Any:
            loss, grads = jax.value_and_grad(loss_fn)(p, x, pos, y)
            updates, s = tx.update(grads, s, p)
            return loss, optax.apply_updates(p, updates), s

        losses = []
        for batch in batches:
            x, y = batch[:, :-1], batch[:, 1:]
            loss, params, opt_state = step(params, opt_state, x, _positions(x), y)
            losses.append(float(loss))
    return losses, params, opt_state


def _tx(built: Built, hp: AdamW) -> Any:
    from maxtext.optimizers import optimizers

    return optimizers.get_optimizer(_with_adam(built.config, hp), lambda step: hp.lr)


# ----------------------------------------------------------------------------- ckptbridge recipes


def read_rules(arg: Any) -> list[dict[str, Any]]:
    """Rules as JSON data: a list given inline, or a file holding a list (or ``{"rules": [...]}``)."""
    if isinstance(arg, list):
        return arg
    data = json.loads(Path(arg).read_text())
    return list(data["rules"] if isinstance(data, dict) else data)


def scaled_adamw(hp: AdamW, update_scale: dict[str, float], mask: Any = None) -> Any:
    """optax's AdamW as MaxText's ``get_optimizer`` builds it (``scale_by_adam``, decoupled weight
    decay, a learning-rate schedule), with the Adam direction of the leaves whose path matches a
    pattern of ``update_scale`` multiplied by its factor, before the decay and the learning rate.
    ``mask``: MaxText's weight-decay mask (``optimizers.get_adamw_mask`` of its ``adamw_mask`` config).

    A leaf reparametrised as ``w' = c w`` (MaxText's query kernel, ``c = 1/sqrt(head_dim)``) with
    its moments mapped (``mu / c``, ``nu / c**2``) follows the original run's trajectory exactly
    under factor ``c``; plain AdamW (factor 1) takes ``1/c`` times the equivalent step on it.
    """
    import re

    import jax
    import optax

    from ckptbridge.adapters.jax import path_name

    def factor(path: Any) -> float:
        name = path_name(path)
        hits = [f for pat, f in update_scale.items() if re.search(pat, name)]
        return float(hits[0]) if hits else 1.0

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        del params
        return jax.tree_util.tree_map_with_path(lambda p, u: u * u.dtype.type(factor(p)), updates), state

    scale = optax.GradientTransformation(lambda params: optax.EmptyState(), update)
    return optax.chain(
        optax.scale_by_adam(b1=hp.b1, b2=hp.b2, eps=hp.eps, eps_root=0.0, mu_dtype="float32"),
        scale,
        optax.add_decayed_weights(hp.wd, mask),
        optax.scale_by_learning_rate(lambda step: hp.lr),
    )


def _opt_target(built: Built, opt_abstract: Any) -> Any:
    """The optimizer state's abstract tree with shardings: each moment like its parameter
    (MaxText's own state sharding), scalars replicated."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from ckptbridge.adapters.jax import path_name

    def leaf(path: Any, x: Any) -> Any:
        name = path_name(path)
        param = next((n for n in built.shardings if name.endswith("/" + n)), None)
        sh = built.shardings[param] if param is not None else NamedSharding(built.mesh, PartitionSpec())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)

    return jax.tree_util.tree_map_with_path(leaf, opt_abstract)


def load_recipe(built: Built, source: str, rules: list[dict[str, Any]], tx: Any = None,
                open_options: dict[str, Any] | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """``ckptbridge.open(source, rules=rules, **open_options)`` loaded by ``ckptbridge.adapters.flax.load`` onto
    MaxText's own abstract boxed tree (``nn.LogicallyPartitioned`` leaves, placed on MaxText's mesh by
    its logical-axis rules) and, with ``tx``, into that optimizer's state (``mu``/``nu``/``count``).

    Returns (``{"params": tree}`` unboxed for ``apply``, the optimizer state or None, a report:
    timings, bytes read, and every leaf whose box or sharding is not MaxText's)."""
    import flax.linen as nn
    import jax

    import ckptbridge
    from ckptbridge.adapters import flax as cbflax
    from ckptbridge.adapters.jax import path_name

    cfg = built.config
    t0 = time.perf_counter()
    ckpt = ckptbridge.open(source, rules=rules, **(open_options or {}))
    opened = time.perf_counter() - t0
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731
    kw = {"mesh": built.mesh, "axis_rules": cfg.logical_axis_rules}
    t0 = time.perf_counter()
    with built.mesh, nn.logical_axis_rules(cfg.logical_axis_rules):
        if tx is None:
            boxed, opt_state = cbflax.load(ckpt, built.abstract, **kw), None
        else:
            plain = jax.tree.map(_unboxed, built.abstract["params"], is_leaf=is_box)
            target = _opt_target(built, jax.eval_shape(tx.init, plain))
            boxed, opt_state = cbflax.load(ckpt, built.abstract, target, **kw)
        jax.block_until_ready(jax.tree.map(_unboxed, boxed, is_leaf=is_box))
    loaded = time.perf_counter() - t0
    flat = jax.tree_util.tree_flatten_with_path(boxed, is_leaf=is_box)[0]
    not_boxed, bad_sharding, shards = [], [], {}
    for path, leaf in flat:
        name = _path_name(path)
        if not is_box(leaf) or tuple(leaf.names) != tuple(built.leaves[name].names):
            not_boxed.append(name)
        arr = _unboxed(leaf)
        shards[name] = _shards(arr)
        if not arr.sharding.is_equivalent_to(built.shardings[name], arr.ndim):
            bad_sharding.append(name)
    if opt_state is not None:
        for path, arr in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
            name = path_name(path)
            shards[name] = _shards(arr)
            param = next((n for n in built.shardings if name.endswith("/" + n)), None)
            if param is not None and not arr.sharding.is_equivalent_to(built.shardings[param], arr.ndim):
                bad_sharding.append(name)
    report = {"open_seconds": opened, "load_seconds": loaded, "bytes_read": int(ckpt.stats.bytes_read),
              "leaves": len(flat), "not_boxed": not_boxed, "not_maxtext_sharding": bad_sharding,
              "devices": int(built.mesh.devices.size), "shards": shards}
    ckpt.close()
    params = jax.tree.map(_unboxed, boxed, is_leaf=is_box)
    return params, opt_state, report


def _shards(arr: Any) -> list[list[Any]]:
    """What each device holds of ``arr`` (its ``jax.Array.sharding``): ``[[device id, [[start, stop] per
    dim]], ...]`` by device id."""
    index = sorted(arr.sharding.devices_indices_map(arr.shape).items(), key=lambda kv: kv[0].id)
    return [[int(dev.id), [[s.start or 0, n if s.stop is None else s.stop] for s, n in zip(idx, arr.shape)]]
            for dev, idx in index]


def _state_arrays(params: Any, opt_state: Any) -> dict[str, Any]:
    """``{path: array}`` of the params, plus ``mu/<path>``, ``nu/<path>``, ``count`` of the Adam state."""
    import numpy as np

    out = {n: np.asarray(v) for n, v in _flat(params).items()}
    if opt_state is not None:
        adam = _adam_of(opt_state)
        out["count"] = np.asarray(adam.count)
        out |= {f"mu/{n}": np.asarray(v) for n, v in _flat(adam.mu).items()}
        out |= {f"nu/{n}": np.asarray(v) for n, v in _flat(adam.nu).items()}
    return out


# ----------------------------------------------------------------------------- converter


def _strip_rope(hooks: Any) -> Any:
    if isinstance(hooks, list):
        return [h for h in hooks if getattr(h, "__name__", "") != "adjust_rope"]
    return hooks


def convert_hf(built: Built, spec: Spec, hf_dir: Path, save_dtype: str = "float32") -> tuple[dict[str, Any], dict[str, Any]]:
    """MaxText's own HF->MaxText conversion of ``hf_dir`` for the model ``built``.

    Uses ``to_maxtext``'s functions exactly as its ``main`` does in eager mode
    (``_get_hf_loading_function`` + ``_get_maxtext_weight``: its stacking, its hooks, its
    shape check), with its ``LazyHFLoader`` reading the local safetensors shards (numpy,
    no torch). Returns (``{path: array}``, report); leaves the converter fails on are
    listed under ``report["errors"]`` instead of aborting.
    """
    from maxtext.checkpoint_conversion import to_maxtext as tm
    from maxtext.checkpoint_conversion.utils.param_mapping import HOOK_FNS, PARAM_MAPPING
    from maxtext.checkpoint_conversion.utils.utils import validate_and_filter_param_map_keys

    cfg = built.config
    hf_cfg, hf_name = _converter_view(spec, json.loads((hf_dir / "config.json").read_text()))
    key, drop_rope = registry.family(spec.family).converter_key(spec)
    mapping = PARAM_MAPPING[key](hf_cfg, cfg, cfg.scan_layers)
    hooks = HOOK_FNS[key](hf_cfg, cfg, cfg.scan_layers, saving_to_hf=False)
    if drop_rope:
        hooks = {k: _strip_rope(v) for k, v in hooks.items()}
    abstract, _treedef = tm.get_maxtext_model_info(cfg)
    loader = tm.LazyHFLoader(str(hf_dir), None, save_dtype=save_dtype)
    weights: list[Any] = [None] * len(abstract)
    errors: dict[str, str] = {}
    # the converter maps the ``params`` collection only (MaxText 0.2.5 has no hook for DeepSeek's
    # ``MoEBiasVar`` router bias, its mapping names it under ``params``; see NOTES.md)
    others = sorted(_mt_name(k) for k in abstract if not k.startswith("params-"))
    for mt_key in validate_and_filter_param_map_keys(mapping.keys(), {k for k in abstract if k.startswith("params-")}):
        idx, shape = tm._get_maxtext_indices_and_shapes(mt_key, abstract)
        load_fn = tm._get_hf_loading_function(mapping[mt_key], lambda n: loader.get_tensor(hf_name(n)),
                                              hooks.get(mt_key), shape, cfg, mt_key)
        try:
            tm._get_maxtext_weight(load_fn, idx, shape, mt_key, weights, save_dtype, False)
        except ValueError as e:  # the converter's own shape check
            errors[_mt_name(mt_key)] = str(e)
            weights[idx] = None
    by_index = {idx: _mt_name(k) for k, (idx, _shape) in abstract.items()}
    out = {by_index[i]: w for i, w in enumerate(weights) if w is not None}
    report = {
        "converter": f"maxtext {_maxtext_version()} to_maxtext PARAM_MAPPING/HOOK_FNS[{key!r}]"
        + (" without adjust_rope" if drop_rope else ""),
        "scan_layers": bool(cfg.scan_layers),
        "save_dtype": save_dtype,
        "errors": errors,
        "leaves": sorted(out),
        "not_converted": others,
    }
    return out, report


def convert_to_hf(built: Built, spec: Spec, params: dict[str, Any], hf_cfg: dict[str, Any]) -> dict[str, Any]:
    """MaxText's own MaxText->HF conversion (``to_huggingface``'s mappings with
    ``saving_to_hf=True`` and ``utils.process_maxtext_param``) of ``{path: array}``."""
    import numpy as np
    from maxtext.checkpoint_conversion.to_huggingface import _get_model_mappings
    from maxtext.checkpoint_conversion.utils.utils import (
        process_maxtext_param,
        validate_and_filter_param_map_keys,
    )

    cfg = built.config
    hf_cfg, hf_name = _converter_view(spec, hf_cfg)
    key, drop_rope = registry.family(spec.family).converter_key(spec)
    maps = _get_model_mappings(key, cfg.scan_layers, hf_cfg, cfg)
    hooks = maps["hook_fn_mapping"]
    if drop_rope:
        hooks = {k: _strip_rope(v) for k, v in hooks.items()}
    state = {"params-" + name.replace("/", "-"): np.asarray(v) for name, v in params.items()}
    missing = set(built.leaves) - set(params)
    if missing:
        raise SystemExit(f"convert-to-hf: params lack {sorted(missing)}")
    out: dict[str, Any] = {}
    for mt_key in validate_and_filter_param_map_keys(maps["param_mapping"].keys(), set(state)):
        weight = [state[k] for k in mt_key] if isinstance(mt_key, tuple) else state[mt_key]
        for name, value in process_maxtext_param(mt_key, weight, maps["param_mapping"], hooks,
                                                 maps["shape_mapping"], cfg):
            out[hf_name(name)] = np.asarray(value)
    return out


def _converter_view(spec: Spec, hf_cfg: dict[str, Any]) -> tuple[dict[str, Any], Callable[[str], str]]:
    """The HF config as MaxText's converter for ``spec`` reads it, and its HF tensor names as the
    checkpoint spells them (the identity but where the family's record says otherwise)."""
    fam = registry.family(spec.family)
    return fam.converter_config(hf_cfg), fam.hf_name


def _mt_name(mt_key: str) -> str:
    parts = mt_key.split("-")
    return "/".join(parts[1:] if parts[0] == "params" else parts)


def stack_unscanned(spec: Spec, unscanned: dict[str, Any], axis: int) -> dict[str, Any]:
    """``decoder/layers_N/...`` leaves stacked on ``axis`` into ``decoder/layers/...``."""
    import re

    import numpy as np

    per: dict[str, dict[int, Any]] = {}
    out = {}
    for name, value in unscanned.items():
        m = re.match(r"^decoder/layers_(\d+)/(.*)$", name)
        if m:
            per.setdefault(m.group(2), {})[int(m.group(1))] = value
        else:
            out[name] = value
    for rest, layers in per.items():
        if sorted(layers) != list(range(spec.layers)):
            raise SystemExit(f"unscanned conversion: layers {sorted(layers)} of {rest}")
        out[f"decoder/layers/{rest}"] = np.stack([layers[i] for i in range(spec.layers)], axis=axis)
    return out


# ----------------------------------------------------------------------------- CLI


def _load_spec(arg: str) -> Spec:
    text = Path(arg).read_text() if not arg.lstrip().startswith("{") else arg
    return Spec.from_json(json.loads(text))


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def built_model(spec: Spec, cache: dict[str, Built]) -> Built:
    """The model of ``spec``, built once per ``cache`` (keyed by the spec's fields)."""
    import dataclasses

    key = json.dumps(dataclasses.asdict(spec), sort_keys=True)
    if key not in cache:
        cache[key] = build(spec)
    return cache[key]


def run_job(job: dict[str, Any], cache: dict[str, Built]) -> dict[str, Any]:
    """Run one subcommand given as a dict of its CLI options (``{"cmd": "forward", ...}``)."""
    import dataclasses

    import numpy as np

    t0 = time.time()
    cmd = job["cmd"]
    spec = Spec.from_json(job["spec"]) if isinstance(job["spec"], dict) else _load_spec(job["spec"])

    def get(s: Spec) -> Built:
        return built_model(s, cache)

    result: dict[str, Any] = {"cmd": cmd}
    if cmd == "tree":
        report = tree_report(get(spec))
        _write_json(Path(job["out"]), report)
    elif cmd == "convert-hf":
        hf_dir = Path(job["hf_dir"])
        dtype = job.get("save_dtype", "float32")
        if job.get("from_unscanned"):
            if not spec.scan:
                raise SystemExit("--from-unscanned builds a scan=True tree; the spec says scan=False")
            flat_spec = dataclasses.replace(spec, scan=False)
            unscanned, report = convert_hf(get(flat_spec), flat_spec, hf_dir, dtype)
            scanned_built = get(spec)
            params = stack_unscanned(spec, unscanned, scanned_built.config.param_scan_axis)
            report["stacked_from_unscanned_on_axis"] = scanned_built.config.param_scan_axis
            want = {n: tuple(_unboxed(v).shape) for n, v in scanned_built.leaves.items()}
            got = {n: tuple(v.shape) for n, v in params.items()}
            if want != got:
                raise SystemExit(f"stacked unscanned conversion does not fit the scanned tree: {want} vs {got}")
        else:
            params, report = convert_hf(get(spec), spec, hf_dir, dtype)
        _write_safetensors(Path(job["out"]), params)
        if job.get("report"):
            _write_json(Path(job["report"]), report)
        result["errors"] = report["errors"]
    elif cmd == "convert-to-hf":
        hf_cfg_path = Path(job["hf_config"])
        hf_cfg = json.loads(hf_cfg_path.read_text())
        prefix = job.get("prefix", "")
        arrays = {k[len(prefix):]: v for k, v in _read_safetensors(Path(job["params"])).items()
                  if k.startswith(prefix)}
        out = Path(job["out"])
        _write_safetensors(out / "model.safetensors", convert_to_hf(get(spec), spec, arrays, hf_cfg))
        (out / "config.json").write_text(hf_cfg_path.read_text())
    elif cmd == "forward":
        built = get(spec)
        variables = place_params(built, job["params"], job.get("state"))
        tokens = np.load(job["tokens"], allow_pickle=False)
        logits = forward(built, variables, tokens)
        Path(job["out"]).parent.mkdir(parents=True, exist_ok=True)
        np.save(job["out"], logits)
    elif cmd == "train":
        built = get(spec)
        variables = place_params(built, job["params"], job.get("state"))
        tokens = np.load(job["tokens"], allow_pickle=False)
        hp = AdamW(**{k: float(job[k]) for k in ("lr", "b1", "b2", "eps", "wd") if k in job})
        opt_in = _read_safetensors(Path(job["opt_state"])) if job.get("opt_state") else None
        if job.get("mu") or job.get("nu"):  # moments as two params files (e.g. convert-hf outputs)
            if opt_in is not None or not (job.get("mu") and job.get("nu")) or "count" not in job:
                raise SystemExit("train: give either opt_state, or mu + nu + count")
            opt_in = {"count": np.asarray(int(job["count"]), dtype=np.int32)}
            for kind in ("mu", "nu"):
                opt_in |= {f"{kind}/{k}": v for k, v in _read_safetensors(Path(job[kind])).items()}
        losses, params, opt_state = train(built, variables, tokens, int(job["steps"]), hp, opt_in)
        out = Path(job["out"])
        _write_safetensors(out / "params.safetensors", {n: np.asarray(v) for n, v in _flat(params).items()})
        adam = _adam_of(opt_state)
        arrays = {"count": np.asarray(adam.count)}
        arrays |= {f"mu/{n}": np.asarray(v) for n, v in _flat(adam.mu).items()}
        arrays |= {f"nu/{n}": np.asarray(v) for n, v in _flat(adam.nu).items()}
        _write_safetensors(out / "opt_state.safetensors", arrays)
        _write_json(out / "train.json", {
            "losses": losses,
            "hyperparameters": dataclasses.asdict(hp),
            "optimizer": "maxtext.optimizers.optimizers.get_optimizer (opt_type=adamw, constant lr)",
            "opt_state_tree": _opt_tree(opt_state),
            "count": int(adam.count),
        })
        result["losses"] = losses
    elif cmd == "load":
        result.update(_load_job(job, get(spec)))
    else:
        raise SystemExit(f"unknown command {cmd!r}")
    result["seconds"] = round(time.time() - t0, 2)
    return result


def _load_job(job: dict[str, Any], built: Built) -> dict[str, Any]:
    """``load``: a ckptbridge checkpoint through rules onto MaxText's tree (and optimizer), then
    any of: dump the loaded state, forward, train on, save the result with ckptbridge."""
    import dataclasses

    import numpy as np

    hp = AdamW(**{k: float(job[k]) for k in ("lr", "b1", "b2", "eps", "wd") if k in job})
    update_scale = job.get("update_scale") or {}
    tx = None
    if job.get("opt"):
        tx = _load_tx(built, hp, update_scale)
    variables, opt_state, report = load_recipe(built, job["source"], read_rules(job.get("rules") or []), tx,
                                               job.get("open_options"))
    if opt_state is not None:
        report["count"] = int(_adam_of(opt_state).count)
    if job.get("dump"):
        _write_safetensors(Path(job["dump"]), _state_arrays(variables, opt_state))  # every collection
    if job.get("tokens"):
        logits = forward(built, variables, np.load(job["tokens"], allow_pickle=False))
        Path(job["logits"]).parent.mkdir(parents=True, exist_ok=True)
        np.save(job["logits"], logits)
    if job.get("steps"):
        if tx is None:
            tx = _load_tx(built, hp, update_scale)
        tokens = np.load(job["train_tokens"], allow_pickle=False)
        losses, params, opt_state = train(built, variables, tokens, int(job["steps"]), hp, None, tx=tx,
                                          opt_state=opt_state)
        report["losses"] = losses
        variables = {"params": params}
        if job.get("train_out"):
            out = Path(job["train_out"])
            _write_safetensors(out / "state.safetensors", _state_arrays(params, opt_state))
            _write_json(out / "train.json", {"losses": losses, "hyperparameters": dataclasses.asdict(hp),
                                             "update_scale": update_scale, "count": int(_adam_of(opt_state).count)})
    if job.get("save_universal"):  # MaxText's state as a ckptbridge checkpoint (weights, mu/nu, count)
        from ckptbridge.adapters import flax as cbflax

        count = int(_adam_of(opt_state).count) if opt_state is not None else None
        cbflax.save(job["save_universal"], variables["params"], opt_state, step=count, overwrite=True)
    if job.get("report"):
        _write_json(Path(job["report"]), report)
    return {"load": report}


def _load_tx(built: Built, hp: AdamW, update_scale: dict[str, float]) -> Any:
    """MaxText's AdamW, or with ``update_scale`` :func:`scaled_adamw` (MaxText's weight-decay mask kept)."""
    from maxtext.optimizers import optimizers

    return scaled_adamw(hp, update_scale, optimizers.get_adamw_mask(built.config)) if update_scale else _tx(built, hp)


def _opt_tree(opt_state: Any) -> list[str]:
    """Every leaf path of the optax state with its shape (params collapsed to ``<params>``)."""
    import jax

    paths = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        parts = []
        for k in path:
            if hasattr(k, "idx"):
                parts.append(f"[{k.idx}]")
            elif hasattr(k, "name"):
                parts.append(f".{k.name}")
            else:
                parts.append(f"/{getattr(k, 'key', k)}")
        paths.append(f"{''.join(parts)} {list(getattr(leaf, 'shape', ()))}")
    return paths


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harness.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tree", help="MaxText's parameter tree as JSON")
    t.add_argument("--spec", required=True)
    t.add_argument("--out", required=True)
    c = sub.add_parser("convert-hf", help="MaxText's own HF->MaxText converter hooks")
    c.add_argument("--spec", required=True)
    c.add_argument("--hf-dir", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--report")
    c.add_argument("--save-dtype", default="float32")
    c.add_argument("--from-unscanned", action="store_true")
    h = sub.add_parser("convert-to-hf", help="MaxText's own MaxText->HF converter hooks")
    h.add_argument("--spec", required=True)
    h.add_argument("--params", required=True)
    h.add_argument("--hf-config", required=True, help="the HF config.json to convert for")
    h.add_argument("--prefix", help="only keys with this prefix, stripped (mu/ or nu/ of a train output)")
    h.add_argument("--out", required=True)
    f = sub.add_parser("forward", help="fp32 logits of MaxText's forward on a CPU mesh")
    f.add_argument("--spec", required=True)
    f.add_argument("--params", required=True)
    f.add_argument("--state")
    f.add_argument("--tokens", required=True)
    f.add_argument("--out", required=True)
    r = sub.add_parser("train", help="optax AdamW steps on MaxText's model")
    r.add_argument("--spec", required=True)
    r.add_argument("--params", required=True)
    r.add_argument("--state")
    r.add_argument("--tokens", required=True)
    r.add_argument("--steps", type=int, required=True)
    r.add_argument("--opt-state")
    r.add_argument("--mu", help="first moments as a params file (MaxText paths)")
    r.add_argument("--nu", help="second moments as a params file (MaxText paths)")
    r.add_argument("--count", type=int, help="optax count (torch's step) with --mu/--nu")
    r.add_argument("--out", required=True)
    for name, default in (("lr", 1e-3), ("b1", 0.9), ("b2", 0.95), ("eps", 1e-8), ("wd", 0.1)):
        r.add_argument(f"--{name}", type=float, default=default)
    ld = sub.add_parser("load", help="a ckptbridge checkpoint through rules onto MaxText's boxed tree")
    ld.add_argument("--spec", required=True)
    ld.add_argument("--source", required=True, help="anything ckptbridge.open reads")
    ld.add_argument("--rules", help="JSON list of rules (e.g. a recipe)")
    ld.add_argument("--open-options", type=json.loads, help='JSON options of ckptbridge.open ({"dequantize_dtype": "float32"})')
    ld.add_argument("--opt", action="store_true", help="also load mu/nu/count into MaxText's AdamW state")
    ld.add_argument("--dump", help="write the loaded params (and mu/, nu/, count) as safetensors")
    ld.add_argument("--tokens")
    ld.add_argument("--logits")
    ld.add_argument("--train-tokens")
    ld.add_argument("--steps", type=int)
    ld.add_argument("--train-out")
    ld.add_argument("--update-scale", type=json.loads, help="JSON {path regex: factor} on the Adam direction")
    ld.add_argument("--save-universal", help="save the (trained) state with ckptbridge.adapters.flax.save")
    ld.add_argument("--report")
    j = sub.add_parser("jobs", help="several jobs (a JSON list of {cmd, ...options}) in one process")
    j.add_argument("--jobs", required=True)
    j.add_argument("--out", help="results JSON")
    sv = sub.add_parser("serve", help="batches of jobs named on stdin, one process for many (see serve())")
    sv.add_argument("--reply-fd", type=int, required=True)
    return p


def _devices_for(jobs: list[dict[str, Any]]) -> int:
    counts = {Spec.from_json(j["spec"] if isinstance(j["spec"], dict) else json.loads(_spec_text(j["spec"]))).devices for j in jobs}
    if len(counts) != 1:
        raise SystemExit(f"jobs need different device counts {sorted(counts)}: run them separately")
    return counts.pop()


def _spec_text(arg: str) -> str:
    return Path(arg).read_text() if not arg.lstrip().startswith("{") else arg


def set_devices(ndev: int) -> None:
    """``ndev`` CPU devices for jax. XLA reads these once, when jax initialises its backend: call
    this before the first job (before importing jax)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={ndev}"])


Batch = Callable[[list[dict[str, Any]], dict[str, Built]], list[dict[str, Any]]]


def run_batch(jobs: list[dict[str, Any]], cache: dict[str, Built]) -> list[dict[str, Any]]:
    """Every job of ``jobs`` in order, sharing ``cache`` (built models by spec)."""
    return [run_job(j, cache) for j in jobs]


def serve(batch: Batch, reply_fd: int) -> int:
    """Run batches of jobs until stdin closes, MaxText imported once for all of them (the client,
    ``tests/maxtext_client.py``, keeps this process for a whole test session). Each stdin line is
    ``{"jobs": jobs.json, "out": results.json}``; each reply, one JSON line on ``reply_fd``:

    - ``{"ok": true}``: the results are in ``out``;
    - ``{"devices": n}``: the batch needs ``n`` devices, not this process's (XLA fixes the count
      when jax starts: the first batch sets it); nothing ran;
    - ``{"error": traceback}``: a job failed; the process then exits, so no later batch runs in
      a state a failure left behind.

    Each batch gets a fresh model cache, as a ``jobs`` process would: what a batch computes does
    not depend on the batches before it.
    """
    import traceback

    ndev = None
    with os.fdopen(reply_fd, "w", buffering=1) as reply:
        for line in sys.stdin:
            request = json.loads(line)
            try:
                jobs = json.loads(Path(request["jobs"]).read_text())
                need = _devices_for(jobs)
                if ndev is None:
                    ndev = need
                    set_devices(ndev)
                if need != ndev:
                    reply.write(json.dumps({"devices": need}) + "\n")
                    continue
                _write_json(Path(request["out"]), batch(jobs, {}))
            except BaseException:  # SystemExit too: the jobs' own errors
                reply.write(json.dumps({"error": traceback.format_exc()}) + "\n")
                return 1
            reply.write(json.dumps({"ok": True}) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "serve":
        return serve(run_batch, args.reply_fd)
    if args.cmd == "jobs":
        jobs = json.loads(Path(args.jobs).read_text())
    else:
        job = {k.replace("-", "_"): v for k, v in vars(args).items() if v is not None}
        jobs = [job]
    set_devices(_devices_for(jobs))
    results = run_batch(jobs, {})
    if args.cmd == "jobs" and args.out:
        _write_json(Path(args.out), results)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
