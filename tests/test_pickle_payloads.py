"""A pickle payload in *every* pickle file a reader opens never runs (issue #18).

tests/test_no_code_execution.py injects a payload into one file of a few formats. Here every
pickle file of real checkpoints is injected, one at a time, and the checkpoint is then opened
and read whole (every state of every tensor, ``extra``): ckptbridge must raise
:class:`ckptbridge.UnsafePickleError` naming ``os.system``, and the payload must not have run.
A file the reader never opened would fail the test (no error), so the lists below are also the
lists of files each reader opens. Covered:

* DeepSpeed: ZeRO-1/2/3 model and optimizer states, BF16_Optimizer, pipeline ``layer_XX`` and 3D
  ``layer_XX-model_YY`` files, and every ``.pt`` of ``ds_to_universal``'s output
  (``zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt``, ``zero/optimizer_state.pt``, model states);
* Megatron legacy: every ``model_optim_rng.pt`` (TP/PP, VPP, bf16) and the distributed
  optimizer's ``distrib_optim.pt``; Megatron ``torch_dist``: ``common.pt``, ``.metadata`` and
  the ``torch.save`` items inside every ``.distcp`` file;
* torch DCP: ``.metadata``, the per-rank ``__R.metadata`` of ``dcp.save(use_collectives=False)``
  (2 ranks) and the items inside the ``.distcp`` files (tensors and pickled objects);
* plain ``torch.save`` files and Hugging Face ``pytorch_model-*.bin`` shards (``huggingface_hub``'s).

Injection: appended before the pickle's ``STOP`` (plain pickles, ``data.pkl`` of a zip archive),
so the file is otherwise intact; inside a ``.distcp`` file the item's ``data.pkl`` is replaced
by a payload pickle of the same length (its CRCs fixed), so every offset the metadata records
stays right. Positive controls show an unrestricted ``torch.load`` runs each kind of injected
pickle (the payload is well formed and reachable).
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import shutil
import struct
import zipfile
import zlib
from collections.abc import Iterator

import pytest
import torch
from test_deepspeed import runs_dir  # noqa: F401  (session fixture: unpacked DeepSpeed runs)
from test_no_code_execution import inject

import ckptbridge

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
MEGATRON = os.path.join(FIX, "megatron")


# ----------------------------------------------------------------------------- injection helpers


def _payload_of_length(marker: str, length: int) -> bytes:
    """A whole pickle stream of exactly ``length`` bytes that runs ``touch marker`` when loaded
    (the marker's path is passed in the environment, so that small items can hold the command)."""
    os.environ["CKPTBRIDGE_PAYLOAD_MARKER"] = marker
    head = b"cos\nsystem\n"
    cmd = 'touch "$CKPTBRIDGE_PAYLOAD_MARKER"'
    fixed = len(head) + 5 + 3  # BINUNICODE header, TUPLE1 REDUCE STOP
    if fixed + len(cmd) > length:
        raise PayloadTooLarge(f"a {length}-byte pickle cannot hold the payload ({fixed + len(cmd)} bytes)")
    cmd += " " * (length - fixed - len(cmd))  # trailing blanks: the same shell command
    raw = cmd.encode()
    return head + b"X" + len(raw).to_bytes(4, "little") + raw + b"\x85R."


class PayloadTooLarge(ValueError):
    pass


def _replace_data_pkl(blob: bytes, marker: str) -> bytes:
    """``blob`` (one torch.save zip archive) with its ``data.pkl`` replaced by a same-length
    payload; the local header's, central directory's and data descriptor's CRC-32 updated."""
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/data.pkl"))
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError("data.pkl is compressed")
    out = bytearray(blob)
    h = info.header_offset
    name_len, extra_len = struct.unpack_from("<HH", out, h + 26)
    start = h + 30 + name_len + extra_len
    new = _payload_of_length(marker, info.compress_size)
    out[start:start + len(new)] = new
    crc = struct.pack("<I", zlib.crc32(new))
    out[h + 14:h + 18] = crc
    if info.flag_bits & 0x08:  # data descriptor after the data, with or without its signature
        d = start + len(new)
        out[d + (4 if out[d:d + 4] == b"PK\x07\x08" else 0):][:4] = crc
    pos, found = 0, False
    while (pos := out.find(b"PK\x01\x02", pos)) >= 0:
        n = struct.unpack_from("<H", out, pos + 28)[0]
        if bytes(out[pos + 46:pos + 46 + n]).decode(errors="replace") == info.filename:
            out[pos + 16:pos + 20] = crc
            found = True
        pos += 4
    if not found:
        raise ValueError("central directory entry of data.pkl not found")
    with zipfile.ZipFile(io.BytesIO(bytes(out))) as zf:  # the archive is valid: CRCs check out
        if zf.testzip() is not None:
            raise ValueError("CRC fix failed")
    return bytes(out)


def _distcp_items(ckpt_dir: str) -> dict[str, list[tuple[str, str, int, int]]]:
    """``.distcp`` file -> [(fqn, kind, offset, length)] of its ``torch.save`` items, from DCP's own
    metadata (read with torch: these are files the test itself wrote or the fixtures hold)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = FileSystemReader(ckpt_dir).read_metadata()
    out: dict[str, list[tuple[str, str, int, int]]] = {}
    for idx, info in meta.storage_data.items():
        kind = "object" if isinstance(meta.state_dict_metadata[idx.fqn], BytesStorageMetadata) else "tensor"
        out.setdefault(info.relative_path, []).append((idx.fqn, kind, int(info.offset), int(info.length)))
    return {f: sorted(v, key=lambda x: x[2]) for f, v in sorted(out.items())}


@contextlib.contextmanager
def injected(path: str, marker: str, item: tuple[int, int] | None = None) -> Iterator[None]:
    """Inject the payload into ``path`` (or into the torch.save item at ``item`` = (offset,
    length) of a ``.distcp`` file) for the duration of the block; the original bytes come back."""
    with open(path, "rb") as fh:
        orig = fh.read()
    try:
        if item is None:
            inject(path, marker)
        else:
            off, n = item
            with open(path, "wb") as fh:
                fh.write(orig[:off] + _replace_data_pkl(orig[off:off + n], marker) + orig[off + n:])
        yield
    finally:
        with open(path, "wb") as fh:
            fh.write(orig)


def _read_everything(ckpt_path: str) -> None:
    c = ckptbridge.open(ckpt_path)
    _ = c.extra, c.step, c.rules
    for name in c:  # lazily opened files are read here
        for s in c[name].states:
            c[name].state(s).read()


def refuses(ckpt_path: str, marker: str, what: str) -> None:
    with pytest.raises(ckptbridge.UnsafePickleError, match="os.system"):
        _read_everything(ckpt_path)
    assert not os.path.exists(marker), f"the payload in {what} ran"


def outcome(ckpt_path: str, marker: str, what: str) -> str:
    """``"refused"`` (UnsafePickleError naming os.system) or ``"unread"`` (the whole checkpoint
    read without opening that file); the payload never ran either way."""
    try:
        _read_everything(ckpt_path)
        result = "unread"
    except ckptbridge.UnsafePickleError as err:
        assert "os.system" in str(err), err
        result = "refused"
    assert not os.path.exists(marker), f"the payload in {what} ran"
    return result


def _pickle_files(root: str) -> list[str]:
    """Every pickle file under ``root`` (zip archives and plain pickles; not the ``.distcp``
    containers, whose items are injected one by one), sorted."""
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            if n.endswith(".distcp"):
                continue
            with open(p, "rb") as fh:
                head = fh.read(4)
            if head == b"PK\x03\x04" or head[:1] == b"\x80":
                out.append(p)
    return sorted(out)


def _each_file(ckpt: str, tmp_path, expect_at_least: int) -> dict[str, str]:
    """Inject every pickle file of ``ckpt`` in turn: relative path -> :func:`outcome`."""
    files = _pickle_files(ckpt)
    assert len(files) >= expect_at_least, files
    out = {}
    for i, f in enumerate(files):
        marker = str(tmp_path / f"ran{i}")
        rel = os.path.relpath(f, ckpt)
        with injected(f, marker):
            out[rel] = outcome(ckpt, marker, rel)
    _read_everything(ckpt)  # and with every file restored, the checkpoint reads again
    return out


def _each_file_refused(ckpt: str, tmp_path, expect_at_least: int) -> list[str]:
    """Every pickle file of ``ckpt`` is opened by the reader, and refused."""
    got = _each_file(ckpt, tmp_path, expect_at_least)
    assert {f for f, r in got.items() if r != "refused"} == set(), got
    return sorted(got)


def _item_class(fqn: str) -> str:
    """``model`` or the optimizer state a Megatron item holds (``exp_avg``, ``param``, ...)."""
    import re

    m = re.match(r"optimizer\.state\.(\w+)\.|optimizer\.distributed\..*\.(\w+)$", fqn)
    return (m.group(1) or m.group(2)) if m else "model"  # fully reshardable / dp_reshardable buckets


def _each_distcp_item(ckpt: str, tmp_path) -> dict[str, str]:
    """Every object item, and per ``.distcp`` file the first tensor item of each kind (model
    weights, each optimizer state), injected in turn (items whose ``data.pkl`` is too small for
    the payload, an int or None, are left out): ``"<file>:<kind>:<fqn>"`` -> :func:`outcome`."""
    out = {}
    for rel, items in _distcp_items(ckpt).items():
        done = set()
        for fqn, kind, off, n in items:
            if kind == "tensor" and _item_class(fqn) in done:
                continue
            marker = str(tmp_path / "ran-item")
            try:
                with injected(os.path.join(ckpt, rel), marker, (off, n)):
                    out[f"{rel}:{kind}:{fqn}"] = outcome(ckpt, marker, f"{rel} ({kind} {fqn!r} at byte {off})")
            except PayloadTooLarge:
                continue
            if kind == "tensor":
                done.add(_item_class(fqn))
    return out


def _positive_control(path: str, marker: str, item: tuple[int, int] | None = None) -> None:
    """An unrestricted loader runs the injected payload (so the injection is well formed)."""
    with injected(path, marker, item):
        if item is None:
            with contextlib.suppress(Exception):  # the payload runs before any later failure
                torch.load(path, map_location="cpu", weights_only=False)
        else:
            with open(path, "rb") as fh:
                fh.seek(item[0])
                torch.load(io.BytesIO(fh.read(item[1])), weights_only=False)
    assert os.path.exists(marker), f"{path}: the injected payload did not run under torch.load"
    os.remove(marker)


# ----------------------------------------------------------------------------- DeepSpeed


# Files a reader does not need are never opened (so their payload cannot run either): with
# ZeRO-3 the per-dp-rank model-states files all repeat the parameter shapes ckptbridge takes
# from dp rank 0's; the pipeline engine's mp_rank_XX_model_states.pt hold no tensors the
# layer files do not hold.
@pytest.mark.parametrize("name,min_files,unread", [
    ("s2_bf16_w2", 3, r"$^"),                     # ZeRO-2: mp_rank_00_model_states + 2 optimizer states
    ("s3_bf16_w2", 4, r"zero_pp_rank_[1-9]\d*_mp_rank_\d+_model_states"),  # ZeRO-3
    ("s1_bf16opt_w2", 3, r"$^"),                  # BF16_Optimizer
    ("pp2_s1_bf16_w4", 8, r"$^"),                 # PipelineModule: layer_XX-model_states.pt
    ("pp2_tp2_s1_bf16_w8", 16, r"$^"),            # 3D: layer_XX-model_YY-model_states.pt
])
def test_deepspeed_every_file(runs_dir, tmp_path, name, min_files, unread):  # noqa: F811
    import re

    src = os.path.join(runs_dir, name, "ckpt")
    with open(os.path.join(src, "latest")) as fh:
        tag = fh.read().strip()
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    shutil.copy(os.path.join(src, "latest"), ckpt)
    shutil.copytree(os.path.join(src, tag), os.path.join(ckpt, tag))
    got = _each_file(ckpt, tmp_path, min_files)
    assert {f for f, r in got.items() if r == "unread"} == {f for f in got if re.search(unread, f)}, got
    assert sum(r == "refused" for r in got.values()) >= 3


@pytest.mark.parametrize("name,unread", [("s2_bf16_w2", r"$^"),
                                         ("s3_fp32_w4", r"^zero_pp_rank_[1-9]\d*_mp_rank_\d+_model_states")])
def test_deepspeed_ds_to_universal_every_file(runs_dir, tmp_path, name, unread):  # noqa: F811
    """Every ``.pt`` that DeepSpeed's ``ds_to_universal`` wrote (39 parameters x fp32, exp_avg,
    exp_avg_sq[, step] + optimizer_state + the copied model states) is opened safely."""
    import re

    ckpt = str(tmp_path / "universal")
    shutil.copytree(os.path.join(runs_dir, name, "ckpt", "global_step3_universal"), ckpt)
    got = _each_file(ckpt, tmp_path, 39 * 3 + 1)
    assert {f for f, r in got.items() if r == "unread"} == {f for f in got if re.search(unread, f)}, got
    kinds = {os.path.basename(f) for f, r in got.items() if r == "refused"}
    assert {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt", "optimizer_state.pt"} <= kinds, kinds


def test_deepspeed_positive_controls(runs_dir, tmp_path):  # noqa: F811
    s2 = os.path.join(runs_dir, "s2_bf16_w2", "ckpt")
    work = str(tmp_path / "c")
    shutil.copytree(s2, work)
    for i, f in enumerate([*glob.glob(os.path.join(work, "global_step3", "*.pt")),
                           os.path.join(work, "global_step3_universal", "zero", "wte.weight", "exp_avg.pt"),
                           os.path.join(work, "global_step3_universal", "zero", "optimizer_state.pt")]):
        _positive_control(f, str(tmp_path / f"ran{i}"))


# ----------------------------------------------------------------------------- Megatron


@pytest.mark.parametrize("rel,min_files", [
    ("A/tp2pp2/torch", 4),
    ("Adistopt/tp2pp1dp2/torch", 4),  # model_optim_rng.pt + distrib_optim.pt per TP rank
    ("Abf16/tp2pp1/torch", 2),
    ("Avpp/tp1pp2vpp2/torch", 2),
    ("B/tp1pp2/torch", 2),
])
def test_megatron_legacy_every_file(tmp_path, rel, min_files):
    ckpt = str(tmp_path / "run")
    shutil.copytree(os.path.join(MEGATRON, rel), ckpt)
    files = _each_file_refused(ckpt, tmp_path, min_files)
    if "distopt" in rel:
        assert sum(f.endswith("distrib_optim.pt") for f in files) == 2


@pytest.mark.parametrize("rel", ["A/tp2pp2/torch_dist", "Adistopt/tp2pp1dp2/torch_dist",
                                 "AdistoptFR/tp1pp2dp2/torch_dist"])
def test_megatron_torch_dist_every_file_and_distcp_items(tmp_path, rel):
    """common.pt, .metadata, per .distcp file a tensor item of each kind, and every object item.

    Never opened (the checkpoint reads whole with their payloads in place): the layers'
    ``_extra_state`` and the ``rng_state`` objects, and in this fp32 run the fully reshardable
    optimizer's ``optimizer.state.param`` copy of the weights (the model's own fp32 weights are
    read instead; the same numbers, test_megatron.py). The dp_reshardable buckets hold the
    master weights together with the moments, and are read."""
    import re

    ckpt = str(tmp_path / "run")
    shutil.copytree(os.path.join(MEGATRON, rel), ckpt)
    it = glob.glob(os.path.join(ckpt, "iter_*"))[0]
    files = _each_file_refused(it, tmp_path, 2)
    assert {"common.pt", ".metadata"} <= set(files), files
    items = _each_distcp_item(it, tmp_path)
    unread = {k for k, r in items.items() if r == "unread"}
    assert unread == {k for k in items if re.search(
        r":object:(.*\._extra_state|rng_state)/|:tensor:optimizer\.state\.param\.", k)}, unread
    refused = set(items) - unread
    classes = {_item_class(k.split(":", 2)[2]) for k in refused if ":tensor:" in k}
    assert classes >= {"model", "exp_avg", "exp_avg_sq"}, classes
    assert {k.split(":")[0] for k in refused} == {os.path.basename(f) for f in glob.glob(os.path.join(it, "*.distcp"))}
    if "Adistopt/" in rel:  # the dp_reshardable optimizer's objects
        assert any(":object:optimizer.distributed" in k for k in refused), refused


def test_megatron_positive_controls(tmp_path):
    ckpt = str(tmp_path / "run")
    shutil.copytree(os.path.join(MEGATRON, "Adistopt"), ckpt)
    _positive_control(os.path.join(ckpt, "tp2pp1dp2", "torch", "iter_0000005", "mp_rank_01", "distrib_optim.pt"),
                      str(tmp_path / "ran0"))
    it = os.path.join(ckpt, "tp2pp1dp2", "torch_dist", "iter_0000005")
    picked = {}  # a tensor item and one of the distributed optimizer's object items
    for rel, items in _distcp_items(it).items():
        for fqn, kind, off, n in items:
            if kind == "tensor" or fqn.startswith("optimizer.distributed.dp_group_idx_0.optimizer"):
                picked.setdefault(kind, (rel, off, n))
    assert set(picked) == {"tensor", "object"}
    for kind, (rel, off, n) in picked.items():
        _positive_control(os.path.join(it, rel), str(tmp_path / f"ran-{kind}"), (off, n))


# ----------------------------------------------------------------------------- torch DCP


def _dcp_state(rank: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(6, 4, generator=g), "own": torch.full((3,), float(rank))},
            "step": 5, "note": {"text": "a note long enough to hold the payload " * 3, "rank": rank},
            "sched": {"milestones": list(range(40))}}


def _save_per_rank_metadata(rank: int, world: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = _dcp_state(rank)
    sd["model"]["w"] = distribute_tensor(sd["model"]["w"], mesh, [Shard(0)])
    dcp.save(sd, checkpoint_id=out, use_collectives=False)


@pytest.fixture(scope="module")
def dcp_dirs(tmp_path_factory) -> dict[str, str]:
    """A coordinated single-process ``dcp.save`` and a 2-rank ``use_collectives=False`` one."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from _dist import run

    root = tmp_path_factory.mktemp("dcp_payloads")
    out = {"coordinated": str(root / "coordinated"), "per_rank": str(root / "per_rank")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_dcp_state(0), checkpoint_id=out["coordinated"], no_dist=True)
    run(_save_per_rank_metadata, 2, out["per_rank"])
    assert {"__0.metadata", "__1.metadata"} <= set(os.listdir(out["per_rank"]))
    assert not os.path.exists(os.path.join(out["per_rank"], ".metadata"))
    return out


