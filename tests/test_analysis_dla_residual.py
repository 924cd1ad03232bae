"""DLA vs direct effect, residual norms and attention sinks (lnfree.analysis.dla / .residual)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import numpy as np
import pytest
import torch
from transformers import GPT2LMHeadModel

from lnfree.analysis import dla, residual
from lnfree.analysis.common import AnalysisModel
from lnfree.forms.bridge import hook_name
from lnfree.forms.load import load
from lnfree.data.tiny import TINY_MODEL_DIR


@pytest.fixture(scope="module")
def models(tiny_ln_free_export):
    """The bundled tiny original (real LayerNorm) and its exactly LN-free export, bridges built once."""
    return {"original": AnalysisModel("original", load(TINY_MODEL_DIR)),
            "ln_free": AnalysisModel("ln_free", load(tiny_ln_free_export))}


@pytest.fixture(scope="module")
def tokens(models):
    vocab = models["original"].loaded.model.config.vocab_size
    return torch.randint(0, vocab, (3, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def results(models, tokens):
    return {label: dla.dla_and_direct_effect(m.bridge(), tokens, batch_size=2) for label, m in models.items()}


def _target_logits(model: AnalysisModel, tokens: torch.Tensor) -> torch.Tensor:
    """The plain model's logit of the next token at each position 0 .. n_pos - 2."""
    with torch.no_grad():
        logits = model.loaded.hf()(input_ids=tokens).logits
    return logits[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]


