"""The name index rules run over (``ckptbridge.rules._names``): every lookup must find exactly what
``re.search`` over every name finds, in order, before and after renames; the fast template expansion
must give what ``re.sub`` gives. Checked against ``re`` itself on recipe patterns and on patterns made
to defeat a literal prefix or suffix (alternatives, quantifiers, classes, flags, ``$`` before a final
newline)."""

from __future__ import annotations

import re

import pytest

from ckptbridge import recipes
from ckptbridge.rules._names import Names, literal_ends, substitute, substitute_all

NAMES = [f"model.layers.{i}.{leaf}" for i in range(12) for leaf in (
    "self_attn.q_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "mlp.experts.3.up_proj.weight",
    "mlp.gate.e_score_correction_bias", "input_layernorm.weight")] + [
    "model.embed_tokens.weight", "lm_head.weight", "odd.weight\n", "Model.Layers.1.W", "a+b.weight", "model.layers"]

TRICKY = [
    r"^model\.layers\.1\.", r"^model\.layers\.1\d?\.", r"\.weight$", r"^model\.layers\.(\d+)\.mlp\.gate\.e_score\w+$",
    r"^model|lm_head", r"^(?:model|lm)\.", r"^model\.layers\.1*\.", r"^model\.layers\.[12]\.", r"^a\+b", r"weight$",
    r"(?i)^model\.layers\.1\.", r"^model\.layers$", r"^model\.layers\.(?P<n>\d+)\.(?P=n)", r"\.weight\Z",
    r"^model\.layers\.\d+\.self_attn\.(q|kv_a)_proj.*$", r"^lm_head\.weight$", r"^odd\.weight$", r"^model\.layer.?s\.1",
]


def _recipe_patterns() -> list[str]:
    config = dict(n_heads=4, n_layers=12, first_dense=3, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
                  v_head_dim=4, q_lora_rank=6, mtp_layers=1)
    return [r.pattern for scan in (True, False)
            for r in recipes.rules("deepseek_v3", src="hf", dst="maxtext", scan=scan, **config)]


def test_hits_equal_a_search_over_every_name_before_and_after_renames():
    names = Names(dict.fromkeys(NAMES, 0))
    patterns = TRICKY + _recipe_patterns()
    for p in patterns:
        assert names.hits(p) == list(filter(re.compile(p).search, NAMES)), p
    assert literal_ends(r"^model\.layers\.(\d+)\.mlp\.weight$") == ("model.layers.", ".mlp.weight")
    assert literal_ends(r"^a|b$") == ("", "") and literal_ends(r"(?i)^ab") == ("", "")
    # renames in place, order kept; the index finds the new names and forgets the old ones
    now = list(NAMES)
    for k in range(0, 12, 3):
        old = [n for n in now if n.startswith(f"model.layers.{k}.")]
        new = {n: n.replace(f"model.layers.{k}.", f"decoder/layers_{k}/") for n in old}
        names.rename(new)
        now = [new.get(n, n) for n in now]
        if k % 2:  # a look-up between renames sorts the names renamed so far into the index
            assert names.hits(rf"^decoder/layers_{k}/") == [new[n] for n in old]
    assert list(names) == now
    for p in patterns:  # with their matches: what re.search gives each name
        hits, matches = names.matches(p)
        assert [m.span() for m in matches] == [re.search(p, n).span() for n in hits], p  # type: ignore[union-attr]
    for p in [*patterns, r"^decoder/layers_3/", r"^decoder/(?P<at>layers_\d+)/input_layernorm\.weight$"]:
        assert names.hits(p) == list(filter(re.compile(p).search, now)), p
    rebuilt = names.rebuilt({n: 0 for n in now[::2]} | {"stacked/w": 1})
    for p in [*patterns, r"^stacked/", r"^decoder/layers_3/"]:
        assert rebuilt.hits(p) == list(filter(re.compile(p).search, [*now[::2], "stacked/w"])), p
        assert names.hits(p) == list(filter(re.compile(p).search, now)), p  # the old index still answers


@pytest.mark.parametrize(("pattern", "to"), [
    (r"^model\.layers\.(\d+)\.(?P<leaf>.+)$", r"decoder/layers_\1/\g<leaf>"),
    (r"^(?P<l>\w+)\.(\d+)", r"\g<2>-\g<l>\g<0>"), (r"^(m)(x)?o", r"[\2]\1"), (r"^model", r"\\n\n"),
    (r"\.", "/"), (r"^model", r"\10"), (r"^model", r"\g<nope>"), (r"^model\.(\d+)?", r"\1x"),
    (r"^model\.(\d+)", r"%s%%\1%"), (r"^(m)(o)(x)?", r"\3\2\1"), (r"^lm_head", "head"),
])
def test_substitute_is_re_sub(pattern, to):
    names = [*NAMES, "model.7.x", "model"]
    for name in names:
        try:
            want = re.sub(pattern, to, name)
        except (re.error, IndexError) as err:
            with pytest.raises(type(err)):
                substitute(pattern, to)(name)
            continue
        assert substitute(pattern, to)(name) == want, (pattern, to, name)
    # all at once (map over the matches): the names a rule hits, with and without their matches, and any names
    hits = list(filter(re.compile(pattern).search, names))
    for some, matches in ((hits, None), (hits, list(map(re.compile(pattern).search, hits))), (names, None)):
        try:
            want_all = [re.sub(pattern, to, name) for name in some]
        except (re.error, IndexError) as err:
            with pytest.raises(type(err)):
                substitute_all(pattern, to, some, matches)
            continue
        assert substitute_all(pattern, to, some, matches) == want_all, (pattern, to)
