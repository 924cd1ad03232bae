"""The `lnfree` command line: schedule, presets, export and error handling."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest
import torch
import typer.main
from transformers import GPT2Config, GPT2LMHeadModel
from typer.testing import CliRunner


from lnfree.cli import app
from lnfree.removal.config import load_preset
from lnfree.removal.resolve import sigma_momentum_per_step
from lnfree.removal.train import run

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
    assert "pass --allow-partial" in result.output and "allow_partial" not in result.output  # the CLI's flag
    result = runner.invoke(app, ["export", str(early), str(tmp_path / "partial"), "--allow-partial"])
    assert result.exit_code == 0, result.output


def test_every_option_has_help_and_shows_its_default():
    checked = 0
    for name, command in typer.main.get_command(app).commands.items():
        if name == "analyze":  # src/lnfree/cli/analysis.py
            continue
        for param in command.params:
            if param.param_type_name != "option" or param.name == "help" or param.required:
                continue
            checked += 1
            assert param.help, f"{name} {param.opts[0]} has no help"
            shown = param.show_default and param.default is not None and (not param.is_flag or param.secondary_opts)
            assert shown or "(default: " in param.help, f"{name} {param.opts[0]} does not show its default"
    assert checked > 40


#: P25 (Baroni et al. 2025) updated σ with momentum 0.9 at each micro-batch of 32 sequences (GPT-2 medium:
#: 16); for large and XL with 0.9^(micro-batch / 32), i.e. 0.9 per 32 sequences again.
P25_SEQUENCES_PER_MOMENTUM = {"gpt2": 32, "gpt2-medium": 16, "gpt2-large": 32, "gpt2-xl": 32}


def test_gpt2_presets_fine_tune_as_p25_did():
    for name, sequences in P25_SEQUENCES_PER_MOMENTUM.items():
        preset = load_preset(name)
        step = preset.train.tokens_per_step // preset.data.context_length
        assert sigma_momentum_per_step(preset.train, step) == pytest.approx(0.9 ** (step / sequences)), name
        assert preset.train.dropout == GPT2Config().resid_pdrop, name  # GPT-2's own dropout, active in train mode
    assert load_preset("tiny").train.dropout == 0.0  # the committed tiny results stay reproducible


def test_a_presets_micro_batch_bounds_the_automatic_one_when_the_user_changes_the_step():
    from lnfree.cli.common import adapt_micro_batch as _adapt_micro_batch
    from lnfree.removal.config import with_overrides
    from lnfree.removal.train import micro_batches

    xl = with_overrides(load_preset("gpt2-xl"), {"train.tokens_per_step": 12 * 1024})
    adapted = _adapt_micro_batch(xl, {"train.tokens_per_step": 12 * 1024}, [])
    assert micro_batches(adapted.train, 1024, 1) == (4, 3)  # the preset's 4 (memory) stays the bound
    assert micro_batches(_adapt_micro_batch(xl, {}, ["train.tokens_per_step=12288"]).train, 1024, 1) == (4, 3)
    small = with_overrides(load_preset("gpt2"), {"train.tokens_per_step": 4 * 1024})
    assert micro_batches(_adapt_micro_batch(small, {"train.tokens_per_step": 4096}, []).train, 1024, 1) == (4, 1)
    explicit = {"train.tokens_per_step": 4096, "train.micro_batch_size": 32}
    assert _adapt_micro_batch(small, explicit, []).train.micro_batch_size == 32  # the user's own: kept (an error)


def test_user_errors_are_one_line_without_links_or_tracebacks(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[train]\nmax_steps = 0\nlearning_rate = -1\n")
    checks = [
        (["remove", "--config", str(config)], "invalid"),
        (["schedule", "--config", str(config), "--n-layer", "2"], "invalid"),
        (["schedule", "--preset", "nope"], "unknown preset"),
        (["remove", "--model", "/nonexistent", "--no-control"], "no such folder: /nonexistent"),
        (["remove", "--model", "./typo", "--no-control"], "no such folder: ./typo"),
        (["export", str(tmp_path / "missing-run"), str(tmp_path / "out")], "no such folder"),
        (["remove", "--resume", "-o", str(tmp_path / "never-ran")], "nothing to resume"),
        (["verify", str(tmp_path)], "is a folder without config.json: expected a model folder"),
    ]
    for args, message in checks:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (args, result.output)
        assert "pydantic.dev" not in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["remove", "--config", str(config)])
    assert "train.max_steps: Input should be greater than or equal to 1 (got 0)" in result.output
    assert "train.learning_rate: Input should be greater than 0" in result.output


def test_unknown_hub_id_fails_fast_when_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    result = runner.invoke(app, ["remove", "--model", "gpt2-typo", "--no-control"])
    assert result.exit_code == 2 and "HF_HUB_OFFLINE" in result.output and "gpt2-typo" in result.output
    assert time.perf_counter() - started < 30  # not the ~44 s of retries (a generous bound, not a benchmark)


def test_remove_adapts_the_micro_batch_and_resuming_a_finished_run_changes_nothing(model_dir, tmp_path):
    out = tmp_path / "run"
    args = ["remove", "--model", str(model_dir), "--data", "tiny", "-o", str(out), "--max-steps", "36",
            "--tokens-per-step", "512", "--set", "train.distill_alpha=0", "--set", "data.max_documents=300", "--set", "data.context_length=64",
            "--set", "data.eval_sequences=4", "--set", f"data.cache_dir={tmp_path / 'cache'}", "--no-control"]
    result = runner.invoke(app, args)  # the generic GPT-2 micro-batch (32) does not fit 8 sequences a step
    assert result.exit_code == 0, result.output
    assert "(on 252 tokens)" in result.output  # 4 held-out sequences × 63 predictions
    assert "warning: the held-out CE averages only 252 tokens" in result.output
    assert "Removed shared tensor" not in result.output and "Loading weights" not in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["removal_events"]) == 7 and summary["held_out_tokens"] == 252
    start = json.loads((out / "log.jsonl").read_text().splitlines()[0])
    assert start["micro_batch_size"] == 8 and start["accumulation"] == 1
    written = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    result = runner.invoke(app, args + ["--resume"])
    assert result.exit_code == 0, result.output
    assert "finished already: nothing changed" in result.output and "ln_2: block 0" in result.output
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == written
    record = json.loads((out / "export" / "lnfree_removal.json").read_text())
    assert len(record["events"]) == 7

    mode = 0o777 & ~_umask()
    assert stat.S_IMODE((out / "export").stat().st_mode) == mode  # not tempfile's 0700
    result = runner.invoke(app, ["export", str(out), str(out / "export")])
    assert result.exit_code == 2 and "pass --overwrite" in result.output


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_verify_writes_its_report_only_where_asked(tiny_ln_free_export, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["verify", str(tiny_ln_free_export), "--tolerance", "1e-2"])
    assert result.exit_code == 0, result.output
    assert list(tmp_path.iterdir()) == [] and "Loading weights" not in result.output
    assert "worst token" in result.output and "position" in result.output
    result = runner.invoke(app, ["verify", str(tiny_ln_free_export), "--tolerance", "1e-2", "--out", "report.json"])
    assert result.exit_code == 0 and json.loads((tmp_path / "report.json").read_text())["ok"]


def test_remove_with_only_the_final_norm_keeps_the_run_folder_and_says_so(run_config, tmp_path):
    from lnfree.forms.load import load

    from lnfree.removal.config import with_overrides

    config = with_overrides(run_config(max_steps=6), {"removal.schedule": {"stages": [{"kind": "ln_f", "start": 3}]}})
    path = tmp_path / "lnf.json"
    path.write_text(config.model_dump_json())
    result = runner.invoke(app, ["remove", "--config", str(path), "--no-control"])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "export" not in summary and summary["partial"].startswith("1 of 7 norms fixed")
    assert "partial removal: 1 of 7 norms fixed" in result.output and not (tmp_path / "run" / "export").exists()
    loaded = load(str(tmp_path / "run"))
    assert [name for name, norm in loaded.norms.items() if norm["fixed"]] == ["ln_f"]


def test_a_run_whose_export_runs_away_keeps_its_summary_and_fails_with_the_reason(run_config, tmp_path, monkeypatch):
    import lnfree.forms.export

    def runs_away(*args, **kwargs):
        raise lnfree.forms.export.RunawayError("the model runs away on 2 of 20 probe rows: BOS, token ' x' twice, then random ids")

    monkeypatch.setattr(lnfree.forms.export, "export_run", runs_away)
    path = tmp_path / "run.json"
    path.write_text(run_config(max_steps=12).model_dump_json())
    result = runner.invoke(app, ["remove", "--config", str(path), "--no-control"])
    assert result.exit_code != 0 and "no export: the model runs away on 2 of 20 probe rows" in result.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "export" not in summary and "--allow-runaway" in summary["export_refused"]


def test_ctrl_c_says_where_the_run_stands_and_how_to_resume_it(tmp_path, model_dir, monkeypatch):
    import sys

    from lnfree import cli
    finish = cli._remove_and_report

    def interrupted(*args):
        finish(*args)  # a whole short run, so that a checkpoint exists
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_remove_and_report", interrupted)
    from conftest import quick_run_config

    config = quick_run_config(tmp_path / "run", model_dir, tmp_path / "cache", max_steps=2)
    (tmp_path / "quick.json").write_text(config.model_dump_json())
    args = ["remove", "--config", str(tmp_path / "quick.json"), "--set", "removal.mode=vanilla", "--no-control",
            "--overwrite"]
    monkeypatch.setattr(sys, "argv", ["lnfree", *args])
    result = runner.invoke(app, args)
    assert result.exit_code == 130
    assert "interrupted: the run in" in result.output and "step_000002" in result.output
    assert result.output.strip().endswith("--resume") and "--overwrite" not in result.output


def test_schedule_of_a_gpt2_preset_needs_no_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = runner.invoke(app, ["schedule", "--preset", "gpt2-xl"])
    assert result.exit_code == 0, result.output
    assert "48 blocks" in result.output


def test_sigterm_stops_a_run_like_ctrl_c(tmp_path, model_dir):
    import signal
    import subprocess
    import sys
    import time

    from conftest import quick_run_config

    config = quick_run_config(tmp_path / "run", model_dir, tmp_path / "cache", max_steps=400, save_every=2)
    (tmp_path / "long.json").write_text(config.model_dump_json())
    process = subprocess.Popen([sys.executable, "-m", "lnfree", "remove", "--config", str(tmp_path / "long.json"),
                                "--set", "removal.mode=vanilla", "--no-control"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not list((tmp_path / "run" / "checkpoints").glob("step_*/trainer_state.json")):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "interrupted: the run in" in stderr and stderr.strip().endswith("--resume")
