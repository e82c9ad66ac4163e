"""The user surface never lies (issue #14, "What a new user hit"): one test or more per item.

Checkpoints are written by the real libraries (torch.save, safetensors, DeepSpeed and
Megatron fixtures); the CLI runs as a subprocess, as a user runs it.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import ckptbridge
from ckptbridge import Checkpointer

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures")
DS_RUN = os.path.join(FIX, "migration", "ds_zero2_w2", "ckpt")  # real DeepSpeed ZeRO-2, 2 ranks
MEGATRON_A = os.path.join(FIX, "megatron", "A")  # real Megatron-LM runs, same model at TP1PP1 and TP2PP2


def cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """``python -m ckptbridge ARGS`` with stdout and stderr captured (so both are pipes)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **kwargs.pop("env", {})}
    return subprocess.run([sys.executable, "-m", "ckptbridge", *args], capture_output=True, text=True,
                          env=env, **kwargs)


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, one line on stderr, no traceback, naming every needle."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(32, 8, generator=g)).pow(2).mean().backward()
        opt.step()


# ---------------------------------------------------------------- 1. Checkpointer.restore / restore_into

Adam = collections.namedtuple("Adam", ["count", "mu"])


@pytest.mark.parametrize("host_tier", [True, False], ids=["host-tier", "disk"])
def test_restore_returns_the_tree_that_was_saved(tmp_path, host_tier):
    state = {
        "model": {"0.weight": np.arange(6, dtype=np.float32).reshape(2, 3)},  # a key with a dot in it
        "opt": {"state": {0: {"step": np.float32(3)}, 1: Adam(np.int64(2), np.ones(2))}},  # int keys
        "sched": [1e-3, (0.9, 0.999)],
        "name": "run-1",
        "empty": {},
    }
    with Checkpointer(tmp_path / "ck", host_tier=host_tier) as ck:
        ck.save(5, state)
        ck.wait()
        got = ck.restore()
        flat = ck.restore(5, flat=True)
    assert list(got) == list(state)
    np.testing.assert_array_equal(got["model"]["0.weight"], state["model"]["0.weight"])
    assert list(got["model"]) == ["0.weight"]  # not split at the dot
    assert list(got["opt"]["state"]) == [0, 1]  # int keys stay ints
    assert got["opt"]["state"][0]["step"] == 3.0
    adam = got["opt"]["state"][1]
    assert type(adam).__name__ == "Adam" and adam._fields == ("count", "mu") and adam.count == 2
    np.testing.assert_array_equal(adam.mu, np.ones(2))
    assert got["sched"] == [1e-3, (0.9, 0.999)] and isinstance(got["sched"][1], tuple)
    assert got["name"] == "run-1" and got["empty"] == {}
    # the flat view keeps the dotted names
    assert "model.0.weight" in flat and "opt.state.1.mu" in flat and flat["sched.1.0"] == 0.9


def test_restore_into_is_strict_and_lists_missing_and_unexpected(tmp_path):
    src = _model(0)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": src.state_dict()})
        ck.wait()
        dst = _model(1)
        before = [p.detach().clone() for p in dst.parameters()]
        with pytest.raises(ckptbridge.TensorNotFoundError) as err:
            ck.restore_into({"net": dst.state_dict()})  # saved under another name
        text = str(err.value)
        assert "missing" in text and "'net.0.weight'" in text
        assert "unexpected" in text and "'model.0.weight'" in text and "strict=False" in text
        assert all(torch.equal(a, b) for a, b in zip(before, dst.parameters()))  # nothing copied
        # strict=False restores what both have and says what it did not
        sd = dst.state_dict()
        missing, unexpected = ck.restore_into({"model": sd, "extra": np.zeros(3)}, strict=False)
        assert missing == ["extra"] and unexpected == []
        assert all(torch.equal(a, b) for a, b in zip(src.parameters(), dst.parameters()))
        result = ck.restore_into({"model": dst})  # an nn.Module stands for its state dict
        assert result.step == 1 and result.missing_keys == () and result.unexpected_keys == ()


def test_restore_into_checks_shapes_before_copying(tmp_path):
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"a": np.ones(4, np.float32), "b": np.ones((2, 2), np.float32)})
        ck.wait()
        a, b = np.zeros(4, np.float32), np.zeros((4, 1), np.float32)
        with pytest.raises(ckptbridge.ShapeMismatchError, match=r"'b'.*\(2, 2\).*\(4, 1\)"):
            ck.restore_into({"a": a, "b": b})
        assert not a.any()  # checked before anything was copied


