"""The bulk helpers of the lazy read model (``ckptbridge._read.model``) that opening DeepSeek-V3's 92k
tensors runs through: specs made in C loops are ordinary ``TensorSpec`` s, ``LazyTensors.layouts`` is
``layout`` per name with equal layouts shared, ``specs`` cannot be written through, and ``no_gc`` gives
the collector back as it was (enabled, nothing frozen, cycles made inside still collected)."""

from __future__ import annotations

import gc
import weakref

import pytest

from ckptbridge._gc import no_gc
from ckptbridge._read.model import LazyTensors, LogicalTensor, TensorSpec, tensor_specs


def _specs() -> dict[str, TensorSpec]:
    return tensor_specs(["a", "b", "c", "d"], ["float32", "bfloat16", "float32", "float32"],
                        [(4, 6), (4, 6), (4, 6), (2,)], [("f", 8), ("f", 104), ("g", 8), ("g", 104)])


def test_tensor_specs_are_plain_specs_in_order():
    specs = _specs()
    assert list(specs) == ["a", "b", "c", "d"]
    assert specs["b"] == TensorSpec("bfloat16", (4, 6), ("f", 104)) and type(specs["b"]) is TensorSpec
    assert specs["b"].dtype == "bfloat16" and specs["b"].shape == (4, 6) and specs["b"].source == ("f", 104)


def test_layouts_equal_layout_per_name_with_equal_ones_shared():
    def build(name: str, spec: TensorSpec) -> LogicalTensor:
        raise AssertionError("layouts build nothing")

    tensors = LazyTensors(_specs(), build)
    names = ["d", "a", "c", "b"]
    layouts = tensors.layouts(names)
    assert layouts == [tensors.layout(n) for n in names]
    assert layouts[1] is layouts[2] and layouts[1] is not layouts[3]  # a, c: float32 (4, 6); b: bfloat16
    custom = LazyTensors(_specs(), build, layout=lambda s: {"fp32": (s.dtype, s.shape), "exp_avg": ("float32", s.shape)})
    mixed = custom.layouts(names)
    assert mixed == [custom.layout(n) for n in names] and mixed[1] is mixed[2]
    with pytest.raises(TypeError):
        tensors.specs["a"] = TensorSpec("float32", (1,), None)  # type: ignore[index]
    assert tensors.specs["a"] is tensors.meta("a") and len(tensors.specs) == 4


def test_no_gc_gives_the_collector_back_with_nothing_frozen():
    class Node:
        pass

    assert gc.isenabled()
    with no_gc():
        assert not gc.isenabled()
        with no_gc():  # nested: the outer one gives it back
            pass
        assert not gc.isenabled()
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made inside
        gone = weakref.ref(a)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    del a, b
    gc.collect()
    assert gone() is None
    gc.disable()
    try:
        with no_gc():
            pass
        assert not gc.isenabled()  # it was off: it stays off
    finally:
        gc.enable()
