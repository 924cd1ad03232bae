"""Entropy neurons: scores, null-space fraction, batched mean ablation, and the planted-neuron check."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import small_gpt2
from lnfree.analysis.entropy_neurons import run as en
from lnfree.forms.bridge import bridge_from_layernorm, hook_name

PLANTED_LAYER, PLANTED_NEURON = 1, 5


# ----------------------------------------------------------------------------------------------
# Pure functions
# ----------------------------------------------------------------------------------------------


def test_candidate_scores_rank_a_hand_made_example():
    e1, e2, e3 = torch.eye(3, dtype=torch.float64)
    W_U = torch.stack([e1, e2, -e1, -e2], dim=1)  # [d_model=3, vocab=4]
    w_out = torch.stack([
        e3,                                    # a: orthogonal to every token: cos 0 everywhere
        2 * e1,                                # b: cos (1, 0, -1, 0)          -> var 1/2, score 2/0.5
        e1 + e2,                               # c: cos ±1/√2                   -> var 1/2, score √2/0.5
        3 * (e1 + e3) / math.sqrt(2),          # d: cos (1/√2, 0, -1/√2, 0)     -> var 1/4, score 3/0.25
    ])
    var = en.logit_variance(w_out, W_U)
    assert torch.allclose(var, torch.tensor([0.0, 0.5, 0.5, 0.25], dtype=torch.float64), atol=1e-12)
    scores = en.candidate_scores(w_out, W_U)
    assert torch.allclose(scores[1:], torch.tensor([4.0, 2 * math.sqrt(2), 12.0], dtype=torch.float64))
    assert scores[0] > 1e20  # LogitVar 0, floored: ranks first
    assert torch.argsort(scores, descending=True).tolist() == [0, 3, 1, 2]


def test_logit_variance_equals_the_direct_computation():
    gen = torch.Generator().manual_seed(0)
    w_out = torch.randn(5, 16, generator=gen, dtype=torch.float64)
    W_U = torch.randn(16, 100, generator=gen, dtype=torch.float64)
    W_U[:, 3] = 0  # a zero column counts as cosine 0
    cos = (w_out / w_out.norm(dim=1, keepdim=True)) @ (W_U / W_U.norm(dim=0).clamp_min(1e-30))
    expected = cos.var(dim=1, unbiased=False)
    assert torch.allclose(en.logit_variance(w_out, W_U, chunk=7), expected, atol=1e-12)
    assert torch.allclose(en.candidate_scores(w_out[0], W_U), w_out[0].norm() / expected[:1])


def test_null_space_fraction_is_one_in_the_null_space_and_zero_along_the_top_direction():
    gen = torch.Generator().manual_seed(1)
    d, vocab = 8, 5  # rank 5 inside the 7-dim centred subspace: two non-trivial null directions
    W_U = en.centred(torch.randn(d, vocab, generator=gen, dtype=torch.float64), dim=0)
    u, s, _ = torch.linalg.svd(W_U, full_matrices=True)
    top = u[:, 0]
    ones = torch.ones(d, dtype=torch.float64) / math.sqrt(d)
    null = u[:, vocab:] @ torch.randn(d - vocab, generator=gen, dtype=torch.float64)
    null = null - (null @ ones) * ones  # the remaining null directions, minus the trivial all-ones one
    assert torch.allclose(W_U.T @ null, torch.zeros(vocab, dtype=torch.float64), atol=1e-12)

    assert en.null_space_fraction(null, W_U, k=2).item() == pytest.approx(1.0, abs=1e-10)
    # The all-ones component is removed by every norm, so it is ignored (centred away).
    assert en.null_space_fraction(null + 5 * ones, W_U, k=2).item() == pytest.approx(1.0, abs=1e-10)
    assert en.null_space_fraction(top, W_U, k=2).item() == pytest.approx(0.0, abs=1e-10)
    assert en.null_space_fraction(top, W_U, k=d - 2).item() == pytest.approx(0.0, abs=1e-10)
    assert en.null_space_fraction(top, W_U, k=d - 1).item() == pytest.approx(1.0, abs=1e-10)
    basis, singular = en.null_space_basis(W_U)
    assert basis.shape == (d, d - 1)
    assert torch.allclose(singular[-vocab:].flip(0), s, atol=1e-10)  # ascending, all-ones excluded
    assert torch.allclose(basis.T @ ones, torch.zeros(d - 1, dtype=torch.float64), atol=1e-10)


def test_known_gpt2_neurons_and_neuron_specs():
    assert en.known_entropy_neurons(12, 768, 3072) == [(11, 584), (11, 2123), (11, 2870)]
    assert en.known_entropy_neurons(24, 1024, 4096) == [(23, 3144), (23, 1083), (23, 1108)]
    assert en.known_entropy_neurons(4, 128, 512) is None
    assert en.known_entropy_neurons(12, 768, 512) is None  # not GPT-2's MLP width
    assert en.parse_neurons([5, "2.7", (1, 3), "9"], layer=3) == [(3, 5), (2, 7), (1, 3), (3, 9)]
    assert en.neuron_label((11, 584)) == "11.584"
    with pytest.raises(ValueError):
        en.parse_neurons([5, "3.5"], layer=3)
    assert en.default_null_k(768) == 12 and en.default_null_k(32) == 1


# ----------------------------------------------------------------------------------------------
# Mean ablation
# ----------------------------------------------------------------------------------------------


def _hf_reference(model, tokens, ablation, means):
    """Entropy / next-token CE of the HF model with `ablation` mean-ablated via forward hooks on mlp.act."""
    handles = []
    for layer in {l for l, _ in ablation}:
        idx = [n for l, n in ablation if l == layer]

        def hook(module, args, output, idx=idx, layer=layer):
            output = output.clone()
            output[..., idx] = means[layer][idx].to(output.dtype)
            return output

        handles.append(model.transformer.h[layer].mlp.act.register_forward_hook(hook))
    try:
        with torch.no_grad():
            log_p = torch.log_softmax(model(tokens).logits.double(), dim=-1)
    finally:
        for handle in handles:
            handle.remove()
    entropy = -(log_p.exp() * log_p).sum(-1)
    ce = -log_p[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return entropy, ce


def test_batched_ablations_match_hooks_on_the_hf_model():
    model = small_gpt2(n_layer=2, n_embd=32, vocab_size=64, seed=3)
    with torch.no_grad():  # make the ablated neurons matter (random init writes ~0.1)
        for layer, neuron in [(0, 3), (1, 7), (1, 9), (1, 11)]:
            model.transformer.h[layer].mlp.c_fc.weight[:, neuron] *= 30
            model.transformer.h[layer].mlp.c_proj.weight[neuron] *= 30
    bridge = bridge_from_layernorm(model)
    tokens = torch.randint(0, 64, (5, 16), generator=torch.Generator().manual_seed(0))

    hf_sums = {0: 0.0, 1: 0.0}

    def saver(layer):
        def hook(module, args, output):
            hf_sums[layer] = hf_sums[layer] + output.double().sum(dim=(0, 1))
        return hook

    handles = [model.transformer.h[l].mlp.act.register_forward_hook(saver(l)) for l in (0, 1)]
    with torch.no_grad():
        model(tokens)
    for handle in handles:
        handle.remove()
    means = en.mean_activations(bridge, tokens, [0, 1], batch_tokens=32)  # 2 sequences per forward
    for layer in (0, 1):
        assert torch.allclose(means[layer], hf_sums[layer] / tokens.numel(), atol=1e-5)

    ablations = [[(1, 7)], [(0, 3)], [(1, 7), (0, 3)], [(1, 7), (1, 9), (1, 11)]]
    # 3 rows per forward: clean and ablated copies of different sequences share forward passes.
    effects = en.ablation_effects(bridge, tokens, ablations, means, batch_tokens=48)
    clean_h, clean_ce = _hf_reference(model, tokens, [], means)
    assert torch.allclose(effects.entropy, clean_h, atol=1e-4)
    assert torch.allclose(effects.ce, clean_ce, atol=1e-4)
    for i, ablation in enumerate(ablations):
        h, ce = _hf_reference(model, tokens, ablation, means)
        assert torch.allclose(effects.ablated_entropy[i], h, atol=1e-4), ablation
        assert torch.allclose(effects.ablated_ce[i], ce, atol=1e-4), ablation
        assert effects.delta_entropy[i].abs().max() > 1e-3, ablation  # the ablations do something
    # Batching does not change the result.
    one_by_one = en.ablation_effects(bridge, tokens, ablations, means, batch_tokens=1)
    assert torch.allclose(one_by_one.ablated_entropy, effects.ablated_entropy, atol=1e-5)


def test_mean_ablating_a_constant_neuron_changes_nothing():
    model = small_gpt2(n_layer=2, n_embd=32, vocab_size=64, seed=4)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[:, 9] = 0.0  # pre-activation = bias: the same at every token
        model.transformer.h[1].mlp.c_fc.bias[9] = 0.7
        model.transformer.h[1].mlp.c_proj.weight[9] *= 50  # and it writes a lot
        model.transformer.h[0].mlp.c_fc.weight[:, 2] *= 30  # a varying neuron, for contrast
        model.transformer.h[0].mlp.c_proj.weight[2] *= 30
    bridge = bridge_from_layernorm(model)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    effects = en.ablation_effects(bridge, tokens, [[(1, 9)], [(0, 2)]])
    assert effects.delta_entropy[0].abs().max() <= 1e-9
    assert effects.delta_ce[0].abs().max() <= 1e-9
    assert effects.delta_entropy[1].abs().max() > 1e-4  # a varying neuron does change the output


# ----------------------------------------------------------------------------------------------
# The planted entropy neuron
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A GPT-2 whose last-layer neuron 5 writes only into u, a direction the unembedding ignores.

    u ⊥ all-ones (so ln_f's centring keeps it) and every token embedding (tied with the
    unembedding) is orthogonal to w_f ⊙ u (w_f: ln_f's weight), so the logits never read u.
    In the LN model, writing into u still changes the residual norm, hence ln_f's scale.
    Returns (original LN model, its LN-free export), both loaded with lnfree.load.
    """
    from transformers import AutoTokenizer

    from lnfree.fixedscale import surgery
    from lnfree.analysis.common import load_models
    from lnfree.forms.export import write_export
    from lnfree.data.tiny import TINY_MODEL_DIR

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    model = small_gpt2(n_layer=2, n_embd=32, n_positions=64, vocab_size=len(tokenizer), seed=5)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        # u = (e_0 - e_1)/√2 is centred, and W_Uᵀu = 0 holds exactly (also in float32 and after
        # folding) when ln_f's weight and every token embedding agree on coordinates 0 and 1.
        u = torch.zeros(32)
        u[0], u[1] = 2**-0.5, -(2**-0.5)
        wte = model.transformer.wte.weight
        assert model.lm_head.weight is wte  # tied
        wte.normal_(0, 0.3, generator=gen)
        wte[:, 1] = wte[:, 0]
        model.transformer.ln_f.weight[1] = model.transformer.ln_f.weight[0]
        mlp = model.transformer.h[PLANTED_LAYER].mlp
        mlp.c_proj.weight[PLANTED_NEURON] = 6.0 * u
        mlp.c_fc.weight[:, PLANTED_NEURON] = torch.randn(32, generator=gen) / math.sqrt(32)
        mlp.c_fc.bias[PLANTED_NEURON] = 1.5
    root = tmp_path_factory.mktemp("planted")
    model.save_pretrained(root / "original")
    tokenizer.save_pretrained(root / "original")

    installed = surgery.install(copy.deepcopy(model))
    ids = torch.randint(0, len(tokenizer), (8, 32), generator=gen)
    surgery.initialise_sigmas(installed, [ids])
    for state in surgery.scale_states(installed).values():
        state.switch_to_fixed()
    write_export(installed, tokenizer, root / "ln_free", {"note": "planted entropy neuron"})
    models = load_models([str(root / "original"), str(root / "ln_free")], ["original", "ln_free"])
    assert not models[0].ln_free and models[1].ln_free
    tokens = torch.randint(0, len(tokenizer), (8, 32), generator=torch.Generator().manual_seed(6))
    return models, tokens


