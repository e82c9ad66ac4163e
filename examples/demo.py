"""The main job on a small real checkpoint that this script makes itself.

    python examples/demo.py OUT_DIR

1. trains a tiny GPT-style torch model for a few AdamW steps and saves
   ``{"model": ..., "optimizer": ..., "step": ...}`` with ``torch.save``;
2. opens it lazily and prints the tensor tree (no torch needed to read it);
3. converts it into the pickle-free universal directory and verifies it;
4. reads one slice of one tensor and shows how few bytes that took;
5. reshards it to a single safetensors file and diffs it against the source.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import ckptbridge


def make_checkpoint(path: str) -> None:
    import torch

    torch.manual_seed(0)
    vocab, width = 101, 60
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, width),
        torch.nn.LayerNorm(width),
        torch.nn.Linear(width, 4 * width),
        torch.nn.GELU(),
        torch.nn.Linear(4 * width, width),
        torch.nn.Linear(width, vocab),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    for step in range(3):
        tokens = torch.randint(0, vocab, (8, 16))
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"  train step {step + 1}: loss {loss.item():.4f}")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3}, path)


def cli(*args: str) -> None:
    print(f"$ ckptbridge {' '.join(args)}")
    subprocess.run([sys.executable, "-m", "ckptbridge._cli", *args], check=True)


def main(out: str) -> None:
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    src = os.path.join(out, "tiny_gpt.pt")
    print("1. making a real checkpoint with torch")
    make_checkpoint(src)

    print("\n2. inspecting it (lazy, pickle-safe, no torch import needed)")
    cli("inspect", src)

    print("\n3. converting to the universal layout and verifying every checksum")
    universal = os.path.join(out, "universal")
    cli("convert", src, universal)
    cli("verify", universal)

    print("\n4. reading a slice reads only its bytes")
    with ckptbridge.open(universal) as ckpt:
        w = ckpt["model.2.weight"]
        rows = w[10:12]
        print(f"  {w!r}\n  rows 10..11 -> array {rows.shape}, {ckpt.stats.bytes_read} bytes read "
              f"of {w.nbytes} in the tensor")

    print("\n5. resharding to one safetensors file and diffing it against the source")
    flat = os.path.join(out, "weights.safetensors")
    cli("reshard", universal, flat, "--to", "safetensors")
    rows = ckptbridge.diff(src, flat)
    print(f"  {sum(r.equal for r in rows)}/{len(rows)} tensors bitwise equal")
    if not all(r.equal for r in rows):
        raise SystemExit("demo failed: round trip is not bitwise")
    print("\ndemo ok")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "demo_out")
