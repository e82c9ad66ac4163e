"""Megatron adapter against real Megatron-LM checkpoints (tests/fixtures/megatron, see its README.md).

Model "A": 4 layers, hidden 64, 4 heads in 2 query groups (GQA), SwiGLU ffn 128, RMSNorm, RoPE,
untied embeddings, vocab 250 (+1 EOD) padded to 256. All layouts hold the same logical state at
iteration 5 (Megatron resharded the TP1/PP1 reference itself and trained 2 more steps), equal up
to fp32 reduction order: we require |a-b| <= 1e-7 + 1e-5*|b| against A/tp1pp1 (measured worst:
1.2e-7 on weights). ``torch`` and ``torch_dist`` of one layout are bit-identical (Megatron
converted one into the other), and so must be what we read from them.
"""

from __future__ import annotations

import os
import shutil

import ml_dtypes
import numpy as np
import pytest

import ckptbridge
import ckptbridge as O
from ckptbridge import MissingShardError
from ckptbridge.adapters import megatron
from ckptbridge.adapters.megatron._layout import MegatronConfig
from ckptbridge.adapters.torch_save import TensorRef, TorchArchive, iter_tensors
from ckptbridge.plugin import FileCache, read_state

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures", "megatron")
REF = os.path.join(FIX, "A", "tp1pp1", "torch")
FP32_LAYOUTS = [
    "A/tp2pp2/torch",
    "A/tp2pp2/torch_dist",
    "Adistopt/tp2pp1dp2/torch",  # distrib_optim.pt flat buffers
    "Adistopt/tp2pp1dp2/torch_dist",  # dp_reshardable bucket buffers
    "AdistoptFR/tp1pp2dp2/torch_dist",  # fully reshardable optimizer, model space
    "Avpp/tp1pp2vpp2/torch",  # virtual pipeline: model0/model1 chunks, interleaved layer numbering
]
RTOL, ATOL = 1e-5, 1e-7


def fx(rel: str) -> str:
    return os.path.join(FIX, rel)


@pytest.fixture(scope="module")
def ref() -> dict[tuple[str, str], np.ndarray]:
    c = O.open(REF)
    return {(n, s): c[n].state(s).read() for n in c for s in c[n].states}


def _all(c) -> dict[tuple[str, str], np.ndarray]:
    return {(n, s): c[n].state(s).read() for n in c for s in c[n].states}


def test_detect_run_iter_and_dist_dirs(tmp_path) -> None:
    assert megatron.detect(REF)
    assert megatron.detect(os.path.join(REF, "iter_0000005"))
    assert megatron.detect(fx("A/tp2pp2/torch_dist/iter_0000005"))
    assert not megatron.detect(str(tmp_path))
    assert not megatron.detect(os.path.join(REF, "latest_checkpointed_iteration.txt"))
    assert O.detect_format(fx("A/tp2pp2/torch_dist")) == "megatron"


def test_reference_view() -> None:
    c = O.open(REF)
    assert c.format == "megatron" and c.step == 5 and len(c) == 27
    assert c.states() == ("fp32", "exp_avg", "exp_avg_sq")
    emb = c["embedding.word_embeddings.weight"]
    assert emb.shape == (251, 64)  # NullTokenizer: 250 + EOD, padding to 256 stripped
    assert c["output_layer.weight"].shape == (251, 64)
    assert c["decoder.layers.3.self_attention.linear_qkv.weight"].shape == (128, 64)
    assert c["decoder.layers.3.mlp.linear_fc1.weight"].shape == (256, 64)
    assert c["decoder.layers.3.mlp.linear_fc2.weight"].shape == (64, 128)
    assert c["decoder.layers.0.input_layernorm.weight"].scalars == {"step": 5}
    meg = c.extra["megatron"]
    assert meg["padded_vocab_size"] == 256 and meg["vocab_size"] == 251 and meg["iteration"] == 5
    assert c.provenance["tp"] == 1 and c.provenance["pp"] == 1


@pytest.mark.parametrize("layout", FP32_LAYOUTS)
def test_every_tensor_matches_tp1pp1_reference(layout: str, ref) -> None:
    c = O.open(fx(layout))
    got = _all(c)
    assert set(got) == set(ref), set(got) ^ set(ref)
    for key, want in ref.items():
        a = got[key]
        assert a.shape == want.shape and a.dtype == want.dtype, key
        np.testing.assert_allclose(a, want, rtol=RTOL, atol=ATOL, err_msg=f"{layout} {key}")
    assert all(c[n].scalars == {"step": 5} for n in c)
    assert c.step == 5


