"""What a benchmark suite declares: its sizes, its cases, the tools' start-up probes.

A suite is a module under ``bench/`` (``bench_core.py`` ...) with a module-level ``SUITE``::

    SUITE = Suite(
        name="core", title="Core: write and read a state dict", module=__name__,
        prepare="prepare",                        # prepare(ctx): make the inputs (untimed, fresh process)
        sizes={"quick": Size("quick", 0.03, reps=1), "1g": Size("1g", 1.0), "8g": Size("8g", 8.0)},
        cases=(
            Case("write/ckptbridge", group="write", tool="ckptbridge", role="ours", fn="write_cb"),
            Case("write/torch.save", group="write", tool="torch.save", fn="write_torch",
                 mem_gib=lambda gib: 2 * gib),     # skipped where the machine has less available
        ),
        startups={"torch": Case("startup/torch", group="start-up", tool="torch", cmd="import_torch")},
    )

Functions are named (strings), not passed, so that the fresh child process that
runs a case can import them from the suite module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

ROLES = ("ours", "peer", "floor", "baseline")


@dataclasses.dataclass(frozen=True)
class Size:
    """One size of a suite: ``gib`` of checkpoint state, ``reps`` repetitions, suite knobs in ``params``."""

    name: str
    gib: float
    reps: int = 3
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured thing: a tool doing one operation, at some settings.

    * ``group``: the operation; cases of one group are compared in one table.
    * ``tool`` / ``settings``: who and how ("default", "fastest fair: zstd off", ...).
    * ``role``: ``ours`` (ckptbridge), ``peer`` (the other tool), ``floor`` (what no tool
      can beat here, e.g. the raw disk), ``baseline`` (no checkpointing at all).
    * exactly one of ``fn`` (``fn(ctx)`` in the suite module, which must time its work
      inside ``with ctx.region():``) and ``cmd`` (``cmd(ctx) -> argv``: a command line,
      timed whole, start-up included; give ``startup`` so that start-up is also reported
      on its own and subtracted).
    * ``ref``: the ckptbridge case the group's ratios are taken against (default: the
      group's first ``ours`` case): the one doing what the peers do (same input, same output
      format); a faster path of ckptbridge's own (its own layout, no conversion) is a second
      row, never the reference.
    * ``vs``: for a peer case, the ckptbridge case its summary line compares it with when that
      is not the reference (the one reading the same input: Orbax's zstd checkpoint vs
      ckptbridge reading that same checkpoint).
    * ``mem_gib``: RAM the case needs at a state size of ``gib`` GiB (number or function);
      a case that does not fit in the memory available is recorded as skipped, with why.
    * ``sizes``: run only at these sizes (default: all).
    * ``check``: ``check(ctx)`` in the suite module, run after the region (outside the clock):
      raise if the tool's output is wrong or missing (some tools exit 0 on failure).
    * ``reads``: the inputs the case reads (paths relative to the inputs directory). They are
      read once before each of its runs with warm inputs, so that every tool of a group starts
      with them in the page cache (an input written with ``O_DIRECT`` is otherwise cold for the
      first tool that reads it and cached for the next); the extra cold-inputs run evicts them.
    * a case that cannot run here raises :class:`Skip` (recorded as skipped, with the reason).
    """

    name: str
    group: str
    tool: str
    settings: str = "default"
    role: str = "peer"
    fn: str | None = None
    cmd: str | None = None
    startup: str | None = None
    ref: bool = False
    vs: str | None = None
    mem_gib: float | Callable[[float], float] = 0.0
    sizes: tuple[str, ...] | None = None
    note: str = ""
    check: str | None = None
    reads: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.fn is None) == (self.cmd is None):
            raise ValueError(f"case {self.name}: give exactly one of fn= and cmd=")
        if self.role not in ROLES:
            raise ValueError(f"case {self.name}: role {self.role!r} not in {ROLES}")

    def memory_needed(self, gib: float) -> float:
        return float(self.mem_gib(gib) if callable(self.mem_gib) else self.mem_gib)


@dataclasses.dataclass(frozen=True)
class Column:
    """An extra per-case metric shown in the tables (the case sets ``ctx.metrics[key]``)."""

    key: str
    header: str
    fmt: str = "{:.3f}"


@dataclasses.dataclass(frozen=True)
class Suite:
    """A benchmark: sizes, the inputs' ``prepare`` function, cases and start-up probes.

    ``prepare_mem_gib`` / ``disk_gib``: memory to make the inputs, disk for inputs + one run's
    outputs, at a state size of ``gib`` (the suite is skipped, with why, where they do not fit).
    ``derive``: a function of the suite module called with the summarized result document
    to add derived per-case metrics (``case["median"]["m.<key>"]``) before it is written."""

    name: str
    title: str
    module: str
    cases: tuple[Case, ...]
    sizes: Mapping[str, Size]
    prepare: str | None = None
    startups: Mapping[str, Case] = dataclasses.field(default_factory=dict)
    columns: tuple[Column, ...] = ()
    description: str = ""
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    timeout_s: float = 3600.0
    prepare_mem_gib: float | Callable[[float], float] = 0.0
    disk_gib: float | Callable[[float], float] = 0.0
    derive: str | None = None

    def __post_init__(self) -> None:
        names = [c.name for c in self.cases] + [c.name for c in self.startups.values()]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"suite {self.name}: duplicate case names {sorted(dup)}")
        for c in self.cases:
            if c.startup is not None and c.startup not in self.startups:
                raise ValueError(f"case {c.name}: unknown start-up probe {c.startup!r}")

    def disk_needed(self, gib: float) -> float:
        d = self.disk_gib
        return float(d(gib) if callable(d) else d)

    def prepare_memory_needed(self, gib: float) -> float:
        m = self.prepare_mem_gib
        return float(m(gib) if callable(m) else m)

    def case(self, name: str) -> Case:
        for c in (*self.cases, *self.startups.values()):
            if c.name == name:
                return c
        raise KeyError(f"suite {self.name}: no case {name!r}")
