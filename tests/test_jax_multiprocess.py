"""Two JAX processes (jax.distributed on CPU) save one checkpoint together and load it back."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

import ckptbridge as cbopen

WORKER = os.path.join(os.path.dirname(__file__), "_jax_mp_worker.py")


def test_two_processes_save_own_shards_and_load(tmp_path):
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    path = str(tmp_path / "ckpt")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, WORKER, str(i), str(port), path], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    # each process read exactly its 4 devices' boxes of w (4 x 16x4 floats), after nothing else
    for i, out in enumerate(outs):
        assert f"OK {i} bytes_read=1024" in out, out[-2000:]
    # each process wrote its own data file; process 0 committed one logical tensor per leaf
    assert sorted(os.listdir(os.path.join(path, "data"))) == [
        "fp32-r00000-00000.safetensors", "fp32-r00001-00000.safetensors"]
    ckpt = cbopen.open(path)
    assert ckpt.step == 4 and sorted(ckpt) == ["b", "w"]
    assert len(ckpt["w"].fragments) == 8 and len(ckpt["b"].fragments) == 1
    ref = np.arange(32 * 16, dtype=np.float32).reshape(32, 16)
    np.testing.assert_array_equal(ckpt["w"].read(), ref)
    np.testing.assert_array_equal(ckpt["b"].read(), ref[0])
    with open(os.path.join(path, "manifest.json")) as fh:
        assert json.load(fh)["provenance"]["processes"] == 2


def test_two_processes_checkpoint_a_donating_loop_and_commit_once_both_wrote(tmp_path):
    """ckptbridge.Checkpointer under jax.distributed: each process snapshots only its addressable
    shards (process 0 also the replicated vector), process 0 commits a step only after process 1's
    part is on disk (process 1 holds step 1 back for 3 s and checks), and every step restores
    bitwise although the train step donates the state right after each save."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    root = str(tmp_path / "ck")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, WORKER, str(i), str(port), root, "checkpointer"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    # 4 of the 8 shards of w (4 x 16x4 float32) each; process 0 also writes b (16 float32)
    assert "OK 0 bytes_per_save=[1088, 1088, 1088]" in outs[0], outs[0][-2000:]
    assert "OK 1 bytes_per_save=[1024, 1024, 1024]" in outs[1], outs[1][-2000:]
    ref = np.arange(32 * 16, dtype=np.float32).reshape(32, 16)
    w, b = ref.copy(), ref[0].copy()
    for step in range(3):
        path = os.path.join(root, f"step_{step:08d}")
        assert cbopen.verify(path) == []
        ckpt = cbopen.open(path)
        assert ckpt.step == step and sorted(ckpt) == ["params.b", "params.w"]
        assert len(ckpt["params.w"].fragments) == 8
        assert sorted(os.listdir(os.path.join(path, "data"))) == [
            "param-r00000-00000.safetensors", "param-r00001-00000.safetensors"]
        assert ckpt["params.w"].read().tobytes() == w.tobytes()
        assert ckpt["params.b"].read().tobytes() == b.tobytes()
        w, b = w * np.float32(0.5) + np.float32(1.0), b + np.float32(1.0)
