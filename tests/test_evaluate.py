"""`lnfree.evaluate` and `lnfree eval`: per-token CE, outliers, calibration, pairwise JSD, datasets."""

from __future__ import annotations

import copy
import json
import math
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoTokenizer, GPT2LMHeadModel
from typer.testing import CliRunner

from lnfree import evaluate as ev
from lnfree.cli import app
from lnfree.errors import UsageError
from lnfree.evaluate.results import ce_headline
from lnfree.removal.derived import STALE_MARKER
from lnfree.data.tiny import TINY_MODEL_DIR

runner = CliRunner()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One token cache for the module: the tiny set is tokenised once."""
    return str(tmp_path_factory.mktemp("eval_cache"))


class WordTokenizer:
    """Enough of a tokenizer for the toy models: a vocabulary size and `decode`."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __len__(self) -> int:
        return self.vocab

    def decode(self, ids) -> str:
        return " ".join(f"w{i}" for i in ids)


class Bigram(nn.Module):
    """A toy LM whose next-token logits depend only on the current token: logits = table[token]."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = nn.Parameter(table.float(), requires_grad=False)

    def forward(self, input_ids, **_):
        return SimpleNamespace(logits=self.table[input_ids])


def toy(label: str, table: torch.Tensor) -> ev.EvalModel:
    return ev.EvalModel(label, Bigram(table), WordTokenizer(table.shape[0]))


def markov_tokens(transition: torch.Tensor, n: int, length: int, seed: int) -> torch.Tensor:
    """Sequences sampled from a first-order Markov chain with the given transition matrix."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.empty(n, length, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, transition.shape[0], (n,), generator=g)
    for t in range(1, length):
        tokens[:, t] = torch.multinomial(transition[tokens[:, t - 1]], 1, generator=g).squeeze(1)
    return tokens


def test_ce_equals_a_hand_computation():
    table = torch.tensor([[2.0, 0.5, -1.0], [0.0, 0.0, 3.0], [-2.0, 1.0, 0.5]])
    tokens = torch.tensor([[0, 1, 2, 2, 0], [2, 1, 1, 0, 2]])
    report = ev.evaluate_models([toy("toy", table)], tokens, n_resamples=50)
    by_hand = []
    for row in tokens.tolist():
        for prev, target in zip(row[:-1], row[1:]):
            logits = table[prev].tolist()
            by_hand.append(math.log(sum(math.exp(x) for x in logits)) - logits[target])
    result = report.model("toy")
    assert result.scored_tokens == 2 * 4 == len(by_hand)  # L−1 per sequence, EOT-agnostic
    assert report.scores["toy"].ce.flatten().tolist() == pytest.approx(by_hand, abs=1e-6)
    assert result.ce.mean == pytest.approx(sum(by_hand) / len(by_hand), abs=1e-6)
    assert result.ce.median == pytest.approx(float(np.median(by_hand)), abs=1e-6)
    # Context-position bins: position 1, 2–3, 4 (targets at positions 1…4 of 5-token sequences).
    assert [b["positions"] for b in result.by_position] == ["1", "2-3", "4"]
    assert result.by_position[0]["mean_ce"] == pytest.approx((by_hand[0] + by_hand[4]) / 2, abs=1e-6)
    assert ev.position_edges(128) == [1, 2, 4, 8, 16, 32, 64, 128]


