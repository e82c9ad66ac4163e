"""Asynchronous multi-level checkpointing: every restored step is bitwise the state at save()."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import ckptbridge
from ckptbridge import Checkpointer
from ckptbridge._checkpointer.steps import committed_steps, step_dir


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def _snapshot(sd):
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in _snapshot(v).items()})
        elif isinstance(v, torch.Tensor):
            out[k] = v.detach().clone().numpy()
    return out


def _optim_flat(opt):
    sd = opt.state_dict()
    return {"state": {str(i): s for i, s in sd["state"].items()}}


def test_torch_loop_async_saves_are_bitwise_the_state_at_save(tmp_path):
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    refs = {}
    with Checkpointer(tmp_path / "ck", keep_last=None) as ck:
        for step in range(6):
            x = torch.randn(16, 32)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            state = {"model": model.state_dict(), "optim": _optim_flat(opt), "loss": float(loss.detach())}
            refs[step] = _snapshot({"model": state["model"], "optim": state["optim"]})
            ck.save(step, state, optimizer=opt)  # params and moments captured lazily
            opt.step()  # blocks only until the snapshot is in host memory
        ck.wait()
        assert [s.step for s in ck.stats] == list(range(6))
        assert all(s.committed and s.stall_seconds >= 0 and s.flush_seconds > 0 for s in ck.stats)
    assert committed_steps(str(tmp_path / "ck")) == list(range(6))
    fresh = Checkpointer(tmp_path / "ck", keep_last=None, host_tier=False)
    for step, ref in refs.items():
        got = fresh.restore(step, flat=True)
        assert set(ref) <= set(got)
        for k, v in ref.items():
            assert got[k].tobytes() == v.tobytes(), (step, k)
        assert isinstance(got["loss"], float)
    fresh.close()
    # the checkpoint is an ordinary universal directory
    c = ckptbridge.open(step_dir(str(tmp_path / "ck"), 5))
    assert c.step == 5 and "model.0.weight" in c


def test_unguarded_state_may_change_the_moment_save_returns(tmp_path):
    t = torch.arange(1000, dtype=torch.float32)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"t": t, "bf": t.to(torch.bfloat16)})
        t.add_(1.0)  # in-place change right after save returns
        ck.wait()
        got = ck.restore(1)
    np.testing.assert_array_equal(got["t"], np.arange(1000, dtype=np.float32))
    assert got["bf"].astype(np.float32).tolist() == torch.arange(1000.0).bfloat16().float().tolist()


def test_host_tier_serves_the_latest_snapshot(tmp_path):
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(7, {"w": np.ones((4, 4), np.float32)})
        ck.wait()
        os.rename(step_dir(str(tmp_path / "ck"), 7), tmp_path / "moved")  # disk copy gone
        np.testing.assert_array_equal(ck.restore(7)["w"], np.ones((4, 4), np.float32))


def test_retention_and_persistent_level(tmp_path):
    persistent = tmp_path / "remote"
    with Checkpointer(tmp_path / "ck", keep_last=2, keep_every=3, persistent=str(persistent)) as ck:
        for step in range(1, 8):
            ck.save(step, {"w": np.full(3, step, np.float32)})
        ck.wait()
        assert all(s.persist_seconds is not None for s in ck.stats)
    assert committed_steps(str(tmp_path / "ck")) == [3, 6, 7]
    assert committed_steps(str(persistent)) == list(range(1, 8))
    assert ckptbridge.verify(step_dir(str(persistent), 5)) == []


def test_fsspec_url_as_persistent_level(tmp_path):
    url = f"file://{tmp_path / 'bucket'}"
    with Checkpointer(tmp_path / "ck", persistent=url) as ck:
        ck.save(2, {"w": np.arange(6, dtype=np.int64)})
        ck.wait()
    c = ckptbridge.open(step_dir(str(tmp_path / "bucket"), 2))
    np.testing.assert_array_equal(c["w"].read(), np.arange(6))


CRASH = textwrap.dedent("""
    import os, sys, time, numpy as np
    import ckptbridge._formats.safetensors_write as st
    from ckptbridge import Checkpointer
    root = sys.argv[1]
    ck = Checkpointer(root)
    ck.save(1, {"w": np.full(1000, 1.0, np.float32)}); ck.wait()
    real = st.write_files
    def slow(*a, **k):
        out = real(*a, **k)
        print("FLUSHING", flush=True); time.sleep(60)
        return out
    st.write_files = slow
    import ckptbridge._formats.universal as u; u.write_files = slow
    ck.save(2, {"w": np.full(1000, 2.0, np.float32)})
    time.sleep(60)
