"""What format detection needs of DCP, cheap to import: :func:`detect` and the options classes
(the reader and writer are imported on first use, see the package)."""

from __future__ import annotations

from dataclasses import dataclass

from ckptbridge.plugin import OpenOptions, OptionError, WriteOptions, storage


def is_dcp_dir(path: str) -> bool:
    """``.metadata``, or the per-rank ``__<rank>.metadata`` files of ``dcp.save(use_collectives=False)``."""
    if not storage.isdir(path):
        return False
    return storage.isfile(storage.join(path, ".metadata")) or storage.isfile(storage.join(path, "__0.metadata"))


def detect(path: str) -> bool:
    """A directory with DCP's ``.metadata`` or per-rank ``__0.metadata`` (never raises)."""
    return is_dcp_dir(path)


@dataclass(frozen=True)
class DcpOpenOptions(OpenOptions):
    """Opening a DCP directory.

    ``prefix``: the state-dict container key to drop from weight names (default: auto among ``model``, ``module``, ``model_state_dict``, ``state_dict``; ``""`` keeps full keys).
    ``read_bytes``: load small non-tensor items (hyper-parameters) into ``extra``.
    """

    prefix: str | None = None
    read_bytes: bool = True


@dataclass(frozen=True)
class DcpWriteOptions(WriteOptions):
    """Writing a torch DCP directory (it loads onto any mesh, so it has no tp/pp layout).

    ``world_size``: number of ``.distcp`` files; each tensor is cut along dim 0 into that many chunks.
    ``state``: which weight state to write (default ``fp32``, else ``param``).
    ``optimizer``: also write the optimizer states as ``get_optimizer_state_dict`` lays them out (default: when the checkpoint has them).
    ``model_key``: container key of the weights (default ``model`` with optimizer states, none without).
    ``optim_key``: container key of the optimizer state.
    """

    world_size: int = 1
    state: str | None = None
    optimizer: bool | None = None
    model_key: str | None = None
    optim_key: str = "optim"

    def validate(self) -> None:
        if self.world_size < 1:
            raise OptionError(f"format 'dcp' (write): world_size must be >= 1, got {self.world_size}")
