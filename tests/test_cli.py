"""The command line as a user runs it (a subprocess; checkpoints written by the real libraries):
the contract other issues rely on (spellings, JSON shapes, exit codes), format detection and
--format, verify and diff on any format, file URLs, progress on a terminal and none on a pipe,
inspect's output, version and help."""

from __future__ import annotations

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
from _common import cli, one_line_error
from safetensors.numpy import load_file

import ckptbridge
from ckptbridge._cli import main

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures")
DS_RUN = os.path.join(FIX, "migration", "ds_zero2_w2", "ckpt")  # real DeepSpeed ZeRO-2, 2 ranks
MEGATRON_A = os.path.join(FIX, "megatron", "A")  # real Megatron-LM runs, same model at TP1PP1 and TP2PP2


def test_inspect_json_contract(pt, capsys):
    path, _ = pt
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "torch-save" and info["step"] == 5
    assert [t["name"] for t in info["tensors"]] == ["embed.weight", "head.weight"]
    t = info["tensors"][1]
    assert t["shape"] == [3, 4] and t["dtype"] == "bfloat16" and t["states"] == ["param"]


def test_inspect_plain_when_piped(pt):
    out = cli("inspect", str(pt[0]))
    assert out.returncode == 0 and "embed.weight\t9x4\tfloat32" in out.stdout


def test_convert_verify_export_diff_reshard(pt, tmp_path):
    path, sd = pt
    u = tmp_path / "u"
    assert cli("convert", str(path), str(u)).returncode == 0
    assert cli("verify", str(u)).returncode == 0
    out = tmp_path / "w.safetensors"
    assert cli("export", str(u), str(out), "--state", "param").returncode == 0
    np.testing.assert_array_equal(load_file(str(out))["embed.weight"], sd["embed.weight"].numpy())
    d = cli("diff", str(path), str(u), "--json")
    assert d.returncode == 0
    rows = json.loads(d.stdout)
    assert all(r["equal"] and r["max_abs_diff"] == 0.0 for r in rows)
    for fmt, dst in (("universal", tmp_path / "r"), ("safetensors", tmp_path / "r.safetensors")):
        r = cli("reshard", str(u), str(dst), "--to", fmt)
        assert r.returncode == 0, r.stderr
        assert all(x.equal for x in ckptbridge.diff(path, dst))


def test_diff_reports_differences_and_missing(tmp_path):
    torch.save({"a": torch.zeros(3), "b": torch.ones(2)}, tmp_path / "x.pt")
    torch.save({"a": torch.tensor([0.0, 0.5, 0.0]), "c": torch.ones(2)}, tmp_path / "y.pt")
    d = cli("diff", str(tmp_path / "x.pt"), str(tmp_path / "y.pt"), "--json")
    assert d.returncode == 1
    rows = {r["name"]: r for r in json.loads(d.stdout)}
    assert rows["a"]["max_abs_diff"] == 0.5 and not rows["b"]["in_b"] and not rows["c"]["in_a"]


def test_verify_fails_and_names_the_tensor(pt, tmp_path):
    u = tmp_path / "u"
    ckptbridge.convert(pt[0], u)
    f = next((u / "data").iterdir())
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(raw)
    r = cli("verify", str(u))
    assert r.returncode == 1 and "checksum" in r.stderr and "'head.weight'" in r.stderr


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path):
    (tmp_path / "junk.bin").write_bytes(b"hello")
    r = cli("inspect", str(tmp_path / "junk.bin"))
    assert r.returncode == 2 and "junk.bin" in r.stderr and "Traceback" not in r.stderr
    r = cli("reshard", str(tmp_path / "junk.bin"), str(tmp_path / "o"), "--to", "nonsense")
    assert r.returncode == 2 and "Traceback" not in r.stderr


# ---------------------------------------------------------------- detection override, file extension


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


# ---------------------------------------------------------------- reshard --to orbax, then diff


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


# ---------------------------------------------------------------- verify on any format


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


# ---------------------------------------------------------------- diff: exit codes, pipes, tolerances


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


# ---------------------------------------------------------------- URLs


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


# ---------------------------------------------------------------- progress on a terminal, none on a pipe


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


# ---------------------------------------------------------------- inspect


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


# ---------------------------------------------------------------- version, entry points, help


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