""")


def test_a_crash_mid_flush_leaves_the_previous_checkpoint_intact(tmp_path):
    root = str(tmp_path / "ck")
    proc = subprocess.Popen([sys.executable, "-c", CRASH, root], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "FLUSHING"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (partial,) = [p for p in os.listdir(root) if p.startswith("step_00000002.partial")]
    assert committed_steps(root) == [1]
    with pytest.raises(ckptbridge.IncompleteCheckpointError):
        ckptbridge.open(os.path.join(root, partial))
    ck = Checkpointer(root)  # a restart: the abandoned step is cleaned up
    assert ck.latest() == 1 and not os.path.exists(os.path.join(root, partial))
    np.testing.assert_array_equal(ck.restore()["w"], np.full(1000, 1.0, np.float32))
    ck.close()


def test_two_writers_never_see_a_half_written_step(tmp_path):
    """A reader polling the root while a writer saves sees only complete steps."""
    root = str(tmp_path / "ck")
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import numpy as np
        from ckptbridge import Checkpointer
        with Checkpointer({root!r}, keep_last=None) as ck:
            for s in range(15):
                ck.save(s, {{"w": np.full((256, 256), s, np.float32)}})
    """)])
    seen = set()
    while writer.poll() is None or len(seen) < 15:
        for s in committed_steps(root):
            if s not in seen:
                c = ckptbridge.open(step_dir(root, s))
                assert float(c["w"][0, 0]) == s and ckptbridge.verify(step_dir(root, s)) == []
                seen.add(s)
        if writer.poll() is not None and len(committed_steps(root)) == len(seen):
            break
        time.sleep(0.01)
    assert writer.returncode == 0 and seen == set(range(15))


KILL_LOOP = textwrap.dedent("""
    import sys, numpy as np
    from ckptbridge import Checkpointer
    ck = Checkpointer(sys.argv[1], keep_last=2)
    start = (ck.latest() or 0) + 1
    for step in range(start, start + 400):
        ck.save(step, {"w": np.full((64, 1024), step, np.float32), "b": np.arange(step, step + 7)})
        if step % 2:
            ck.wait()
            print(step, flush=True)
""")


@pytest.mark.parametrize("seed", range(10))
def test_sigkill_at_random_points_never_loses_the_last_committed_step(tmp_path, seed):
    """20 kills at random moments over 50+ saves: latest() is always a complete, verifiable step."""
    rng = np.random.default_rng(seed)
    root = str(tmp_path / "ck")
    reported = 0
    for _ in range(2):  # kill, restart, kill again in the same root
        proc = subprocess.Popen([sys.executable, "-c", KILL_LOOP, root], stdout=subprocess.PIPE, text=True)
        lines = []
        deadline = time.monotonic() + float(rng.uniform(0.3, 0.9))
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(int(line))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        reported = max([reported, *lines])
        latest = Checkpointer(root, keep_last=2).latest()
        assert latest is not None and latest >= reported
        path = step_dir(root, latest)
        assert ckptbridge.verify(path) == []
        c = ckptbridge.open(path)
        assert float(c["w"][3, 5]) == latest and int(c["b"][0]) == latest


TWO_JOBS = textwrap.dedent("""
    import sys, numpy as np
    from ckptbridge import Checkpointer
    root, value = sys.argv[1], float(sys.argv[2])
    with Checkpointer(root, keep_last=None) as ck:
        for s in range(12):
            ck.save(s, {"w": np.full((128, 256), value + s, np.float32), "tag": value})
""")


