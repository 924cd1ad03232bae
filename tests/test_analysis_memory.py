"""The analyses' memory bounds change no number: logits in budgeted passes, the unembedding in column
blocks, no logits where none are read, one bridge at a time, and the peak each run reports."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from families import tiny_family
from lnfree.analysis import common, dla, residual
from lnfree.analysis.patching import run as patching
from lnfree.analysis.entropy_neurons import run as en
from lnfree.analysis.entropy_neurons import ablation
from lnfree.analysis.common import AnalysisModel, logit_rows
from lnfree.analysis.ioi import make_ioi_prompts
from lnfree.forms.bridge import LAST_POSITION_LOGITS, bridge_from_layernorm, hook_name, norm_centres, norm_weight
from lnfree.cli import app
from lnfree.forms.load import LoadedModel, load
from lnfree.data.tiny import TINY_MODEL_DIR


@pytest.fixture(scope="module")
def original():
    """The bundled tiny GPT-2 (real LayerNorm), its bridge built once."""
    return AnalysisModel("original", load(TINY_MODEL_DIR))


@pytest.fixture(scope="module")
def tokens(original):
    vocab = original.loaded.model.config.vocab_size
    return torch.randint(0, vocab, (5, 16), generator=torch.Generator().manual_seed(0))


def one_sequence_per_pass(monkeypatch, n_pos: int, vocab: int) -> None:
    """Shrink the logits budget to one sequence of ``n_pos`` positions per forward pass."""
    monkeypatch.setattr(common, "LOGITS_BUDGET", n_pos * vocab)


def test_logit_rows_keep_a_pass_within_the_budget():
    assert logit_rows(64, 262_144, 8) == 4  # Gemma 3 at 64 tokens: 4 × 64 × 262,144 = 2**26 logits
    assert logit_rows(64, 50_257, 8) == 8  # GPT-2: the batch asked for fits
    assert logit_rows(1024, 262_144, 8) == 1  # never fewer than one sequence
    assert logit_rows(1, 262_144, 256) == 256  # patching's last-position logits


# ----------------------------------------------------------------------------------------------
# Entropy neurons: W_U in column blocks, ablations in budgeted passes, no logits for the means
# ----------------------------------------------------------------------------------------------


def whole_unembedding(bridge) -> torch.Tensor:
    """What `unembedding` computed before it was read in blocks: the whole matrix in float64 at once."""
    W_U = bridge.W_U.detach().to(torch.float64)
    weight = norm_weight(bridge, bridge.ln_final.original_component)
    if isinstance(weight, torch.Tensor) and weight.shape == (W_U.shape[0],):
        W_U = W_U * weight.to(torch.float64)[:, None]
    return en.centred(W_U, dim=0) if norm_centres(bridge) else W_U


@pytest.mark.parametrize("which", ["tiny", "gemma3"])
def test_unembedding_in_column_blocks_gives_the_same_numbers(original, which):
    """Blocks of columns hold the same float64 values; scores computed from them are bit-for-bit the
    same (the same blocks are summed in the same order); smaller blocks only reorder float64 sums."""
    if which == "tiny":
        bridge = original.bridge()
    else:  # RMSNorm with Gemma's 1 + weight, left in the final norm (no compatibility mode: nothing folded)
        bridge = bridge_from_layernorm(tiny_family("gemma3", vocab_size=300), compatibility_mode=False)
    whole = whole_unembedding(bridge)
    columns = en.unembedding_columns(bridge)
    assert torch.equal(en.unembedding(bridge), whole)
    assert columns.shape == tuple(whole.shape)
    w_out = en.output_weights(bridge, bridge.cfg.n_layers - 1)
    assert torch.equal(en.logit_variance(w_out, columns), en.logit_variance(w_out, whole))
    centre = norm_centres(bridge)
    for blocks, matrix in zip(en.null_space_basis(columns, centre=centre), en.null_space_basis(whole, centre=centre)):
        assert torch.equal(blocks, matrix)
    small = en.unembedding_columns(bridge, chunk=7)
    torch.testing.assert_close(en.logit_variance(w_out, small), en.logit_variance(w_out, whole), rtol=1e-10, atol=0)
    # an fp32 W_U is read in float64 block by block: the same as converting it whole
    fp32 = bridge.W_U.detach()
    assert torch.equal(en.logit_variance(w_out, fp32, chunk=64), en.logit_variance(w_out, fp32.double(), chunk=64))


def test_ablations_in_budgeted_passes_give_the_same_numbers(original, tokens, monkeypatch):
    """One sequence per pass and one position per statistics slice, against all rows in one pass: the
    per-token statistics are exactly each row's own; the forward passes differ only by fp32 rounding."""
    bridge = original.bridge()
    vocab = bridge.cfg.d_vocab
    sets = [[(3, 5)], [(3, 7)], [(3, 5), (3, 7)]]
    means = en.mean_activations(bridge, tokens, [3])
    together = en.ablation_effects(bridge, tokens, sets, means)
    one_sequence_per_pass(monkeypatch, tokens.shape[1], vocab)
    monkeypatch.setattr(ablation, "STATS_BUDGET", vocab)  # one position per slice
    apart = en.ablation_effects(bridge, tokens, sets, means)
    for name in ("entropy", "ce", "ablated_entropy", "ablated_ce"):
        torch.testing.assert_close(getattr(apart, name), getattr(together, name), rtol=0, atol=1e-5)
    logits = torch.randn(2, 9, vocab, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(2))
    for sliced, whole in zip(ablation._token_stats(logits, ids), ablation._token_stats(logits, ids, slice_tokens=18)):
        assert torch.equal(sliced, whole)


