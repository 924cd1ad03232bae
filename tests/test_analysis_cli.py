"""`lnfree analyze`: every analysis on the same models, one index of headline numbers and figures."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

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


def test_analyze_runs_without_bootstrap_and_reports_bad_input(tiny_ln_free_export, model_dir, tmp_path):
    ok = runner.invoke(app, ["analyze", "residual", "--models", "tiny", *SMALL, "--n-bootstrap", "0",
                             "--out", str(tmp_path / "a")])
    assert ok.exit_code == 0, ok.output
    unknown = runner.invoke(app, ["analyze", "attention", "--models", "tiny", "--out", str(tmp_path / "b")])
    assert unknown.exit_code == 2 and "unknown analysis 'attention'" in unknown.output
    none = runner.invoke(app, ["analyze", "dla", "--out", str(tmp_path / "c")])
    assert none.exit_code == 2 and "at least one model" in none.output
    mixed = runner.invoke(app, ["analyze", "dla", "--models", "tiny", str(model_dir), *SMALL, "--out", str(tmp_path / "d")])
    assert mixed.exit_code == 2 and "different vocabularies" in mixed.output