@pytest.mark.parametrize("kind", ["coordinated", "per_rank"])
def test_dcp_metadata_files_and_distcp_items(dcp_dirs, tmp_path, kind):
    ckpt = str(tmp_path / kind)
    shutil.copytree(dcp_dirs[kind], ckpt)
    files = _each_file_refused(ckpt, tmp_path, 1)
    assert files == ([".metadata"] if kind == "coordinated" else ["__0.metadata", "__1.metadata"])
    if kind == "coordinated":  # (torch's reader, used to locate the items, needs the global .metadata)
        items = _each_distcp_item(ckpt, tmp_path)
        assert set(items.values()) == {"refused"} and {k.split(":")[2] for k in items} == {"model.w", "note.text", "sched.milestones"}, items


def test_dcp_positive_controls(dcp_dirs, tmp_path):
    ckpt = str(tmp_path / "c")
    shutil.copytree(dcp_dirs["per_rank"], ckpt)
    _positive_control(os.path.join(ckpt, "__1.metadata"), str(tmp_path / "ran0"))
    shutil.copytree(dcp_dirs["coordinated"], str(tmp_path / "d"))
    kinds = set()
    for rel, items in _distcp_items(str(tmp_path / "d")).items():
        for i, (_, kind, off, n) in enumerate(items):
            with contextlib.suppress(PayloadTooLarge):
                _positive_control(os.path.join(str(tmp_path / "d"), rel), str(tmp_path / f"ran-{i}"), (off, n))
                kinds.add(kind)
    assert kinds == {"tensor", "object"}


# ----------------------------------------------------------------------------- torch / HF


def test_plain_torch_and_hf_bin_shards(tmp_path):
    import huggingface_hub

    torch.save({"w": torch.randn(3, 2), "meta": {"k": [1, 2]}}, tmp_path / "model.pt")
    marker = str(tmp_path / "ran")
    with injected(str(tmp_path / "model.pt"), marker):
        refuses(str(tmp_path / "model.pt"), marker, "model.pt")
    hf = tmp_path / "hf"  # pytorch_model-0000K-of-0000N.bin shards + index, as huggingface_hub writes them
    hf.mkdir()
    sd = {"a.weight": torch.randn(40, 20), "b.weight": torch.randn(40, 20), "c.bias": torch.randn(20)}
    huggingface_hub.save_torch_state_dict(sd, hf, safe_serialization=False, max_shard_size="4KB")
    shards = sorted(f for f in os.listdir(hf) if f.endswith(".bin"))
    assert len(shards) >= 2 and (hf / "pytorch_model.bin.index.json").exists()
    assert _each_file_refused(str(hf), tmp_path, 2) == shards