def test_mean_activations_read_no_logits_and_give_the_same_numbers(original, tokens):
    bridge = original.bridge()
    sums = []

    def add(activation, hook):
        sums.append(activation.detach().double().sum(dim=(0, 1)))

    with torch.no_grad(), bridge.hooks(fwd_hooks=[(hook_name("mlp_post", 2), add)]):
        logits = bridge(tokens, return_type="logits")  # every position's logits, as before
    assert logits.shape[1] == tokens.shape[1]
    assert torch.equal(en.mean_activations(bridge, tokens, [2])[2], sums[0] / tokens.numel())
    with torch.no_grad(), bridge.hooks(fwd_hooks=[LAST_POSITION_LOGITS]):
        assert bridge(tokens, return_type="logits").shape == (*tokens.shape[:1], 1, logits.shape[-1])


# ----------------------------------------------------------------------------------------------
# DLA, residual norms and sinks, patching
# ----------------------------------------------------------------------------------------------


def test_dla_in_budgeted_batches_gives_the_same_numbers(original, tokens, monkeypatch):
    bridge = original.bridge()
    together = dla.dla_and_direct_effect(bridge, tokens, batch_size=5)
    one_sequence_per_pass(monkeypatch, tokens.shape[1], bridge.cfg.d_vocab)
    apart = dla.dla_and_direct_effect(bridge, tokens, batch_size=5)
    for name in ("dla", "de", "bias", "target_logits"):  # a sequence's numbers are its own, up to fp32 rounding
        torch.testing.assert_close(getattr(apart, name), getattr(together, name), rtol=1e-5, atol=1e-5)


def test_residual_norms_and_sinks_read_no_logits_and_give_the_same_numbers(original, tokens):
    model = original.loaded.hf()
    with torch.no_grad():
        full = model(input_ids=tokens, output_hidden_states=True)  # every position's logits, as before
    stream = residual.residual_stream(model, tokens)
    for layer in range(model.config.n_layer):
        assert torch.equal(stream[layer], full.hidden_states[layer])
    bridge = original.bridge()
    store = {}

    def saver(pattern, hook):
        store[hook.name] = pattern[..., 0].detach().float()

    with torch.no_grad(), bridge.hooks(fwd_hooks=[(hook_name("pattern", 1), saver)]):
        bridge(tokens, return_type=None)
    assert torch.equal(residual.attention_to_first(bridge, tokens, batch_size=5)[1], next(iter(store.values())))


