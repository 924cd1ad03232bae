"""What the commands refuse and say: nothing of the user's replaced, every model name known, one-line
errors that name the command line's flags, and the bundled models passing their own checks."""

from __future__ import annotations

import json

import pytest
import torch
import typer.main
from transformers import AutoTokenizer
from typer.testing import CliRunner

from families import tiny_family
from lnfree.cli import app
from lnfree.data.tiny import TINY_MODEL_DIR

runner = CliRunner()
QUICK = ["--dataset", "tiny", "--n-sequences", "2", "--bootstrap", "10", "--device", "cpu", "--no-progress"]


def test_eval_never_replaces_a_file_it_did_not_write(tmp_path):
    out = tmp_path / "eval"
    out.mkdir()
    (out / "summary.json").write_text('{"mine": true}')
    for extra in ([], ["--overwrite"]):
        result = runner.invoke(app, ["eval", "tiny", *QUICK, "--out", str(out), *extra])
        assert result.exit_code == 2 and "summary.json was not written by lnfree eval" in result.output, result.output
        assert "--out" in result.output and "(CLI:" not in result.output
    assert json.loads((out / "summary.json").read_text()) == {"mine": True} and len(list(out.iterdir())) == 1


def test_eval_writes_exactly_the_files_it_names(tmp_path):
    from lnfree.evaluate.output import report_files

    out = tmp_path / "eval"
    result = runner.invoke(app, ["eval", "tiny", "tiny", "--labels", "a", "b", *QUICK, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == sorted(report_files(["a", "b"]))


def test_eval_of_a_model_without_n_positions_defaults_its_context(tmp_path):
    """A Llama-family config has max_position_embeddings, no n_positions (was: `min() arg is an empty sequence`)."""
    from lnfree.evaluate.run import MAX_DEFAULT_CONTEXT, default_context

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    tiny_family("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id).save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    result = runner.invoke(app, ["eval", str(tmp_path / "llama"), *QUICK, "--out", str(tmp_path / "eval")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["dataset"]["context"] == 64
    assert default_context(None, [32768]) == MAX_DEFAULT_CONTEXT and default_context(None, []) == MAX_DEFAULT_CONTEXT
    assert default_context(256, [64, 1024]) == 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a torch without CUDA")
def test_a_device_this_torch_lacks_is_one_error_line(tmp_path):
    for command in (["eval", "tiny", "--device", "cuda"], ["analyze", "dla", "--models", "tiny", "--device", "cuda:1"]):
        result = runner.invoke(app, [*command, "--out", str(tmp_path / "o")])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and "no usable CUDA" in lines[0], result.output


def test_a_mistyped_model_name_is_named_unknown_with_the_names(monkeypatch):
    from lnfree.models.sources import MODEL_NAMES

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # online: still no Hub look-up for a typo of a name
    monkeypatch.setattr("huggingface_hub.HfApi.model_info", lambda *a, **k: pytest.fail("asked the Hub"))
    result = runner.invoke(app, ["eval", "gemma3-270", "--out", "unused"])
    assert result.exit_code == 2 and "unknown model name 'gemma3-270'" in result.output
    assert "did you mean 'gemma3-270m'" in result.output and all(n in result.output for n in MODEL_NAMES)
    commands = typer.main.get_command(app).commands
    for name, option in (("eval", "models"), ("remove", "model"), ("analyze", "models")):
        text = next(p.help for p in commands[name].params if p.name == option)
        assert all(n in text for n in MODEL_NAMES), (name, text)


def test_push_without_a_token_or_a_network_says_what_to_do_in_one_line(tiny_ln_free_export, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    args = ["push", str(tiny_ln_free_export), "--repo-id", "user/tiny-lnfree"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1, result.output
    assert "no Hugging Face token" in result.output and "hf auth login" in result.output
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read at import: set where the tests' workers started
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1, result.output
    assert "cannot reach the Hugging Face Hub" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("preset, lr", [("gpt2", 1e-4), ("tiny", 1e-5)])
def test_a_lower_lr_lowers_the_presets_floor(preset, lr, tmp_path):
    from lnfree.cli.common import base_config, remove_config

    cfg = remove_config(base_config(preset, None, None), {"train.learning_rate": lr}, [])
    assert cfg.train.learning_rate == cfg.train.min_learning_rate == lr
    kept = remove_config(base_config(preset, None, None), {"train.learning_rate": 1.0}, [])
    assert kept.train.min_learning_rate == base_config(preset, None, None).train.min_learning_rate
    result = runner.invoke(app, ["remove", "--preset", preset, "--lr", str(lr), "--resume", "-o", str(tmp_path / "x")])
    assert result.exit_code == 2 and "min_learning_rate" not in result.output, result.output  # past the config:
    assert ("nothing to resume" if preset == "tiny" else "openai-community/gpt2") in result.output  # (offline here)


def test_the_bundled_models_pass_verify_and_it_prints_what_it_compares():
    for name in ("tiny", "realtext"):
        result = runner.invoke(app, ["verify", name])
        assert result.exit_code == 0, result.output
        assert "max |Δ| / logit scale" in result.output and "(tolerance 1e-04;" in result.output


def test_errors_name_the_flags_of_the_command_line():
    from lnfree.cli.common import cli_message

    assert cli_message("x already holds this same run; continue it with resume=True (CLI: --resume) or replace it "
                       "with overwrite=True (CLI: --overwrite)") == (
        "x already holds this same run; continue it with --resume or replace it with --overwrite")
    assert cli_message("3 norms are still real; pass allow_partial=True (CLI: --allow-partial) to export anyway") == (
        "3 norms are still real; pass --allow-partial to export anyway")
    commands = typer.main.get_command(app).commands
    for name in ("schedule", "plan"):
        assert not any("--model" in (p.help or "") for p in commands[name].params), name
    assert "README" not in (commands["eval"].help or "")
    assert all(commands[c].params and any("--dataset" in p.opts and "--data" in p.opts for p in commands[c].params)
               for c in ("remove", "analyze"))