def test_restore_into_a_fresh_optimizer_continues_the_run_exactly(tmp_path):
    """A new model and a new AdamW (no state yet) restored from a step continue bitwise like the
    original run; dropping the optimizer state (the old silent behaviour) does not."""
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    _train(model, opt, 3, seed=1)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(3, {"model": model, "optim": opt}, optimizer=opt)  # objects stand for their state dicts
        ck.wait()
        saved = ck.restore()
        assert set(saved["optim"]) == {"state", "param_groups"} and set(saved["optim"]["state"]) == {0, 1, 2, 3}

        fresh = _model(7)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)  # other lr/betas: the saved ones win
        assert not fresh_opt.state
        result = ck.restore_into({"model": fresh, "optim": fresh_opt})
        assert result.step == 3 and not result.missing_keys and not result.unexpected_keys
        group = fresh_opt.param_groups[0]
        assert group["lr"] == 1e-2 and group["betas"] == (0.8, 0.95) and group["weight_decay"] == 0.1
        for p, q in zip(model.parameters(), fresh.parameters()):
            assert torch.equal(p, q)
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.state[p][k], fresh_opt.state[q][k]), k

        _train(model, opt, 2, seed=2)
        _train(fresh, fresh_opt, 2, seed=2)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))

        # negative control: weights only, fresh Adam state -> a different run
        control = _model(7)
        control_opt = torch.optim.AdamW(control.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
        ck.restore_into({"model": control}, step=3, strict=False)
        _train(control, control_opt, 2, seed=2)
        model2 = _model(0)
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
        ck.restore_into({"model": model2, "optim": opt2}, step=3)
        _train(model2, opt2, 2, seed=2)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
        assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), control.parameters()))


def test_restore_into_refuses_what_it_cannot_fill(tmp_path):
    """JAX arrays are immutable: restore_into says so (naming them) instead of skipping them."""
    import jax.numpy as jnp

    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"w": np.ones(3, np.float32)})
        ck.wait()
        with pytest.raises(ckptbridge.CheckpointError, match=r"'w'.*cannot be filled in place"):
            ck.restore_into({"w": jnp.zeros(3)})
        np.testing.assert_array_equal(ck.restore()["w"], np.ones(3))


# ---------------------------------------------------------------- a small real checkpoint


@pytest.fixture()
def pt(tmp_path):
    """A torch.save file (fp32 and bf16 tensors, a step) and its state dict."""
    torch.manual_seed(0)
    sd = {"embed.weight": torch.randn(9, 4), "head.weight": torch.randn(3, 4).bfloat16(), "iteration": 5}
    path = tmp_path / "m.pt"
    torch.save(sd, path)
    return str(path), sd


# ---------------------------------------------------------------- 2. write failures: one line, exit 2

FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10


def _set_immutable(path: str, on: bool) -> bool:
    """chattr +i / -i (root cannot write into an immutable directory); False where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        buf = bytearray(4)
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf)
        flags = int.from_bytes(buf, "little")
        flags = flags | FS_IMMUTABLE_FL if on else flags & ~FS_IMMUTABLE_FL
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags.to_bytes(4, "little"))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _writable(path: str) -> bool:
    probe = os.path.join(path, ".probe")
    try:
        with open(probe, "w"):
            pass
    except OSError:
        return False
    os.remove(probe)
    return True


@contextlib.contextmanager
def read_only_dir(path):
    """A directory nobody can create files in, as this process really is: mode 0555 for a normal
    user; for root (whom modes do not stop) the immutable attribute. Where neither holds (root
    without CAP_LINUX_IMMUTABLE), a path whose parent is a regular file, which fails for anyone."""
    os.makedirs(path)
    os.chmod(path, 0o555)
    immutable = False
    if _writable(path):
        immutable = _set_immutable(path, True)
    try:
        if _writable(path):  # neither worked: a destination below a file cannot be written either
            blocker = os.path.join(path, "file")
            open(blocker, "w").close()
            yield blocker
        else:
            yield path
    finally:
        if immutable:
            _set_immutable(path, False)
        os.chmod(path, 0o755)


@pytest.mark.parametrize("command", [
    ("convert",), ("export",), ("reshard", "--to", "universal"), ("reshard", "--to", "safetensors"),
])
def test_write_failures_are_one_line_exit_2(pt, tmp_path, command):
    src = pt[0]
    name, *more = command
    suffix = ".safetensors" if name == "export" else ""
    with read_only_dir(str(tmp_path / "ro")) as ro:
        for dst in (f"{ro}/out{suffix}", f"/proc/ckptbridge-test/out{suffix}"):
            r = cli(name, src, dst, *more)
            one_line_error(r, dst, "cannot write")
            assert not os.path.exists(dst)
        assert [n for n in os.listdir(tmp_path / "ro") if n != "file"] == []  # no staging left behind


def test_a_source_error_during_a_write_still_names_the_source(pt, tmp_path):
    src = tmp_path / "ds"
    shutil.copytree(DS_RUN, src)
    os.remove(src / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    r = cli("convert", str(src), str(tmp_path / "out"))
    one_line_error(r, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert "cannot write" not in r.stderr


# ---------------------------------------------------------------- 3. missing extras name the extra

def _without(module: str, *argv: str, code: str | None = None) -> subprocess.CompletedProcess:
    """Run the CLI (or ``code``) in a fresh interpreter where ``module`` cannot be imported."""
    body = code or f"from ckptbridge._cli import main; raise SystemExit(main({list(argv)!r}))"
    prog = f"import sys; sys.modules[{module!r}] = None\n{body}"
    return subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def orbax_ckpt(tmp_path_factory):
    """A real Orbax StandardCheckpointer checkpoint."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    path = str(tmp_path_factory.mktemp("orbax") / "ckpt")
    with ocp.StandardCheckpointer() as ck:
        ck.save(path, {"params": {"w": jnp.arange(12.0).reshape(3, 4)}, "step": 7})
    return path


