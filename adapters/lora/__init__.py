"""LoRA adapters: HF PEFT adapters read and merged lazily, and adapters carried between frameworks.

* ``_read``: a PEFT adapter folder opens as its ``lora_A`` / ``lora_B`` tensors, each with the base
  weight it adapts (``extra["lora"]``), and ``ckptbridge.open(base, adapters=[...])`` merges them per
  slice (used by the safetensors adapter);
* ``_carry``: :func:`carry` moves an adapter alone through a family recipe (HF PEFT, MaxText,
  Megatron-Bridge names, and from MaxText's training-time qwix LoRA, ``<kernel>_lora_a`` /
  ``_lora_b``, and to it with ``qwix=True``; ``_plan`` writes each base rule for the factors;
  ``_experts`` stacks PEFT's 3-D expert pairs so that a recipe's experts unstack them per expert,
  e.g. to Megatron's ``local_experts.N``) and :func:`save_peft` writes one as a PEFT folder;
  ``_qwix``'s :func:`save_qwix` writes qwix factors as MaxText's training LoRA (Orbax:
  ``restore_lora_from_path``'s tree; with Adam moments, Tunix's ``PeftTrainer`` checkpoint)::

    from ckptbridge.adapters import lora
    mt = lora.carry(ckptbridge.open("peft_adapter/"), rules)
    lora.save_peft(lora.carry(ckptbridge.open("mt_lora.safetensors"), back, alpha=16.0), "adapter/")
    lora.save_qwix(lora.carry(ckptbridge.open("peft_adapter/"), rules, qwix=True), "lora_ckpt/")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptbridge.plugin import LazyNames

if TYPE_CHECKING:  # imported on first use (see LazyNames): the safetensors reader needs only ._read
    from ._carry import carry as carry
    from ._carry import factor_name as factor_name
    from ._carry import factor_of as factor_of
    from ._carry import save_peft as save_peft
    from ._plan import Copy as Copy
    from ._plan import Place as Place
    from ._plan import Plan as Plan
    from ._plan import plan as plan
    from ._qwix import save_qwix as save_qwix

__getattr__ = LazyNames(__name__)

__all__ = ["Copy", "Place", "Plan", "carry", "factor_name", "factor_of", "plan", "save_peft", "save_qwix"]
