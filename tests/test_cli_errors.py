"""Errors a user meets on the command line: one line on stderr naming the file and what to do,
exit 2, nothing left behind: write failures, missing extras (named with their pip install),
options that do not apply to the format.

Checkpoints are written by the real libraries (torch.save, Orbax, DeepSpeed and Megatron fixtures);
the CLI runs as a subprocess, as a user runs it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from _common import cli, one_line_error

import ckptbridge

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures")
DS_RUN = os.path.join(FIX, "migration", "ds_zero2_w2", "ckpt")  # real DeepSpeed ZeRO-2, 2 ranks
MEGATRON_A = os.path.join(FIX, "megatron", "A")  # real Megatron-LM runs, same model at TP1PP1 and TP2PP2


# ---------------------------------------------------------------- write failures: one line, exit 2

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


# ---------------------------------------------------------------- missing extras name the extra

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
    # a format's reader or writer is imported on first use: one that fails to import says the same
    r = _without("ckptbridge.adapters.orbax._reader", "inspect", orbax_ckpt)
    one_line_error(r, orbax_ckpt, "'ckptbridge.adapters.orbax._reader'", "pip install 'ckptbridge[jax]'")
    r = _without("ckptbridge.adapters.dcp._writer", "reshard", src, str(tmp_path / "w"), "--to", "dcp")
    one_line_error(r, "'ckptbridge.adapters.dcp._writer'", "pip install 'ckptbridge[torch]'")
    assert not any(os.path.exists(tmp_path / n) for n in ("o", "d", "w"))
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


# ---------------------------------------------------------------- options that do not apply are errors


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
    (None, ("--to", "universal", "-O", "split_fused=true"), ("'torch-save'", "'split_fused'")),
])
def test_options_that_do_not_apply_are_errors(pt, tmp_path, src, args, needles):
    dst = str(tmp_path / "out")
    r = cli("reshard", src or pt[0], dst, *args)
    one_line_error(r, *needles)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("out")]  # nothing written, not even a stage