def test_missing_extras_name_the_pip_install(pt, tmp_path, orbax_ckpt):
    src = pt[0]
    for command in ("inspect", "verify"):  # a missing extra is bad input (2), not a failed check (1)
        r = _without("tensorstore", command, orbax_ckpt)
        one_line_error(r, orbax_ckpt, "tensorstore", "pip install 'ckptbridge[jax]'")
    r = _without("tensorstore", "reshard", src, str(tmp_path / "o"), "--to", "orbax")
    one_line_error(r, "tensorstore", "pip install 'ckptbridge[jax]'")
    r = _without("torch", "reshard", src, str(tmp_path / "d"), "--to", "dcp")
    one_line_error(r, "writing DCP checkpoints", "pip install 'ckptbridge[torch]'")
    assert not any(os.path.exists(tmp_path / n) for n in ("o", "d"))
    # Megatron's rank files are written without torch (ckptbridge's own torch.save-compatible writer)
    mega = os.path.join(MEGATRON_A, "tp1pp1", "torch")
    r = _without("torch", "reshard", mega, str(tmp_path / "m"), "--to", "megatron", "--tp", "2")
    assert r.returncode == 0, r.stderr
    a, b = ckptbridge.open(mega), ckptbridge.open(str(tmp_path / "m"))
    assert a.keys() == b.keys() and all(np.array_equal(a[n].read(), b[n].read()) for n in a)
    # reading needs no torch at all
    r = _without("torch", "inspect", src)
    assert r.returncode == 0 and "embed.weight" in r.stdout, r.stderr
    # a persistent level at a URL needs fsspec: said when the Checkpointer is made, not in a thread
    r = _without("fsspec", code=(
        "import ckptbridge\n"
        "try:\n"
        f"    ckptbridge.Checkpointer({str(tmp_path / 'ck')!r}, persistent='s3://bucket/run')\n"
        "except ckptbridge.MissingExtraError as err:\n"
        "    print(err)\n"))
    assert r.returncode == 0 and "pip install 'ckptbridge[remote]'" in r.stdout, r.stdout + r.stderr


def _extras() -> dict[str, list[str]]:
    """The installed package's extras: extra -> its requirements (what ``pip install`` reads)."""
    from importlib.metadata import requires

    out: dict[str, list[str]] = {}
    for req in requires("ckptbridge") or []:
        m = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", req)
        if m:
            out.setdefault(m.group(1), []).append(req.split(";")[0].strip())
    return out


def test_remote_extra_is_declared():
    assert any(d.startswith("fsspec") for d in _extras()["remote"])


# ---------------------------------------------------------------- 4. detection override, file extension