def test_percentiles_and_outliers_on_a_constructed_case():
    ce = (torch.arange(1, 1001, dtype=torch.float64) / 10).reshape(10, 100).float()  # 0.1 … 100.0
    d = ev.distribution(ce, n_resamples=20)
    assert d.median == pytest.approx(50.05, abs=1e-4)
    assert d.p95 == pytest.approx(95.005, abs=1e-4) and d.p99 == pytest.approx(99.001, abs=1e-4)
    assert d.p99_9 == pytest.approx(99.9001, abs=1e-4) and d.max == pytest.approx(100.0)
    tokens = torch.arange(10 * 101).reshape(10, 101) % 50
    scores = ev.TokenScores(ce, ce, ce, torch.zeros_like(ce, dtype=torch.int64))
    count, listed = ev.outliers(scores, tokens, WordTokenizer(50), threshold=99.55, limit=3, context_tokens=4)
    assert count == 5  # 99.6 … 100.0
    assert [(o.sequence, o.position) for o in listed] == [(9, 100), (9, 99), (9, 98)]
    assert [o.ce for o in listed] == pytest.approx([100.0, 99.9, 99.8], abs=1e-4)
    assert listed[0].token_id == int(tokens[9, 100])
    assert listed[0].context == " ".join(f"w{int(i)}" for i in tokens[9, 96:100])

    # End to end: a model that is absurdly sure one bigram never happens. Its few tokens dominate
    # the mean (the "130 nats on the Pile" failure) while the median and p99 barely move.
    table = torch.zeros(4, 4)
    table[1, 2] = -5000.0
    tokens = torch.tensor([[0, 3, 0, 3, 0, 3, 0, 3]] * 6 + [[0, 1, 2, 3, 0, 1, 2, 3]] * 2)
    report = ev.evaluate_models([toy("exploding", table), toy("sane", torch.zeros(4, 4))], tokens, n_resamples=50)
    bad = report.model("exploding")
    assert bad.tokens_above_threshold == 4 and bad.sequences_with_outliers == 2
    assert bad.ce.max > 4999 and bad.ce.median == pytest.approx(math.log(4), abs=1e-5)
    assert bad.mean_ce_at_or_below_threshold == pytest.approx(math.log(4), abs=1e-5)
    assert {(o.sequence, o.position, o.token_id) for o in bad.outliers} == {(6, 2, 2), (6, 6, 2), (7, 2, 2), (7, 6, 2)}
    assert bad.outliers[0].context.endswith("w1") and bad.outliers[0].other_models_ce["sane"] == pytest.approx(math.log(4))
    assert "Warning — exploding: 4 token(s) in 2 sequence(s)" in ev.markdown(report)


def test_bootstrap_is_identical_for_the_same_seed():
    table = torch.randn(6, 6, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 6, (40, 12), generator=torch.Generator().manual_seed(1))
    models = [toy("a", table), toy("b", table * 0.5)]
    run = lambda seed: ev.evaluate_models(models, tokens, seed=seed, n_resamples=200)  # noqa: E731
    first, again, other = run(7), run(7), run(8)
    assert first.to_dict() == again.to_dict()
    assert first.model("a").ce.mean_ci != other.model("a").ce.mean_ci
    assert first.pair("a", "b").jsd.mean_ci != other.pair("a", "b").jsd.mean_ci
    assert first.settings["bootstrap_block"] == 6  # round(√40)


def test_block_bootstrap_widens_the_ci_of_correlated_neighbours():
    from lnfree.evaluate.results import bootstrap_ci

    # Runs of 10 identical neighbours (sequences of one document): 10 independent values, not 200.
    values = np.repeat(np.random.default_rng(0).normal(size=20), 10)
    plain = bootstrap_ci(values, n_resamples=2000, seed=0)
    blocked = bootstrap_ci(values, n_resamples=2000, seed=0, block=10)
    assert (blocked[1] - blocked[0]) > 2 * (plain[1] - plain[0])
    assert bootstrap_ci(values, seed=3, block=1) == bootstrap_ci(values, seed=3)  # block 1 is the plain bootstrap


