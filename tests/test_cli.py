"""The `lnfree` command line: schedule, presets, export and error handling."""

from __future__ import annotations

import json

import torch
from transformers import GPT2LMHeadModel
from typer.testing import CliRunner

from lnfree.cli import app
from lnfree.train import run

runner = CliRunner()


def test_schedule_prints_the_preset_timeline():
    result = runner.invoke(app, ["schedule", "--preset", "gpt2", "--n-layer", "12"])
    assert result.exit_code == 0, result.output
    assert "12 × ln_2: steps 20–42 (every 2)" in result.output
    assert "ln_f: step 104" in result.output and "300 steps" in result.output
    events = runner.invoke(app, ["schedule", "--preset", "gpt2-xl", "--n-layer", "48", "--events"])
    assert "step   722: ln_f" in events.output


def test_schedule_rejects_an_impossible_override(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('model = "x"\n[train]\nmax_steps = 50\n[removal.schedule]\nstages = [{kind = "ln_2", start = 20, gap = 2}, {kind = "ln_f"}]\n')
    result = runner.invoke(app, ["schedule", "--config", str(config), "--n-layer", "12"])
    assert result.exit_code == 2 and "before the last ln_1 V path" in result.output


def test_presets_lists_every_preset():
    result = runner.invoke(app, ["presets"])
    assert result.exit_code == 0 and "gpt2-xl" in result.output and "LNFree800" in result.output


def test_remove_reports_errors_without_a_traceback(tmp_path, model_dir):
    result = runner.invoke(app, ["remove", "--model", str(model_dir), "--data", str(tmp_path / "missing.txt"),
                                 "--output-dir", str(tmp_path / "out")])
    assert result.exit_code == 2 and "data source not found" in result.output
    assert not (tmp_path / "out").exists()
    result = runner.invoke(app, ["remove", "--preset", "nope"])
    assert result.exit_code == 2 and "unknown preset" in result.output
    result = runner.invoke(app, ["remove", "--set", "train.bogus=1"])
    assert result.exit_code == 2 and "unknown config key" in result.output


def test_export_command_writes_a_loadable_model_and_refuses_partial_runs(run_config, tmp_path):
    finished = run(run_config(max_steps=12, save_every=3), progress=False)
    out = tmp_path / "exported"
    result = runner.invoke(app, ["export", str(finished.output_dir), str(out)])
    assert result.exit_code == 0, result.output
    plain = GPT2LMHeadModel.from_pretrained(out).eval()
    ids = torch.randint(0, plain.config.vocab_size, (2, 30))
    finished.model.eval()
    error = (plain(input_ids=ids).logits - finished.model(input_ids=ids).logits).abs().max().item()
    assert error <= 1e-4
    assert json.loads((out / "lnfree_removal.json").read_text())["fully_removed"]
    early = finished.output_dir / "checkpoints" / "step_000003"
    result = runner.invoke(app, ["export", str(early), str(tmp_path / "partial")])
    assert result.exit_code == 2 and "still real" in result.output and not (tmp_path / "partial").exists()
    result = runner.invoke(app, ["export", str(early), str(tmp_path / "partial"), "--allow-partial"])
    assert result.exit_code == 0, result.output
