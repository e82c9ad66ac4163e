"""Which rank am I, how many ranks: the one answer every part of the library asks for.

The order, first answer wins:

1. values the caller passed (``rank=`` / ``world_size=``; one of them fills in only its half);
2. a running framework job, through the registered *rank providers* (entry-point group
   ``ckptbridge.rank_providers``, lowest ``priority`` first): ``torch`` answers when
   ``torch.distributed`` is initialised (priority 10), ``jax`` when ``jax.distributed`` is
   (priority 20). A provider never imports its framework: a job that has not imported it is not
   that framework's job;
3. the launcher's variables: ``RANK``/``WORLD_SIZE`` (torchrun, or any ``env://`` launcher),
   ``SLURM_PROCID``/``SLURM_NTASKS``, ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE``,
   ``PMI_RANK``/``PMI_SIZE``;
4. nothing: :func:`find_ranks` returns ``None``, :func:`rank_world` its ``default`` (one process)::

    rank, world = rank_world()                     # (0, 1) outside a launcher
    found = find_ranks()                           # Ranks(rank=3, world=8, source='torch') or None

A runtime registers its provider as an entry point (``pyproject.toml``)::

    [project.entry-points."ckptbridge.rank_providers"]
    mpi = "my_package.ranks:PROVIDER"        # RankProvider("mpi", ranks, priority=30)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ._errors import OptionError
from ._plugins import PluginGroup

ENTRY_POINT_GROUP = "ckptbridge.rank_providers"
LAUNCHER_VARIABLES = (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"),
                      ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"))


@dataclass(frozen=True)
class Ranks:
    """This process's ``rank`` among ``world`` processes, and who said so (``source``: a
    provider's name, or the launcher's variable)."""

    rank: int
    world: int
    source: str


@dataclass(frozen=True)
class RankProvider:
    """A runtime that can tell a running job's ranks: ``ranks()`` returns ``(rank, world)``, or
    ``None`` when no job of that runtime runs in this process."""

    name: str
    ranks: Callable[[], tuple[int, int] | None]
    priority: int = 100


_GROUP = PluginGroup(ENTRY_POINT_GROUP)
def rank_providers() -> list[RankProvider]:
    """The providers registered as entry points (loaded on first use), in ``priority`` order."""
    return sorted((p for p in _GROUP.load() if isinstance(p, RankProvider)), key=lambda p: (p.priority, p.name))


def rank_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(rank, world size)`` from the launcher's variables; ``(0, 1)`` outside a launcher."""
    found = _from_env(os.environ if env is None else env)
    return (found.rank, found.world) if found else (0, 1)


def find_ranks(env: Mapping[str, str] | None = None, *, frameworks: bool = True) -> Ranks | None:
    """This process's ranks from a running framework job (``frameworks=False``: skip them), else
    the launcher's variables (``env``, default ``os.environ``); ``None`` if neither tells."""
    if frameworks:
        for p in rank_providers():
            got = p.ranks()
            if got is not None:
                return Ranks(int(got[0]), int(got[1]), p.name)
    return _from_env(os.environ if env is None else env)


def rank_world(rank: int | None = None, world_size: int | None = None,
               default: tuple[int, int] | None = (0, 1)) -> tuple[int, int]:
    """``(rank, world size)``: the values given, else :func:`find_ranks`, else ``default``
    (``None``: raise :class:`~ckptbridge.OptionError`)."""
    if rank is not None and world_size is not None:
        return rank, world_size
    found = find_ranks()
    if found is None:
        if default is None:
            raise OptionError("rank and world size unknown: initialise torch.distributed or "
                              "jax.distributed first, run under a launcher (RANK/WORLD_SIZE, SLURM ...), "
                              "or pass rank= and world_size=")
        found = Ranks(*default, "default")
    return (found.rank if rank is None else rank, found.world if world_size is None else world_size)


def _from_env(env: Mapping[str, str]) -> Ranks | None:
    for rv, wv in LAUNCHER_VARIABLES:
        if rv in env and wv in env:
            try:
                rank, size = int(env[rv]), int(env[wv])
            except ValueError:
                raise OptionError(f"{rv}={env[rv]!r}, {wv}={env[wv]!r}: not integers") from None
            if not 0 <= rank < size:
                raise OptionError(f"{rv}={rank} is outside {wv}={size}")
            return Ranks(rank, size, f"{rv}/{wv}")
    return None