def test_jsd_of_a_model_with_itself_is_zero():
    model = GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    tokens = torch.randint(0, len(tokenizer), (4, 32), generator=torch.Generator().manual_seed(0))
    same = [ev.EvalModel("a", model, tokenizer), ev.EvalModel("b", copy.deepcopy(model), tokenizer)]
    report = ev.evaluate_models(same, tokens, n_resamples=20)
    assert report.jsd[("a", "b")].abs().max() == 0.0 and report.pair("a", "b").delta_ce == 0.0
    # Against an fp64 reference on random distributions: symmetric, bounded by log 2.
    a, b = torch.randn(2, 50, 7, dtype=torch.float64).log_softmax(-1)
    m = (a.exp() + b.exp()) / 2
    reference = 0.5 * (a.exp() * (a - m.log())).sum(-1) + 0.5 * (b.exp() * (b - m.log())).sum(-1)
    assert torch.allclose(ev.js_divergence(a, b), reference, atol=1e-12)
    assert torch.allclose(ev.js_divergence(b, a), reference, atol=1e-12)
    assert float(ev.js_divergence(torch.tensor([0.0, -1e4]), torch.tensor([-1e4, 0.0]))) == pytest.approx(math.log(2))


def test_ece_of_a_perfectly_calibrated_toy_is_near_zero():
    g = torch.Generator().manual_seed(0)
    transition = torch.softmax(3 * torch.randn(8, 8, generator=g), dim=-1)  # confidences spread over bins
    tokens = markov_tokens(transition, 200, 64, seed=1)
    calibrated = toy("calibrated", transition.log())
    underconfident = toy("underconfident", 0.2 * transition.log())
    report = ev.evaluate_models([calibrated, underconfident], tokens, n_resamples=100)
    assert report.model("calibrated").ece < 0.01
    assert report.model("underconfident").ece > 0.1
    low, high = report.model("calibrated").ece_ci
    assert low <= report.model("calibrated").ece <= high
    # The bin arithmetic itself: 90% right at confidence 0.9 is calibrated, 50% right is 0.4 off.
    conf = torch.full((1, 10), 0.9)
    assert ev.expected_calibration_error(conf, torch.tensor([[1] * 9 + [0]])) == pytest.approx(0.0, abs=1e-6)
    assert ev.expected_calibration_error(conf, torch.tensor([[1] * 5 + [0] * 5])) == pytest.approx(0.4)


def test_eps_trick_hf_and_folded_forms_give_the_same_ce(tiny_ln_free_export, cache):
    reports = {form: ev.evaluate([str(tiny_ln_free_export)], "tiny", labels=[form], form=form, n_sequences=12,
                                 device="cpu", cache_dir=cache, n_resamples=20)
               for form in ("plain", "hf", "folded")}
    assert reports["plain"].models[0].form == "plain" and reports["folded"].models[0].form == "folded"
    ce = {form: r.scores[form].ce for form, r in reports.items()}
    assert {r.models[0].scored_tokens for r in reports.values()} == {12 * 127}
    for form in ("hf", "folded"):  # per token fp32 rounding differs (CE up to ~30 here); the mean agrees
        assert torch.allclose(ce[form], ce["plain"], rtol=1e-4, atol=1e-4)
        assert abs(reports[form].models[0].ce.mean - reports["plain"].models[0].ce.mean) <= 1e-5
    # The plain load really is the eps-trick file (LayerNorm modules with eps 1e12).
    plain = ev.load_models([str(tiny_ln_free_export)], form="plain")[0].module
    assert plain.transformer.ln_f.eps >= 1e6


def test_plain_form_refuses_an_eps_trick_file_whose_config_says_1e5(tiny_ln_free_export, tmp_path, cache):
    import shutil

    stale = tmp_path / "stale"
    shutil.copytree(tiny_ln_free_export, stale)
    config = json.loads((stale / "config.json").read_text())
    config["layer_norm_epsilon"] = 1e-5  # the published checkpoints' trap: modules rebuilt with eps 1e-5
    (stale / "config.json").write_text(json.dumps(config))
    with pytest.raises(ev.EvalError, match="eps-trick norm weights but eps"):
        ev.evaluate([str(stale)], "tiny", form="plain", n_sequences=2, device="cpu", cache_dir=cache)
    hf = ev.evaluate([str(stale)], "tiny", form="hf", n_sequences=4, device="cpu", cache_dir=cache, n_resamples=5)
    good = ev.evaluate([str(tiny_ln_free_export)], "tiny", form="hf", n_sequences=4, device="cpu", cache_dir=cache,
                       n_resamples=5)
    assert abs(hf.models[0].ce.mean - good.models[0].ce.mean) <= 1e-5  # lnfree.load fixes the eps


