"""Lazy, asynchronous, multi-level checkpointing straight into the universal layout.

The levels, one module each: ``leaves`` (what is captured, and the runtimes
that capture it), ``host`` (reused host buffers laid out as file images),
``jobs`` (a save in flight, its timings), ``core`` (the :class:`Checkpointer`: snapshot and
flush threads, commit),
``tree`` (the saved tree's skeleton), ``restore`` (strict restores into live state),
``policy`` (:class:`SavePolicy`: back-pressure and priorities under load),
``steps`` (step directories, retention, clean-up) and ``persist`` (the copy to
a persistent directory or URL). See :class:`Checkpointer`.
"""

from __future__ import annotations

from .core import Checkpointer
from .jobs import SaveStats
from .leaves import Capture, Leaf, LeafProvider, leaves_of, register_leaf_provider
from .policy import SavePolicy
from .restore import RestoreResult
from .steps import committed_steps, step_dir

__all__ = [
    "Capture",
    "Checkpointer",
    "Leaf",
    "LeafProvider",
    "RestoreResult",
    "SavePolicy",
    "SaveStats",
    "committed_steps",
    "leaves_of",
    "register_leaf_provider",
    "step_dir",
]