def test_ln_free_dla_equals_de_and_components_sum_to_logits(models, tokens, results):
    result = results["ln_free"]
    assert models["ln_free"].ln_free
    heads = torch.as_tensor(result.mask("head"))
    assert int(heads.sum()) == 4 * 4  # 4 layers × 4 heads
    assert result.dla.shape == result.de.shape == (len(result.labels), 3, 23)
    # every head (and every other component): DLA == DE within 1e-5
    assert (result.dla.double() - result.de).abs().max() < 1e-5
    table = dla.component_table(result, "ln_free")
    assert (table.loc[table["kind"] == "head", "nmae"] < 1e-5).all()
    assert dla.global_nmae(result, n_resamples=50)["nmae"] < 1e-5
    # the targets are the NEXT tokens, and the components plus the biases sum to their logits
    assert torch.equal(result.targets, tokens[:, 1:])
    expected = _target_logits(models["ln_free"], tokens)
    torch.testing.assert_close(result.target_logits, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(result.dla.sum(0) + result.bias, expected, atol=1e-4, rtol=0)


def test_layernorm_model_dla_differs_from_de_and_de_is_an_ablation(models, tokens, results):
    result = results["original"]
    bridge = models["original"].bridge()
    heads = torch.as_tensor(result.mask("head"))
    gap = (result.dla[heads].double() - result.de[heads]).abs()
    assert gap.amax(dim=(1, 2)).max() > 1e-2  # at least one head has DLA != DE
    stats = dla.global_nmae(result, n_resamples=50)
    assert stats["nmae"] > 1e-2
    # global NMAE is a ratio of sums over heads × samples, per-head NMAE a ratio of means
    d, e = result.dla[heads].double().numpy(), result.de[heads].double().numpy()
    assert stats["nmae"] == pytest.approx(np.abs(d - e).sum() / np.abs(e).sum(), rel=1e-9)
    table = dla.component_table(result, "original")
    first = table[table["kind"] == "head"].iloc[0]
    assert first["nmae"] == pytest.approx(np.abs(d[0] - e[0]).mean() / np.abs(e[0]).mean(), rel=1e-9)
    # DLA at the cached scale is still an exact decomposition of the target logits
    expected = _target_logits(models["original"], tokens)
    torch.testing.assert_close(result.dla.sum(0) + result.bias, expected, atol=1e-4, rtol=0)
    # final_norm recomputes the bridge's own final LayerNorm
    store = {}
    with torch.no_grad(), bridge.hooks(fwd_hooks=[(hook_name("ln_final_in"), lambda t, hook: store.update(x=t))]):
        logits = bridge(tokens, return_type="logits")
    recomputed = dla.final_norm(bridge, store["x"].double()) @ bridge.W_U.double() + bridge.b_U.double()
    torch.testing.assert_close(recomputed, logits.double(), atol=1e-4, rtol=0)
    # DE of a head == the target-logit drop when the bridge runs with that head removed from the final residual
    from lnfree.analysis.attribution import residual_decomposition

    index = result.labels.index("L2H1")
    component = residual_decomposition(bridge, tokens, per_head=True).components[index]
    with torch.no_grad(), bridge.hooks(fwd_hooks=[(hook_name("ln_final_in"), lambda t, hook: t - component)]):
        ablated = bridge(tokens, return_type="logits")
    target = tokens[:, 1:, None]
    drop = logits[:, :-1].gather(-1, target)[..., 0] - ablated[:, :-1].gather(-1, target)[..., 0]
    torch.testing.assert_close(result.de[index], drop.double(), atol=1e-4, rtol=0)


def test_dla_run_writes_tables_figures_and_summary(models, tokens, tmp_path):
    summary = dla.run(list(models.values()), tmp_path, tokens=tokens, seed=3, n_bootstrap=100, batch_size=2)
    assert set(summary["models"]) == {"original", "ln_free"}
    assert all(Path(p).is_file() for p in summary["tables"] + summary["figures"])
    written = json.loads((tmp_path / "dla_summary.json").read_text())
    assert written["models"] == json.loads(json.dumps(summary["models"]))
    table = pd.read_csv(tmp_path / "dla_components.csv")
    assert {"model", "layer", "head", "kind", "nmae", "mean_dla", "mean_de"} <= set(table.columns)
    assert len(table[(table["kind"] == "head")]) == 2 * 16 and len(table[table["kind"] == "mlp"]) == 2 * 4
    free, original = summary["models"]["ln_free"]["heads"], summary["models"]["original"]["heads"]
    assert free["nmae"] < 1e-5 and original["nmae"] > 1e-2
    assert original["ci_low"] <= original["nmae"] <= original["ci_high"]
    # seeded: the same seed gives the same CI
    again = dla.run(list(models.values()), tmp_path / "again", tokens=tokens, seed=3, n_bootstrap=100)
    assert again["models"]["original"]["heads"] == original
    assert any(p.endswith("dla_nmae_heads_original.html") for p in summary["figures"])


def test_sink_rates_on_a_constructed_attention_pattern():
    # attention to key 0, [layer=1, seq=2, head=2, query=4]; query 0 always puts 1 on itself
    attn0 = torch.tensor([[[[1.0, 0.5, 0.2, 0.4], [1.0, 0.9, 0.8, 0.1]],
                           [[1.0, 0.1, 0.3, 0.2], [1.0, 0.25, 0.05, 0.6]]]])
    # queries 1..3: head 0 mean = (0.5+0.2+0.4+0.1+0.3+0.2)/6 = 0.2833 (no sink; 2/6 above 0.3, 0.3 itself is not)
    #               head 1 mean = (0.9+0.8+0.1+0.25+0.05+0.6)/6 = 0.45 (sink; 3/6 above 0.3)
    expected_means = torch.tensor([[1.7 / 6, 2.7 / 6]], dtype=torch.float64)
    torch.testing.assert_close(residual.head_mean_attention(attn0), expected_means)
    torch.testing.assert_close(residual.per_query_share(attn0), torch.tensor([[2 / 6, 3 / 6]], dtype=torch.float64))
    assert residual.sink_rate(attn0, "head_mean") == pytest.approx(1 / 2)
    assert residual.sink_rate(attn0, "per_query") == pytest.approx(5 / 12)
    # with query 0 included, head 0's mean is (1.7 + 2)/8 = 0.4625 and both heads are sinks
    assert residual.sink_rate(attn0, "head_mean", exclude_first_query=False) == pytest.approx(1.0)
    assert residual.sink_rate(attn0, "per_query", exclude_first_query=False) == pytest.approx(9 / 16)
    assert residual.sink_rate(attn0, "head_mean", threshold=0.5) == 0.0
    with pytest.raises(ValueError):
        residual.sink_rate(attn0, "gu")


def test_attention_to_first_matches_eager_transformers_attention(models, tokens):
    attn0 = residual.attention_to_first(models["original"].bridge(), tokens, batch_size=2)
    plain = GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR, attn_implementation="eager").eval()
    with torch.no_grad():
        attentions = plain(input_ids=tokens, output_attentions=True).attentions  # per layer [seq, head, q, k]
    expected = torch.stack([a[..., 0] for a in attentions])
    assert attn0.shape == (4, 3, 4, 24)
    torch.testing.assert_close(attn0, expected, atol=1e-5, rtol=0)


