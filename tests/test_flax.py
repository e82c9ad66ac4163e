"""Flax/optax train states <-> universal names and states, and torch <-> Flax rules."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # conftest sets it first

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_deepspeed import runs_dir  # noqa: F401  (session fixture: the unpacked DeepSpeed runs)

import ckptbridge as cbopen
from ckptbridge import Checkpoint, CheckpointIndex
from ckptbridge.adapters import flax as cbflax
from ckptbridge.plugin import Box, Piece
from ckptbridge.plugin import write_universal as save
from ckptbridge.rules import Rename, Stack, Transpose, apply_rules, rule_from_json, rules_to_json

pytestmark = pytest.mark.filterwarnings("ignore")
D, V, L, OUT = 8, 10, 3, 4


def mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(D, name="attn")(nn.LayerNorm(epsilon=1e-5, name="ln")(x)), None


class Net(nn.Module):
    """A Linen model whose layers are stacked with nn.scan."""

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(V, D, name="embed")(ids)
        x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=L)(name="layers")(x, None)
        return nn.Dense(OUT, name="head")(x)


def trained_linen(steps=2):
    model = Net()
    ids = jnp.arange(6) % V
    variables = jax.jit(model.init)(jax.random.key(0), ids)
    tx = optax.adamw(1e-2)
    opt = tx.init(variables["params"])
    params = variables["params"]

    @jax.jit
    def step(params, opt):
        g = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, ids) ** 2))(params)
        upd, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, upd), opt

    for _ in range(steps):
        params, opt = step(params, opt)
    return model, ids, {"params": params}, opt, tx


def abstract_like(tree, sharding_fn):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_fn(x)), tree)


def test_linen_adamw_round_trip_onto_new_mesh(tmp_path):
    _, _, variables, opt, _ = trained_linen()
    m24 = mesh((2, 4), ("data", "model"))
    def put(x):  # the last dim over "model" where it divides
        spec = P(*[None] * (x.ndim - 1), "model") if x.ndim and x.shape[-1] % 4 == 0 else P()
        return jax.device_put(x, NamedSharding(m24, spec))

    variables = jax.tree.map(put, variables)
    path = str(tmp_path / "flax")
    cbflax.save(path, variables, opt)
    ckpt = cbopen.open(path)
    assert ckpt.step == 2
    k = ckpt["layers/attn/kernel"]
    assert set(k.states) == {"fp32", "exp_avg", "exp_avg_sq"} and k.scalars == {"step": 2}
    assert k.shape == (L, D, D)
    np.testing.assert_array_equal(k.state("exp_avg").read(), np.asarray(opt[0].mu["layers"]["attn"]["kernel"]))

    m42 = mesh((4, 2), ("a", "b"))
    rep = lambda x: NamedSharding(m42, P("a") if x.ndim and x.shape[0] % 4 == 0 else P())  # noqa: E731
    tgt_params = abstract_like(variables, rep)
    tgt_opt = abstract_like(opt, rep)
    params2, opt2 = cbflax.load(path, tgt_params, tgt_opt)
    for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(params2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(opt), jax.tree.leaves(opt2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert isinstance(opt2[0], optax.ScaleByAdamState) and int(opt2[0].count) == 2
    assert params2["params"]["embed"]["embedding"].sharding.mesh.shape == {"a": 4, "b": 2}


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.emb = nnx.Embed(V, D, rngs=rngs)
        self.lin = nnx.Linear(D, OUT, rngs=rngs)
        self.ln = nnx.LayerNorm(OUT, rngs=rngs)

    def __call__(self, ids):
        return self.ln(self.lin(self.emb(ids)))


def test_nnx_state_and_optimizer_round_trip(tmp_path):
    model = NnxNet(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    ids = jnp.arange(5)
    for _ in range(3):
        grads = nnx.grad(lambda m: jnp.sum(m(ids) ** 2))(model)
        opt.update(model, grads)
    path = str(tmp_path / "nnx")
    cbflax.save(path, nnx.state(model, nnx.Param), nnx.state(opt))
    ckpt = cbopen.open(path)
    assert set(ckpt["lin/kernel"].states) == {"fp32", "exp_avg", "exp_avg_sq"}
    assert ckpt["lin/kernel"].scalars == {"step": 3}

    fresh = NnxNet(nnx.Rngs(1))
    fresh_opt = nnx.Optimizer(fresh, optax.adamw(1e-2), wrt=nnx.Param)
    pstate, ostate = cbflax.load(path, nnx.state(fresh, nnx.Param), nnx.state(fresh_opt))
    nnx.update(fresh, pstate)
    nnx.update(fresh_opt, ostate)
    np.testing.assert_array_equal(np.asarray(fresh(ids)), np.asarray(model(ids)))
    want = nnx.state(opt).to_pure_dict()
    got = nnx.state(fresh_opt).to_pure_dict()
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def torch_checkpoint(path):
    """A real torch model + Adam state (one step), written as a universal directory with torch names."""
    import torch
    torch.manual_seed(0)

    class TBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(D)
            self.attn = torch.nn.Linear(D, D)

    class TNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(V, D)
            self.layers = torch.nn.ModuleList([TBlock() for _ in range(L)])
            self.head = torch.nn.Linear(D, OUT)

        def forward(self, ids):
            x = self.embed(ids)
            for blk in self.layers:
                x = x + blk.attn(blk.ln(x))
            return self.head(x)

    net = TNet()
    for p in net.parameters():  # non-trivial norms
        p.data.add_(0.1 * torch.randn_like(p))
    adam = torch.optim.Adam(net.parameters(), lr=1e-2)
    ids = torch.arange(6) % V
    net(ids).pow(2).sum().backward()
    adam.step()
    names = dict(net.named_parameters())
    pieces, scalars = [], {}
    for name, p in names.items():
        st = adam.state[p]
        for state, t in (("fp32", p), ("exp_avg", st["exp_avg"]), ("exp_avg_sq", st["exp_avg_sq"])):
            arr = t.detach().numpy().copy()
            pieces.append(Piece(name, state, "float32", arr.shape, Box.full(arr.shape), arr))
        scalars[name] = {"step": int(st["step"])}
    save(path, pieces, step=1, scalars=scalars)
    return net, ids, {n: p.detach().numpy().copy() for n, p in names.items()}, adam


def test_torch_names_into_scanned_linen_model(tmp_path):
    import torch
    net, _, ref, adam = torch_checkpoint(str(tmp_path / "torch"))
    ckpt = cbopen.open(str(tmp_path / "torch"))
    rules = cbflax.torch_to_flax_rules(ckpt, scan="layers")
    text = rules_to_json(rules)  # rules are data: printable, storable, parseable
    assert [rule_from_json(r) for r in text] == list(rules)
    assert Transpose(r"^layers/(\d+)/attn/kernel$", (1, 0)) in rules
    assert Stack(r"^layers/(\d+)/(.*)$", r"layers/\2", 0) in rules
    assert any(isinstance(r, Rename) and r.to == "embed/embedding" for r in rules)

    model, jids, variables, _, tx = trained_linen(steps=0)
    sh = NamedSharding(mesh((2, 4), ("x", "y")), P())
    tgt = abstract_like(variables, lambda x: sh)
    opt_tgt = tx.init(variables["params"])
    params, opt = cbflax.load(ckpt, tgt, opt_tgt, rules=rules)
    p = params["params"]
    np.testing.assert_array_equal(np.asarray(p["embed"]["embedding"]), ref["embed.weight"])
    np.testing.assert_array_equal(np.asarray(p["layers"]["attn"]["kernel"]),
                                  np.stack([ref[f"layers.{i}.attn.weight"].T for i in range(L)]))
    np.testing.assert_array_equal(np.asarray(p["layers"]["ln"]["scale"]),
                                  np.stack([ref[f"layers.{i}.ln.weight"] for i in range(L)]))
    np.testing.assert_array_equal(np.asarray(p["head"]["kernel"]), ref["head.weight"].T)
    mu = opt[0].mu["layers"]["attn"]["kernel"]
    exp_avg = adam.state[net.layers[1].attn.weight]["exp_avg"].numpy()
    np.testing.assert_array_equal(np.asarray(mu[1]), exp_avg.T)
    assert int(opt[0].count) == 1
    # the same numbers compute the same function in both frameworks
    with torch.no_grad():
        want = net(torch.as_tensor(np.asarray(jids))).numpy()
    np.testing.assert_allclose(np.asarray(model.apply(params, jids)), want, rtol=1e-5, atol=1e-5)

    # and back: save the Flax train state, map to torch names, compare with the torch tensors
    path = str(tmp_path / "flax")
    cbflax.save(path, params, opt)
    back = cbopen.open(path)
    rules_back = cbflax.flax_to_torch_rules(back, scan="layers")
    tensors = apply_rules(back.tensors, rules_back)
    assert set(tensors) == set(ref)
    view = Checkpoint(CheckpointIndex("universal", path, tensors), back.files)
    for name, arr in ref.items():
        np.testing.assert_array_equal(view[name].read(), arr)
        np.testing.assert_array_equal(view[name].state("exp_avg").read(),
                                      adam.state[dict(net.named_parameters())[name]]["exp_avg"].numpy())
        assert view[name].scalars == {"step": 1}


def test_linen_unscanned_names():
    shapes = {"blocks.0.fc.weight": (6, 4), "blocks.1.fc.weight": (6, 4), "norm.weight": (4,),
              "conv.weight": (5, 3, 2, 2), "wte.weight": (9, 4)}
    rules = cbflax.torch_to_flax_rules(shapes)
    names = {}
    for n in shapes:
        for r in rules:
            if isinstance(r, Rename):
                import re
                n2 = re.sub(r.pattern, r.to, n)
                if n2 != n:
                    names[n] = n2
                    break
    assert names == {"blocks.0.fc.weight": "blocks_0/fc/kernel", "blocks.1.fc.weight": "blocks_1/fc/kernel",
                     "norm.weight": "norm/scale", "conv.weight": "conv/kernel", "wte.weight": "wte/embedding"}
    assert Transpose(r"^conv/kernel$", (2, 3, 1, 0)) in rules
    back = cbflax.flax_to_torch_rules({"blocks_0/fc/kernel": (4, 6), "conv/kernel": (2, 2, 3, 5)})
    assert Rename(r"^blocks_(\d+)/fc/kernel$", r"blocks.\1.fc.weight") in back
    assert Transpose(r"^conv/kernel$", (3, 2, 0, 1)) in back


def test_deepspeed_zero2_loads_onto_2x4_mesh_as_optax_state(runs_dir):  # noqa: F811
    """A real DeepSpeed ZeRO-2 checkpoint (4 ranks) straight onto a 2x4 mesh, no convert step."""
    import torch
    run = os.path.join(runs_dir, "s2_fp32_w4")
    ckpt = cbopen.open(os.path.join(run, "ckpt"))
    assert ckpt.format == "deepspeed"
    rules = cbflax.torch_to_flax_rules(ckpt, scan="blocks")
    m = mesh((2, 4), ("data", "model"))

    def shard(name, shape):  # last dim over "model" where it divides, else replicated
        return NamedSharding(m, P(*[None] * (len(shape) - 1), "model") if shape[-1] % 4 == 0 else P())

    target = cbflax.abstract_params(ckpt, rules, shard)
    assert target["blocks"]["qkv"]["kernel"].shape == (3, 60, 180)
    tx = optax.adamw(1e-3)
    opt_target = tx.init(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), target))
    params, opt = cbflax.load(ckpt, target, opt_target, rules=rules)

    ref = torch.load(os.path.join(run, "reference_full_fp32.pt"), weights_only=True)
    qkv = np.stack([ref[f"blocks.{i}.qkv.weight"].numpy().T for i in range(3)])
    np.testing.assert_array_equal(np.asarray(params["blocks"]["qkv"]["kernel"]), qkv)
    assert params["blocks"]["qkv"]["kernel"].sharding.spec == P(None, None, "model")
    np.testing.assert_array_equal(np.asarray(params["wte"]["embedding"]), ref["wte.weight"].numpy())
    np.testing.assert_array_equal(np.asarray(params["ln_f"]["scale"]), ref["ln_f.weight"].numpy())
    adam = opt[0]
    assert isinstance(adam, optax.ScaleByAdamState) and int(adam.count) == 3
    np.testing.assert_array_equal(np.asarray(adam.mu["blocks"]["fc"]["kernel"][2]),
                                  ckpt["blocks.2.fc.weight"].state("exp_avg").read().T)
    np.testing.assert_array_equal(np.asarray(adam.nu["lm_head"]["bias"]),
                                  ckpt["lm_head.bias"].state("exp_avg_sq").read())


class _Boxed(nn.Module):
    """A Linen model whose parameters are boxed with logical axis names (as MaxText's are)."""

    @nn.compact
    def __call__(self, x):
        k = self.param("kernel", nn.with_logical_partitioning(nn.initializers.normal(), ("embed", "mlp")), (D, 16))
        s = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)), (D,))
        return (x * s) @ k


