"""DeepSpeed checkpoints (ZeRO stages 0-3, BF16_Optimizer, Megatron-DeepSpeed naming) as lazy views.

Opens a checkpoint root (with ``latest``) or one tag folder without torch
and without running any pickled code: every optimizer/model-states file is
parsed with ``ckptbridge.adapters.torch_save`` (safe unpickler, in-place storages), and each parameter becomes a
:class:`~ckptbridge.plugin.LogicalTensor` whose states point straight into
the rank files (nothing is copied at open time)::

    ckpt = ckptbridge.open("run/ckpt")                 # root with 'latest'
    ckpt = ckptbridge.open("run/ckpt/global_step3")    # or the tag folder
    ckpt["blocks.0.fc.weight"].state("exp_avg")[:4]    # reads only those bytes
    ckpt["blocks.0.fc.weight"].scalars                 # {'step': 3}
    ckpt.extra["param_groups"], ckpt.extra["ds_config"]

States: ``fp32`` (fp32 master weights), ``exp_avg``, ``exp_avg_sq`` (Adam
moments), ``param`` (the bf16/fp16 module weights, where the checkpoint
stores them and they are not fp32). Frozen parameters have only their
weights (``param``, or ``fp32`` when stored in fp32).

The layout comes from DeepSpeed's own metadata, never from guesses:
``param_shapes`` (flat order, also with ``round_robin_gradients``),
``param_alignment_paddings``, ``group_paddings``, ``partition_count``,
``zero_stage`` and, for ZeRO-3, the per-parameter ``ceil(numel/dp)``
partitioning of ``stage3.py``. ``param_slice_mappings`` is not used: with
``round_robin_gradients`` DeepSpeed records it wrongly (see README).

Tensor-parallel slots (``mp_rank_XX``) are merged as ``ds_to_universal``
merges them, from the ``universal_checkpoint_info`` patterns in the model
states (replicated / row-parallel (dim 1) / vocabulary padding / two fused
sub-parameters, default: concatenate on dim 0). Pipeline stages contribute
their own parameters; pipeline-replicated (tied) ones are taken from stage 0.

Mixture-of-experts (``deepspeed.moe.layer.MoE``, ZeRO-1/2, any EP and DP): the
expert param groups (``'moe': True``) are partitioned over each expert-parallel
rank's expert-data-parallel group; every expert becomes one logical tensor under
its global id (``moe.deepspeed_moe.experts.deepspeed_experts.E.fc.weight``, local
``K`` of EP rank ``r`` is ``r * num_local + K``, see ``_moe.py``).

DeepSpeed's *universal* folders (``ds_to_universal`` output or
``ckptbridge reshard --to deepspeed-universal``) open here too.

:func:`load_engine` resumes a live engine (ZeRO-1/2/3, any world size) straight
from a native checkpoint of another world size or stage, each rank reading only
its new partition: no ``ds_to_universal``, no ``load_universal``::

    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    load_engine(engine, "run/ckpt")

Engines with MoE layers (ZeRO-1/2) load at a new EP/DP the same way: each expert
parameter reads the tensor of its global expert id.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptbridge.plugin import CheckpointIndex, Format, LazyNames

from ._format import DeepSpeedOpenOptions, DeepSpeedUniversalWriteOptions, detect

if TYPE_CHECKING:  # the reader's and writer's names, imported on first use (see LazyNames)
    from ._reader import index as index
    from ._resume import EngineLoad as EngineLoad
    from ._resume import load_engine as load_engine
    from ._universal_write import write as write


def _open(path: str, o: DeepSpeedOpenOptions) -> CheckpointIndex:
    from . import index

    return index(path, tag=o.tag)


FORMAT = Format("deepspeed", detect=detect, index=_open, open_options=DeepSpeedOpenOptions, priority=20,
                description="DeepSpeed ZeRO 1/2/3 checkpoints (and ds_to_universal output), read in place")
UNIVERSAL_FORMAT = Format("deepspeed-universal", write=LazyNames.deferred(__name__, "write"),
                          write_options=DeepSpeedUniversalWriteOptions, priority=21,
                          description="DeepSpeed's universal layout (load_universal), any DP degree")
FORMATS = (FORMAT, UNIVERSAL_FORMAT)
__getattr__ = LazyNames(__name__, FORMAT.extra)

__all__ = ["FORMAT", "FORMATS", "UNIVERSAL_FORMAT", "DeepSpeedOpenOptions", "DeepSpeedUniversalWriteOptions",
           "EngineLoad", "detect", "index", "load_engine", "write"]
