"""Flax and optax: train states <-> universal names and states, driven by rules.

A Flax train state is parameters (Linen ``{"params": ...}`` variables or a
plain params dict, or an NNX ``nnx.State``) plus an optax state. optax's
Adam/AdamW keep ``ScaleByAdamState(count, mu, nu)``; the universal
checkpoint keeps, per parameter, the states ``fp32`` (the weights; ``param``
when they are not float32), ``exp_avg`` (= ``mu``), ``exp_avg_sq`` (= ``nu``)
and the scalar ``step`` (= ``count``; torch Adam's ``step`` counts the same
updates). Parameter names are the params-tree key paths joined with ``/``
(Linen's leading ``params`` collection dropped, other collections keep their name:
``MoEBiasVar/decoder/...``; ``save`` and ``load`` name them the same way)::

    from ckptbridge.adapters import flax as cbflax

    cbflax.save("ckpt/100", params, opt_state, step=100)          # from any mesh
    params, opt_state = cbflax.load("ckpt/100", abstract_params, abstract_opt_state)

    # a torch checkpoint (DeepSpeed, DCP, universal ...) into a Flax model:
    rules = cbflax.torch_to_flax_rules(ckpt, scan="layers")
    print(rules)                  # data: Rename / Transpose / Stack rules
    params, opt_state = cbflax.load(ckpt, abstract_params, abstract_opt_state, rules=rules)

Targets (``abstract_params`` ...) are trees of ``jax.Array``,
``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` (loaded sharded, each
device reading only its box) or numpy arrays (loaded on the host).

The mapping between torch and Flax conventions is a list of rules from
``ckptbridge.rules`` (data, printable, stored in manifests):
``Linear.weight`` [out, in] <-> ``Dense.kernel`` [in, out] (a ``Transpose``),
``Embedding.weight`` <-> ``embedding``, ``LayerNorm.weight`` <-> ``scale``,
``Conv.weight`` [out, in, *k] <-> ``kernel`` [*k, in, out], per-layer
tensors ``layers.N.*`` <-> one tensor stacked on a leading axis
(``nn.scan`` / ``nnx.scan``). :func:`torch_to_flax_rules` and
:func:`flax_to_torch_rules` build the list for a checkpoint from its names
and shapes; the rules themselves move fragment boxes and strides only.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptbridge.plugin import (
    WEIGHT_STATES,
    Checkpoint,
    FileCache,
    FormatError,
    LogicalTensor,
    Rename,
    Rule,
    ShapeMismatchError,
    Stack,
    State,
    TensorState,
    Transpose,
    Unstack,
    as_checkpoint,
    read_state,
    rules_to_json,
    weight_state_for,
)
from ckptbridge.plugin import dtypes as _dtypes

from .jax import flatten, load_arrays, path_name, save_pieces, tree_pieces

__all__ = [
    "AdamGroup",
    "abstract_params",
    "flatten_state",
    "flax_to_torch_rules",
    "group_names",
    "group_train_state",
    "load",
    "save",
    "torch_to_flax_rules",
]

MOMENTS = {"mu": "exp_avg", "nu": "exp_avg_sq"}
PARAMS_PREFIX = "params/"


# ------------------------------------------------------------------ names


def flatten_state(tree: Any) -> dict[str, Any]:
    """``{"/"-joined key path: leaf}`` of a params / optimizer tree (NNX ``State`` -> pure dict first;
    Flax's boxed leaves, ``nn.Partitioned`` / ``nn.LogicallyPartitioned``, are leaves of their own)."""
    if hasattr(tree, "to_pure_dict"):
        tree = tree.to_pure_dict()
    flat, _ = flatten(tree, is_leaf=_is_box)
    return {name: _unbox(leaf) for name, leaf in flat}


def _is_box(x: Any) -> bool:
    """A Flax ``AxisMetadata`` box (what ``model.init`` returns under ``nn.with_logical_partitioning``)."""
    meta = sys.modules.get("flax.core.meta")
    return meta is not None and isinstance(x, meta.AxisMetadata)


def _unbox(leaf: Any) -> Any:
    """A box's raw value (``unbox()`` would also apply its sharding constraint, which abstract
    targets such as ``ShapeDtypeStruct`` cannot take)."""
    return leaf.value if _is_box(leaf) else leaf


def _box_sharding(box: Any, mesh: Any = None, axis_rules: Any = None) -> Any:
    """The sharding a boxed leaf asks for: its value's, else its logical names on its mesh (a box
    without a mesh, as MaxText's abstract tree holds them, takes ``mesh`` and ``axis_rules``)."""
    sh = getattr(_unbox(box), "sharding", None)
    box_mesh = getattr(box, "mesh", None) or mesh
    if sh is not None or box_mesh is None:
        return sh
    import flax.linen as nn
    from jax.sharding import NamedSharding

    if isinstance(box, nn.LogicallyPartitioned):  # logical names -> mesh axes by its rules (or the context's)
        rules = box.rules if box.rules is not None else axis_rules
        return NamedSharding(box_mesh, nn.logical_to_mesh_axes(box.names, rules))  # type: ignore[arg-type]
    return NamedSharding(box_mesh, box.get_partition_spec())


def _strip_params(name: str) -> str:
    return name[len(PARAMS_PREFIX):] if name.startswith(PARAMS_PREFIX) else name


def _variables_names(tree: Any) -> Any:
    """How :func:`save` and :func:`load` name a params tree's leaves (one rule, both ways): Linen
    variables (a mapping with a ``params`` collection, possibly beside others such as MaxText's
    ``MoEBiasVar``) drop the leading ``params/`` and keep every other collection's name as the
    first part (``decoder/...``, ``MoEBiasVar/decoder/...``); a plain params dict or an NNX
    ``State`` keeps its paths."""
    linen = hasattr(tree, "keys") and "params" in tree and not hasattr(tree, "to_pure_dict")
    return _strip_params if linen else (lambda name: name)


@dataclass(frozen=True)
class AdamGroup:
    """One optax ``ScaleByAdamState`` found by name: ``{prefix}/count``, ``{prefix}/mu/<p>``, ``{prefix}/nu/<p>``."""

    prefix: str
    params: tuple[str, ...]  # the <p> paths
    count: str | None


@dataclass
class Grouping:
    """How native (tree) names map onto universal names and states."""

    states: dict[str, dict[str, str]] = field(default_factory=dict)  # universal -> {state: native}
    counts: dict[str, str] = field(default_factory=dict)  # universal -> native count name
    rest: list[str] = field(default_factory=list)  # native names left as they are
    groups: list[AdamGroup] = field(default_factory=list)


def _find_adam(names: Sequence[str]) -> list[AdamGroup]:
    present = set(names)
    found: dict[str, dict[str, Any]] = {}
    for name in names:
        segs = name.split("/")
        for i, seg in enumerate(segs):
            if seg != "mu":
                continue
            pre, p = "/".join(segs[:i]), "/".join(segs[i + 1 :])
            nu = "/".join([*segs[:i], "nu", *segs[i + 1 :]])
            if p and nu in present:
                g = found.setdefault(pre, {"params": [], "count": None})
                g["params"].append(p)
                count = f"{pre}/count" if pre else "count"
                g["count"] = count if count in present else None
                break
    return [AdamGroup(pre, tuple(g["params"]), g["count"]) for pre, g in found.items()]


def group_names(names: Sequence[str], weight_names: Sequence[str] | None = None) -> Grouping:
    """Group tree names of a train state: weights + optax Adam ``mu``/``nu``/``count``.

    ``weight_names`` are the names holding weights (default: every name not in
    an optimizer state). A weight ``params/<p>``, ``<p>`` or ``<x>/<p>`` pairs
    with ``mu/<p>``; its universal name is ``<p>`` without Linen's ``params/``.
    """
    out = Grouping()
    groups = _find_adam(names)
    out.groups = groups
    used: set[str] = set()
    for g in groups:
        pre = f"{g.prefix}/" if g.prefix else ""
        for p in g.params:
            uni = _strip_params(p)
            st = out.states.setdefault(uni, {})
            st["exp_avg"] = f"{pre}mu/{p}"
            st["exp_avg_sq"] = f"{pre}nu/{p}"
            used.update((st["exp_avg"], st["exp_avg_sq"]))
            if g.count:
                out.counts[uni] = g.count
                used.add(g.count)
    opt_prefixes = tuple(f"{g.prefix}/" for g in groups if g.prefix)
    candidates = [n for n in (weight_names if weight_names is not None else names)
                  if n not in used and not (opt_prefixes and n.startswith(opt_prefixes))]
    by_uni: dict[str, list[str]] = {}
    for n in candidates:
        by_uni.setdefault(_strip_params(n), []).append(n)
    for uni in list(out.states):
        native = by_uni.get(uni)
        if native is None:  # weights under a wrapper ({"model": ...}, {"params": {"params": ...}}): if unique
            native = [n for n in candidates if n.endswith("/" + uni)]
            native = native if len(native) == 1 else None
        if native:
            out.states[uni]["weights"] = sorted(native, key=len)[0]
            used.add(out.states[uni]["weights"])
    for n in candidates:
        uni = _strip_params(n)
        if n not in used and uni not in out.states and n.startswith(PARAMS_PREFIX):
            out.states[uni] = {"weights": n}
            used.add(n)
    out.rest = [n for n in names if n not in used]
    return out


def group_train_state(
    raw: Mapping[str, TensorState], read_count: Any = None
) -> tuple[dict[str, LogicalTensor], list[dict[str, Any]]]:
    """Logical tensors for a train state read as raw named states (e.g. from Orbax).

    Weights become ``fp32``/``param``, optax ``mu``/``nu`` ``exp_avg``/``exp_avg_sq``,
    ``count`` the scalar ``step``. Returns the tensors and the (descriptive) rules applied.
    Names not part of a train state keep their own logical tensor.
    """

    g = group_names(list(raw))
    tensors: dict[str, LogicalTensor] = {}
    counts: dict[str, int] = {}
    if read_count is None:
        def read_count(state: TensorState) -> int:
            with FileCache() as fc:
                return int(read_state(state, None, fc).reshape(()))
    for uni, native in g.states.items():
        states: dict[str, TensorState] = {}
        if "weights" in native:
            w = raw[native["weights"]]
            states[weight_state_for(w.dtype)] = w
        for s in ("exp_avg", "exp_avg_sq"):
            if s in native:
                states[s] = raw[native[s]]
        scalars = {}
        if uni in g.counts:
            cname = g.counts[uni]
            if cname not in counts:
                counts[cname] = read_count(raw[cname])
            scalars["step"] = counts[cname]
        tensors[uni] = LogicalTensor(uni, states, scalars)
    for n in g.rest:
        tensors.setdefault(n, LogicalTensor(n, {weight_state_for(raw[n].dtype): raw[n]}))
    rules: list[Rule] = []
    if any(n.startswith(PARAMS_PREFIX) for n in raw):
        kinds = sorted({weight_state_for(raw[n].dtype) for n in raw if n.startswith(PARAMS_PREFIX)})
        rules.append(State(r"^params/(.*)$", r"\1", "|".join(kinds)))
    for grp in g.groups:
        pre = re.escape(grp.prefix + "/") if grp.prefix else ""
        rules.append(State(rf"^{pre}mu/(.*)$", r"\1", "exp_avg"))
        rules.append(State(rf"^{pre}nu/(.*)$", r"\1", "exp_avg_sq"))
        if grp.count:
            rules.append(State(rf"^{re.escape(grp.count)}$", "*", "step"))
    return tensors, rules_to_json(rules)


# ------------------------------------------------------------------ save


def save(
    path: str,
    params: Any,
    opt_state: Any = None,
    *,
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
    rules: Sequence[Any] = (),
    overwrite: bool = False,
) -> str:
    """Save a Flax train state as a universal directory (call on every process).

    ``params``: Linen variables / params dict or NNX ``State``; ``opt_state``:
    any optax state (Adam moments are found by their ``mu``/``nu``/``count``
    fields, anywhere in it), or an NNX optimizer ``State``. Other optimizer
    leaves are kept as tensors named ``opt_state/<path>``.
    """
    import jax


    name = _variables_names(params)
    flat_params = {name(n): v for n, v in flatten_state(params).items()}
    flat_opt = flatten_state(opt_state) if opt_state is not None else {}
    g = group_names(list(flat_opt), weight_names=[])
    mu = {u: flat_opt[s["exp_avg"]] for u, s in g.states.items() if "exp_avg" in s}
    nu = {u: flat_opt[s["exp_avg_sq"]] for u, s in g.states.items() if "exp_avg_sq" in s}
    missing = sorted(set(mu) - set(flat_params))
    if missing:
        raise FormatError(f"optimizer moments for {missing[:5]} have no parameter of that name in params")
    adam_counts = {int(np.asarray(jax.device_get(flat_opt[c]))) for c in set(g.counts.values())}
    rest = {f"opt_state/{n}": flat_opt[n] for n in g.rest
            if not _same_count(n, flat_opt[n], adam_counts)}  # a schedule's count is the step: not a tensor
    pieces, layout = tree_pieces(flat_params)
    for tree, state in ((mu, "exp_avg"), (nu, "exp_avg_sq")):
        more, _ = tree_pieces(tree, state)
        pieces += more
    more, _ = tree_pieces(rest)
    pieces += more
    scalars: dict[str, dict[str, int]] = {}
    for uni, cname in g.counts.items():
        scalars[uni] = {"step": int(np.asarray(jax.device_get(flat_opt[cname])))}
    if step is None and scalars:
        step = max(s["step"] for s in scalars.values())
    provenance = {"source_format": "flax", "optimizer": "optax-adam" if g.groups else None,
                  "processes": jax.process_count(), "layout": layout}
    all_rules = [*rules_to_json(rules), *rules_to_json([
        State(rf"^{re.escape(grp.prefix + '/') if grp.prefix else ''}{m}/(.*)$", r"\1", s)
        for grp in g.groups for m, s in MOMENTS.items()
    ])]
    return save_pieces(path, pieces, step=step, extra=extra, rules=all_rules, provenance=provenance,
                       scalars=scalars, overwrite=overwrite)


def _same_count(name: str, value: Any, adam_counts: set[int]) -> bool:
    """An optax ``count`` leaf (a schedule's) holding the Adam step: :func:`load` restores it from the step."""
    import jax

    if not (name == "count" or name.endswith("/count")) or len(adam_counts) != 1 or int(getattr(value, "ndim", 1)):
        return False
    return int(np.asarray(jax.device_get(value))) in adam_counts


# ------------------------------------------------------------------ load


def _fill(ckpt: Checkpoint, target: Any, assign: Any, dtype: Any, mesh: Any = None,
          axis_rules: Any = None) -> Any:
    """Fill every leaf of ``target``: ``assign(name)`` gives ``(tensor, state)``, a scalar or None (keep).

    Every leaf is matched and checked (name, shape) before any data is read."""
    import jax


    pure = target.to_pure_dict() if hasattr(target, "to_pure_dict") else target
    flat, treedef = jax.tree_util.tree_flatten_with_path(pure, is_leaf=_is_box)
    boxes = {i: leaf for i, (_, leaf) in enumerate(flat) if _is_box(leaf)}
    leaves = [_unbox(leaf) for _, leaf in flat]
    shardings = {i: _box_sharding(b, mesh, axis_rules) for i, b in boxes.items()}
    assigned = [assign(path_name(kp)) for kp, _ in flat]  # raises on a missing tensor, before any read
    for i, got in enumerate(assigned):
        if isinstance(got, tuple) and hasattr(leaves[i], "shape"):
            found = ckpt[got[0]].state(got[1]).shape if got[1] else ckpt[got[0]].shape
            if tuple(found) != tuple(leaves[i].shape):
                raise ShapeMismatchError(f"{ckpt.path}: tensor {got[0]!r} has shape {tuple(found)}, the target "
                                         f"{path_name(flat[i][0])!r} expects {tuple(leaves[i].shape)}")
    reqs, where = [], []
    for i, (kp, _) in enumerate(flat):
        leaf = leaves[i]
        name = path_name(kp)
        got = assigned[i]
        if got is None:
            continue
        if not isinstance(got, tuple):  # a scalar (the Adam count)
            value = np.asarray(got, dtype=getattr(leaf, "dtype", None))
            sh = shardings.get(i, getattr(leaf, "sharding", None))
            leaves[i] = jax.device_put(value, sh) if sh is not None else value
            continue
        tname, state = got
        want = dtype if dtype is not None else getattr(leaf, "dtype", None)
        sh = shardings.get(i, getattr(leaf, "sharding", None))
        if sh is not None:
            reqs.append((tname, sh, want, tuple(getattr(leaf, "shape", ())), state))
            where.append(i)
        else:
            view = ckpt[tname].state(state) if state else ckpt[tname]
            arr = view.read(dtype=None if want is None else np.dtype(want).name)
            if hasattr(leaf, "shape") and tuple(leaf.shape) != arr.shape:
                raise ShapeMismatchError(f"{ckpt.path}: tensor {tname!r} has shape {arr.shape}, "
                                         f"the target {name!r} expects {tuple(leaf.shape)}")
            leaves[i] = arr
    for i, arr in zip(where, load_arrays(ckpt, reqs), strict=True):
        leaves[i] = arr
    leaves = [boxes[i].replace_boxed(leaf) if i in boxes else leaf for i, leaf in enumerate(leaves)]
    filled = jax.tree_util.tree_unflatten(treedef, leaves)
    if hasattr(target, "to_pure_dict"):
        from flax import nnx

        nnx.replace_by_pure_dict(target, filled)
        return target
    return filled


def _step_of(ckpt: Checkpoint, names: Sequence[str]) -> int | None:
    for n in names:
        t = ckpt.index.tensors.get(n)
        if t is not None and "step" in t.scalars:
            return int(t.scalars["step"])
    return ckpt.step


def load(
    source: Any,
    params: Any,
    opt_state: Any = None,
    *,
    rules: Sequence[Any] = (),
    dtype: Any = None,
    mesh: Any = None,
    axis_rules: Any = None,
) -> Any:
    """Load a train state from ``source`` (path or Checkpoint, any format) into Flax/optax trees.

    ``params`` / ``opt_state`` are targets of the shapes wanted (see module
    doc). ``rules`` (e.g. :func:`torch_to_flax_rules`) rename and reshape the
    checkpoint's tensors first. Returns ``params`` (or ``(params, opt_state)``
    when ``opt_state`` is given) filled with the checkpoint's values.

    Boxed leaves (``nn.LogicallyPartitioned``) load onto the mesh their logical
    names ask for; boxes without a mesh of their own (MaxText's abstract tree)
    use ``mesh`` and ``axis_rules`` (the model's logical-axis rules)::

        params = cbflax.load(ckpt, abstract_boxed, mesh=mesh, axis_rules=config.logical_axis_rules)

    Every optax ``count`` (Adam's and a schedule's) is set to the checkpoint's step.
    Names and shapes are all checked before any data is read.
    """

    ckpt, owned = as_checkpoint(source), not isinstance(source, Checkpoint)
    try:
        view = ckpt.with_rules(rules)
        tensors = view.index.tensors
        universal = _variables_names(params)

        def weight(name: str) -> tuple[str, str | None] | None:
            uni = universal(name)
            if uni not in tensors:
                raise FormatError(f"{ckpt.path}: no tensor {uni!r} for parameter {name!r} "
                                  f"(tensors: {sorted(tensors)[:8]}...); pass rules= to map names")
            t = tensors[uni]
            return uni, next((s for s in WEIGHT_STATES if s in t.states), None)

        if opt_state is None:
            return _fill(view, params, weight, dtype, mesh, axis_rules)
        names = list(flatten_state(opt_state))
        g = group_names(names, weight_names=[])
        native: dict[str, tuple[str, str]] = {}
        for uni, st in g.states.items():
            for s in ("exp_avg", "exp_avg_sq"):
                if s in st:
                    native[st[s]] = (uni, s)
        step = _step_of(view, list(g.states))
        # Adam's count, and any other optax count (a schedule's) counts the same updates
        counts = {c for c in g.counts.values()} | {n for n in names if n == "count" or n.endswith("/count")}

        def moment(name: str) -> Any:
            if name in native:
                uni, s = native[name]
                if uni not in tensors or s not in tensors[uni].states:
                    raise FormatError(f"{ckpt.path}: tensor {uni!r} has no optimizer state {s!r} "
                                      f"(states: {sorted(tensors[uni].states) if uni in tensors else 'none'})")
                return native[name]
            if name in counts:
                if step is None:
                    raise FormatError(f"{ckpt.path}: no Adam step recorded to restore {name!r}")
                return step
            other = f"opt_state/{name}"
            if other in tensors:
                return other, None
            return None

        for name in names:  # every optimizer leaf found before any data is read
            moment(name)
        out_params = _fill(view, params, weight, dtype, mesh, axis_rules)
        return out_params, _fill(view, opt_state, moment, None, mesh, axis_rules)
    finally:
        if owned:
            ckpt.close()


def abstract_params(source: Any, rules: Sequence[Any] = (), sharding: Any = None) -> dict[str, Any]:
    """A nested dict of ``jax.ShapeDtypeStruct`` for the (rule-mapped) weights of ``source``: a load target.

    ``sharding`` is one ``Sharding`` or a callable ``(name, shape) -> Sharding``
    (``None``: unsharded host arrays are loaded instead)::

        rules = torch_to_flax_rules(ckpt, scan="blocks")
        params = abstract_params(ckpt, rules, lambda name, shape: NamedSharding(mesh, P()))
        opt_state = jax.eval_shape(optax.adamw(1e-3).init, params)   # or tx.init on zeros
    """
    import jax


    ckpt, owned = as_checkpoint(source), not isinstance(source, Checkpoint)
    try:
        tensors = ckpt.with_rules(rules).index.tensors
        out: dict[str, Any] = {}
        for name, t in tensors.items():
            st = t.state()
            sh = sharding(name, st.shape) if callable(sharding) and not isinstance(
                sharding, jax.sharding.Sharding) else sharding
            node = out
            keys = name.split("/")
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = jax.ShapeDtypeStruct(st.shape, np.dtype(_np_dtype(st.dtype)), sharding=sh)
        return out
    finally:
        if owned:
            ckpt.close()


def _np_dtype(name: str) -> Any:
    return _dtypes.to_numpy(name)


# ------------------------------------------------------------------ torch <-> flax rules


_LAYER = re.compile(r"(?<=[./])(\d+)(?=[./])|^(\d+)(?=[./])")


def _generalise(name: str, sep: str) -> tuple[str, list[str]]:
    """An anchored regex for ``name`` with every layer number replaced by ``(\\d+)``."""
    parts = re.split(r"(\d+)", name)
    pattern, nums = "^", []
    for i, part in enumerate(parts):
        if i % 2 and _is_index(parts, i, sep):
            pattern += r"(\d+)"
            nums.append(part)
        else:
            pattern += re.escape(part)
    return pattern + "$", nums


def _is_index(parts: Sequence[str], i: int, sep: str) -> bool:
    before = parts[i - 1] if i else ""
    after = parts[i + 1] if i + 1 < len(parts) else ""
    return (not before or before.endswith((sep, "_"))) and (not after or after.startswith(sep))


def _shapes(source: Any) -> dict[str, tuple[int, ...]]:
    if isinstance(source, Checkpoint):
        return {n: t.shape for n, t in source.index.tensors.items()}
    if isinstance(source, Mapping):
        return {n: tuple(getattr(v, "shape", None) or v) for n, v in source.items()}
    raise TypeError("give a Checkpoint or a {name: shape} mapping")


DEFAULT_EMBEDDINGS = r"(^|[._/])(embed\w*|wte|wpe|tok_embeddings|word_embeddings|position_embeddings|embedding)([._/]|$)"


def torch_to_flax_rules(
    source: Any,
    *,
    embeddings: str = DEFAULT_EMBEDDINGS,
    scan: str | None = None,
    index_sep: str = "_",
) -> tuple[Rule, ...]:
    """Rules that turn torch names/layouts into Flax ones, for the tensors of ``source``.

    ``source``: a Checkpoint or ``{name: shape}``. ``.weight`` of 2-D tensors
    becomes ``kernel`` transposed (``embedding`` when the name matches
    ``embeddings``), of 1-D tensors ``scale``, of 3/4/5-D tensors (conv)
    ``kernel`` with dims ``[*k, in, out]``; ``.`` becomes ``/``; a layer index
    ``blocks.3`` becomes ``blocks_3`` (``index_sep``) or, with
    ``scan="blocks"``, is stacked into one ``blocks/...`` tensor on a leading axis.
    """
    renames: dict[str, str] = {}
    transposes: dict[str, tuple[int, ...]] = {}
    for name, shape in _shapes(source).items():
        pattern, nums = _generalise(name, ".")
        stem, _, leaf = name.rpartition(".")
        nd = len(shape)
        perm: tuple[int, ...] | None = None
        if leaf == "weight":
            if nd == 2 and re.search(embeddings, name):
                leaf = "embedding"
            elif nd == 2:
                leaf, perm = "kernel", (1, 0)
            elif nd == 1:
                leaf = "scale"
            elif nd >= 3:
                leaf, perm = "kernel", (*range(2, nd), 1, 0)
        new = (stem + "." + leaf) if stem else leaf
        # rewrite layer numbers to backrefs and dots to '/'
        k = 0
        out_parts = []
        for i, part in enumerate(re.split(r"(\d+)", new)):
            if i % 2 and _is_index(re.split(r"(\d+)", new), i, "."):
                k += 1
                out_parts.append(f"\\{k}")
            else:
                out_parts.append(part)
        to = "".join(out_parts).replace(".", "/")
        if scan is None and index_sep != "/":
            to = re.sub(r"/(\\\d+)(?=/|$)", index_sep + r"\1", to)
        if len(nums) != k:
            raise FormatError(f"torch_to_flax_rules: could not generalise {name!r}")
        renames.setdefault(pattern, to)
        if perm is not None:
            tpat, _ = _generalise(re.sub(pattern, to, name), "/")
            transposes.setdefault(tpat, perm)
    rules: list[Rule] = [Rename(p, t) for p, t in renames.items()]
    rules += [Transpose(p, perm) for p, perm in transposes.items()]
    if scan is not None:
        s = re.escape(scan.replace(".", "/"))
        rules.append(Stack(rf"^{s}/(\d+)/(.*)$", f"{scan.replace('.', '/')}/\\2", 0))
    return tuple(rules)


def flax_to_torch_rules(
    source: Any,
    *,
    embeddings: str = DEFAULT_EMBEDDINGS,
    scan: str | None = None,
    index_sep: str = "_",
) -> tuple[Rule, ...]:
    """The inverse of :func:`torch_to_flax_rules`, for the Flax-named tensors of ``source``.

    ``scan="blocks"`` unstacks ``blocks/...`` tensors along their leading axis
    into ``blocks.N....``; ``kernel`` -> ``weight`` transposed back, ``scale`` and
    ``embedding`` -> ``weight``, ``/`` -> ``.``, ``blocks_3`` -> ``blocks.3``.
    """
    shapes = _shapes(source)
    rules: list[Rule] = []
    if scan is not None:
        s = re.escape(scan.replace(".", "/"))
        rules.append(Unstack(rf"^{s}/(.*)$", f"{scan.replace('.', '/')}/{{i}}/\\1", 0))
        stacked = {n: sh for n, sh in shapes.items() if re.match(rf"^{s}/", n)}
        shapes = {n: sh for n, sh in shapes.items() if n not in stacked}
        for n, sh in stacked.items():
            shapes[re.sub(rf"^{s}/", f"{scan.replace('.', '/')}/0/", n)] = tuple(sh[1:])
    transposes: dict[str, tuple[int, ...]] = {}
    renames: dict[str, str] = {}
    for name, shape in shapes.items():
        stem, _, leaf = name.rpartition("/")
        nd = len(shape)
        pattern, _ = _generalise(name, "/")
        if leaf == "kernel" and nd >= 2:
            perm = (1, 0) if nd == 2 else (nd - 1, nd - 2, *range(nd - 2))
            transposes.setdefault(pattern, perm)
        torch_leaf = "weight" if leaf in ("kernel", "scale", "embedding") else leaf
        new = (stem + "/" + torch_leaf) if stem else torch_leaf
        if index_sep != "/":
            new = re.sub(rf"(?<=[^/]){re.escape(index_sep)}(\d+)(?=/|$)", r"/\1", new)
        parts = re.split(r"(\d+)", new)
        k, out = 0, []
        for i, part in enumerate(parts):
            if i % 2 and _is_index(parts, i, "/"):
                k += 1
                out.append(f"\\{k}")
            else:
                out.append(part)
        renames.setdefault(pattern, "".join(out).replace("/", "."))
    rules += [Transpose(p, perm) for p, perm in transposes.items()]
    rules += [Rename(p, t) for p, t in renames.items()]
    return tuple(rules)