@pytest.mark.parametrize("family", ["A/tp2pp2", "Adistopt/tp2pp1dp2"])
def test_legacy_and_torch_dist_of_one_layout_are_bitwise_equal(family: str) -> None:
    a, b = _all(O.open(fx(family + "/torch"))), _all(O.open(fx(family + "/torch_dist")))
    assert set(a) == set(b)
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_bf16_run_states() -> None:
    c = O.open(fx("Abf16/tp2pp1/torch"))
    assert c.states() == ("param", "fp32", "exp_avg", "exp_avg_sq")
    for n in c:
        t = c[n]
        assert t.dtype == "float32" and t.state("param").dtype == "bfloat16"
        # Megatron copies the fp32 master into the bf16 model weights after every step.
        np.testing.assert_array_equal(t.state("param").read(), t.read().astype(ml_dtypes.bfloat16))
    # The fp32 master and the Adam moments themselves are checked bitwise against megatron-core's
    # own optimizer state: tests/test_megatron_core_writer_paths.py.


def test_tied_embeddings_family_b() -> None:
    """Model B (tools/megatron/make_tied.sh): GPT-2-like, LayerNorm + biases everywhere, learned
    positions, MHA, GeLU, tied embeddings: with PP=2 the last stage keeps its own copy of the word
    embeddings as output_layer.weight (with its own, equal, Adam state)."""
    ref = O.open(fx("B/tp1pp1/torch"))
    c = O.open(fx("B/tp1pp2/torch"), check_replicas=True)
    assert "output_layer.weight" not in c and len(c) == len(ref) == 52
    assert c["embedding.position_embeddings.weight"].shape == (32, 64)
    assert c["decoder.layers.3.self_attention.linear_qkv.bias"].shape == (192,)
    for n in ref:
        for s in ref[n].states:
            np.testing.assert_allclose(c[n].state(s).read(), ref[n].state(s).read(), rtol=RTOL, atol=ATOL,
                                       err_msg=f"{n} {s}")
    # the last stage's output_layer copy equals the embedding, state by state
    a = TorchArchive.open(fx("B/tp1pp2/torch/iter_0000005/mp_rank_00_001/model_optim_rng.pt"))
    with FileCache() as files:
        from ckptbridge.plugin import TensorState

        ref_ = a.obj["model"]["output_layer.weight"]
        copy = read_state(TensorState(ref_.dtype, ref_.shape, (a.fragment(ref_),)), None, files)
    emb = O.open(fx("B/tp1pp2/torch"), strip_padding=False)["embedding.word_embeddings.weight"].read()
    np.testing.assert_array_equal(copy, emb)


def test_virtual_pipeline_renumbering() -> None:
    c = O.open(fx("Avpp/tp1pp2vpp2/torch"))
    ren = sorted((r["axis"], r["offset"]) for r in c.rules if r["rule"] == "Renumber")
    # chunks in (virtual stage, pipeline rank) order hold layers 0, 1, 2, 3
    assert ren == [("pp=0,vpp=0", 0), ("pp=0,vpp=1", 2), ("pp=1,vpp=0", 1), ("pp=1,vpp=1", 3)]


def test_check_replicas_reads_every_tp_copy() -> None:
    c = O.open(fx("A/tp2pp2/torch"), check_replicas=True)
    assert len(c) == 27


def test_rules_describe_the_layout() -> None:
    c = O.open(fx("A/tp2pp2/torch"))
    kinds = {}
    for r in c.rules:
        kinds.setdefault(r["rule"], []).append(r)
    assert {"Shard", "Replicate", "Fuse", "Pad", "Renumber"} <= set(kinds)
    qkv = next(r for r in kinds["Fuse"] if r["parts"] == ["q", "k", "v"])
    assert qkv["groups"] == 2 and qkv["widths"] == [32, 16, 16]
    glu = next(r for r in kinds["Fuse"] if r["parts"] == ["gate", "up"])
    assert glu["widths"] == [128, 128]
    assert kinds["Pad"][0]["size"] == 251 and kinds["Pad"][0]["padded"] == 256
    assert sorted((r["axis"], r["offset"]) for r in kinds["Renumber"]) == [("pp=0", 0), ("pp=1", 2)]
    assert any(r["dim"] == 1 for r in kinds["Shard"])  # row-parallel