def test_boxed_linen_params_load_with_their_logical_shardings(tmp_path):
    """``model.init`` under ``nn.with_logical_partitioning`` returns ``nn.LogicallyPartitioned`` boxes:
    they load by their plain names, stay boxed, and land on the mesh their logical names ask for."""
    m = mesh((2, 4), ("data", "model"))
    rules = (("embed", "data"), ("mlp", "model"))
    model = _Boxed()
    boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.ones((1, D)))
    assert isinstance(boxed["params"]["kernel"], nn.LogicallyPartitioned)
    src = model.init(jax.random.PRNGKey(1), jnp.ones((1, D)))
    plain = jax.tree.map(np.asarray, nn.meta.unbox(src))
    cbflax.save(str(tmp_path / "u"), plain)
    with nn.logical_axis_rules(rules):
        target = jax.tree.map(lambda b: b.replace_boxed(b.value) if isinstance(b, nn.LogicallyPartitioned) else b,
                              boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
        target = jax.tree.map(lambda b: nn.LogicallyPartitioned(b.value, b.names, mesh=m, rules=rules),
                              target, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
        got = cbflax.load(str(tmp_path / "u"), target)
    k = got["params"]["kernel"]
    assert isinstance(k, nn.LogicallyPartitioned) and k.names == ("embed", "mlp")
    np.testing.assert_array_equal(np.asarray(k.value), plain["params"]["kernel"])
    assert k.value.sharding.is_equivalent_to(NamedSharding(m, P("data", "model")), 2)
    assert got["params"]["scale"].value.sharding.is_equivalent_to(NamedSharding(m, P("data")), 1)
    # the names of a boxed tree are the plain ones (no trailing '/value')
    assert sorted(cbflax.flatten_state(boxed)) == ["params/kernel", "params/scale"]


class _TwoCollections(nn.Module):
    """A router-like module with a parameter and a non-trained variable in a collection of its own
    (as MaxText keeps DeepSeek's router correction bias in ``MoEBiasVar``)."""

    @nn.compact
    def __call__(self, x):
        k = self.param("kernel", nn.initializers.normal(1.0), (D, 4))
        b = self.variable("MoEBiasVar", "bias", lambda: jnp.arange(4, dtype=jnp.float32) / 10)
        return x @ k + b.value


def test_linen_variables_with_several_collections_save_and_load_the_same_names(tmp_path):
    """``save`` and ``load`` name a Linen tree alike whatever its collections: ``params/`` dropped,
    every other collection kept as the first part of the name; a tree with two collections loads
    (weights and Adam moments), each collection filled from its own tensors."""
    model = _TwoCollections()
    x = jnp.ones((2, D))
    variables = jax.tree.map(np.asarray, model.init(jax.random.PRNGKey(3), x))
    variables["MoEBiasVar"]["bias"] = variables["MoEBiasVar"]["bias"] + 1.0  # not the init: must come from the file
    tx = optax.adam(1e-2)
    opt = tx.init(variables["params"])
    g = jax.grad(lambda p: jnp.sum(model.apply({**variables, "params": p}, x) ** 2))(variables["params"])
    _, opt = tx.update(g, opt, variables["params"])
    cbflax.save(str(tmp_path / "u"), variables, opt, step=1)
    assert sorted(cbopen.open(str(tmp_path / "u"))) == ["MoEBiasVar/bias", "kernel"]
    target = jax.tree.map(np.zeros_like, variables)
    got, got_opt = cbflax.load(str(tmp_path / "u"), target, jax.tree.map(np.zeros_like, opt))
    np.testing.assert_array_equal(got["MoEBiasVar"]["bias"], variables["MoEBiasVar"]["bias"])
    np.testing.assert_array_equal(got["params"]["kernel"], variables["params"]["kernel"])
    np.testing.assert_array_equal(got_opt[0].mu["kernel"], opt[0].mu["kernel"])
    np.testing.assert_array_equal(np.asarray(model.apply(got, x)), np.asarray(model.apply(variables, x)))
    only = cbflax.load(str(tmp_path / "u"), {"params": target["params"]})  # one collection: the same names
    np.testing.assert_array_equal(only["params"]["kernel"], variables["params"]["kernel"])
