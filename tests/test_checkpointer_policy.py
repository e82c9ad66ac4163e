"""The checkpointer under load: back-pressure (wait / skip / coalesce), flush priority, guards
that wait only for what a JAX step donates, and snapshots that let go of device memory.

Load is made deterministic with a runtime plug-in (the public ``register_leaf_provider``): a
``Held`` value's copy to host waits for a gate, so its save keeps its host buffer set for as
long as the test wants, exactly as a slow device-to-host transfer or a slow disk would.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import ckptbridge
from ckptbridge import Checkpointer, OptionError, SavePolicy
from ckptbridge.plugin import Box, Leaf, LeafProvider, register_leaf_provider


class Held:
    """A host tensor whose snapshot waits for ``gate`` (a stand-in for a slow transfer)."""

    def __init__(self, value: np.ndarray, gate: threading.Event) -> None:
        self.value, self.gate = value, gate


def _held_leaves(name, value, capture):
    def copy(out, v=value):
        v.gate.wait(timeout=60)
        np.copyto(out, v.value)

    shape = value.value.shape
    return [Leaf(name, "float32", shape, Box.full(shape), copy, lazy=True, key=id(value))]


register_leaf_provider(LeafProvider("held-test", (__name__,), leaves=_held_leaves))


def _state(step, gate):
    return {"held": Held(np.full(64, float(step), np.float32), gate), "w": np.full((8, 8), float(step), np.float32)}


def _committed(root):
    from ckptbridge._checkpointer.steps import committed_steps

    return committed_steps(str(root))


def _check_steps(root, steps):
    assert _committed(root) == steps
    for s in steps:
        c = ckptbridge.open(str(root / f"step_{s:08d}"))
        assert c.step == s
        np.testing.assert_array_equal(c["held"].read(), np.full(64, float(s), np.float32))
        np.testing.assert_array_equal(c["w"].read(), np.full((8, 8), float(s), np.float32))


def _opened():
    ev = threading.Event()
    ev.set()
    return ev


def _in_thread(fn, *args):
    done = threading.Event()
    out = {}

    def run():
        out["value"] = fn(*args)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done, out


@pytest.mark.parametrize("on_busy, returned, written, dropped", [
    ("wait", True, [0, 1, 2], []),
    ("skip", False, [0, 1], [2]),
    ("coalesce", True, [0, 2], [1]),
])
def test_a_save_that_finds_every_buffer_set_in_use(tmp_path, on_busy, returned, written, dropped):
    """Save 0's snapshot is held, so both host buffer sets are taken (save 1 queues behind it);
    save 2 then waits for the disk, is skipped, or replaces save 1, as the policy says."""
    gate = threading.Event()
    ck = Checkpointer(tmp_path / "ck", keep_last=None, policy=SavePolicy(on_busy=on_busy))
    assert ck.save(0, _state(0, gate)) is True
    assert ck.save(1, _state(1, _opened())) is True
    done, out = _in_thread(ck.save, 2, _state(2, _opened()))
    if on_busy == "wait":
        assert not done.wait(0.5)  # blocked until save 0 is on disk
        gate.set()
    else:
        assert done.wait(10)  # at once, while save 0 is still held
        gate.set()
    assert done.wait(60) and out["value"] is returned
    ck.wait()
    assert ck.dropped == dropped
    ck.close()
    _check_steps(tmp_path / "ck", written)


def test_coalesce_replaces_queued_saves_copied_or_not(tmp_path, monkeypatch):
    """Save 0's flush is held. Save 1 is copied to host and waits for the disk; save 2 replaces
    it (reusing its buffers: save 2's values, not save 1's, reach the disk); save 3, whose
    snapshot is held, replaces save 2 before its copy started. Only the newest is written."""
    import ckptbridge._checkpointer.core as core

    real = core.write_rank
    flush_gate = threading.Event()

    def held_flush(*args, **kwargs):
        flush_gate.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(core, "write_rank", held_flush)
    ck = Checkpointer(tmp_path / "ck", keep_last=None, policy=SavePolicy(on_busy="coalesce"))
    ck.save(0, _state(0, _opened()))
    ck.save(1, _state(1, _opened()))
    ck.wait_snapshots()  # save 1 is on the host, its flush queued behind save 0's
    assert ck.save(2, _state(2, _opened())) is True
    assert ck.dropped == [1]
    ck.save(3, _state(3, _opened()))
    flush_gate.set()
    ck.wait()
    assert ck.dropped == [1, 2]
    ck.close()
    _check_steps(tmp_path / "ck", [0, 3])


def test_one_host_buffer_set_makes_each_save_wait_for_the_previous_flush(tmp_path):
    gate = threading.Event()
    ck = Checkpointer(tmp_path / "ck", keep_last=None, policy=SavePolicy(host_buffers=1))
    ck.save(0, _state(0, gate))
    done, _ = _in_thread(ck.save, 1, _state(1, _opened()))
    assert not done.wait(0.5)
    gate.set()
    assert done.wait(60)
    ck.close()


def test_flush_priority_follows_the_backlog(tmp_path, monkeypatch):
    """``auto``: the flush runs at the lower priority while nobody waits for it, at the
    training's own once a save waits for the disk (or ``wait()`` is called)."""
    import ckptbridge._checkpointer.core as core

    seen = []
    real = core.write_rank
    gate = threading.Event()

    def recording(*args, background, **kwargs):
        seen.append(background)
        gate.wait(60)
        return real(*args, background=background, **kwargs)

    monkeypatch.setattr(core, "write_rank", recording)
    opened = threading.Event()
    opened.set()
    ck = Checkpointer(tmp_path / "ck", keep_last=None)
    ck.save(0, _state(0, opened))
    while not seen:  # flush 0 has started, alone
        time.sleep(0.01)
    ck.save(1, _state(1, opened))
    done, _ = _in_thread(ck.save, 2, _state(2, opened))  # waits for a buffer set
    time.sleep(0.3)
    gate.set()
    assert done.wait(60)
    ck.close()
    assert len(seen) == 3 and seen[:2] == [True, False]  # (save 2's flush races with close's wait)
    _check_steps(tmp_path / "ck", [0, 1, 2])
    for priority, want in (("background", True), ("normal", False)):
        seen.clear()
        with Checkpointer(tmp_path / priority, policy=SavePolicy(flush_priority=priority)) as ck:
            ck.save(0, _state(0, opened))
            ck.wait()
        assert seen == [want]