def test_residual_norms_equal_norms_of_transformers_hidden_states(models, tokens):
    loaded = models["original"].loaded
    norms = residual.residual_norms(loaded.hf(), tokens, batch_size=2)
    plain = GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR).eval()
    with torch.no_grad():
        hidden = plain(input_ids=tokens, output_hidden_states=True).hidden_states  # n_layers + 1, last after ln_f
    assert norms.shape == (5, 3, 24)
    for layer in range(4):
        torch.testing.assert_close(norms[layer], torch.linalg.norm(hidden[layer], dim=-1), atol=1e-4, rtol=1e-5)
    # the final entry is the residual entering ln_f: ln_f of it is transformers' last hidden state
    final = residual.residual_stream(loaded.hf(), tokens)[-1]
    torch.testing.assert_close(plain.transformer.ln_f(final), hidden[-1], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(norms[-1], torch.linalg.norm(final, dim=-1), atol=1e-4, rtol=1e-5)


def test_residual_run_writes_tables_figures_and_summary(models, tokens, tmp_path):
    summary = residual.run(list(models.values()), tmp_path, tokens=tokens, n_bootstrap=50, batch_size=2)
    assert all(Path(p).is_file() for p in summary["tables"] + summary["figures"])
    norms = pd.read_csv(tmp_path / "residual_norms.csv")
    assert len(norms) == 2 * 5 * 2  # models × (4 resid_pre + final) × position groups
    heads = pd.read_csv(tmp_path / "attention_sinks_heads.csv")
    assert len(heads) == 2 * 16 and heads["mean_attention_to_first"].between(0, 1).all()
    rates = pd.read_csv(tmp_path / "attention_sinks.csv")
    assert set(rates["definition"]) == {"head_mean", "per_query"}
    for label, entry in summary["models"].items():
        assert set(entry["sink_rate"]) == {"head_mean", "per_query"}
        assert len(entry["norm_position_0"]) == len(entry["norm_other_positions"]) == 5
    # the summary's numbers are the tables' numbers
    row = norms[(norms["model"] == "ln_free") & (norms["layer"] == 2) & (norms["positions"].astype(str) == "0")]
    assert row["mean_norm"].item() == pytest.approx(summary["models"]["ln_free"]["norm_position_0"][2])


def test_dla_refuses_a_partially_ln_free_model(tokens):
    from lnfree.fixedscale import surgery
    from lnfree.forms.load import LoadedModel

    model = surgery.install(GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR).eval())
    surgery.initialise_sigmas(model, [tokens])
    for name, state in surgery.scale_states(model).items():
        if name.endswith("ln_2"):
            state.switch_to_fixed()  # ln_2 fixed-scale, ln_1 and ln_f still real
    partial = LoadedModel(model, None, "partial", "test", True)
    with pytest.raises(ValueError, match="partially LN-free"):
        dla.dla_and_direct_effect(partial.bridge(), tokens)


@pytest.mark.parametrize("family", ["tiny-gpt2", "llama"])
def test_dla_equals_de_when_only_the_final_norm_is_fixed(family, tokens):
    """The DLA-exact partial removal: every block norm real, the final norm fixed."""
    from families import tiny_family
    from lnfree.fixedscale import surgery
    from lnfree.forms.load import LoadedModel

    model = GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR).eval() if family == "tiny-gpt2" else tiny_family(family)
    ids = tokens % model.config.vocab_size
    surgery.install(model)
    surgery.initialise_sigmas(model, [ids])
    surgery.scale_states(model)["ln_f"].switch_to_fixed()
    partial = AnalysisModel("ln_f_only", LoadedModel(model, None, "partial", "test", True))
    result = dla.dla_and_direct_effect(partial.bridge(), ids, batch_size=2)
    assert (result.dla.double() - result.de).abs().max() < 1e-5
    assert dla.global_nmae(result, n_resamples=50)["nmae"] < 1e-5
    expected = _target_logits(partial, ids)
    torch.testing.assert_close(result.dla.sum(0) + result.bias, expected, atol=1e-4, rtol=0)
    assert dla._final_norm_state(partial).startswith("fixed")