def test_tiny_comparison_in_one_command(tiny_ln_free_export, tmp_path, cache):
    vanilla = GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR)
    with torch.no_grad():
        for p in vanilla.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    vanilla.save_pretrained(tmp_path / "vanilla")
    AutoTokenizer.from_pretrained(TINY_MODEL_DIR).save_pretrained(tmp_path / "vanilla")
    out = tmp_path / "eval"
    result = runner.invoke(app, [
        "eval", "tiny", str(tmp_path / "vanilla"), str(tiny_ln_free_export), "--labels", "original", "vanilla", "ln_free",
        "--dataset", "tiny", "--n-sequences", "16", "--out", str(out), "--cache-dir", cache, "--bootstrap", "100",
        "--device", "cpu", "--no-progress"])
    assert result.exit_code == 0, result.output
    table = (out / "comparison.md").read_text()
    assert "Δ vs vanilla" in table and "## Pairwise, on identical tokens" in table
    assert "CIs over blocks of" in table  # the header names the unit the CIs resample
    for label in ("original", "vanilla", "ln_free"):
        assert f"| {label} |" in table and (out / f"{label}.json").is_file() and (out / f"{label}.csv").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert [m["scored_tokens"] for m in summary["models"]] == [16 * 127] * 3
    assert len(summary["pairs"]) == 3 and summary["reference"] == "vanilla"
    assert summary["convention"] == ev.SCORING_CONVENTION
    headline = ce_headline(summary, "ln_free")  # what the experiments' summary.json files report
    ln_free = summary["models"][2]
    assert headline["ln_free"] == ln_free["ce"]["mean"] and headline["scored_tokens"] == 16 * 127
    assert headline["delta_vs_reference"] == pytest.approx(ln_free["ce"]["mean"] - summary["models"][1]["ce"]["mean"])
    assert headline["ci"][0] <= headline["delta_vs_reference"] <= headline["ci"][1] and headline["reference"] == "vanilla"
    assert "blocks of" in headline["ci_method"]
    with pytest.raises(UsageError, match="not one of the evaluated labels"):
        ce_headline(summary, "nobody")
    # The tiny set is the removal run's held-out text: the original's CE recomputed directly.
    from lnfree.removal.config import load_preset
    from lnfree.data.documents import prepare_data

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    config = load_preset("tiny").data.model_copy(update={"cache_dir": cache})
    ids = torch.from_numpy(np.asarray(prepare_data(config, tokenizer, 128, len(tokenizer)).held_out[:16], dtype=np.int64))
    with torch.no_grad():
        logits = GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR).eval()(input_ids=ids).logits
    direct = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert summary["models"][0]["ce"]["mean"] == pytest.approx(float(direct), abs=1e-5)

    # A second evaluation into the same folder is refused; with --overwrite it replaces the first: no
    # per-model file of it stays behind, and nothing it did not write goes.
    (out / "notes.txt").write_text("mine")
    (out / STALE_MARKER).write_text("stale")  # as `lnfree remove --overwrite` leaves it: the new report clears it
    second = ["eval", "tiny", "--labels", "alone", "--dataset", "tiny", "--n-sequences", "4", "--out", str(out),
              "--cache-dir", cache, "--bootstrap", "10", "--device", "cpu", "--no-progress"]
    refused = runner.invoke(app, second)
    assert refused.exit_code == 2 and "already holds an earlier evaluation" in refused.output
    assert "--overwrite" in refused.output and "written to" not in refused.output and (out / "ln_free.json").is_file()
    again = runner.invoke(app, [*second, "--overwrite"])
    assert again.exit_code == 0, again.output
    assert not any((out / f"{label}.json").exists() for label in ("original", "vanilla", "ln_free"))
    assert (out / "alone.json").is_file() and (out / "notes.txt").read_text() == "mine"
    assert not (out / STALE_MARKER).exists()