def test_policy_values_are_checked():
    for bad in ({"on_busy": "drop"}, {"flush_priority": "high"}, {"host_buffers": 0},
                {"snapshot_threads": 1.5}, {"host_buffers": True}, {"reuse_files": 1}):
        with pytest.raises(OptionError, match=next(iter(bad))):
            SavePolicy(**bad)
    with pytest.raises(ckptbridge.CheckpointError, match="SavePolicy"):
        Checkpointer("unused", policy={"on_busy": "skip"})


@pytest.mark.parametrize("threads", [1, 4])
def test_snapshot_threads_copy_bitwise(tmp_path, threads):
    rng = np.random.default_rng(threads)
    state = {f"t{i}": rng.standard_normal((int(rng.integers(1, 300)), 33)).astype(np.float32) for i in range(9)}
    with Checkpointer(tmp_path / "ck", policy=SavePolicy(snapshot_threads=threads), host_tier=False) as ck:
        ck.save(5, state)
        ck.wait()
        got = ck.restore(5)
    for k, v in state.items():
        assert got[k].tobytes() == v.tobytes()


# ---------------------------------------------------------------- JAX guards


def test_a_guarded_jax_step_waits_only_if_it_donates_an_array_still_being_copied(tmp_path):
    import jax
    import jax.numpy as jnp

    keep = jax.jit(lambda p: p * 2.0)
    donate = jax.jit(lambda p: p * 2.0, donate_argnums=(0,))
    donate_by_name = jax.jit(lambda p: p * 2.0, donate_argnames=("p",))
    w = jnp.arange(64, dtype=jnp.float32)
    other = jnp.ones(64, jnp.float32)
    gate = threading.Event()
    ck = Checkpointer(tmp_path / "ck", keep_last=None)
    guarded = {name: ck.guard(f) for name, f in
               (("keep", keep), ("donate", donate), ("by_name", donate_by_name))}
    ck.save(0, {"w": w, "held": Held(np.zeros(64, np.float32), gate)})  # snapshot held at the gate
    assert guarded["keep"](w)[1] == 2.0  # donates nothing: no wait
    assert guarded["donate"](other)[1] == 2.0  # donates an array that was not saved: no wait
    done, out = _in_thread(lambda: guarded["by_name"](p=w))  # donates w (by name): waits for its copy
    assert not done.wait(0.5)
    gate.set()
    assert done.wait(60) and float(out["value"][1]) == 2.0
    assert w.is_deleted()  # it really was donated
    ck.wait()
    ck.close()
    c = ckptbridge.open(str(tmp_path / "ck" / "step_00000000"))
    np.testing.assert_array_equal(c["w"].read(), np.arange(64, dtype=np.float32))


