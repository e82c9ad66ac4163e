"""``ckptbridge reshard --to megatron -o optimizer=false`` writes the model weights only.

That is what Megatron-LM's own ``tools/checkpoint/convert.py`` writes, and what the benchmark
compares it with (bench/bench_megatron.py). From the real TP2/PP2 fixture to TP1/PP2: the rank
files have no ``optimizer`` entry (read by ckptbridge's pickle-free reader), the weights equal
the source's, and without the option (the control) the Adam state is written.
"""

from __future__ import annotations

import os

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "megatron", "A", "tp2pp2", "torch")


def _rank_objects(path: str) -> list[dict]:
    from ckptbridge.adapters.torch_save import TorchArchive

    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs if f == "model_optim_rng.pt")
    assert len(files) == 2  # TP1 x PP2
    return [TorchArchive.open(f).obj for f in files]


def test_weights_only(tmp_path) -> None:
    import ckptbridge
    from ckptbridge._cli import main as cli

    weights, full = str(tmp_path / "weights"), str(tmp_path / "full")
    assert cli(["reshard", FIX, weights, "--to", "megatron", "--tp", "1", "--pp", "2", "-o", "optimizer=false"]) == 0
    assert cli(["reshard", FIX, full, "--to", "megatron", "--tp", "1", "--pp", "2"]) == 0
    assert all("optimizer" not in o and o["model"] for o in _rank_objects(weights))
    assert all("optimizer" in o for o in _rank_objects(full))  # control: the default keeps the Adam state
    w = ckptbridge.open(weights)
    assert {s for t in w.tensors.values() for s in t.states} == {"fp32"}
    assert {"exp_avg", "exp_avg_sq"} <= {s for t in ckptbridge.open(full).tensors.values() for s in t.states}
    rows = ckptbridge.diff(FIX, weights)
    assert rows and all(r.equal for r in rows)
