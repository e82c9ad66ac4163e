"""Example models for the migration demos: one tiny GPT in torch and in Flax NNX.

``torch_gpt``: the tiny GPT of the DeepSpeed fixtures (``nn.Linear`` weights
[out, in], fused ``qkv``, one module per layer in ``blocks.N``).
``flax_gpt``: the same network in Flax NNX (``kernel`` [in, out], separate
``q``/``k``/``v``, layers stacked on a leading axis and run with ``nnx.scan``,
or one module per layer with ``scan=False``); ``linen_gpt``: the same in Flax
Linen with ``nn.scan`` (the NNX names under ``params``). ``ckptbridge.adapters.gpt_rules``
maps the checkpoint names of one onto the other.
"""