def test_reshard_adds_the_extension_and_format_overrides_detection(pt, tmp_path):
    src, sd = pt
    r = cli("reshard", src, str(tmp_path / "x"), "--to", "safetensors")
    assert r.returncode == 0, r.stderr
    assert os.path.exists(tmp_path / "x.safetensors") and not os.path.exists(tmp_path / "x")
    r = cli("inspect", str(tmp_path / "x.safetensors"))
    assert r.returncode == 0 and "embed.weight\t9x4" in r.stdout
    # a file named without its extension: detection cannot tell, --format can
    os.rename(tmp_path / "x.safetensors", tmp_path / "weights")
    r = cli("inspect", str(tmp_path / "weights"))
    one_line_error(r, "weights", "not a checkpoint", "--format")
    r = cli("inspect", str(tmp_path / "weights"), "--format", "safetensors")
    assert r.returncode == 0 and "embed.weight\t9x4" in r.stdout, r.stderr
    ckpt = ckptbridge.open(tmp_path / "weights", format="safetensors")
    np.testing.assert_array_equal(ckpt["embed.weight"].read(), sd["embed.weight"].numpy())
    r = cli("inspect", str(tmp_path / "weights"), "--format", "nonsense")
    one_line_error(r, "nonsense", "known:")


# ---------------------------------------------------------------- 5. reshard --to orbax, then diff


def test_reshard_to_orbax_then_diff_is_clean(tmp_path):
    dst = str(tmp_path / "orbax")
    r = cli("reshard", DS_RUN, dst, "--to", "orbax")
    assert r.returncode == 0, r.stderr
    d = cli("diff", DS_RUN, dst, "--json")
    rows = json.loads(d.stdout)
    assert d.returncode == 0 and rows and all(row["equal"] for row in rows), [r for r in rows if not r["equal"]]
    assert "step" not in {row["name"] for row in rows}
    assert ckptbridge.open(dst).step == ckptbridge.open(DS_RUN).step == 4  # the step is the checkpoint's
    assert "step" in ckptbridge.open(dst, layout="raw")  # Orbax's own tree still has it


# ---------------------------------------------------------------- 6. options that do not apply are errors


@pytest.mark.parametrize("src, args, needles", [
    (os.path.join(MEGATRON_A, "tp1pp1", "torch"), ("--to", "universal", "--tp", "8", "--pp", "3"),
     ("'universal'", "'pp'", "'tp'")),
    (None, ("--to", "universal", "-o", "bogus=1"), ("'universal'", "'bogus'")),
    (os.path.join(MEGATRON_A, "tp1pp1", "torch"), ("--to", "megatron", "--zero-stage", "7"),
     ("'megatron'", "'zero_stage'")),
    (DS_RUN, ("--to", "deepspeed-universal", "--tp", "4"), ("'deepspeed-universal'", "'tp'")),
    (None, ("--to", "megatron", "--tp", "0"), ("'megatron'", "tp must be >= 1")),
    (None, ("--to", "dcp", "-o", "world_size=two"), ("'dcp'", "'world_size'", "integer")),
    (None, ("--to", "universal", "-o", "foo"), ("-o expects key=value", "'foo'")),
    (None, ("--to", "universal", "-O", "split_fused"), ("-O expects key=value",)),
    (None, ("--to", "universal", "-O", "split_fused=true"), ("'torch'", "'split_fused'")),
])
def test_options_that_do_not_apply_are_errors(pt, tmp_path, src, args, needles):
    dst = str(tmp_path / "out")
    r = cli("reshard", src or pt[0], dst, *args)
    one_line_error(r, *needles)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("out")]  # nothing written, not even a stage


# ---------------------------------------------------------------- 7. verify on any format


