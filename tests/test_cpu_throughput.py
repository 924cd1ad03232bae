"""Smoke test of the CPU throughput benchmark (benchmarks/cpu_throughput.py) on the tiny model."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lnfree.removal.config import load_preset

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # about a minute on a CPU without native bf16, where its bf16 arm is emulated
def test_cpu_throughput_runs_its_variants_against_fp32_round_by_round(tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(load_preset("tiny-distill").model_dump_json())  # with a teacher, as the default config
    out = tmp_path / "cpu_throughput"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_throughput.py"), "--config", str(config),
                    "--steps", "3", "--warmup", "1", "--rounds", "1", "--chunk", "512", "--threads", "1",
                    "--variants", "bf16 + chunked", "--set", "train.tokens_per_step=2048", "--out", str(out)],
                   check=True, cwd=ROOT, capture_output=True)
    results = json.loads((tmp_path / "cpu_throughput.json").read_text())
    assert results["tokens_per_step"] == 2048  # --set reached the config every variant ran (the preset's: 4096)
    assert list(results["runs"]) == ["fp32", "bf16 + chunked"]  # the baseline always runs
    fp32, chunked = (runs[0] for runs in results["runs"].values())
    assert (fp32["precision"], chunked["precision"]) == ("no", "bf16")
    assert chunked["settings"]["train.chunked_vocab_loss"] == 512
    assert all(len(run["step_cpu_seconds"]) == 2 for run in (fp32, chunked))  # steps 2 and 3
    assert results["summary"]["fp32"]["cpu_ratio_per_round"] == [1.0]
    for summary in results["summary"].values():
        assert all(math.isfinite(summary[k]) and summary[k] > 0 for k in ("tokens_per_cpu_hour", "tokens_per_hour"))
    assert "tokens / CPU-hour" in (tmp_path / "cpu_throughput.txt").read_text()


@pytest.mark.slow  # about a minute on a CPU without native bf16, where its bf16 arm is emulated
def test_with_before_the_earlier_checkout_runs_the_baseline(tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(load_preset("tiny-distill").model_dump_json())
    out = tmp_path / "cpu_throughput"
    # this checkout stands in for an earlier one: it runs the config without train.fused_optimizer
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_throughput.py"), "--config", str(config),
                    "--steps", "3", "--warmup", "1", "--rounds", "1", "--threads", "1", "--variants", "bf16",
                    "--before", str(ROOT), "--out", str(out)], check=True, cwd=ROOT, capture_output=True)
    results = json.loads((tmp_path / "cpu_throughput.json").read_text())
    assert results["baseline"] == "fp32 (lnfree before)"
    assert list(results["runs"]) == ["fp32 (lnfree before)", "bf16"]
    assert results["summary"]["fp32 (lnfree before)"]["cpu_ratio_per_round"] == [1.0]
    assert "train.fused_optimizer" in results["runs"]["bf16"][0]["settings"]
    assert "CPU throughput / fp32 (lnfree before)" in (tmp_path / "cpu_throughput.txt").read_text()


@pytest.mark.slow  # about a minute on a CPU without native bf16, where its bf16 arm is emulated
def test_another_baseline_replaces_fp32(tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(load_preset("tiny").model_dump_json())
    out = tmp_path / "cpu_throughput"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_throughput.py"), "--config", str(config),
                    "--steps", "3", "--warmup", "1", "--rounds", "1", "--threads", "1",
                    "--variants", "bf16 (embedding trained)", "--baseline", "fp32 (embedding trained)",
                    "--out", str(out)], check=True, cwd=ROOT, capture_output=True)
    results = json.loads((tmp_path / "cpu_throughput.json").read_text())
    assert list(results["runs"]) == ["fp32 (embedding trained)", "bf16 (embedding trained)"]  # no plain fp32
    assert results["summary"]["fp32 (embedding trained)"]["cpu_ratio_per_round"] == [1.0]
    assert "CPU throughput / fp32 (embedding trained)" in (tmp_path / "cpu_throughput.txt").read_text()


def test_every_variant_can_be_chosen_by_name(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from cpu_throughput import BEFORE, VARIANTS

    # --variants splits on commas: a name holding one could never be chosen (nor could the default, all of them)
    assert not [name for name in [*VARIANTS, *BEFORE] if "," in name]