def test_guard_donates_flag_overrides_what_jit_says(tmp_path):
    import jax
    import jax.numpy as jnp

    keep = jax.jit(lambda p: p + 1.0)
    w = jnp.arange(8, dtype=jnp.float32)
    ck = Checkpointer(tmp_path / "ck", keep_last=None)
    always = ck.guard(keep, donates=True)
    plain = ck.guard(lambda p: keep(p))  # not a jax.jit function: taken to donate everything
    never = ck.guard(keep, donates=False)
    for step, fn in enumerate((always, plain)):
        gate = threading.Event()
        ck.save(step, {"w": w, "held": Held(np.zeros(8, np.float32), gate)})
        done, _ = _in_thread(fn, w)
        assert not done.wait(0.3)
        gate.set()
        assert done.wait(60)
    gate = threading.Event()
    ck.save(2, {"w": w, "held": Held(np.zeros(8, np.float32), gate)})
    assert float(never(w)[0]) == 1.0  # returns while the snapshot is held
    gate.set()
    ck.close()
    assert _committed(tmp_path / "ck") == [0, 1, 2]


def test_an_unguarded_jax_save_frees_its_device_copies_once_they_are_on_the_host(tmp_path):
    """Without a guard, save copies each shard on the device first (a later donation cannot touch
    it); once on the host the copies are released, not kept with the snapshot until the host
    buffers are reused (that would double the state's device memory)."""
    import gc

    import jax
    import jax.numpy as jnp

    params = {"w": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64), "b": jnp.ones(64, jnp.bfloat16)}
    jax.block_until_ready(params)
    gc.collect()
    before = len(jax.live_arrays())
    with Checkpointer(tmp_path / "ck", keep_last=None) as ck:
        ck.save(0, {"params": params})
        ck.wait()
        gc.collect()
        assert len(jax.live_arrays()) == before
        assert ck.restore(0)["params"]["w"].tobytes() == np.asarray(params["w"]).tobytes()


class Staged:
    """A tensor whose transfer to host is started first and finished later (as on a GPU)."""

    def __init__(self, value: np.ndarray, log: list) -> None:
        self.value, self.log = value, log


def _staged_leaves(name, value, capture):
    shape = value.value.shape
    return [Leaf(name, "float32", shape, Box.full(shape),
                 lambda out, v=value: (v.log.append(("copy", name)), np.copyto(out, v.value)),
                 lazy=True, key=id(value), start=lambda v=value: v.log.append(("start", name)))]


# (replaces the provider registered above: one provider per module)
register_leaf_provider(LeafProvider("held-test", (__name__,), leaves=lambda n, v, c: (
    _staged_leaves(n, v, c) if isinstance(v, Staged) else _held_leaves(n, v, c))))


def test_every_transfer_is_started_before_the_first_copy_waits(tmp_path):
    log = []
    state = {f"t{i}": Staged(np.full(16, float(i), np.float32), log) for i in range(5)}
    with Checkpointer(tmp_path / "ck", keep_last=None, policy=SavePolicy(snapshot_threads=1)) as ck:
        ck.save(0, state)
        ck.wait()
        got = ck.restore(0)
    assert [k for k, _ in log] == ["start"] * 5 + ["copy"] * 5
    for i in range(5):
        np.testing.assert_array_equal(got[f"t{i}"], np.full(16, float(i), np.float32))


def test_host_buffer_sets_are_cut_to_what_memory_holds(tmp_path, monkeypatch, caplog):
    """A state whose spare buffer set would not fit in the memory available keeps one set (with a
    warning), so the second save waits for the first flush instead of the machine running out of
    memory (at 8 GiB on a 24 GiB machine the spare set got the process OOM-killed)."""
    from ckptbridge._checkpointer import host
    from ckptbridge._checkpointer.policy import sets_that_fit

    assert sets_that_fit(None, 8 << 30, 2) == 2
    assert sets_that_fit(14 << 30, 8 << 30, 2) == 1 and sets_that_fit(40 << 30, 8 << 30, 2) == 2
    assert sets_that_fit(1 << 20, 8 << 30, 3) == 1  # never fewer than one

    monkeypatch.setattr(host, "available_memory", lambda: 1 << 30)  # just the reserve: no room for a spare
    gate = threading.Event()
    ck = Checkpointer(tmp_path / "ck", keep_last=None, policy=SavePolicy(host_buffers=2))
    with caplog.at_level("WARNING", logger="ckptbridge"):
        ck.save(0, _state(0, gate))
    assert len(ck._buffers) == 1 and "host memory holds 1 set" in caplog.text
    done, _ = _in_thread(ck.save, 1, _state(1, _opened()))
    assert not done.wait(0.5)  # as with host_buffers=1: the one set is busy until the flush ends
    gate.set()
    assert done.wait(60)
    ck.wait()
    _check_steps(tmp_path / "ck", [0, 1])
    ck.close()

    monkeypatch.setattr(host, "available_memory", lambda: 64 << 30)  # negative control: plenty of memory
    ck = Checkpointer(tmp_path / "ck2", keep_last=None, policy=SavePolicy(host_buffers=2))
    ck.save(0, _state(0, _opened()))
    ck.wait()
    assert len(ck._buffers) == 2
    ck.close()