def test_consolidation_follows_megatron_tp_layout() -> None:
    """Check the TP rules on the raw rank files: QKV per query group, SwiGLU halves, vocab rows."""
    c = O.open(fx("A/tp2pp2/torch"))
    it = fx("A/tp2pp2/torch/iter_0000005")
    with FileCache() as files:
        def raw(tp: int, pp: int, key: str) -> np.ndarray:
            a = TorchArchive.open(os.path.join(it, f"mp_rank_{tp:02d}_{pp:03d}", "model_optim_rng.pt"))
            ref = dict(iter_tensors(a.obj["model"]))[key]
            f = a.fragment(ref)
            from ckptbridge.plugin import TensorState

            return read_state(TensorState(ref.dtype, ref.shape, (f,)), None, files)

        fc1 = c["decoder.layers.3.mlp.linear_fc1.weight"].read()  # stage 1, local layer 1
        r0, r1 = raw(0, 1, "decoder.layers.1.mlp.linear_fc1.weight"), raw(1, 1, "decoder.layers.1.mlp.linear_fc1.weight")
        np.testing.assert_array_equal(fc1, np.concatenate([r0[:64], r1[:64], r0[64:], r1[64:]]))
        qkv = c["decoder.layers.0.self_attention.linear_qkv.weight"].read()
        q0 = raw(0, 0, "decoder.layers.0.self_attention.linear_qkv.weight")
        np.testing.assert_array_equal(qkv[:64], q0)  # rank 0 holds query group 0 whole
        emb = c["embedding.word_embeddings.weight"].read()
        e1 = raw(1, 0, "embedding.word_embeddings.weight")
        np.testing.assert_array_equal(emb[128:], e1[: 251 - 128])


def test_split_fused_views() -> None:
    c = O.open(fx("A/tp2pp2/torch_dist"), split_fused=True)
    fused = O.open(fx("A/tp2pp2/torch_dist"))
    base = "decoder.layers.2.self_attention.linear_qkv"
    assert f"{base}.weight" not in c
    q, k, v = (c[f"{base}.{p}.weight"] for p in "qkv")
    assert (q.shape, k.shape, v.shape) == ((64, 64), (32, 64), (32, 64))
    w = fused[f"{base}.weight"].read().reshape(2, 4, 16, 64)  # [group, (2 q heads, k, v), d, h]
    np.testing.assert_array_equal(q.read(), w[:, :2].reshape(64, 64))
    np.testing.assert_array_equal(k.state("exp_avg").read(),
                                  fused[f"{base}.weight"].state("exp_avg").read().reshape(2, 4, 16, 64)[:, 2].reshape(32, 64))
    np.testing.assert_array_equal(v.read(), w[:, 3].reshape(32, 64))
    g, u = c["decoder.layers.2.mlp.linear_fc1.gate.weight"], c["decoder.layers.2.mlp.linear_fc1.up.weight"]
    f = fused["decoder.layers.2.mlp.linear_fc1.weight"].read()
    np.testing.assert_array_equal(g.read(), f[:128])
    np.testing.assert_array_equal(u.read(), f[128:])
    assert any(r["rule"] == "Split" for r in c.rules)


def test_keep_padding_option() -> None:
    c = O.open(REF, strip_padding=False)
    assert c["embedding.word_embeddings.weight"].shape == (256, 64)
    assert not any(r["rule"] == "Pad" for r in c.rules)


def test_vocab_padding_rule_matches_megatron_formula() -> None:
    c = O.open(REF)
    cfg = MegatronConfig.from_args(c.extra["megatron"]["args"])
    # Megatron-LM tokenizer._vocab_size_with_padding: ceil(V / (divisible_by * TP)) * (divisible_by * TP)
    assert [cfg.padded_vocab_for(t) for t in (1, 2, 4, 8)] == [256, 256, 256, 512]


def test_reads_only_the_requested_rows() -> None:
    c = O.open(fx("A/tp2pp2/torch"))
    c.stats.reset()
    c["output_layer.weight"][130:132]
    assert c.stats.bytes_read == 2 * 64 * 4  # two rows, from the TP rank 1 file only
    assert all("mp_rank_01_001" in f for f in c.stats.per_file)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("run", "victim"), [
    ("A/tp2pp2/torch", "iter_0000005/mp_rank_01_001"),                # a rank's directory
    ("Adistopt/tp2pp1dp2/torch", "iter_0000005/mp_rank_01/distrib_optim.pt"),
    ("A/tp2pp2/torch_dist", "iter_0000005/__3_1.distcp"),
])
def test_missing_file_is_named(tmp_path, run: str, victim: str) -> None:
    dst = tmp_path / "run"
    shutil.copytree(fx(run), dst)
    path = dst / victim
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    with pytest.raises(MissingShardError, match=os.path.basename(victim)):
        O.open(str(dst))


def test_tracker_naming_a_missing_iteration(tmp_path) -> None:
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(MissingShardError, match="iter_0000007"):
        megatron.index(str(tmp_path))


# ----------------------------------------------------------------------------- writer


