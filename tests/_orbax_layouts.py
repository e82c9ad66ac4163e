"""Orbax checkpoints written by ``orbax.checkpoint`` in each layout its PyTree handler offers
(shared by the Orbax tests): OCDBT or plain directories, zarr v2 or v3, zstd or uncompressed."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh

LAYOUTS = {  # name -> (use_ocdbt, use_zarr3, use_compression)
    "ocdbt-zarr2-zstd": (True, False, True),   # StandardCheckpointer's defaults
    "ocdbt-zarr3-zstd": (True, True, True),
    "ocdbt-zarr2-raw": (True, False, False),
    "ocdbt-zarr3-raw": (True, True, False),
    "dir-zarr2-raw": (False, False, False),
    "dir-zarr3-raw": (False, True, False),
}


def mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    """A mesh over the first ``prod(shape)`` devices."""
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def sharded_on_2x4(ref: dict[str, np.ndarray], specs: dict[str, tuple[Any, ...]]) -> dict[str, jax.Array]:
    """Each array of ``ref`` placed on a 2x4 ("x", "y") mesh with ``PartitionSpec(*specs[name])``."""
    from jax.sharding import NamedSharding, PartitionSpec

    m = mesh((2, 4), ("x", "y"))
    return {k: jax.device_put(v, NamedSharding(m, PartitionSpec(*specs[k]))) for k, v in ref.items()}


def save_layouts(root: Path, tree: Any, names: Iterable[str] = LAYOUTS) -> None:
    """Save ``tree`` with Orbax once per layout, to ``root / <layout name>``."""
    for name in names:
        ocdbt, zarr3, compress = LAYOUTS[name]
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3, use_compression=compress)
        with ocp.Checkpointer(handler) as ck:
            ck.save(str(root / name), args=ocp.args.PyTreeSave(tree))