def test_bad_input_gives_clear_errors(tmp_path):
    with pytest.raises(ev.EvalError, match="unknown dataset preset 'owt'.*owt-val"):
        ev.resolve_dataset("owt")
    with pytest.raises(ev.EvalError, match="dataset not found"):
        ev.resolve_dataset(str(tmp_path / "missing.jsonl"))
    result = runner.invoke(app, ["eval", "tiny", "--dataset", "no-such-set", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "unknown dataset preset" in result.output
    result = runner.invoke(app, ["eval", str(tmp_path / "no-model"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "could not load model" in result.output
    tokens = torch.randint(0, 4, (3, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ev.EvalError, match="different vocabularies"):
        ev.score({"a": Bigram(torch.zeros(4, 4)), "b": Bigram(torch.zeros(4, 5))}, tokens, pairs=[("a", "b")])
    with pytest.raises(ev.EvalError, match="tokenizers differ"):
        ev.evaluate_models([toy("a", torch.zeros(4, 4)), toy("b", torch.zeros(4, 4))],
                           {"a": tokens, "b": tokens.clone()}, pairwise=True)
    with pytest.raises(ev.EvalError, match="2 labels for 1 models"):
        ev.load_models(["tiny"], ["a", "b"])


def test_datasets_local_files_and_streamed_hub_sets(tmp_path, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    eot = tokenizer.eos_token_id
    docs = ["Lucy saw a cat. The cat sang.", "Adam went to the beach.", "The parrot said, hello."] * 4
    (tmp_path / "docs.txt").write_text("\n\n".join(docs))  # a .txt file is one document
    stream = tokenizer("\n\n".join(docs))["input_ids"] + [eot]
    spec = ev.resolve_dataset(str(tmp_path / "docs.txt"))
    got = ev.load_sequences(spec, tokenizer, context=8, n_sequences=None, vocab_size=len(tokenizer))
    assert got.tolist() == np.asarray(stream[: len(stream) // 8 * 8]).reshape(-1, 8).tolist()
    np.save(tmp_path / "ids.npy", np.arange(50) % 7)
    npy = ev.load_sequences(ev.resolve_dataset(str(tmp_path / "ids.npy")), tokenizer, context=10, n_sequences=3,
                            vocab_size=len(tokenizer))
    assert npy.tolist() == (np.arange(30) % 7).reshape(3, 10).tolist()
    with pytest.raises(ev.EvalError, match="holds only 5 sequences"):
        ev.load_sequences(ev.resolve_dataset(str(tmp_path / "ids.npy")), tokenizer, context=10, n_sequences=6,
                          vocab_size=len(tokenizer))

    pile = ev.resolve_dataset("pile")
    assert (pile.source, pile.context, pile.n_sequences, pile.how) == (
        "apollo-research/monology-pile-uncopyrighted-tokenizer-gpt2", 1024, 10_000, "stream")
    owt = ev.resolve_dataset("owt-val")
    assert (owt.source, owt.revision, owt.val_fraction, owt.val_seed) == (
        "Skylion007/openwebtext", "refs/convert/parquet", 0.0005, 2357)
    # A streamed Hub set of pre-tokenised rows: the first rows in order, read lazily, then cached.
    calls, consumed = [], []

    def rows():
        for i in range(1000):
            consumed.append(i)
            yield {"input_ids": [(i + j) % 50 for j in range(6)]}

    def fake_load_dataset(source, **kwargs):
        calls.append((source, kwargs))
        return rows()

    import datasets

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    spec = ev.resolve_dataset("someone/tokens", split="validation")
    first = ev.load_sequences(spec, tokenizer, context=4, n_sequences=3, vocab_size=len(tokenizer), cache_dir=str(tmp_path))
    assert calls == [("someone/tokens", {"revision": None, "split": "validation", "streaming": True})]
    assert first.tolist() == [[0, 1, 2, 3], [4, 5, 1, 2], [3, 4, 5, 6]] and len(consumed) == 2
    again = ev.load_sequences(spec, tokenizer, context=4, n_sequences=3, vocab_size=len(tokenizer), cache_dir=str(tmp_path))
    assert again.tolist() == first.tolist() and len(calls) == 1


def test_hellaswag_adapter(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # not installed
    with pytest.raises(ev.BenchmarkUnavailable, match="pip install 'lm-eval"):
        ev.hellaswag(nn.Linear(1, 1), None)
    seen = {}

    class HFLM:
        def __init__(self, pretrained, tokenizer, batch_size):
            seen["model"], seen["batch_size"] = pretrained, batch_size

    def simple_evaluate(model, tasks, **kwargs):
        seen["tasks"], seen["limit"] = tasks, kwargs["limit"]
        return {"results": {"hellaswag": {"acc,none": 0.28, "acc_stderr,none": 0.004, "acc_norm,none": 0.3,
                                          "acc_norm_stderr,none": 0.005}}}

    fake = types.ModuleType("lm_eval")
    fake.simple_evaluate = simple_evaluate
    fake.models = types.ModuleType("lm_eval.models")
    fake.models.huggingface = types.ModuleType("lm_eval.models.huggingface")
    fake.models.huggingface.HFLM = HFLM
    monkeypatch.setitem(sys.modules, "lm_eval", fake)
    monkeypatch.setitem(sys.modules, "lm_eval.models", fake.models)
    monkeypatch.setitem(sys.modules, "lm_eval.models.huggingface", fake.models.huggingface)
    module = nn.Linear(1, 1)
    out = ev.hellaswag(module, None, batch_size=4, limit=10)
    assert out == {"hellaswag_acc": 0.28, "hellaswag_acc_stderr": 0.004, "hellaswag_acc_norm": 0.3,
                   "hellaswag_acc_norm_stderr": 0.005}
    assert seen == {"model": module, "batch_size": 4, "tasks": ["hellaswag"], "limit": 10}


def test_scoring_in_chunks_of_positions_gives_the_same_numbers(monkeypatch):
    from lnfree.evaluate import scoring

    table = torch.randn(6, 6, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 6, (5, 12), generator=torch.Generator().manual_seed(1))
    models = {"a": toy("a", table).module, "b": toy("b", table * 0.5).module}
    whole = scoring.score(models, tokens, batch_size=3, pairs=[("a", "b")])
    monkeypatch.setattr(scoring, "STAT_CHUNK", 1)  # one position of one row at a time... of each row
    chunked = scoring.score(models, tokens, batch_size=3, pairs=[("a", "b")])
    for label in models:
        for name in ("ce", "entropy", "confidence", "top1"):
            assert torch.equal(getattr(whole[0][label], name), getattr(chunked[0][label], name)), (label, name)
    assert torch.equal(whole[1][("a", "b")], chunked[1][("a", "b")])


def test_the_default_batch_keeps_a_models_logits_within_a_gigabyte():
    from lnfree.evaluate.run import auto_batch_size

    assert auto_batch_size(128, 554) == 8 and auto_batch_size(64, 262_144) == 8  # tiny; Gemma 3 at 64 tokens
    assert auto_batch_size(1024, 262_144) == 1 and auto_batch_size(1024, 50_257) == 5  # Gemma 3, GPT-2 at 1,024
