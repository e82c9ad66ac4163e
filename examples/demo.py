"""The main job, end to end, on a small real checkpoint this script makes itself.

    python examples/demo.py OUT_DIR

1. trains a tiny GPT with real DeepSpeed ZeRO-2 on 2 CPU ranks (gloo) for 4 steps and saves a
   checkpoint; DeepSpeed then continues *itself* for 3 more steps (the reference);
2. opens the DeepSpeed checkpoint lazily and prints its tensors, states and layout rules;
3. converts it to the pickle-free universal layout and verifies every checksum;
4. reads one slice and shows how few bytes that took;
5. continues the run in JAX/optax on a 4-device mesh straight from the DeepSpeed files
   (weights and AdamW moments and step, no conversion step) and prints JAX's losses next to
   DeepSpeed's own continuation;
6. reshards the universal checkpoint to one safetensors file and diffs it against DeepSpeed's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import ckptbridge  # noqa: E402


def cli(*args: str) -> None:
    print(f"$ ckptbridge {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "ckptbridge", *args], check=True)


def make_deepspeed_run(out: str) -> None:
    env = dict(os.environ, DS_ACCELERATOR="cpu", DS_SKIP_SHM_OP="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={29500 + os.getpid() % 2000}",
           os.path.join(ROOT, "tests", "fixtures", "migration", "make_deepspeed_run.py"),
           "--out", out, "--steps", "4", "--more", "3"]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def main(out: str) -> None:
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    run = os.path.join(out, "deepspeed_run")
    print("1. training a tiny GPT with real DeepSpeed ZeRO-2 on 2 CPU ranks (about a minute)", flush=True)
    make_deepspeed_run(run)
    with open(os.path.join(run, "losses.json")) as fh:
        losses = json.load(fh)
    print(f"   DeepSpeed losses: {[round(x, 4) for x in losses['losses']]}, "
          f"then its own continuation {[round(x, 4) for x in losses['continuation_losses']]}")
    ds = os.path.join(run, "ckpt")

    print("\n2. inspecting the DeepSpeed checkpoint (lazy, pickle-safe; no DeepSpeed or torch needed)")
    cli("inspect", ds)

    print("\n3. converting to the universal layout and verifying every checksum")
    universal = os.path.join(out, "universal")
    cli("convert", ds, universal)
    cli("verify", universal)

    print("\n4. reading a slice reads only its bytes")
    with ckptbridge.open(ds) as ckpt:
        w = ckpt["blocks.0.fc.weight"]
        part = w.state("exp_avg")[10:12]
        print(f"   {w!r}\n   exp_avg rows 10..11 -> {part.shape}: {ckpt.stats.bytes_read} bytes read "
              f"from {len(ckpt.stats.per_file)} rank file(s), of {w.nbytes} in the tensor")

    print("\n5. continuing the run in JAX/optax on a 4-device mesh, straight from the DeepSpeed files")
    from examples.migrate_deepspeed_to_jax import continue_in_jax

    jax_losses = continue_in_jax(ds, 3, n_devices=4)
    for i, (j, d) in enumerate(zip(jax_losses, losses["continuation_losses"])):
        print(f"   step +{i}: JAX {j:.6f}   DeepSpeed {d:.6f}   |diff| {abs(j - d):.1e}")
    worst = max(abs(j - d) for j, d in zip(jax_losses, losses["continuation_losses"]))
    if worst > 1e-3:
        raise SystemExit(f"demo failed: JAX continuation differs from DeepSpeed's by {worst}")

    print("\n6. resharding to one safetensors file and diffing it against the DeepSpeed checkpoint")
    flat = os.path.join(out, "fp32.safetensors")
    cli("reshard", universal, flat, "--to", "safetensors", "--state", "fp32")
    rows = ckptbridge.diff(ds, flat)  # each side's weights: DeepSpeed's fp32 master, the file's tensors
    same = sum(r.equal for r in rows if r.in_a and r.in_b)
    print(f"   {same}/{len(rows)} tensors bitwise equal across formats")
    if same != len(rows):
        raise SystemExit("demo failed: round trip is not bitwise")
    print("\ndemo ok")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "demo_out")
