"""The tiny GPT of ``torch_gpt`` in Flax Linen, layers stacked with ``nn.scan``.

Its parameter names are those of the NNX model in ``flax_gpt`` (under the
Linen ``params`` collection): ``params/blocks/q/kernel`` ``[N_LAYER, D, D]``
..., so the same rule set (``gpt_rules.torch_to_flax(scan=True)``) loads a
torch checkpoint into it::

    model = GPT()
    variables = model.init(jax.random.key(0), x)           # {"params": ...}
    variables = cbflax.load(ckpt, variables, rules=gpt_rules.torch_to_flax(60))
    logits = model.apply(variables, x)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

VOCAB, D, CTX, N_LAYER, N_HEAD = 101, 60, 16, 3, 4
LN_EPS = 1e-5


class Block(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, _: None = None) -> tuple[jax.Array, None]:
        B, T, C = x.shape
        h = nn.LayerNorm(epsilon=LN_EPS, name="ln1")(x)
        heads = lambda t: t.reshape(B, T, N_HEAD, C // N_HEAD)  # noqa: E731
        q = heads(nn.Dense(D, use_bias=False, name="q")(h))
        k = heads(nn.Dense(D, use_bias=False, name="k")(h))
        v = heads(nn.Dense(D, use_bias=False, name="v")(h))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(C // N_HEAD))
        att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T, T), bool)), att, -jnp.inf), axis=-1)
        x = x + nn.Dense(D, name="proj")(jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(B, T, C))
        h = nn.LayerNorm(epsilon=LN_EPS, name="ln2")(x)
        h = nn.Dense(D, name="fc_out")(jax.nn.gelu(nn.Dense(4 * D, name="fc")(h), approximate=False))
        return x + h, None


class GPT(nn.Module):
    @nn.compact
    def __call__(self, idx: jax.Array) -> jax.Array:
        T = idx.shape[1]
        x = nn.Embed(VOCAB, D, name="wte")(idx) + nn.Embed(CTX, D, name="wpe")(jnp.arange(T))[None]
        blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=N_LAYER)
        x, _ = blocks(name="blocks")(x, None)
        return nn.Dense(VOCAB, name="lm_head")(nn.LayerNorm(epsilon=LN_EPS, name="ln_f")(x))
