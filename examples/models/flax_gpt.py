"""The tiny GPT of ``torch_gpt`` in Flax NNX, for migrating runs between torch and JAX.

Same computation as the torch model (LayerNorm eps 1e-5, exact GELU, causal
softmax attention with 4 heads), with the Flax conventions a rule set has to
bridge (see ``ckptbridge.adapters.gpt_rules``):

* ``nnx.Linear.kernel`` is ``[in, out]`` (torch ``Linear.weight`` is ``[out, in]``);
* the fused torch ``qkv`` projection is three layers ``q``, ``k``, ``v``;
* ``nnx.Embed.embedding``, ``nnx.LayerNorm.scale``;
* with ``scan=True`` (default) the blocks are one module whose parameters are
  stacked on a leading layer axis (``blocks/fc/kernel`` is ``[N_LAYER, D, 4D]``)
  and run with ``nnx.scan``; with ``scan=False`` they are ``blocks/0/...``.

Usage::

    model = GPT(nnx.Rngs(0))
    graphdef, params = split_params(model)            # params: a pure nested dict
    loss = loss_fn(graphdef, params, x, y)            # x, y: int arrays [B, CTX]
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

VOCAB, D, CTX, N_LAYER, N_HEAD = 101, 60, 16, 3, 4
LN_EPS = 1e-5


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(D, epsilon=LN_EPS, rngs=rngs)
        self.q = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.proj = nnx.Linear(D, D, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, epsilon=LN_EPS, rngs=rngs)
        self.fc = nnx.Linear(D, 4 * D, rngs=rngs)
        self.fc_out = nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        B, T, C = x.shape
        h = self.ln1(x)
        heads = lambda t: t.reshape(B, T, N_HEAD, C // N_HEAD)  # noqa: E731
        q, k, v = heads(self.q(h)), heads(self.k(h)), heads(self.v(h))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(C // N_HEAD))
        causal = jnp.tril(jnp.ones((T, T), dtype=bool))
        att = jax.nn.softmax(jnp.where(causal, att, -jnp.inf), axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fc_out(jax.nn.gelu(self.fc(self.ln2(x)), approximate=False))


class GPT(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, scan: bool = True) -> None:
        self.scan = scan
        self.wte = nnx.Embed(VOCAB, D, rngs=rngs)
        self.wpe = nnx.Embed(CTX, D, rngs=rngs)
        if scan:
            @nnx.split_rngs(splits=N_LAYER)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(r: nnx.Rngs) -> Block:
                return Block(r)

            self.blocks = make(rngs)
        else:
            self.blocks = nnx.List([Block(rngs) for _ in range(N_LAYER)])
        self.ln_f = nnx.LayerNorm(D, epsilon=LN_EPS, rngs=rngs)
        self.lm_head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, idx: jax.Array) -> jax.Array:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(jnp.arange(T))[None]
        if self.scan:
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def run(block: Block, h: jax.Array) -> jax.Array:
                return block(h)

            x = run(self.blocks, x)
        else:
            for b in self.blocks:
                x = b(x)
        return self.lm_head(self.ln_f(x))


def split_params(model: GPT) -> tuple[Any, dict[str, Any]]:
    """The model's graph definition and its parameters as a plain nested dict."""
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def loss_fn(graphdef: Any, params: dict[str, Any], x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of the model ``graphdef`` with ``params``."""
    model = nnx.merge(graphdef, params)
    logits = model(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def decay_mask(params: dict[str, Any]) -> dict[str, Any]:
    """AdamW weight decay on every ``kernel`` (the matrices except the embeddings, as
    ``torch_gpt.param_groups``): a tree of booleans like ``params``."""
    return jax.tree_util.tree_map_with_path(lambda p, _: getattr(p[-1], "key", None) == "kernel", params)


def optimizer(params: dict[str, Any], lr: float = 1e-2, betas: tuple[float, float] = (0.9, 0.95),
              eps: float = 1e-8, weight_decay: float = 0.1, clip: float = 1.0) -> optax.GradientTransformation:
    """optax AdamW matching ``torch.optim.AdamW`` + DeepSpeed/torch global-norm clipping and groups."""
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(lr, b1=betas[0], b2=betas[1], eps=eps, weight_decay=weight_decay,
                                   mask=decay_mask(params)))