def _activation_std(bridge, tokens, layer, neuron):
    store = {}

    def saver(activation, hook):
        store["a"] = activation[..., neuron].detach().clone()

    with torch.no_grad(), bridge.hooks(fwd_hooks=[(hook_name("mlp_post", layer), saver)]):
        bridge(tokens, return_type="logits")
    return float(store["a"].std())


def test_planted_entropy_neuron_ranks_first_and_only_acts_through_the_final_norm(planted):
    models, tokens = planted
    original, ln_free = (m.bridge() for m in models)
    neuron = (PLANTED_LAYER, PLANTED_NEURON)
    for bridge in (original, ln_free):
        ranking = en.rank_candidates(bridge)
        top = ranking.iloc[0]
        assert (top["layer"], top["neuron"]) == neuron
        assert top["score"] > 1e3 * ranking.iloc[1]["score"]
        assert top["null_space_fraction"] == pytest.approx(1.0, abs=1e-6)  # bottom-1 direction is u
        assert ranking.iloc[1:]["null_space_fraction"].max() < 0.5
        assert _activation_std(bridge, tokens, *neuron) > 0.1  # it fires, and varies: ablation is not trivial

    control = (PLANTED_LAYER, 0)  # an ordinary neuron
    ln = en.ablation_effects(original, tokens, [[neuron], [control]])
    free = en.ablation_effects(ln_free, tokens, [[neuron], [control]])
    # LN model: writing into u changes the residual norm, so ln_f's scale, so the entropy.
    assert ln.delta_entropy[0].abs().median() > 1e-2
    assert ln.delta_ce[0].abs().median() > 1e-3
    # LN-free model: the fixed-scale ln_f passes u on, and W_U ignores it: nothing changes.
    assert free.delta_entropy[0].abs().max() <= 1e-6
    # CE reads single float32 logits, whose rounding (summing the large ±u components) is ~1e-6.
    assert free.delta_ce[0].abs().max() <= 1e-5
    assert free.delta_entropy[1].abs().max() > 1e-4  # while an ordinary neuron's ablation is seen


