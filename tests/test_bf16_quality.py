"""Smoke tests of the same-tokens quality benchmarks (benchmarks/bf16_quality.py, benchmarks/freeze_embeddings.py)
on run-config files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lnfree.removal.config import load_preset

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # about a minute on a CPU without native bf16, where its bf16 arm is emulated
def test_a_config_file_runs_in_both_precisions_without_control_in_vanilla_mode(tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(load_preset("tiny-distill").model_dump_json())
    out = tmp_path / "quality"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bf16_quality.py"), "--presets", str(config),
                    "--no-control", "--set", "removal.mode=vanilla", "--set", "train.max_steps=3", "--set", "train.eval_every=0", "--threads", "1",
                    "--out", str(out)], check=True, cwd=ROOT, capture_output=True)
    results = json.loads(out.with_suffix(".json").read_text())
    runs = results["results"][str(config)]
    assert set(runs) == {"fp32", "bf16"}
    assert all(set(run["cpu_seconds"]) == {"vanilla"} for run in runs.values())  # the run itself, no control
    assert list(results["within"]) == [f"{config}/vanilla"]
    assert runs["fp32"]["held_out_ce"]["vanilla"] > 0


def test_freeze_embeddings_benchmark_runs_both_arms_on_a_config_file(tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(load_preset("tiny-distill").model_dump_json())
    out = tmp_path / "freeze"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "freeze_embeddings.py"), "--config", str(config),
                    "--set", "removal.mode=vanilla", "--set", "train.max_steps=3", "--set", "train.eval_every=0",
                    "--threads", "1", "--out", str(out)], check=True, cwd=ROOT, capture_output=True)
    results = json.loads(out.with_suffix(".json").read_text())
    frozen, trained = (results["results"][arm]["held_out_ce"]["vanilla"] for arm in ("frozen", "trained"))
    assert frozen != trained  # the arms differ: the embedding trained in one of them only
    assert results["frozen_minus_trained"] == frozen - trained
