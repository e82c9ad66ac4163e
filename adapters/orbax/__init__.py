"""Orbax: open Orbax checkpoints as a lazy universal view, and write Orbax checkpoints.

Reading (``detect`` / ``index``) understands what ``orbax.checkpoint`` writes:

* a PyTree item directory (``StandardCheckpointer`` / ``PyTreeCheckpointer``):
  ``_METADATA`` (the tree: key paths and value types), the arrays in Zarr
  (v2 ``.zarray`` or v3 ``zarr.json``), either inside one OCDBT database
  (``manifest.ocdbt``, the default) or as plain per-array directories;
* a ``CheckpointManager`` step directory (``<step>/<item>/``, each item a
  PyTree directory; JSON items go into ``extra``) and the manager's root
  directory (the latest finished step, or ``step=N``).

Every array is a logical tensor named by its key path joined with ``/``;
its fragments are the Zarr write chunks (the shards the saving mesh wrote).
Their bytes are read in place (``_direct``): uncompressed chunks are plain
file regions inside the OCDBT data files (located once through the OCDBT
B+tree) or chunk files, zstd chunks (Orbax's default) :class:`ZstdChunk` s
decoded once per chunk per batch of requests. Anything else goes through
TensorStore (:class:`TensorStoreRegion`: batched reads straight into the
destination buffers).
A Flax/optax train state (``params`` + ``ScaleByAdamState`` ``mu``/``nu``/
``count``) is grouped onto the universal states (``fp32``, ``exp_avg``,
``exp_avg_sq``, scalar ``step``) by :mod:`ckptbridge.adapters.flax`
(``layout="raw"`` keeps Orbax's own tree names)::

    ckpt = ckptbridge.open("ckpts/1000/state")        # or the manager root
    ckpt["Dense_0/kernel"].state("exp_avg")[:, :8]

In place at a URL too (``gs://``, ``s3://``): chunk bytes through the storage layer (only
the ranges needed), the OCDBT index through TensorStore's ``gcs``/``s3`` drivers, set up
from the same storage options (credentials from the environment, see :mod:`._kvstore`)::

    ckptbridge.open("gs://bucket/run/checkpoints")    # latest step of a CheckpointManager

Writing (:func:`write`, registered as ``reshard --to orbax``) produces a
``StandardCheckpointer`` directory (OCDBT + Zarr, streamed chunk by chunk)
that ``orbax.checkpoint`` restores onto any mesh::

    ckptbridge.reshard("run/global_step3", "out/orbax", to="orbax")
    ocp.StandardCheckpointer().restore("out/orbax", abstract_target)

Tree written: ``{"params": weights, "opt_state": {"count", "mu", "nu"}, "step"}``
(optimizer part only when Adam moments exist); ``-o layout=flat`` writes
just the weights. Names are split on ``/`` into nested dicts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptbridge.plugin import CheckpointIndex, Format, LazyNames

from ._format import OrbaxOpenOptions, OrbaxWriteOptions, detect

if TYPE_CHECKING:  # the reader's and writer's names, imported on first use (see LazyNames)
    from ._direct import ZstdChunk as ZstdChunk
    from ._reader import index as index
    from ._tensorstore import TensorStoreRegion as TensorStoreRegion
    from ._writer import write as write


def _open(path: str, o: OrbaxOpenOptions) -> CheckpointIndex:
    from . import index

    return index(path, step=o.step, layout=o.layout)


FORMAT = Format("orbax", detect=detect, index=_open, write=LazyNames.deferred(__name__, "write"),
                open_options=OrbaxOpenOptions, write_options=OrbaxWriteOptions, priority=50, extra="jax",
                description="Orbax checkpoints (StandardCheckpointer, CheckpointManager; OCDBT, zarr2, zarr3)")
__getattr__ = LazyNames(__name__, FORMAT.extra)

__all__ = ["FORMAT", "OrbaxOpenOptions", "OrbaxWriteOptions", "TensorStoreRegion", "ZstdChunk", "detect", "index",
           "write"]