def test_run_writes_tables_figures_and_summary(planted, tmp_path):
    models, tokens = planted
    summary = en.run(models, tmp_path / "out", tokens=tokens, top_k=3, n_bootstrap=50, max_token_rows=1000)
    assert summary["selection"] == "top-3 candidates of original"
    assert summary["neurons"][0] == f"{PLANTED_LAYER}.{PLANTED_NEURON}"
    names = list(summary["ablations"])
    assert len(names) == 5 and names[3:] == ["top-2", "top-3"]
    assert summary["ablations"]["top-3"] == summary["neurons"]
    for path in summary["tables"] + summary["figures"]:
        assert Path(path).is_file()
    assert {Path(p).stem for p in summary["tables"]} == {
        "candidates", "null_space_spectrum", "ablations", "distributions", "per_token"}
    assert {Path(p).stem for p in summary["figures"]} >= {
        "candidates", "ablation_distributions", "cumulative_entropy", "null_space_spectrum"}
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["neurons"] == summary["neurons"]

    planted_name = summary["neurons"][0]
    free = summary["per_model"]["ln_free"]["ablations"][planted_name]
    orig = summary["per_model"]["original"]["ablations"][planted_name]
    assert free["median_abs_delta_entropy"] <= 1e-6 and abs(free["relative_entropy_change_percent"]) < 1e-4
    assert orig["median_abs_delta_entropy"] > 1e-2
    lo, hi = orig["median_abs_delta_entropy_lo"], orig["median_abs_delta_entropy_hi"]
    assert lo <= orig["median_abs_delta_entropy"] <= hi
    assert summary["per_model"]["ln_free"]["selected"][planted_name]["rank"] == 1
    assert summary["per_model"]["original"]["selected"][planted_name]["null_space_fraction"] == pytest.approx(1, abs=1e-6)

    candidates = pd.read_csv(tmp_path / "out" / "candidates.csv")
    d_mlp = models[0].bridge().cfg.d_mlp
    assert len(candidates) == 2 * d_mlp and candidates["selected"].sum() == 2 * 3
    ablations = pd.read_csv(tmp_path / "out" / "ablations.csv")
    assert len(ablations) == 2 * 5 and set(ablations["kind"]) == {"single", "cumulative"}
    per_token = pd.read_csv(tmp_path / "out" / "per_token.csv")
    kept = summary["per_token_sequences"]  # 1000 rows allowed: 1000 // (2 models × 5 sets × 32) = 3 sequences
    assert len(kept) == 3 and len(per_token) == 2 * 5 * 3 * 32
    assert per_token["delta_ce"].isna().sum() == 2 * 5 * 3  # no next token at the last position
    dist = pd.read_csv(tmp_path / "out" / "distributions.csv")
    row = dist[(dist.model == "original") & (dist.ablation == planted_name) & (dist.metric == "abs_delta_entropy")]
    assert row["median"].item() == pytest.approx(orig["median_abs_delta_entropy"])
    assert row["count"].item() == tokens.numel()