def test_patching_in_budgeted_batches_gives_the_same_numbers(original, monkeypatch):
    bridge = original.bridge()
    prompts = make_ioi_prompts(original.tokenizer, 6, seed=0)
    together = patching.patch_ioi(bridge, prompts, batch_size=256)
    monkeypatch.setattr(common, "LOGITS_BUDGET", 5 * bridge.cfg.d_vocab)  # 5 prompts per pass
    apart = patching.patch_ioi(bridge, prompts, batch_size=256)
    for kind in patching.KINDS:
        torch.testing.assert_close(apart.activation[kind], together.activation[kind], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(apart.attribution[kind], together.attribution[kind], rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# One bridge at a time; the peak in the output
# ----------------------------------------------------------------------------------------------


def test_entropy_neurons_build_one_bridge_at_a_time_and_keep_a_callers_bridge(tiny_ln_free_export, tokens, tmp_path,
                                                                             monkeypatch):
    models = [AnalysisModel("original", load(TINY_MODEL_DIR)), AnalysisModel("ln_free", load(tiny_ln_free_export))]
    built = []
    build = LoadedModel.bridge

    def counted(self):
        assert all(m._bridge is None for m in models), "another model's bridge is still alive"
        built.append(self.source)
        return build(self)

    monkeypatch.setattr(LoadedModel, "bridge", counted)
    en.run(models, tmp_path / "first", tokens=tokens[:2], n_bootstrap=0)
    assert len(built) == 2 and all(m._bridge is None for m in models)
    en.run(models, tmp_path / "ln_free_reference", tokens=tokens[:2], n_bootstrap=0, reference="ln_free")
    assert len(built) == 5  # the reference ranked first, then every model in order
    monkeypatch.setattr(LoadedModel, "bridge", build)
    cached = models[0].bridge()
    en.run(models[:1], tmp_path / "cached", tokens=tokens[:2], n_bootstrap=0)
    assert models[0]._bridge is cached  # built by the caller: kept


def test_analyze_and_eval_report_their_peak_memory(tmp_path):
    runner = CliRunner()
    out = tmp_path / "analysis"
    result = runner.invoke(app, ["analyze", "residual", "--models", "tiny", "--n-sequences", "2", "--length", "16",
                                 "--n-bootstrap", "0", "--no-progress", "--device", "cpu", "--out", str(out)])
    assert result.exit_code == 0, result.output
    peaks = json.loads((out / "timings.json").read_text())["peak_memory_gb"]
    assert list(peaks) == ["residual"] and 0.05 < peaks["residual"] < 100
    assert f"peak memory {peaks['residual']:.2f} GB" in result.stdout and "peak memory: " in result.stdout
    again = runner.invoke(app, ["analyze", "dla", "--models", "tiny", "--n-sequences", "2", "--length", "16",
                                "--n-bootstrap", "0", "--no-progress", "--device", "cpu", "--out", str(out)])
    assert again.exit_code == 0, again.output
    assert list(json.loads((out / "timings.json").read_text())["peak_memory_gb"]) == ["dla", "residual"]  # kept
    evaluated = runner.invoke(app, ["eval", "tiny", "--n-sequences", "4", "--context", "16", "--no-progress",
                                    "--bootstrap", "10", "--out", str(tmp_path / "eval")])
    assert evaluated.exit_code == 0, evaluated.output
    peak = json.loads((tmp_path / "eval" / "summary.json").read_text())["settings"]["peak_memory_gb"]
    assert 0.05 < peak < 100 and f"peak memory: {peak:.2f} GB" in evaluated.stdout
