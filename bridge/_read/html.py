"""Rich HTML views for notebooks: checkpoints, tensors and reshard plans.

``Checkpoint``, ``TensorView`` and :class:`ReshardPlan` define
``_repr_html_`` so Jupyter shows them as a collapsible tree (shapes, dtypes,
states, scalars), a drawn fragment map (which file holds which box of each
tensor) and, for a plan, which source fragment and file every target box
reads from. Metadata only: nothing here reads tensor data::

    ckpt                                   # in a notebook cell: the tree view
    ckpt["blocks.0.qkv.weight"]            # one tensor: its fragments drawn
    ReshardPlan.build(ckpt["wte.weight"], {"dev0": Box((0, 0), (51, 60)), ...})
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .. import _dtypes
from .model import Box, Fragment, LogicalTensor
from .plan import CopyOp, plan


class TensorView(Protocol):
    """What the renderings need of a ``ckptbridge.TensorView``."""

    tensor: LogicalTensor
    state_name: str

    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def fragments(self) -> tuple[Fragment, ...]: ...
    @property
    def nbytes(self) -> int: ...
    def state(self, name: str) -> TensorView: ...


class Checkpoint(Protocol):
    """What the renderings need of a ``ckptbridge.Checkpoint``."""

    @property
    def format(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def step(self) -> int | None: ...
    @property
    def tensors(self) -> Mapping[str, LogicalTensor]: ...
    def states(self) -> tuple[str, ...]: ...

__all__ = ["ReshardPlan", "checkpoint_html", "fragment_svg", "tensor_html"]

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac", "#1f77b4", "#2ca02c")
MAX_TENSORS = 300  # rows shown in a checkpoint's tree before "... N more"
MAX_RECTS = 256  # rectangles drawn per tensor

_STYLE = ("<style>.cb-t{font-family:monospace;font-size:12px;border-collapse:collapse}"
          ".cb-t td,.cb-t th{padding:1px 8px;text-align:left;border-bottom:1px solid #eee}"
          ".cb-k{color:#888}.cb-s{display:inline-block;width:10px;height:10px;margin-right:3px}"
          "details.cb>summary{cursor:pointer;font-family:monospace}</style>")


def _e(x: object) -> str:
    return html.escape(str(x))


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _where(frag: Fragment) -> str:
    """The file of a fragment (its location's ``file``, else its description)."""
    loc = frag.location
    return str(getattr(loc, "file", None) or loc.describe())


def _colors(fragments: Sequence[Fragment]) -> dict[str, str]:
    files: dict[str, str] = {}
    for f in fragments:
        files.setdefault(_where(f), PALETTE[len(files) % len(PALETTE)])
    return files


def _rects(box: Box, shape: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """A box of ``shape`` as ``(row, col, rows, cols)`` rectangles of the 2-D view
    ``[prod(shape[:-1]), shape[-1]]`` (1-D: one row; 0-D: one cell)."""
    shape = tuple(shape)
    if len(shape) == 0:
        return [(0, 0, 1, 1)]
    if len(shape) == 1:
        return [(0, box.offset[0], 1, box.shape[0])]
    lead = shape[:-2]
    out = []
    count = math.prod(box.shape[:-2]) if lead else 1
    for k in range(min(count, MAX_RECTS)):
        idx, rem = [], k
        for d in reversed(range(len(lead))):
            idx.append(box.offset[d] + rem % box.shape[d])
            rem //= box.shape[d]
        idx.reverse()
        flat = 0
        for d, i in enumerate(idx):
            flat = flat * shape[d] + i
        out.append((flat * shape[-2] + box.offset[-2], box.offset[-1], box.shape[-2], box.shape[-1]))
    return out


def _grid(shape: Sequence[int]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, max(int(shape[0]), 1)
    return max(math.prod(shape[:-1]), 1), max(int(shape[-1]), 1)


def fragment_svg(shape: Sequence[int], boxes: Sequence[tuple[Box, str, str]], width: int = 260,
                 outline: Sequence[tuple[Box, str]] = ()) -> str:
    """An SVG of a tensor's 2-D view with ``boxes`` = ``(box, color, tooltip)`` filled and
    ``outline`` = ``(box, label)`` drawn as labelled frames (targets of a plan)."""
    rows, cols = _grid(shape)
    height = int(min(max(width * rows / cols, 14), 220))
    sx, sy = width / cols, height / rows
    parts = [f'<svg width="{width + 2}" height="{height + 2}" style="background:#fafafa;border:1px solid #ccc">']
    for box, color, tip in boxes:
        for r, c, h, w in _rects(box, shape):
            parts.append(f'<rect x="{1 + c * sx:.2f}" y="{1 + r * sy:.2f}" width="{max(w * sx, 0.5):.2f}" '
                         f'height="{max(h * sy, 0.5):.2f}" fill="{color}" fill-opacity="0.75" stroke="white" '
                         f'stroke-width="0.5"><title>{_e(tip)}</title></rect>')
    for box, label in outline:
        for r, c, h, w in _rects(box, shape)[:1]:
            parts.append(f'<rect x="{1 + c * sx:.2f}" y="{1 + r * sy:.2f}" width="{w * sx:.2f}" '
                         f'height="{h * sy:.2f}" fill="none" stroke="black" stroke-width="1.2">'
                         f'<title>{_e(label)}</title></rect>')
            parts.append(f'<text x="{3 + c * sx:.2f}" y="{11 + r * sy:.2f}" font-size="9" '
                         f'font-family="monospace">{_e(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _legend(colors: Mapping[str, str]) -> str:
    items = [f'<span class="cb-s" style="background:{c}"></span>{_e(os.path.basename(f) or f)}'
             for f, c in list(colors.items())[:12]]
    more = f" ... {len(colors) - 12} more files" if len(colors) > 12 else ""
    return "<div style='font-family:monospace;font-size:11px'>" + " &nbsp; ".join(items) + more + "</div>"


def _state_svg(view: TensorView, width: int = 260) -> str:
    frags = view.fragments
    colors = _colors(frags)
    boxes = [(f.box, colors[_where(f)], f"{f.box.offset}+{f.box.shape} {f.location.describe()}")
             for f in frags[:MAX_RECTS]]
    return fragment_svg(view.shape, boxes, width) + _legend(colors)


def tensor_html(view: TensorView) -> str:
    """One tensor: shape, dtype, states, scalars and each state's fragment map."""
    t = view.tensor
    head = (f"<b>{_e(t.name)}</b> <span class='cb-k'>{_e(view.dtype)} {list(view.shape)} "
            f"({_size(view.nbytes)})</span>")
    if t.scalars:
        head += " <span class='cb-k'>" + _e(", ".join(f"{k}={v}" for k, v in t.scalars.items())) + "</span>"
    cells = []
    for s in t.states:
        v = view.state(s)
        cells.append(f"<td style='vertical-align:top'><div class='cb-k'>{_e(s)}: {len(v.fragments)} "
                     f"fragments</div>{_state_svg(v, 220)}</td>")
    return _STYLE + f"<div>{head}</div><table><tr>{''.join(cells)}</tr></table>"


def _tree(names: Sequence[str]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for n in names:
        sep = "/" if "/" in n else "."
        node = root
        parts = n.split(sep)
        for p in parts[:-1]:
            node = node.setdefault(p + sep, {})
        node[parts[-1]] = n
    return root


def checkpoint_html(ckpt: Checkpoint) -> str:
    """A checkpoint as a collapsible tree of its tensors with shapes, dtypes, states and
    fragment maps, under a summary of format, step, states and files."""
    tensors = ckpt.tensors
    files: dict[str, None] = {}
    total = 0
    for t in tensors.values():
        for st in t.states.values():
            total += st.nbytes
            for f in st.fragments:
                files.setdefault(_where(f))
    states = ", ".join(ckpt.states())
    head = (f"<b>Checkpoint</b> <span class='cb-k'>format</span> {_e(ckpt.format)} "
            f"<span class='cb-k'>step</span> {_e(ckpt.step)} <span class='cb-k'>tensors</span> {len(tensors)} "
            f"<span class='cb-k'>states</span> {_e(states)} <span class='cb-k'>size</span> {_size(total)} "
            f"<span class='cb-k'>files</span> {len(files)}<br><span class='cb-k'>{_e(ckpt.path)}</span>")
    colors = {f: PALETTE[i % len(PALETTE)] for i, f in enumerate(files)}
    shown = list(tensors)[:MAX_TENSORS]

    def row(name: str) -> str:
        t = tensors[name]
        st = t.state()
        boxes = [(f.box, colors[_where(f)], f"{f.box.offset}+{f.box.shape} {f.location.describe()}")
                 for f in st.fragments[:MAX_RECTS]]
        scal = ", ".join(f"{k}={v}" for k, v in t.scalars.items())
        return (f"<tr><td>{_e(name)}</td><td>{_e(list(st.shape))}</td><td>{_e(st.dtype)}</td>"
                f"<td>{_e(', '.join(t.states))}</td><td>{_e(scal)}</td><td>{len(st.fragments)}</td>"
                f"<td>{fragment_svg(st.shape, boxes, 120)}</td></tr>")

    def render(node: Mapping[str, Any], depth: int) -> str:
        out = []
        leaves = [v for v in node.values() if isinstance(v, str)]
        if leaves:
            out.append("<table class='cb-t'><tr><th>tensor</th><th>shape</th><th>dtype</th><th>states</th>"
                       "<th>scalars</th><th>frags</th><th>fragment map (weights)</th></tr>"
                       + "".join(row(n) for n in leaves) + "</table>")
        for key, sub in node.items():
            if isinstance(sub, str):
                continue
            count = _count(sub)
            opened = " open" if depth < 1 else ""
            out.append(f"<details class='cb'{opened} style='margin-left:{12 if depth else 0}px'>"
                       f"<summary>{_e(key)} <span class='cb-k'>({count})</span></summary>"
                       f"{render(sub, depth + 1)}</details>")
        return "".join(out)

    more = f"<div class='cb-k'>... {len(tensors) - len(shown)} more tensors</div>" if len(tensors) > len(shown) else ""
    return _STYLE + f"<div>{head}</div>" + render(_tree(shown), 0) + more + _legend(colors)


def _count(node: Mapping[str, Any]) -> int:
    return sum(1 if isinstance(v, str) else _count(v) for v in node.values())


@dataclass(frozen=True)
class ReshardPlan:
    """Where each target box of one tensor reads from: the core planner's copy ops, per target.

    ``targets`` maps a label (a device, a rank) to the box of the tensor it
    needs; ``reads[label]`` are the :class:`CopyOp`s (source fragment, box
    inside it, box inside the target) that fill it. Build one from a
    ``TensorView`` or a list of fragments::

        plan = ReshardPlan.build(ckpt["blocks.0.fc.weight"], {"cpu:0": Box((0, 0), (120, 60)),
                                                             "cpu:1": Box((120, 0), (120, 60))})
        plan            # in a notebook: both layouts drawn, and a table of reads
        plan.rows()     # [{"target", "box", "file", "location", "source_box", "bytes"}, ...]
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    fragments: tuple[Fragment, ...]
    targets: tuple[tuple[str, Box], ...]
    reads: tuple[tuple[str, tuple[CopyOp, ...]], ...]

    @staticmethod
    def build(source: Any, targets: Mapping[str, Box] | Sequence[Box], name: str | None = None,
              shape: Sequence[int] | None = None, dtype: str | None = None) -> ReshardPlan:
        """Plan ``targets`` (``{label: Box}`` or a list of boxes) against ``source``
        (a ``TensorView`` or a sequence of ``Fragment``s with ``shape`` and ``dtype`` given)."""
        if hasattr(source, "fragments") and hasattr(source, "shape"):
            frags = tuple(source.fragments)
            name = name or getattr(source, "name", "tensor")
            shape = tuple(source.shape)
            dtype = dtype or str(source.dtype)
        else:
            frags = tuple(source)
            if shape is None:
                raise ValueError("give shape= with a list of fragments")
            shape = tuple(shape)
            dtype = dtype or str(frags[0].location.dtype if frags else "float32")
            name = name or "tensor"
        items = tuple(targets.items()) if isinstance(targets, Mapping) else tuple(
            (f"target {i}", b) for i, b in enumerate(targets))
        name = name or "tensor"
        reads = tuple((label, plan(frags, box, name)) for label, box in items)
        return ReshardPlan(name, tuple(shape), dtype, frags, items, reads)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per copy: target label and box, source file and location, source box, bytes."""
        size = _dtypes.itemsize(self.dtype)
        out = []
        for label, ops in self.reads:
            box = dict(self.targets)[label]
            for op in ops:
                src = Box(tuple(a + b for a, b in zip(op.fragment.box.offset, op.src.offset)), op.src.shape)
                out.append({"target": label, "box": (box.offset, box.shape), "file": _where(op.fragment),
                            "location": op.fragment.location.describe(),
                            "source_box": (src.offset, src.shape), "bytes": op.src.size * size})
        return out

    @property
    def bytes_read(self) -> int:
        """Bytes the plan reads in total (replicated targets read again)."""
        return sum(r["bytes"] for r in self.rows())

    def __str__(self) -> str:
        lines = [f"ReshardPlan {self.name} {list(self.shape)} {self.dtype}: {len(self.fragments)} "
                 f"source fragments -> {len(self.targets)} targets"]
        for r in self.rows():
            lines.append(f"  {r['target']:<12} <- {os.path.basename(r['file'])} box {r['source_box'][0]}"
                         f"+{r['source_box'][1]} ({r['bytes']} B)")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        colors = _colors(self.fragments)
        src = [(f.box, colors[_where(f)], f"{f.box.offset}+{f.box.shape} {f.location.describe()}")
               for f in self.fragments[:MAX_RECTS]]
        tcolors = {label: PALETTE[i % len(PALETTE)] for i, (label, _) in enumerate(self.targets)}
        tgt = [(b, tcolors[label], f"{label}: {b.offset}+{b.shape}") for label, b in self.targets]
        head = (f"<b>ReshardPlan</b> {_e(self.name)} <span class='cb-k'>{_e(self.dtype)} {list(self.shape)}: "
                f"{len(self.fragments)} source fragments -> {len(self.targets)} targets, "
                f"{_size(self.bytes_read)} read</span>")
        pics = (f"<table><tr><td><div class='cb-k'>source fragments (by file)</div>"
                f"{fragment_svg(self.shape, src, 240, outline=[(b, lab) for lab, b in self.targets])}"
                f"{_legend(colors)}</td><td><div class='cb-k'>targets</div>"
                f"{fragment_svg(self.shape, tgt, 240)}</td></tr></table>")
        rows = "".join(
            f"<tr><td><span class='cb-s' style='background:{tcolors[r['target']]}'></span>{_e(r['target'])}</td>"
            f"<td>{_e(r['box'][0])}+{_e(r['box'][1])}</td>"
            f"<td><span class='cb-s' style='background:{colors.get(r['file'], '#999')}'></span>"
            f"{_e(os.path.basename(r['file']))}</td><td>{_e(r['source_box'][0])}+{_e(r['source_box'][1])}</td>"
            f"<td>{_e(r['location'])}</td><td>{r['bytes']}</td></tr>"
            for r in self.rows()[:400])
        table = ("<table class='cb-t'><tr><th>target</th><th>target box</th><th>file</th><th>source box</th>"
                 f"<th>location</th><th>bytes</th></tr>{rows}</table>")
        return _STYLE + f"<div>{head}</div>" + pics + table