def test_run_uses_given_neurons_in_any_layer(planted, tmp_path):
    models, tokens = planted
    summary = en.run(models[:1], tmp_path, tokens=tokens[:2], neurons=["0.3", 5], n_bootstrap=0)
    assert summary["selection"] == "given"
    assert summary["neurons"] == ["0.3", f"{PLANTED_LAYER}.5"]
    assert list(summary["ablations"]) == ["0.3", "1.5", "top-2"]
    with pytest.raises(ValueError, match="no neuron"):
        en.run(models[:1], tmp_path, tokens=tokens[:2], neurons=[10_000], n_bootstrap=0)


def test_token_stats_across_slices():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 7, 11, generator=gen) * 3
    ids = torch.randint(0, 11, (3, 7), generator=gen)
    entropy, ce = en._token_stats(logits, ids, slice_tokens=5)  # slices straddle sequence boundaries
    log_p = torch.log_softmax(logits.double(), dim=-1)
    assert torch.allclose(entropy, -(log_p.exp() * log_p).sum(-1))
    assert torch.allclose(ce, -log_p[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1))


def test_neuron_selection_defaults():
    ranking = pd.DataFrame({"layer": [11, 11, 11, 11], "neuron": [7, 3, 584, 9], "rank": [1, 2, 3, 4]})
    small, medium, other = (12, 768, 3072), (24, 1024, 4096), (4, 128, 512)
    assert en.select_neurons(small, ranking) == ([(11, 584), (11, 2123), (11, 2870)], "known GPT-2 entropy neurons")
    assert en.select_neurons(medium, None)[0] == [(23, 3144), (23, 1083), (23, 1108)]
    assert en.select_neurons(small, ranking, layer=11)[0][0] == (11, 584)
    # Another layer, or another shape: the top-ranked candidates.
    in_layer_10 = ranking.assign(layer=10)
    assert en.select_neurons(small, in_layer_10, layer=10, top_k=2) == ([(10, 7), (10, 3)], "top-2 candidates")
    assert en.select_neurons(other, ranking, top_k=3)[0] == [(11, 7), (11, 3), (11, 584)]
    assert en.select_neurons(small, ranking, neurons=[5, "10.2"]) == ([(11, 5), (10, 2)], "given")
    assert en.select_neurons(small, ranking, layer=4, neurons=[5])[0] == [(4, 5)]
