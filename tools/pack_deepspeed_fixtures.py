#!/usr/bin/env python
"""Pack real DeepSpeed run folders into ``tests/fixtures/deepspeed/runs.tar.xz`` + ``runs.json``.

Each run folder (made by the shared fixtures' ``make_ckpts.sh`` or by
``tools/make_deepspeed_ckpt.py``) holds ``ckpt/<tag>/`` (the checkpoint),
``ckpt/<tag>_universal/`` (DeepSpeed's ``ds_to_universal`` output, when it
works), ``fp32/pytorch_model.bin`` (``zero_to_fp32``) and the live engine's
state (``reference_full_fp32.pt`` + ``reference_optim_state.pt``, or
``reference.pt``). The archive holds them byte for byte; xz finds the
repeated tensors across runs and formats (~19 MB of checkpoints plus all
references pack into ~9 MB)::

    python tools/pack_deepspeed_fixtures.py /work/shared/fixtures/deepspeed/s1_* /tmp/dsvar/s2_bf16_w2_palign ...
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import os
import tarfile

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "deepspeed")
KEEP_TOP = ("meta.json", "reference_full_fp32.pt", "reference_optim_state.pt", "reference_module_sd.pt",
            "reference.pt", "ds_config.json")


def _files(run: str) -> list[str]:
    out = [os.path.join(run, f) for f in KEEP_TOP if os.path.exists(os.path.join(run, f))]
    for root, _, names in os.walk(os.path.join(run, "ckpt")):
        out += [os.path.join(root, n) for n in names if not n.endswith(".py")]
    z = os.path.join(run, "fp32", "pytorch_model.bin")
    if os.path.exists(z):
        out.append(z)
    return sorted(out)


def _describe(run: str) -> dict:
    with open(os.path.join(run, "meta.json")) as fh:
        meta = json.load(fh)
    ck = os.path.join(run, "ckpt")
    with open(os.path.join(ck, "latest")) as fh:
        tag = fh.read().strip()
    extra = {"offload": meta["offload"]} if any((meta.get("offload") or {}).values()) else {}  # ZeRO-Offload runs
    return {
        "name": os.path.basename(os.path.normpath(run)),
        "tag": tag,
        "stage": meta["stage"], "world_size": meta["world_size"], "dtype": meta["dtype"],
        "optimizer_wrapper": meta.get("optimizer_wrapper"),
        "global_steps": meta["global_steps"],
        "ds_universal": os.path.isdir(os.path.join(ck, tag + "_universal")),
        "zero_to_fp32": os.path.exists(os.path.join(run, "fp32", "pytorch_model.bin")),
        **extra,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    descr = []
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for run in a.runs:
            run = os.path.normpath(run)
            name = os.path.basename(run)
            descr.append(_describe(run))
            for f in _files(run):
                info = tar.gettarinfo(f, arcname=os.path.join(name, os.path.relpath(f, run)))
                info.mode, info.uid, info.gid, info.uname, info.gname, info.mtime = 0o644, 0, 0, "", "", 0
                with open(f, "rb") as fh:
                    tar.addfile(info, fh)
    data = lzma.compress(buf.getvalue(), preset=9 | lzma.PRESET_EXTREME)
    with open(os.path.join(a.out, "runs.tar.xz"), "wb") as fh:
        fh.write(data)
    with open(os.path.join(a.out, "runs.json"), "w") as fh:
        json.dump(descr, fh, indent=1)
    print(f"{len(descr)} runs, {len(buf.getvalue()) / 1e6:.1f} MB -> {len(data) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
