"""The lazy ``Checkpoint`` view every format opens into.

An adapter turns native files into a :class:`CheckpointIndex` (pure
metadata: logical tensors, fragments, rules); :class:`Checkpoint` adds the
reader. Nothing is read until a tensor is sliced::

    ckpt = ckptbridge.open("run/global_step3")
    ckpt.format, ckpt.step, len(ckpt)
    w = ckpt["blocks.0.qkv.weight"]           # TensorView of the weights
    w.shape, w.dtype, w.states                  # metadata only
    w[:10]                                      # reads only rows 0..9
    ckpt["blocks.0.qkv.weight"].state("exp_avg").read()
    ckpt.stats.bytes_read
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import CheckpointError, TensorNotFoundError
from .executor import FileCache, ReadStats, read_state, read_states
from .model import Box, Fragment, LogicalTensor, TensorState
from .plan import normalize_index

if TYPE_CHECKING:  # the rule language is imported by with_rules: opening a checkpoint does not need it
    from ..rules import Rule

    RuleLike = Rule | Mapping[str, Any]
    """A mapping rule, as a rule object or its JSON form (what ``rules=`` arguments take)."""


@dataclass(frozen=True)
class CheckpointIndex:
    """What a checkpoint holds, without any tensor data.

    ``rules`` are the Universal Checkpoint Language rules that map the native
    pieces onto the logical tensors (see ``ckptbridge.rules``), as data.
    ``extra`` is non-tensor state (optimizer hyper-parameters, scheduler,
    RNG, data position ...), JSON-able.
    """

    format: str
    path: str
    tensors: Mapping[str, LogicalTensor]
    step: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    rules: tuple[Mapping[str, Any], ...] = ()
    provenance: Mapping[str, Any] = field(default_factory=dict)


class TensorView:
    """One state of one logical tensor; slicing reads only what is asked."""

    def __init__(self, ckpt: Checkpoint, tensor: LogicalTensor, state: str | None = None) -> None:
        self._ckpt = ckpt
        self.tensor = tensor
        self.state_name = tensor.weight_state if state is None else state
        self._state: TensorState = tensor.state(self.state_name)

    @property
    def name(self) -> str:
        """The logical tensor's name."""
        return self.tensor.name

    @property
    def shape(self) -> tuple[int, ...]:
        """This state's global shape (padding removed)."""
        return self._state.shape

    @property
    def dtype(self) -> str:
        """This state's dtype name as stored (``"bfloat16"``, ``"float32"`` ...)."""
        return self._state.dtype

    @property
    def fragments(self) -> tuple[Fragment, ...]:
        """The boxes this state is stored in, and where each one's bytes are."""
        return self._state.fragments

    @property
    def states(self) -> tuple[str, ...]:
        """Every state of the tensor (``fp32``, ``exp_avg`` ...)."""
        return tuple(self.tensor.states)

    @property
    def scalars(self) -> dict[str, float | int]:
        """Per-tensor scalars (e.g. the optimizer's ``step``)."""
        return dict(self.tensor.scalars)

    @property
    def ndim(self) -> int:
        return len(self._state.shape)

    @property
    def nbytes(self) -> int:
        return self._state.nbytes

    def state(self, name: str) -> TensorView:
        """The same tensor's state ``name`` (``exp_avg``, ...)."""
        return TensorView(self._ckpt, self.tensor, name)

    def read(self, box: Box | None = None, dtype: str | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """Read ``box`` (default all) as a numpy array, optionally cast to ``dtype``
        (or into ``out``, an array of the box's shape)."""
        return read_state(self._state, box, self._ckpt.files, dtype, self._label(), out)

    def __getitem__(self, index: object) -> np.ndarray:
        box, post = normalize_index(index, self.shape)
        arr: np.ndarray = self.read(box)[post]
        return arr

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.read()
        return arr if dtype is None else arr.astype(dtype)

    def _label(self) -> str:
        return f"{self._ckpt.path}: tensor {self.name!r} state {self.state_name!r}"

    def _repr_html_(self) -> str:
        from .html import tensor_html  # notebooks only: not on the import path of open

        return tensor_html(self)

    def __repr__(self) -> str:
        return (
            f"TensorView({self.name!r}, state={self.state_name!r}, shape={self.shape}, "
            f"dtype={self.dtype}, fragments={len(self.fragments)})"
        )


class Checkpoint(Mapping[str, TensorView]):
    """A lazily read checkpoint of any supported format (see :func:`ckptbridge.open`)."""

    def __init__(self, index: CheckpointIndex, files: FileCache | None = None) -> None:
        self.index = index
        self.files = files or FileCache()

    @property
    def format(self) -> str:
        """The registered format that opened it (``"deepspeed"``, ``"universal"`` ...)."""
        return self.index.format

    @property
    def path(self) -> str:
        return self.index.path

    @property
    def step(self) -> int | None:
        """The training step, when the checkpoint records one."""
        return self.index.step

    @property
    def extra(self) -> Mapping[str, Any]:
        """Non-tensor state (hyper-parameters, scheduler, RNG ...), JSON-able."""
        return self.index.extra

    @property
    def rules(self) -> tuple[Mapping[str, Any], ...]:
        """The mapping rules applied, in their JSON form."""
        return self.index.rules

    @property
    def provenance(self) -> Mapping[str, Any]:
        return self.index.provenance

    @property
    def tensors(self) -> Mapping[str, LogicalTensor]:
        """The logical tensors' metadata by name (no data)."""
        return self.index.tensors

    @property
    def stats(self) -> ReadStats:
        """Bytes read so far, per file."""
        return self.files.stats

    def __getitem__(self, name: str) -> TensorView:
        try:
            tensor = self.index.tensors[name]
        except KeyError:
            raise TensorNotFoundError(f"{self.path}: no tensor {name!r} in this checkpoint") from None
        return TensorView(self, tensor)

    def __iter__(self) -> Iterator[str]:
        return iter(self.index.tensors)

    def __len__(self) -> int:
        return len(self.index.tensors)

    def read(self, name: str, state: str | None = None, box: Box | None = None,
             dtype: str | None = None) -> np.ndarray:
        """Shorthand for ``ckpt[name].state(state).read(box, dtype)``."""
        view = self[name] if state is None else self[name].state(state)
        return view.read(box, dtype)

    def state_dict(self, state: str | None = None, dtype: str | None = None) -> dict[str, np.ndarray]:
        """All tensors of one state (default: the weights) as numpy arrays, cast to ``dtype``.

        Reads everything, for small models; the copies run in rounds of many tensors (one
        concurrent fetch per object for a checkpoint behind a URL)::

            weights = ckptbridge.open("s3://bucket/run/ckpt").state_dict()
            moments = ckpt.state_dict("exp_avg")
        """
        views = [TensorView(self, t, state) for t in self.index.tensors.values()
                 if state is None or state in t.states]
        arrays = read_states([(v._state, v._label()) for v in views], self.files, dtype)
        return {v.name: a for v, a in zip(views, arrays)}

    def states(self) -> tuple[str, ...]:
        """Every state name present in any tensor."""
        seen: dict[str, None] = {}
        for t in self.index.tensors.values():
            seen.update(dict.fromkeys(t.states))
        return tuple(seen)

    def with_rules(self, rules: Sequence[RuleLike]) -> Checkpoint:
        """This checkpoint seen through mapping ``rules`` (rule objects or their JSON form):
        names, shapes and states after the rules, sharing this checkpoint's reader. Nothing is
        read, and each tensor's fragments are built when it is first used (every rule's checks run
        here); the rules are appended to ``rules`` (and recorded by ``convert``)::

            hf = ckptbridge.open("llama/").with_rules(recipes.rules("llama", src="hf", dst="maxtext", ...))
            hf["decoder/layers/self_attention/query/kernel"].shape
        """
        from ..rules import Rule, rule_from_json, rules_to_json
        from ..rules._apply import map_rules

        parsed = [r if isinstance(r, Rule) else rule_from_json(r) for r in rules]
        if not parsed:
            return self
        try:
            tensors = map_rules(self.index.tensors, parsed)
        except CheckpointError as err:  # name the checkpoint too
            raise type(err)(f"{self.path}: {err.args[0] if err.args else err}") from None
        index = dataclasses.replace(self.index, tensors=tensors, rules=(*self.index.rules, *rules_to_json(parsed)))
        return Checkpoint(index, self.files)

    def close(self) -> None:
        self.files.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _repr_html_(self) -> str:
        from .html import checkpoint_html  # notebooks only: not on the import path of open

        return checkpoint_html(self)

    def __repr__(self) -> str:
        return f"Checkpoint(format={self.format!r}, path={self.path!r}, step={self.step}, tensors={len(self)})"