def test_two_jobs_writing_the_same_steps_into_one_root_never_mix(tmp_path):
    """Both jobs race for every step; each committed step is wholly one job's."""
    root = str(tmp_path / "ck")
    jobs = [subprocess.Popen([sys.executable, "-c", TWO_JOBS, root, v]) for v in ("100", "200")]
    assert [j.wait(timeout=300) for j in jobs] == [0, 0]
    assert committed_steps(root) == list(range(12))
    for s in range(12):
        c = ckptbridge.open(step_dir(root, s))
        w = c["w"].read()
        assert ckptbridge.verify(step_dir(root, s)) == []
        assert (w == w[0, 0]).all() and float(w[0, 0]) - s in (100.0, 200.0)
        assert c.extra["values"]["tag"] == float(w[0, 0]) - s
    assert not [p for p in os.listdir(root) if ".partial" in p]


def test_flush_writes_from_the_snapshot_buffers_without_a_copy(tmp_path, monkeypatch):
    """The snapshot lands in page-aligned images of the data files, so the flush only checksums
    and writes them; the files equal what a synchronous write of the same state gives, also
    when the state's layout changes from one save to the next."""
    import ckptbridge._formats.safetensors_write as st
    from ckptbridge.plugin import Box, Piece, write_rank
    from ckptbridge.plugin import commit_universal as commit

    copies = []
    real = st._produce
    monkeypatch.setattr(st, "_produce", lambda *a: copies.append(a[1]) or real(*a))
    rng = np.random.default_rng(0)
    states = [{"w": rng.standard_normal((300, 7)).astype(np.float32), "b": np.arange(5, dtype=np.int64)},
              {"w": rng.standard_normal((301, 7)).astype(np.float32), "b": np.arange(5, dtype=np.int64),
               "h": rng.standard_normal(1000).astype(np.float16)},
              {"w": rng.standard_normal((300, 7)).astype(np.float32), "b": np.arange(5, dtype=np.int64)}]
    with Checkpointer(tmp_path / "ck", keep_last=5, host_tier=False) as ck:
        for step, sd in enumerate(states):
            ck.save(step, sd)
        ck.wait()
    assert copies == []  # no chunk went through a staging buffer
    for step, sd in enumerate(states):
        ref = str(tmp_path / f"ref{step}")
        write_rank(ref, [Piece(k, "param", st_dtype, v.shape, Box.full(v.shape), v)
                         for k, v in sd.items() for st_dtype in [ckptbridge.plugin.dtypes.name_of(v.dtype)]])
        commit(ref)
        got = step_dir(str(tmp_path / "ck"), step)
        names = sorted(os.listdir(os.path.join(ref, "data")))
        assert names == sorted(os.listdir(os.path.join(got, "data")))
        for n in names:
            with open(os.path.join(ref, "data", n), "rb") as a, open(os.path.join(got, "data", n), "rb") as b:
                assert a.read() == b.read(), (step, n)
        c = ckptbridge.open(got)
        for k, v in sd.items():
            assert c[k].read().tobytes() == v.tobytes()