def _rank_tensors(run: str) -> dict[str, np.ndarray]:
    """Every tensor of every rank file (model + optimizer + distrib_optim), keyed by rank/path."""
    out = {}
    with FileCache() as files:
        for root, _, names in os.walk(run):
            for n in names:
                if not n.endswith(".pt"):
                    continue
                a = TorchArchive.open(os.path.join(root, n))
                rank = os.path.relpath(os.path.join(root, n), run)
                for key, ref in iter_tensors({k: v for k, v in a.obj.items() if k not in ("rng_state", "args")}):
                    if isinstance(ref, TensorRef):
                        from ckptbridge.plugin import TensorState

                        st = TensorState(ref.dtype, ref.shape, (a.fragment(ref),))
                        out[f"{rank}:{key}"] = read_state(st, None, files)
    return out


@pytest.mark.parametrize("src,mid", [("A/tp2pp2/torch", (1, 1)), ("A/tp1pp1/torch", (2, 2)),
                                     ("B/tp1pp2/torch", (2, 1))])
def test_round_trip_gives_back_the_original_shards_bitwise(src: str, mid: tuple[int, int], tmp_path) -> None:
    orig = O.open(fx(src))
    tp, pp = orig.provenance["tp"], orig.provenance["pp"]
    ckptbridge.reshard(orig, str(tmp_path / "mid"), to="megatron", tp=mid[0], pp=mid[1])
    back = tmp_path / "back"
    ckptbridge.reshard(O.open(str(tmp_path / "mid")), str(back), to="megatron", tp=tp, pp=pp)
    a, b = _rank_tensors(fx(src)), _rank_tensors(str(back))
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
    assert (back / "latest_checkpointed_iteration.txt").read_text() == "5"


@pytest.mark.parametrize("src,tp,pp", [
    ("A/tp2pp2/torch_dist", 1, 2),
    ("Abf16/tp2pp1/torch", 1, 2),
    ("Adistopt/tp2pp1dp2/torch_dist", 1, 1),
    ("AdistoptFR/tp1pp2dp2/torch_dist", 2, 1),
    ("Avpp/tp1pp2vpp2/torch", 2, 1),
    ("B/tp1pp2/torch", 2, 2),
])
def test_written_layout_reads_back_identically(src: str, tp: int, pp: int, tmp_path) -> None:
    c = O.open(fx(src))
    dst = str(tmp_path / "out")
    ckptbridge.reshard(c, dst, to="megatron", tp=tp, pp=pp)
    d = O.open(dst)
    assert d.provenance["tp"] == tp and d.provenance["pp"] == pp and d.step == 5
    a, b = _all(c), _all(d)
    assert set(a) == set(b)
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    ranks = sorted(os.listdir(os.path.join(dst, "iter_0000005")))
    assert len(ranks) == tp * pp
    if "Adistopt" in src:
        assert all(os.path.isfile(os.path.join(dst, "iter_0000005", r, "distrib_optim.pt")) for r in ranks)


def test_write_from_split_view_refuses_existing_destination(tmp_path) -> None:
    c = O.open(fx("A/tp2pp2/torch"), split_fused=True)
    dst = str(tmp_path / "out")
    ckptbridge.reshard(c, dst, to="megatron", tp=1, pp=1)
    np.testing.assert_array_equal(O.open(dst)["decoder.layers.1.mlp.linear_fc1.weight"].read(),
                                  O.open(fx("A/tp2pp2/torch"))["decoder.layers.1.mlp.linear_fc1.weight"].read())
    with pytest.raises(FileExistsError):
        ckptbridge.reshard(c, dst, to="megatron", tp=1, pp=1)


def test_reshard_cli_path_and_universal_round_trip(tmp_path) -> None:
    """``ckptbridge reshard --to megatron`` (the WRITERS registry) from a Megatron checkpoint and from
    the universal directory converted from it: same logical tensors, same step, same Megatron args."""
    from ckptbridge import convert, reshard

    src = fx("Abf16/tp2pp1/torch")
    reshard(src, str(tmp_path / "direct"), to="megatron", tp=1, pp=2)
    convert(O.open(src), str(tmp_path / "universal"))
    reshard(str(tmp_path / "universal"), str(tmp_path / "via_universal"), to="megatron", tp=1, pp=2)
    a = _all(O.open(src))
    for out in ("direct", "via_universal"):
        d = O.open(str(tmp_path / out))
        assert d.step == 5 and d.provenance["tp"] == 1 and d.provenance["pp"] == 2
        b = _all(d)
        assert set(a) == set(b)
        for k in a:
            assert np.array_equal(a[k], b[k]), (out, k)
