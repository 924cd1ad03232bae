"""`lnfree analyze`: every analysis on the same models, one index of headline numbers and figures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import byte_level_bpe, own_corpus, small_gpt2
from typer.testing import CliRunner

from lnfree.analysis.ioi import DEFAULT_TEMPLATES, GPT2_NAMES, GPT2_OBJECTS, GPT2_PLACES
from lnfree.cli import app

runner = CliRunner()
SMALL = ["--n-sequences", "4", "--length", "24", "--n-prompts", "8", "--device", "cpu"]


def test_analyze_all_writes_every_analysis_and_an_index(tiny_ln_free_export, tmp_path):
    out = tmp_path / "analysis"
    result = runner.invoke(app, ["analyze", "all", "--models", "tiny", str(tiny_ln_free_export),
                                 "--labels", "original", "ln_free", *SMALL, "--n-bootstrap", "20", "--out", str(out)])
    assert result.exit_code == 0, result.output
    index = json.loads((out / "index.json").read_text())
    assert list(index["models"]) == ["original", "ln_free"] and index["tokens"] == [4, 24]
    assert set(index["analyses"]) == {"dla", "patching", "entropy-neurons", "residual"}
    for summary in index["analyses"].values():
        assert summary["figures"] and all(Path(p).exists() for p in summary["figures"] + summary["tables"])
    dla = index["analyses"]["dla"]["models"]
    assert dla["ln_free"]["heads"]["nmae"] < 1e-5 < dla["original"]["heads"]["nmae"]
    page = (out / "index.md").read_text()
    assert "DLA vs DE: global NMAE" in page and "mean per-prompt NMAE" in page and "sink rate" in page
    assert "dla/dla_global_nmae.html" in page and (out / "index.html").exists()
    # figures open offline: one local plotly.js for all of them, no CDN
    assert list(out.rglob("plotly.min.js")) == [out / "plotly.min.js"]
    for figure in (Path(p) for s in index["analyses"].values() for p in s["figures"] if p.endswith(".html")):
        html = figure.read_text()
        assert 'src="../plotly.min.js"' in html and "cdn.plot.ly" not in html, figure
    # one report: headline tables first, then every figure inline, loading the one plotly.js; stable element ids
    report = (out / "index.html").read_text()
    figures = [Path(p) for s in index["analyses"].values() for p in s["figures"] if p.endswith(".html")]
    assert report.count("class=\"plotly-graph-div\"") == len(figures) and report.count("plotly.min.js") == 1
    assert report.index("Headline numbers") < report.index("plotly-graph-div")
    assert 'id="dla-dla_global_nmae"' in report and "neurons (layer.neuron)" in report
    # a progress bar per analysis, with its total (models) from the first model on; no weight-loading bars
    assert all(re.search(rf"{name}: +\d+%.*model 1/2 \(original\), pass 1\b", result.stderr)
               for name in index["analyses"]), result.stderr
    assert "Loading weights" not in result.stderr
    # the headline numbers are printed too
    assert "DLA vs DE: global NMAE, heads" in result.stdout and "attention sink rate" in result.stdout
    # written again from the same models (--overwrite: they are there already): byte-identical results;
    # wall-clock seconds only in timings.json
    timings = {p for p in out.rglob("timings.json")}
    assert timings == {out / "timings.json", out / "patching" / "timings.json", out / "entropy-neurons" / "timings.json"}
    assert set(json.loads((out / "timings.json").read_text())["seconds"]) == set(index["analyses"])
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p not in timings}
    again = runner.invoke(app, ["analyze", "all", "--models", "tiny", str(tiny_ln_free_export),
                                "--labels", "original", "ln_free", *SMALL, "--n-bootstrap", "20", "--out", str(out),
                                "--overwrite"])
    assert again.exit_code == 0, again.output
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p not in timings}
    assert sorted(after) == sorted(before)
    assert [p.relative_to(out) for p in before if before[p] != after[p]] == []


def own_model(folder: Path, names) -> Path:
    """A random GPT-2 with a byte-level BPE of its own, trained on a small corpus naming `names`, and that corpus."""
    corpus = own_corpus(names, GPT2_PLACES, GPT2_OBJECTS)
    tokenizer = byte_level_bpe(corpus)
    model = small_gpt2(n_layer=2, n_embd=32, n_positions=64, vocab_size=len(tokenizer))
    model.config.bos_token_id = model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "corpus.txt").write_text("\n\n".join(corpus[:100]) + "\n")
    return folder


def test_analyze_all_on_a_model_with_its_own_tokenizer(tmp_path):
    """Its BPE splits words of three templates: patching runs on the one that aligns (was an error)."""
    model = own_model(tmp_path / "own", GPT2_NAMES[:20])
    out = tmp_path / "analysis"
    result = runner.invoke(app, ["analyze", "all", "--models", str(model), *SMALL, "--n-bootstrap", "0",
                                 "--data", str(model / "corpus.txt"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    index = json.loads((out / "index.json").read_text())
    assert set(index["analyses"]) == {"dla", "patching", "entropy-neurons", "residual"} and not index["skipped"]
    patching = index["analyses"]["patching"]
    assert patching["models"]["own"]["n_prompts"] == 8
    assert set(patching["models"]["own"]["templates_dropped"]) == set(DEFAULT_TEMPLATES[1:])


def test_analyze_all_skips_what_a_model_cannot_support_and_says_why(tmp_path):
    """A tokenizer without single-token names cannot give IOI prompts: the other analyses run, exit status 1."""
    model = own_model(tmp_path / "own", ["Ka", "Lu", "Mo"])
    out = tmp_path / "analysis"
    result = runner.invoke(app, ["analyze", "all", "--models", str(model), *SMALL, "--n-bootstrap", "0",
                                 "--data", str(model / "corpus.txt"), "--out", str(out)])
    assert result.exit_code == 1, result.output
    index = json.loads((out / "index.json").read_text())
    assert set(index["analyses"]) == {"dla", "entropy-neurons", "residual"}
    assert list(index["skipped"]) == ["patching"] and "two names" in index["skipped"]["patching"]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "skipped patching" in errors[0] and "Traceback" not in result.output
    assert "patching: skipped: IOI prompts need two names" in result.stderr
    assert "Skipped: IOI prompts need two names" in (out / "index.md").read_text()


def test_analyze_runs_without_bootstrap_and_reports_bad_input(tiny_ln_free_export, model_dir, tmp_path):
    ok = runner.invoke(app, ["analyze", "residual", "--models", "tiny", *SMALL, "--n-bootstrap", "0",
                             "--no-progress", "--out", str(tmp_path / "a")])
    assert ok.exit_code == 0, ok.output
    assert "pass" not in ok.stderr  # no progress bar
    unknown = runner.invoke(app, ["analyze", "attention", "--models", "tiny", "--out", str(tmp_path / "b")])
    assert unknown.exit_code == 2 and "unknown analysis 'attention'" in unknown.output
    none = runner.invoke(app, ["analyze", "dla", "--out", str(tmp_path / "c")])
    assert none.exit_code == 2 and "at least one model" in none.output
    mixed = runner.invoke(app, ["analyze", "dla", "--models", "tiny", str(model_dir), *SMALL, "--out", str(tmp_path / "d")])
    assert mixed.exit_code == 2 and "different vocabularies" in mixed.output


def test_quiet_libraries_silences_other_libraries_for_the_block_only():
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    from lnfree.analysis.common import quiet_libraries

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_libraries():
            warnings.warn_explicit("theirs", UserWarning, "bridge.py", 1, module="transformer_lens.model_bridge")
            warnings.warn_explicit("ours", UserWarning, "dla.py", 1, module="lnfree.analysis.dla")
            assert not logging.getLogger("transformer_lens").isEnabledFor(logging.WARNING)
            assert not hf_logging.is_progress_bar_enabled()  # transformers' weight-loading bars
        warnings.warn_explicit("after", UserWarning, "bridge.py", 2, module="transformer_lens.model_bridge")
    assert [str(w.message) for w in caught] == ["ours", "after"]
    assert logging.getLogger("transformer_lens").isEnabledFor(logging.WARNING) and hf_logging.is_progress_bar_enabled()


def test_default_labels_are_unique_and_explicit_ones_must_be():
    from lnfree.evaluate.results import model_labels

    assert model_labels(["runs/tiny-llama", "runs/tiny-llama/export"]) == ["runs/tiny-llama", "tiny-llama/export"]
    assert model_labels(["gpt2", "runs/gpt2/export", "runs/gpt2/control"]) == ["gpt2", "gpt2/export", "control"]
    assert model_labels(["tiny", "tiny"]) == ["tiny", "tiny #2"]
    with pytest.raises(ValueError, match="must be unique"):
        model_labels(["a", "b"], ["x", "x"])


def test_an_analysis_progress_bar_has_a_total_from_the_first_model_on():
    from types import SimpleNamespace

    from lnfree.analysis.common import analysis_progress

    models = [SimpleNamespace(label=label, on_forward=None) for label in ("original", "vanilla", "ln_free")]
    with analysis_progress(models, "dla") as bar:
        assert bar.total == 3  # counted in models: a total from the first model on
        for _ in range(4):
            models[0].on_forward("original")
        assert bar.n == 0 and "model 1/3 (original), pass 4" in str(bar)
        models[1].on_forward("vanilla")
        assert bar.n == pytest.approx(1.25)  # 4 passes per model: tqdm shows the ETA
        assert "model 2/3 (vanilla), pass 1/4" in str(bar)
    assert all(m.on_forward is None for m in models)


def test_analyses_into_one_folder_share_its_index_and_nothing_is_replaced_without_overwrite(tmp_path):
    out = tmp_path / "analysis"
    args = ["--models", "tiny", "--labels", "original", *SMALL, "--n-bootstrap", "0", "--no-progress", "--out", str(out)]
    assert runner.invoke(app, ["analyze", "dla", "--dataset", "tiny", *args]).exit_code == 0
    second = runner.invoke(app, ["analyze", "residual", "--data", "tiny", *args])  # --data: the old name, kept
    assert second.exit_code == 0, second.output
    index = json.loads((out / "index.json").read_text())
    assert list(index["analyses"]) == ["dla", "residual"] and index["tokens"] == [4, 24]
    assert all(Path(p).exists() for s in index["analyses"].values() for p in s["figures"])
    page, markdown = (out / "index.html").read_text(), (out / "index.md").read_text()
    assert "id='dla'" in page and "id='residual'" in page and "dla/dla_global_nmae.html" in markdown
    assert "DLA vs DE: global NMAE" in second.stdout and "attention sink rate" in second.stdout
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    refusals = [
        (["analyze", "dla", *args], "already holds the dla analysis"),
        (["analyze", "patching", *args[:-2], "--n-prompts", "4", "--out", str(out)], "other settings (n_prompts)"),
        (["analyze", "patching", *args[2:], "--models", "realtext"], "other models"),
    ]
    for command, message in refusals:
        result = runner.invoke(app, command)
        assert result.exit_code == 2 and message in result.output and "--overwrite" in result.output, result.output
        assert "overwrite=True" not in result.output  # the CLI names its flag
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    replaced = runner.invoke(app, ["analyze", "dla", *args, "--overwrite"])
    assert replaced.exit_code == 0 and list(json.loads((out / "index.json").read_text())["analyses"]) == ["dla", "residual"]
    # a file no analysis wrote is never replaced, not even with --overwrite
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "index.md").write_text("my notes")
    for extra in ([], ["--overwrite"]):
        result = runner.invoke(app, ["analyze", "dla", *args[:-1], str(mine), *extra])
        assert result.exit_code == 2 and "index.md was not written by lnfree analyze" in result.output
    assert (mine / "index.md").read_text() == "my notes"


def test_analyze_rejects_no_sequences_and_names_its_own_options(tmp_path):
    none = runner.invoke(app, ["analyze", "dla", "--models", "tiny", "--n-sequences", "0", "--out", str(tmp_path / "a")])
    assert none.exit_code == 2 and not (tmp_path / "a").exists()
    many = runner.invoke(app, ["analyze", "dla", "--models", "tiny", "--n-sequences", "100000", "--length", "24",
                               "--device", "cpu", "--no-progress", "--out", str(tmp_path / "b")])
    assert many.exit_code == 2 and "--length" in many.output and "--context" not in many.output, many.output


def test_every_figure_gives_a_model_and_a_quantity_one_colour():
    import pandas as pd

    from lnfree.analysis.dla import _global_bar
    from lnfree.analysis.entropy_neurons.figures import cumulative_entropy_figure, distributions_figure
    from lnfree.analysis.palette import MODEL_COLOURS, quantity_colour
    from lnfree.analysis.patching.output import _agreement_figure

    models, sets = ["original", "vanilla", "ln_free"], ["L3.7", "top-2"]
    dist = pd.DataFrame([{"model": m, "metric": k, "ablation": a, "q05": 0, "q25": 1, "median": 2, "q75": 3, "q95": 4,
                          "mean": 2} for m in models for k in ("abs_delta_entropy", "abs_delta_ce") for a in sets])
    abl = pd.DataFrame([{"model": m, "ablation": a, "kind": "single" if a == sets[0] else "cumulative",
                         "n_neurons": i + 1, "relative_entropy_change_percent": -1.0}
                        for m in models for i, a in enumerate(sets)])
    for figure in (distributions_figure(dist, sets, models), cumulative_entropy_figure(abl, sets, models)):
        colours = {t.name: t.marker.color or t.line.color for t in figure.data}
        assert colours == {m: MODEL_COLOURS[m] for m in models}, colours  # the box plot and the line plot alike
    agreement = [{"model": m, "kind": k, "statistic": s, "value": 0.5, "ci_low": 0.4, "ci_high": 0.6}
                 for s in ("nmae", "pearson_r") for k in ("resid_pre", "z") for m in models]
    bars = _agreement_figure(agreement).data
    assert [t.marker.color for t in bars] == [quantity_colour(t.name) for t in bars]  # the same in both panels
    assert len({quantity_colour(k) for k in ("resid_pre", "z", "heads", "MLPs")} | set(MODEL_COLOURS.values())) == 7
    stats = {"nmae": 1.6e-7, "ci_low": 1e-7, "ci_high": 2e-7}
    dla = _global_bar({"ln_free": {"heads": stats, "mlps": stats}})
    assert all(t.texttemplate and t.marker.color == quantity_colour(t.name) for t in dla.data)  # 1.6e-7 is labelled