def test_host_images_are_page_locked_for_cuda_tensors_and_unlocked_after(tmp_path, monkeypatch):
    """For CUDA tensors the snapshot images are registered with CUDA (``cudaHostRegister`` via
    torch's own ``_pin_memory_utils``, as DCP's stager does) and unregistered when the layout
    changes or the checkpointer closes. No GPU here: the CUDA calls are recorded, and CPU
    tensors stand in for CUDA ones."""
    import mmap as _mmap

    from torch.cuda import _pin_memory_utils

    import ckptbridge.adapters.torch._leaves as at

    pinned: dict[int, int] = {}
    log = []

    def pin_memory(addr: int, size: int) -> None:
        assert addr % _mmap.PAGESIZE == 0 and addr not in pinned
        pinned[addr] = size
        log.append(("pin", addr))

    def unpin_memory(addr: int) -> None:
        del pinned[addr]
        log.append(("unpin", addr))

    monkeypatch.setattr(_pin_memory_utils, "pin_memory", pin_memory)
    monkeypatch.setattr(_pin_memory_utils, "unpin_memory", unpin_memory)
    monkeypatch.setattr(at, "_pin_for", lambda t: at.pin_host)  # every tensor "is on a GPU"
    model = _tiny_model()
    ck = Checkpointer(tmp_path / "ck", keep_last=2)
    ck.save(1, {"model": model.state_dict()})
    ck.save(2, {"model": model.state_dict()})
    ck.wait()
    images = [img for b in ck._buffers for img in b.images.values()]
    assert len(images) == 2 and sorted(pinned.values()) == sorted(len(i) for i in images)
    assert set(pinned) == {np.frombuffer(i, np.uint8).ctypes.data for i in images}
    ck.save(3, {"model": model.state_dict(), "extra": torch.ones(5)})  # a new layout: the save's set
    ck.wait()  # and the spare one (pre-faulted in the background) drop their old images
    for b in ck._buffers:
        b.ready.wait()
    images = [img for b in ck._buffers for img in b.images.values()]
    assert set(pinned) == {np.frombuffer(i, np.uint8).ctypes.data for i in images}
    assert len(pinned) == 2 and sum(1 for k, _ in log if k == "unpin") == 2
    ck.close()
    assert pinned == {}
    c = ckptbridge.open(step_dir(str(tmp_path / "ck"), 3))
    np.testing.assert_array_equal(c["extra"].read(), np.ones(5, np.float32))


def _safetensors_length(path):
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    return 8 + n + max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")


def _data_file(root, step):
    (name,) = os.listdir(os.path.join(step_dir(root, step), "data"))
    return os.path.join(step_dir(root, step), "data", name)


def test_a_dropped_steps_file_is_overwritten_by_the_next_save_unless_a_reader_holds_it(tmp_path):
    root = str(tmp_path / "ck")
    sizes = [(64, 64), (64, 64), (32, 64), (96, 64), (96, 64)]  # the state shrinks, then grows
    states, inodes, kept = {}, {}, {}
    with contextlib.ExitStack() as stack, Checkpointer(root, keep_last=1) as ck:
        for step, shape in enumerate(sizes, 1):
            if step == 4:  # a reader of step 3 keeps its file open while step 3 is dropped
                reader = stack.enter_context(open(_data_file(root, 3), "rb"))
                held = reader.read()
            states[step] = {"w": np.random.default_rng(step).standard_normal(shape).astype(np.float32)}
            ck.save(step, states[step])
            ck.wait()
            ck._chores.submit(lambda: None).result()  # retention (run after each commit) is done
            inodes[step] = os.stat(_data_file(root, step)).st_ino
            pool = os.path.join(root, ".reuse")
            kept[step] = len(os.listdir(pool)) if os.path.isdir(pool) else 0
            with ckptbridge.open(step_dir(root, step)) as restored:  # closed: its file may be reused
                np.testing.assert_array_equal(restored["w"].read(), states[step]["w"])
            assert ckptbridge.verify(step_dir(root, step)) == []
            assert os.path.getsize(_data_file(root, step)) == _safetensors_length(_data_file(root, step))
        assert committed_steps(root) == [5]
        assert reader.seek(0) == 0 and reader.read() == held  # the reader kept its bytes
    assert inodes[3] == inodes[1] and inodes[4] == inodes[2]  # overwritten in place, shorter, then longer
    assert kept == {1: 0, 2: 1, 3: 1, 4: 0, 5: 1}  # step 3's file was open when it was dropped: deleted
    assert not os.path.exists(os.path.join(root, ".reuse"))  # close() drops the spare files


def test_reuse_files_off_deletes_dropped_steps(tmp_path):
    root = str(tmp_path / "ck")
    with Checkpointer(root, keep_last=1, policy=ckptbridge.SavePolicy(reuse_files=False)) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": np.full((64, 64), step, np.float32)})
            ck.wait()
            ck._chores.submit(lambda: None).result()
            assert committed_steps(root) == [step]
            assert not os.path.exists(os.path.join(root, ".reuse"))
