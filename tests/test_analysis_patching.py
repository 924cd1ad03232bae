"""IOI prompt generator, activation vs attribution patching (lnfree.analysis.ioi / .patching)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import byte_level_bpe, own_corpus
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lnfree.analysis.patching import run as patching
from lnfree.analysis.common import AnalysisModel, NotApplicable
from lnfree.analysis.ioi import (DEFAULT_TEMPLATES, GPT2_NAMES, GPT2_OBJECTS, GPT2_PLACES, make_ioi_prompts,
                                 single_token_id, single_token_words)
from lnfree.forms.bridge import bridge_from_folded, hook_name
from lnfree.forms.load import load
from lnfree.data.tiny import NAMES, OBJECTS, PLACES, TINY_MODEL_DIR


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL_DIR)


@pytest.fixture(scope="module")
def merging_tokenizer():
    """The tiny tokenizer with one token spanning two words, "Mary and"."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    tokenizer.add_tokens(["Mary and"])
    return tokenizer


@pytest.fixture(scope="module")
def original():
    return AnalysisModel("original", load(str(TINY_MODEL_DIR)))


@pytest.fixture(scope="module")
def ln_free(tiny_ln_free_export):
    return AnalysisModel("ln_free", load(str(tiny_ln_free_export)))


def bpe_tokenizer(words_in_training: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained in memory on IOI text of every default template."""
    text = []
    for i, name in enumerate(words_in_training):
        other = words_in_training[(i + 1) % len(words_in_training)]
        for t in DEFAULT_TEMPLATES:
            text.append(t.format(N1=name, N2=other, S2=name, PLACE="store", OBJECT="drink", ART="a") + " " + other)
    text += [" ".join(PLACES), " ".join(OBJECTS), "a an apple"] * 5
    return byte_level_bpe(text)


# ------------------------------------------------------------------------------------------------
# Prompt generator
# ------------------------------------------------------------------------------------------------


def test_generator_is_seeded_balanced_and_aligned(tiny_tokenizer):
    prompts = make_ioi_prompts(tiny_tokenizer, 24, seed=3)
    again = make_ioi_prompts(tiny_tokenizer, 24, seed=3)
    other = make_ioi_prompts(tiny_tokenizer, 24, seed=4)
    assert torch.equal(prompts.clean_ids, again.clean_ids) and prompts.clean_texts == again.clean_texts
    assert torch.equal(prompts.corrupted_ids, again.corrupted_ids)
    assert prompts.clean_texts != other.clean_texts
    # both orders, balanced (partner pairs); every template used; one length; BOS first
    assert prompts.orders.count("ABBA") == prompts.orders.count("BABA") == 12
    assert len(set(prompts.templates)) > 1
    assert prompts.clean_ids.shape == prompts.corrupted_ids.shape == (24, 16)
    assert (prompts.clean_ids[:, 0] == tiny_tokenizer.eos_token_id).all()
    # clean and corrupted differ exactly at S2; each prompt's corruption is its partner
    differ = prompts.clean_ids != prompts.corrupted_ids
    assert differ.sum(1).eq(1).all() and differ[:, prompts.s2_position].all()
    assert torch.equal(prompts.corrupted_ids[0::2], prompts.clean_ids[1::2])
    assert torch.equal(prompts.corrupted_ids[1::2], prompts.clean_ids[0::2])
    labels = prompts.position_labels
    assert labels[prompts.s2_position] == "S2" and {"BOS", "N1", "N2", "PLACE", "OBJECT"} <= set(labels)
    n1, n2 = labels.index("N1"), labels.index("N2")
    for i in range(len(prompts)):
        # the text re-tokenises to the ids; names are single known tokens at their slots
        ids = tiny_tokenizer(prompts.clean_texts[i], add_special_tokens=False)["input_ids"]
        assert ids == prompts.clean_ids[i, 1:].tolist()
        assert tiny_tokenizer.convert_ids_to_tokens(int(prompts.io_ids[i])) == prompts.io_names[i]
        s2 = int(prompts.clean_ids[i, prompts.s2_position])
        assert s2 == prompts.s_ids[i] != prompts.io_ids[i]
        first, second = int(prompts.clean_ids[i, n1]), int(prompts.clean_ids[i, n2])
        assert (s2, int(prompts.io_ids[i])) == ((second, first) if prompts.orders[i] == "ABBA" else (first, second))
        assert prompts.clean_texts[i].startswith("Then, ")
    assert len(make_ioi_prompts(tiny_tokenizer, 5, seed=0)) == 5
    half = prompts.subset(range(0, 24, 2))
    assert half.orders == ["ABBA"] * 12 and torch.equal(half.clean_ids, prompts.clean_ids[0::2])
    # the tiny tokenizer keeps the default (GPT-2) words it knows: all but the unknown ones
    assert set(prompts.words["names"]) <= set(NAMES) and len(prompts.words["names"]) >= 35
    assert single_token_id(tiny_tokenizer, "Zebulon") is None  # <|unk|> is not a token of the word


def test_generator_with_byte_level_bpe():
    known = ["Mary", "John", "Anna", "Tom", "Lucy", "Peter"]
    tok = bpe_tokenizer(known)
    kept = single_token_words(tok, ["Mary", "Zebulon", "John", "Anna", "Tom", "Lucy", "Peter", "Mary"])
    assert kept == tuple(known)
    prompts = make_ioi_prompts(tok, 10, seed=1)
    assert set(prompts.io_names) <= set(known) and set(prompts.words["names"]) == set(known)
    tokens = tok.convert_ids_to_tokens(prompts.clean_ids[0].tolist())
    assert tokens[prompts.s2_position].startswith("Ġ")  # the leading-space form
    assert tok.convert_ids_to_tokens(int(prompts.io_ids[0])) == "Ġ" + prompts.io_names[0]
    assert (prompts.clean_ids != prompts.corrupted_ids).sum(1).eq(1).all()
    assert make_ioi_prompts(tok, 10, seed=1, prepend_bos=False).clean_ids.shape[1] == prompts.clean_ids.shape[1] - 1


def test_generator_aligns_prompts_for_a_tokenizer_of_the_models_own():
    """A BPE trained on other text splits some template words: the templates that align are kept."""
    tok = byte_level_bpe(own_corpus(GPT2_NAMES[:20], GPT2_PLACES, GPT2_OBJECTS))
    assert len(tok.tokenize(" walked")) > 1 and len(tok.tokenize(" went")) == 1  # the construction
    prompts = make_ioi_prompts(tok, 12, seed=0)
    assert prompts.template_texts == DEFAULT_TEMPLATES[:1] and set(prompts.templates) == {0}
    assert set(prompts.dropped_templates) == set(DEFAULT_TEMPLATES[1:])
    assert all("tokens with S2 at position" in why for why in prompts.dropped_templates.values())
    differ = prompts.clean_ids != prompts.corrupted_ids
    assert differ.sum(1).eq(1).all() and differ[:, prompts.s2_position].all()
    for i in range(len(prompts)):
        assert tok(prompts.clean_texts[i], add_special_tokens=False)["input_ids"] == prompts.clean_ids[i, 1:].tolist()
        assert tok.convert_ids_to_tokens(int(prompts.clean_ids[i, prompts.s2_position])) == "Ġ" + prompts.s_names[i]


def test_generator_keeps_the_largest_aligned_group_and_redraws_words_that_do_not_fit(tiny_tokenizer, merging_tokenizer):
    longer = "When {N1} and {N2} went to the {PLACE}, {S2} gave {ART} {OBJECT} to the"
    first_longer = make_ioi_prompts(tiny_tokenizer, 8, templates=(longer, *DEFAULT_TEMPLATES[:2]))
    assert first_longer.template_texts == DEFAULT_TEMPLATES[:2] and list(first_longer.dropped_templates) == [longer]
    assert first_longer.dropped_templates[longer].startswith("16 tokens with S2 at position 10")  # kept: at 11
    # drawn prompts with Mary first would hold the token "Mary and": they are redrawn
    prompts = make_ioi_prompts(merging_tokenizer, 24, seed=0, names=("John", "Tom", "Mary", "Anna"))
    assert "Mary" in prompts.io_names and "Mary and" not in " ".join(prompts.clean_texts)
    assert (prompts.clean_ids != prompts.corrupted_ids).sum(1).eq(1).all()


def test_generator_rejects_bad_inputs(tiny_tokenizer, merging_tokenizer):
    with pytest.raises(NotApplicable, match="two names that are single tokens"):
        make_ioi_prompts(tiny_tokenizer, 4, names=["Mary", "Zebulon"])
    with pytest.raises(NotApplicable, match="none of the templates"):  # the first name is always N1 in the probe
        make_ioi_prompts(merging_tokenizer, 4, names=("Mary", "John"))
    with pytest.raises(ValueError, match="unknown fields"):
        make_ioi_prompts(tiny_tokenizer, 4, templates=("Then, {N1} and {N2} met {X}. {S2} gave it to",))
    with pytest.raises(ValueError, match="exactly once"):
        make_ioi_prompts(tiny_tokenizer, 4, templates=("Then, {N1} went. {S2} gave it to",))


# ------------------------------------------------------------------------------------------------
# Patching
# ------------------------------------------------------------------------------------------------


def naive_patch(bridge, prompts, kind, i, layer, cell) -> float:
    """One forward pass, one prompt, one cell: the unbatched reference."""
    clean = {}

    def save(x, hook):
        clean["x"] = x.detach().clone()

    name = hook_name(kind, layer)
    with torch.no_grad():
        with bridge.hooks(fwd_hooks=[(name, save)]):
            bridge(prompts.clean_ids[i : i + 1], return_type="logits")

        def write(x, hook):
            x = x.clone()
            if kind == "resid_pre":
                x[:, cell] = clean["x"][:, cell]
            else:
                x[:, :, cell] = clean["x"][:, :, cell]
            return x

        with bridge.hooks(fwd_hooks=[(name, write)]):
            logits = bridge(prompts.corrupted_ids[i : i + 1], return_type="logits")[0, -1]
        base = bridge(prompts.corrupted_ids[i : i + 1], return_type="logits")[0, -1]
    io, s = prompts.io_ids[i], prompts.s_ids[i]
    return float((logits[io] - logits[s]) - (base[io] - base[s]))


def logit_noise(bridge, ids: torch.Tensor) -> float:
    """The fp32 rounding noise of a last-position logit difference: 64 ulps of the largest logit.

    Patching the same cell in batches of another composition sums in another order, which moves a
    logit by a few ulps of its magnitude (up to 7 measured for the tiny model, batch of 1 vs 29).
    """
    with torch.no_grad():
        scale = bridge(ids, return_type="logits")[:, -1].abs().max()
    return float(64 * torch.finfo(torch.float32).eps * scale)


@pytest.mark.parametrize("which", ["original", "ln_free"])
def test_layer0_s2_patch_recovers_the_full_gap_and_batching_is_exact(which, request, tiny_tokenizer):
    bridge = request.getfixturevalue(which).bridge()
    prompts = make_ioi_prompts(tiny_tokenizer, 4, seed=0)
    clean = patching.logit_diff(bridge, prompts.clean_ids, prompts.io_ids, prompts.s_ids)
    corrupted = patching.logit_diff(bridge, prompts.corrupted_ids, prompts.io_ids, prompts.s_ids)
    gap = clean - corrupted
    noise = logit_noise(bridge, prompts.clean_ids)
    assert gap.abs().min() > max(0.01, 50 * noise)  # the checks below can tell a patch from noise
    # the whole grid, unpruned, in batches that mix layers (29 does not divide 4 x 4 x 16)
    full = patching.activation_patching(bridge, prompts, "resid_pre", batch_size=29, skip_unchanged=False)
    normed = patching.normalise(full, clean, corrupted)
    s2 = prompts.s2_position
    torch.testing.assert_close(full[:, 0, s2], gap, atol=noise, rtol=0)  # the whole gap, in logits...
    assert (normed[:, 0, s2] - 1).abs().max() < noise / gap.abs().min()  # ...so the normalised value is 1
    others = torch.ones(normed.shape[1:], dtype=torch.bool)
    others[0, s2] = False
    others[1:, s2:] = False  # what S2 can reach from layer 1 on
    assert full[:, others].abs().max() < noise  # logits: zero up to the float noise of batch composition
    # pruning the unchanged cells gives the same grid
    pruned = patching.activation_patching(bridge, prompts, "resid_pre", batch_size=64)
    torch.testing.assert_close(pruned, full, atol=noise, rtol=0)
    # batched rows equal one-forward-per-cell patching
    heads = patching.activation_patching(bridge, prompts, "z", batch_size=11)
    for i, layer, cell in ((0, 0, s2), (3, 2, s2 + 2), (1, 3, prompts.n_positions - 1)):
        reference = naive_patch(bridge, prompts, "resid_pre", i, layer, cell)
        assert full[i, layer, cell].item() == pytest.approx(reference, abs=noise)
    for i, layer, head in ((1, 0, 3), (3, 2, 2), (2, 3, 0)):
        reference = naive_patch(bridge, prompts, "z", i, layer, head)
        assert heads[i, layer, head].item() == pytest.approx(reference, abs=noise)


def linear_bridge(ln_free_model: AnalysisModel):
    """The LN-free tiny model made affine: Q = K = 0 in every block and every MLP output zeroed.

    Zero queries and keys give every head the same fixed causal pattern (uniform over the
    positions so far), so each head's output is a fixed average of values, linear in the residual
    stream; without norms and MLPs, the logits are then an affine function of resid_pre at every
    layer and position and of every head's z. Information still flows from S2 to the last
    position, so the clean-corrupted gap is not zero.
    """
    folded = ln_free_model.loaded.folded()
    d_model = folded.config.n_embd
    with torch.no_grad():
        for block in folded.transformer.h:
            block.attn.c_attn.weight[:, : 2 * d_model] = 0  # Conv1D weight [d_model, 3 d_model]: Q, K, V
            block.attn.c_attn.bias[: 2 * d_model] = 0
            block.mlp.c_proj.weight.zero_()
            block.mlp.c_proj.bias.zero_()
    return bridge_from_folded(folded, ln_free_model.tokenizer)


def test_attribution_equals_activation_patching_when_the_metric_is_linear(ln_free, tiny_tokenizer):
    prompts = make_ioi_prompts(tiny_tokenizer, 6, seed=2)
    bridge = linear_bridge(ln_free)
    clean = patching.logit_diff(bridge, prompts.clean_ids, prompts.io_ids, prompts.s_ids)
    corrupted = patching.logit_diff(bridge, prompts.corrupted_ids, prompts.io_ids, prompts.s_ids)
    assert (clean - corrupted).abs().min() > 1e-3
    for kind in patching.KINDS:
        act = patching.activation_patching(bridge, prompts, kind, skip_unchanged=False)
        attr = patching.attribution_patching(bridge, prompts, kind)
        scale = act.abs().max()
        assert scale > 1e-3, kind  # non-trivial
        torch.testing.assert_close(attr, act, atol=1e-4 * scale, rtol=1e-4, msg=kind)
        # normalised (the reported unit), the two agree to float precision as well
        normed = [patching.normalise(x, clean, corrupted) for x in (attr, act)]
        torch.testing.assert_close(*normed, atol=1e-3, rtol=1e-3)
        agree = patching.agreement_summary(act, attr, act != 0, units=prompts.pair, n_bootstrap=50)
        assert agree["nmae"]["value"] < 1e-3 and agree["pearson_r_pooled"]["value"] > 0.9999, kind
    # the layer-0 S2 residual carries the whole gap here too
    torch.testing.assert_close(patching.activation_patching(bridge, prompts)[:, 0, prompts.s2_position],
                               clean - corrupted, atol=logit_noise(bridge, prompts.clean_ids), rtol=0)  # fmt: skip

    # Sanity check of the construction: on the unmodified LN-free model they differ.
    act = patching.activation_patching(ln_free.bridge(), prompts, "resid_pre")
    attr = patching.attribution_patching(ln_free.bridge(), prompts, "resid_pre")
    assert (act - attr).abs().max() > 1e-2


def test_patch_ioi_and_agreement(original, tiny_tokenizer):
    prompts = make_ioi_prompts(tiny_tokenizer, 8, seed=0)
    result = patching.patch_ioi(original.bridge(), prompts, batch_size=32)
    s2 = prompts.s2_position
    noise = logit_noise(original.bridge(), prompts.clean_ids)
    assert (result.activation["resid_pre"][:, 0, s2] - 1).abs().max() < noise / result.gap.abs().min()
    assert set(result.seconds) == {"caches", "attribution", "activation"}
    # patch_ioi's attribution equals the standalone function's
    attr = patching.attribution_patching(original.bridge(), prompts, "z")
    torch.testing.assert_close(result.attribution["z"], patching.normalise(attr, result.clean_ld, result.corrupted_ld))
    nmae, r = patching.agreement_per_prompt(result.activation["resid_pre"], result.attribution["resid_pre"],
                                            result.changed["resid_pre"])  # fmt: skip
    assert nmae.shape == r.shape == (8,) and np.isfinite(nmae).all() and (r > 0.5).all()
    # agreement statistics are invariant to the per-prompt normalisation and exact for identical grids
    a = torch.randn(6, 3, 4)
    same = patching.agreement_summary(a, a.clone(), n_bootstrap=20)
    assert same["nmae"]["value"] == 0 and same["pearson_r"]["value"] == pytest.approx(1)
    scaled = patching.agreement_per_prompt(a * torch.tensor([1, -2, 3, 4, 5, 0.5])[:, None, None],
                                           (a + 0.1) * torch.tensor([1, -2, 3, 4, 5, 0.5])[:, None, None])
    np.testing.assert_allclose(scaled[0], patching.agreement_per_prompt(a, a + 0.1)[0], rtol=1e-6)


def test_run_writes_tables_figures_and_summary(original, ln_free, tmp_path):
    summary = patching.run([original, ln_free], tmp_path, n_prompts=4, n_bootstrap=20)
    assert {"tables", "figures"} <= set(summary)
    for path in summary["tables"] + summary["figures"]:
        assert (tmp_path / path.split("/")[-1]).is_file()
    assert json.loads((tmp_path / "patching_summary.json").read_text())["models"].keys() == {"original", "ln_free"}
    import pandas as pd

    cells = pd.read_csv(tmp_path / "patching_cells.csv")
    assert set(cells["model"]) == {"original", "ln_free"} and set(cells["kind"]) == {"resid_pre", "z"}
    assert len(cells) == 2 * 4 * 4 * (16 + 4)
    agreement = pd.read_csv(tmp_path / "patching_agreement.csv")
    assert {"nmae", "pearson_r", "pearson_r_pooled"} <= set(agreement["statistic"])
    assert (agreement["ci_low"] <= agreement["value"] + 1e-12).where(agreement["ci_low"].notna(), True).all()
    info = summary["models"]["ln_free"]
    assert info["ln_free"] and info["agreement"]["resid_pre"]["n_prompts"] == 4
    assert any(p.endswith("patching_heatmaps_original.html") for p in summary["figures"])


def test_attribution_is_the_directional_derivative_at_the_corrupted_run(original, tiny_tokenizer):
    """Attribution = d/dε m(corrupted + ε·(clean − corrupted)) at ε = 0 (central differences, float64).

    On a non-linear model this tells the corrupted-run gradient from the clean-run gradient.
    """
    bridge = original.bridge()
    prompts = make_ioi_prompts(tiny_tokenizer, 2, seed=1)
    attribution = patching.attribution_patching(bridge, prompts, "resid_pre")
    clean = patching.cache_activations(bridge, prompts.clean_ids, "resid_pre")
    corrupted = patching.cache_activations(bridge, prompts.corrupted_ids, "resid_pre")
    layer, position, eps = 1, prompts.s2_position, 1e-3
    name = hook_name("resid_pre", layer)

    def metric(i: int, scale: float) -> float:
        def shift(x, hook):
            x = x.clone()
            delta = (clean[layer, i, position] - corrupted[layer, i, position]).to(x.dtype)
            x[:, position] = x[:, position] + scale * delta
            return x

        with torch.no_grad(), bridge.hooks(fwd_hooks=[(name, shift)]):
            logits = bridge(prompts.corrupted_ids[i : i + 1], return_type="logits")[0, -1].double()
        return float(logits[prompts.io_ids[i]] - logits[prompts.s_ids[i]])

    at_corrupted = [(metric(i, eps) - metric(i, -eps)) / (2 * eps) for i in range(2)]
    at_clean = [(metric(i, 1 + eps) - metric(i, 1 - eps)) / (2 * eps) for i in range(2)]
    for i in range(2):
        value = float(attribution[i, layer, position])
        assert value == pytest.approx(at_corrupted[i], rel=2e-2, abs=2e-3)
        assert abs(at_clean[i] - at_corrupted[i]) > 10 * abs(value - at_corrupted[i])  # the test can tell them apart
