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
