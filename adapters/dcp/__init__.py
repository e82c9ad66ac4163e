"""torch.distributed.checkpoint (DCP) directories: read in place, and write.

**Reading.** ``torch.distributed.checkpoint.save`` writes ``.metadata``
(a pickle: every tensor's global size and saved chunks, and where each chunk
is) and ``__<rank>_<n>.distcp`` files. With the default ``torch_save``
serialization every chunk is a complete ``torch.save`` archive appended to
the file, its storage bytes uncompressed inside; with ``safetensors``
serialization each file is a safetensors file. Either way a chunk becomes a
:class:`~ckptbridge._read.model.Fragment` pointing at its bytes in the
``.distcp`` file, so loading any box reads only that box. The metadata
pickle goes through the safe loader (see :mod:`ckptbridge.adapters.dcp._metadata`,
shared with the Megatron ``torch_dist`` reader).

Names: DCP flattens nested state dicts (``{"model": ..., "optim": ...}``)
into dotted keys and records each key's path (``planner_data``). The
weights become logical tensors named like the model's state dict (a leading
``model``/``module``/``state_dict`` container key is dropped, recorded as a
``Rename`` rule; ``prefix=""`` keeps full keys, ``prefix="net"`` drops
another one). Optimizer entries (``optim.state.<param>.<state>``, as
``get_optimizer_state_dict`` produces) become states of ``<param>``
(``exp_avg``, ``exp_avg_sq``, ...) and 0-dim entries such as Adam's
``step`` become scalars. Small non-tensor items (``param_groups``) land in
``extra``::

    ckpt = ckptbridge.open("dcp_ckpt")                # detected by .metadata
    ckpt["layers.0.w"].state("exp_avg")[:4]           # reads 4 rows from the .distcp
    ckpt["layers.0.w"].scalars                        # {"step": 10}

**Writing.** :func:`write` produces a DCP directory (``--to dcp``) that
``dcp.load`` reads onto any mesh: each tensor is saved as ``world_size``
chunks along dim 0, as a ``Shard(0)`` save on that many ranks would be::

    ckptbridge.reshard("run/global_step3", "out/dcp", to="dcp", world_size=4)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptbridge.plugin import CheckpointIndex, Format, LazyNames

from ._format import DcpOpenOptions, DcpWriteOptions, detect

if TYPE_CHECKING:  # the reader's and writer's names, imported on first use (see LazyNames)
    from ._metadata import DcpChunk as DcpChunk
    from ._metadata import DcpMetadata as DcpMetadata
    from ._metadata import DcpTensor as DcpTensor
    from ._metadata import chunk_fragment as chunk_fragment
    from ._metadata import object_archive as object_archive
    from ._metadata import read_metadata as read_metadata
    from ._metadata import tensor_state as tensor_state
    from ._reader import index as index
    from ._writer import write as write


def _open(path: str, o: DcpOpenOptions) -> CheckpointIndex:
    from . import index

    return index(path, prefix=o.prefix, read_bytes=o.read_bytes)


FORMAT = Format("dcp", detect=detect, index=_open, write=LazyNames.deferred(__name__, "write"),
                open_options=DcpOpenOptions, write_options=DcpWriteOptions, priority=40, extra="torch",
                description="torch.distributed.checkpoint directories (FSDP/DTensor)")
__getattr__ = LazyNames(__name__, FORMAT.extra)

__all__ = [
    "FORMAT",
    "DcpChunk",
    "DcpMetadata",
    "DcpOpenOptions",
    "DcpTensor",
    "DcpWriteOptions",
    "chunk_fragment",
    "detect",
    "index",
    "object_archive",
    "read_metadata",
    "tensor_state",
    "write",
]