def test_verify_deepspeed_and_safetensors(pt, tmp_path):
    r = cli("verify", DS_RUN)
    assert r.returncode == 0 and r.stdout.startswith("ok ") and "deepspeed" in r.stdout, r.stderr
    broken = tmp_path / "ds"
    shutil.copytree(DS_RUN, broken)
    os.remove(broken / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    r = cli("verify", str(broken))
    assert r.returncode == 1 and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "never finished" not in r.stderr

    from safetensors.torch import save_file

    shards = tmp_path / "hf"
    shards.mkdir()
    save_file({"a": torch.randn(64, 8)}, shards / "model-00001-of-00002.safetensors")
    save_file({"b": torch.randn(32)}, shards / "model-00002-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (shards / "model.safetensors.index.json").write_text(json.dumps(index))
    for path in (shards, shards / "model-00001-of-00002.safetensors"):
        r = cli("verify", str(path))
        assert r.returncode == 0 and "safetensors" in r.stdout, r.stderr
    one = shards / "model-00001-of-00002.safetensors"
    whole = one.read_bytes()
    one.write_bytes(whole[:-100])  # cut off: a copy that did not finish
    r = cli("verify", str(shards))
    assert r.returncode == 1 and "model-00001-of-00002.safetensors" in r.stderr and "'a'" in r.stderr
    one.write_bytes(whole)
    os.remove(shards / "model-00002-of-00002.safetensors")
    r = cli("verify", str(shards))
    assert r.returncode == 1 and "model-00002-of-00002.safetensors" in r.stderr, r.stderr


# ---------------------------------------------------------------- 8. diff: exit codes, pipes, tolerances


def test_diff_state_that_nobody_has_is_exit_2(pt):
    r = cli("diff", pt[0], pt[0], "--state", "bogus")
    one_line_error(r, "'bogus'")
    with pytest.raises(ckptbridge.TensorNotFoundError, match="bogus"):
        ckptbridge.diff(pt[0], pt[0], state="bogus")


@pytest.mark.parametrize("same", [True, False])
def test_diff_keeps_its_status_when_the_pipe_closes(pt, tmp_path, same):
    sd = pt[1]
    other = tmp_path / "other.pt"
    many = {f"t{i:04d}": torch.zeros(2) for i in range(3000)}  # enough rows to fill the pipe
    torch.save({**many, **sd}, tmp_path / "a.pt")
    torch.save({**many, **sd, **({} if same else {"embed.weight": sd["embed.weight"] + 1})}, other)
    shell = f"{sys.executable} -m ckptbridge diff {tmp_path / 'a.pt'} {other} | head -c 10 >/dev/null; " \
            "echo ${PIPESTATUS[0]}"
    r = subprocess.run(["bash", "-c", shell], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.stdout.strip() == ("0" if same else "1") and "Traceback" not in r.stderr, r.stderr
    assert "BrokenPipe" not in r.stderr


def test_diff_tolerances_megatron_tp2pp2_vs_tp1pp1(tmp_path):
    a, b = os.path.join(MEGATRON_A, "tp1pp1", "torch"), os.path.join(MEGATRON_A, "tp2pp2", "torch")
    r = cli("diff", a, b, "--json")
    rows = json.loads(r.stdout)
    worst = max(row["max_abs_diff"] for row in rows)
    assert r.returncode == 1 and 0 < worst < 1e-6  # float reduction order differs across layouts
    assert cli("diff", a, b, "--atol", "1e-6").returncode == 0
    assert cli("diff", a, b, "--atol", "1e-9").returncode == 1
    one_line_error(cli("diff", a, b, "--atol", "x"), "--atol")  # argparse: exit 2 too
    x = torch.linspace(1, 100, 50)
    torch.save({"x": x}, tmp_path / "x.pt")
    torch.save({"x": x * (1 + 1e-4)}, tmp_path / "y.pt")
    assert cli("diff", str(tmp_path / "x.pt"), str(tmp_path / "y.pt"), "--rtol", "1e-3").returncode == 0
    assert cli("diff", str(tmp_path / "x.pt"), str(tmp_path / "y.pt"), "--rtol", "1e-5").returncode == 1


# ---------------------------------------------------------------- 9. URLs


def test_file_urls_open_and_unknown_schemes_say_so(pt, tmp_path):
    src, sd = pt
    url = "file://" + os.path.abspath(src)
    ckpt = ckptbridge.open(url)
    np.testing.assert_array_equal(ckpt["embed.weight"].read(), sd["embed.weight"].numpy())
    from pathlib import Path

    spaced = tmp_path / "a dir" / "m.pt"
    spaced.parent.mkdir()
    shutil.copy(src, spaced)
    assert ckptbridge.open(spaced.as_uri()).step == 5  # percent-escaped, as Path.as_uri() writes it
    assert Path(ckptbridge.open(spaced.as_uri()).path) == spaced
    r = cli("inspect", url)
    assert r.returncode == 0 and "embed.weight" in r.stdout
    r = cli("convert", url, "file://" + str(tmp_path / "u"))
    assert r.returncode == 0 and ckptbridge.verify(str(tmp_path / "u")) == []
    # gs://, s3://, hf:// go through fsspec (tests/test_remote.py, against real servers); a scheme
    # no file system serves is one line naming it, and never a local folder called "nosuch:"
    remote = "nosuch://bucket/ckpt"
    with pytest.raises(ckptbridge.CheckpointError, match="nosuch") as err:
        ckptbridge.open(remote)
    assert "no such file" not in str(err.value)
    one_line_error(cli("inspect", remote), "nosuch://", "Protocol not known")
    one_line_error(cli("convert", src, remote), "nosuch://", "Protocol not known")
    assert not os.path.exists("nosuch:")


# ---------------------------------------------------------------- 10. whole pickled objects, legacy files


def test_a_pickled_module_is_a_clear_error(tmp_path):
    model = _model()
    torch.save(model, tmp_path / "model.pt")
    with pytest.raises(ckptbridge.FormatError, match=r"pickled torch\.nn\..*Sequential object.*state_dict"):
        ckptbridge.open(tmp_path / "model.pt")
    torch.save({"model": model, "step": 3}, tmp_path / "wrapped.pt")
    one_line_error(cli("inspect", str(tmp_path / "wrapped.pt")), "wrapped.pt", "'model'", "state_dict()")
    torch.save({"model": model.state_dict(), "step": 3}, tmp_path / "ok.pt")  # the fix it suggests
    assert len(ckptbridge.open(tmp_path / "ok.pt")) == 4


def test_legacy_torch_save_files_are_read_safely(tmp_path):
    sd = {"a": torch.randn(4, 3), "b": torch.arange(10), "c": torch.randn(6).bfloat16(),
          "t": torch.randn(4, 6).t(), "view": torch.arange(20.0)[5:9], "nested": {"x": torch.ones(2)},
          "iteration": 9}
    path = tmp_path / "legacy.pt"
    torch.save(sd, path, _use_new_zipfile_serialization=False)
    assert path.read_bytes()[:2] != b"PK"  # really the legacy layout
    ckpt = ckptbridge.open(path)
    assert ckpt.format == "torch-save" and ckpt.step == 9
    ref = torch.load(path)
    for name in ("a", "b", "c", "t", "view"):
        assert ckpt[name].read().tobytes() == ref[name].contiguous().view(torch.uint8).numpy().tobytes(), name
    np.testing.assert_array_equal(ckpt["nested.x"].read(), np.ones(2, np.float32))
    # truncated copies and code in the pickle are refused, naming the file
    cut = tmp_path / "cut.pt"
    cut.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ckptbridge.TruncatedError, match="cut.pt"):
        ckptbridge.open(cut)

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"w": torch.ones(2), "x": Payload()}, tmp_path / "evil.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(ckptbridge.UnsafePickleError, match="evil.pt"):
        ckptbridge.open(tmp_path / "evil.pt")
    assert not os.path.exists(tmp_path / "pwned")


def test_open_with_rules(pt):
    ckpt = ckptbridge.open(pt[0], rules=[ckptbridge.Rename(r"^embed\.", "wte.")])
    assert "wte.weight" in ckpt and "embed.weight" not in ckpt
    np.testing.assert_array_equal(ckpt["wte.weight"].read(), pt[1]["embed.weight"].numpy())


# ---------------------------------------------------------------- 11. progress on a terminal, none on a pipe


def run_in_pty(*args: str, timeout: float = 300) -> tuple[int, str]:
    """Run ``python -m ckptbridge ARGS`` with stdout and stderr on a pseudo-terminal."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ckptbridge", *args], stdin=slave, stdout=slave, stderr=slave,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120", "TERM": "xterm"},
                            close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], timeout)
        if not ready:
            proc.kill()
            raise AssertionError(f"{args}: no output for {timeout}s")
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(), b"".join(chunks).decode("utf-8", "replace")


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A 32 MiB torch file and its universal copy."""
    root = tmp_path_factory.mktemp("big")
    torch.manual_seed(0)
    torch.save({"w": torch.randn(2048, 4096), "b": torch.randn(4096)}, root / "big.pt")
    ckptbridge.convert(str(root / "big.pt"), str(root / "u"))
    return root


@pytest.mark.parametrize("command, label", [
    ("convert {pt} {out}", "converting"),
    ("export {pt} {out}.safetensors", "exporting"),
    ("verify {u}", "verifying"),
    ("verify {pt}", "verifying"),
    ("diff {pt} {u}", "comparing"),
    ("reshard {u} {out} --to safetensors", "writing safetensors"),
])
def test_progress_on_a_terminal_and_nothing_on_a_pipe(big, tmp_path, command, label):
    def argv(out):
        return command.format(pt=big / "big.pt", u=big / "u", out=out).split()

    total = "67.1" if command.startswith("diff") else "33.6"  # MB: both sides for diff
    rc, text = run_in_pty(*argv(tmp_path / "tty"))
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    assert rc == 0, text
    assert f"{label} " in plain and f"0.0/{total} MB" in plain, plain[-2000:]
    assert f"{total}/{total} MB" in plain  # the bar follows the bytes read, to the end
    r = cli(*argv(tmp_path / "pipe"))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert label not in r.stdout and "\x1b" not in r.stdout and "MB" not in r.stdout


@pytest.mark.heavy
def test_export_streams(tmp_path):
    """export writes through the chunked pipeline convert uses: its peak memory above the opened
    checkpoint stays well below the input (it held every tensor whole before: ~2x the input)."""
    src = tmp_path / "big.pt"
    torch.manual_seed(0)
    torch.save({"w": torch.randn(8192, 8192), "b": torch.randn(1000)}, src)  # 256 MiB, one big tensor
    size = os.path.getsize(src)
    probe = r"""
import sys, ckptbridge
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
ckpt = ckptbridge.open(sys.argv[1])
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as fh:  # peak RSS counts from here
    fh.write("5")
ckptbridge.export(ckpt, sys.argv[2], dtype=sys.argv[3] or None)
print(status("VmHWM") - base)
"""
    for dtype, bound in (("", 0.5), ("bfloat16", 0.75)):
        out = tmp_path / f"out{dtype}.safetensors"
        r = subprocess.run([sys.executable, "-c", probe, str(src), str(out), dtype], capture_output=True,
                           text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr
        peak = int(r.stdout.strip())
        assert peak < bound * size, (dtype, peak / size)
        from safetensors import safe_open

        with safe_open(str(out), "np") as fh:
            assert fh.get_slice("w").get_shape() == [8192, 8192]
            ref = torch.load(src)["w"][:3]
            got = fh.get_slice("w")[:3]
            want = ref.numpy() if not dtype else ref.bfloat16().float().numpy()
            np.testing.assert_array_equal(got.astype(np.float32), want)
        os.remove(out)


# ---------------------------------------------------------------- 12. inspect


def test_inspect_piped_is_clean_tsv_with_the_model_dtype():
    src = os.path.join(FIX, "megatron", "Abf16", "tp2pp1", "torch")  # bf16 run: bf16 params, fp32 master
    r = cli("inspect", src)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "name\tshape\tdtype\tstates\tfragments"
    assert all(line.count("\t") == 4 for line in lines) and "rules" not in r.stdout  # no title, no rules block
    rows = {line.split("\t")[0]: line.split("\t") for line in lines[1:]}
    dtype, states = rows["embedding.word_embeddings.weight"][2:4]
    assert dtype == "bfloat16"  # what the model holds, not the fp32 master
    assert "param:bfloat16" in states and "fp32:float32" in states and "exp_avg:float32" in states
    info = json.loads(cli("inspect", src, "--json").stdout)
    t = next(t for t in info["tensors"] if t["name"] == "embedding.word_embeddings.weight")
    assert t["dtype"] == "bfloat16" and t["state_dtypes"]["fp32"] == "float32" and info["rules"]
    r = cli("inspect", src, "--fragments")
    lines = r.stdout.splitlines()
    assert lines[0] == "name\tstate\tbox\tlocation" and all(line.count("\t") == 3 for line in lines)
    rc, text = run_in_pty("inspect", src)
    assert rc == 0 and "rules" in text and "format=megatron" in text  # the terminal gets the rich view


# ---------------------------------------------------------------- 13. version, entry points, help


def test_version_module_entry_and_help_on_every_argument():
    from ckptbridge._cli import build_parser

    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"ckptbridge {ckptbridge.__version__}"
    exe = shutil.which("ckptbridge", path=os.path.dirname(sys.executable))
    assert exe and subprocess.run([exe, "--version"], capture_output=True, text=True).stdout == r.stdout
    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and "inspect" in a.choices)
    for name, cmd in sub.choices.items():
        assert cmd.description, name
        for action in cmd._actions:
            if action.dest != "help":
                assert action.help, (name, action.dest)
    to = next(a for a in sub.choices["reshard"]._actions if a.dest == "to")
    assert set(to.choices) >= {"universal", "safetensors", "dcp", "orbax", "megatron", "deepspeed-universal"}
    r = cli("reshard", "--help")
    assert r.returncode == 0 and "deepspeed-universal" in r.stdout and "write options per format" in r.stdout
    r = cli("reshard", "a", "b", "--to", "nonsense")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_license_readme_install_section_and_public_imports_only():
    root = os.path.join(HERE, "..")
    with open(os.path.join(root, "LICENSE")) as fh:
        assert "Apache License" in fh.read(200) or "Apache License" in fh.read()
    with open(os.path.join(root, "README.md")) as fh:
        readme = fh.read()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    for extra in ("torch", "jax", "deepspeed", "megatron", "remote"):
        assert f"ckptbridge[{extra}]" in install, extra
    for cmd in ("formats", "--format", "-O", "--rules", "--version", "python -m ckptbridge"):
        assert cmd in readme, cmd
    private = re.compile(r"(from|import)\s+ckptbridge[\w.]*\._|ckptbridge\._")
    for f in sorted(os.listdir(os.path.join(root, "notebooks"))):
        if f.endswith(".ipynb"):
            with open(os.path.join(root, "notebooks", f)) as fh:
                cells = json.load(fh)["cells"]
            code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
            assert "ckptbridge" in code and not private.search(code), f


# ---------------------------------------------------------------- 14. extras give ranges; CI pins them


def test_extras_are_ranges_and_ci_pins_them_in_a_constraints_file():
    root = os.path.join(HERE, "..")
    extras = _extras()
    for name in ("torch", "deepspeed", "megatron"):
        for req in extras[name]:
            assert "==" not in req, (name, req)
    assert any(r.startswith("torch>=") for r in extras["torch"])
    with open(os.path.join(root, "constraints.txt")) as fh:
        pins = {line.split("==")[0].strip(): line.split("==")[1].strip()
                for line in fh if "==" in line and not line.lstrip().startswith("#")}
    assert pins["torch"] == "2.13.0" and pins["deepspeed"] == "0.19.8" and pins["megatron-core"] == "0.16.1"
    with open(os.path.join(root, "Makefile")) as fh:
        make = fh.read()
    installs = [line for line in make.splitlines() if "pip install" in line and "-e" in line]
    assert installs and all("-c constraints.txt" in line for line in installs), installs
    from importlib.metadata import version

    assert version("torch").split("+")[0] == pins["torch"]


# ---------------------------------------------------------------- the README's plug-in example, run


def _readme_blocks(section: str) -> list[tuple[str, str]]:
    with open(os.path.join(HERE, "..", "README.md")) as fh:
        text = fh.read().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", text, re.S)


def test_the_readme_format_plugin_works_through_its_entry_point(tmp_path):
    """The README's .npy plug-in, installed the way a package installs it (an entry point in
    its distribution's metadata), then used by the CLI and the API on files numpy wrote."""
    blocks = dict(_readme_blocks("Writing a format plug-in"))
    site = tmp_path / "site"
    (site / "ckpt_npy-0.1.dist-info").mkdir(parents=True)
    (site / "ckpt_npy.py").write_text(blocks["python"])
    (site / "ckpt_npy-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: ckpt-npy\nVersion: 0.1\n")
    toml = blocks["toml"]
    group = re.search(r'entry-points\."([^"]+)"', toml).group(1)
    name, target = re.search(r'^(\w+)\s*=\s*"([^"]+)"', toml, re.M).groups()
    (site / "ckpt_npy-0.1.dist-info" / "entry_points.txt").write_text(f"[{group}]\n{name} = {target}\n")
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    np.save(tmp_path / "w.npy", w)
    np.save(tmp_path / "b16.npy", np.arange(8, dtype=np.int16))
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}

    r = cli("formats", "--json", env=env)
    fmt = next(f for f in json.loads(r.stdout) if f["name"] == "npy")
    assert fmt["read"] and not fmt["write"] and fmt["open_options"][0]["name"] == "name"
    r = cli("inspect", str(tmp_path / "w.npy"), env=env)
    assert r.returncode == 0 and r.stdout.splitlines()[1] == "w\t4x6\tfloat32\tfp32:float32\t1", r.stderr
    out = tmp_path / "u"
    r = cli("convert", str(tmp_path / "w.npy"), str(out), "-O", "name=wte.weight", env=env)
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(ckptbridge.open(out)["wte.weight"].read(), w)
    assert cli("diff", str(tmp_path / "w.npy"), str(out), "--rules-b", _rename_rules(tmp_path),
               env=env).returncode == 0
    one_line_error(cli("inspect", str(tmp_path / "w.npy"), "-O", "bogus=1", env=env), "'npy'", "'bogus'")
    r = cli("inspect", str(tmp_path / "b16.npy"), "--json", env=env)
    assert json.loads(r.stdout)["tensors"][0]["dtype"] == "int16"
    # registered at run time instead (no entry point: the module alone on the path)
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy(site / "ckpt_npy.py", plain / "ckpt_npy.py")
    code = ("import sys, ckpt_npy, ckptbridge\n"
            "from ckptbridge.plugin import register_format\n"
            "register_format(ckpt_npy.FORMAT)\n"
            "ckpt = ckptbridge.open(sys.argv[1])\n"
            "print(ckpt.format, ckpt['w'][1:3, 2:5].tolist())\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "w.npy")], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(plain)})
    assert r.returncode == 0 and r.stdout.split(" ", 1) == ["npy", f"{w[1:3, 2:5].tolist()}\n"], r.stderr


def _rename_rules(tmp_path) -> str:
    path = tmp_path / "rules.json"
    path.write_text(json.dumps(ckptbridge.rules_to_json([ckptbridge.Rename(r"^wte\.weight$", "w")])))
    return str(path)
