"""Smoke test of the step-time benchmark at a toy size: every variant runs, and every ratio is finite."""

from __future__ import annotations

import json
import math
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, out: Path, *args: str) -> dict:
    """Run `benchmarks/<script>` with `args` and `--out out` in a process of its own (benchmarks change process-wide
    settings such as the C allocator's); return the JSON record it wrote beside `out`."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args, "--out", str(out)], check=True, cwd=ROOT,
                   capture_output=True)
    return json.loads(out.with_suffix(".json").read_text())


def test_step_time_runs_every_variant(tmp_path):
    out = tmp_path / "step_time.json"
    # A subprocess: the benchmark changes the C allocator's settings for its whole process.
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "step_time.py"), "--layers", "1", "--vocab", "256", "--batch", "1",
         "--seq", "16", "--rounds", "2", "--warmup", "0", "--site-rounds", "2", "--site-reps", "1", "--out", str(out)],
        check=True, cwd=ROOT, capture_output=True, text=True,
    )
    results = json.loads(out.read_text())
    assert results["steady_allocator"] is (platform.libc_ver()[0] == "glibc")
    assert set(results["steps"]) == {"gpt2", "llama"}
    for shape, variants in results["steps"].items():
        assert {"plain", "plain, second copy", "lnfree all real", "lnfree all fixed"} <= set(variants), shape
    assert len(results["sites"]) == 4
    for site, variants in results["sites"].items():
        assert {"plain", "plain, second copy", "lnfree real (gathering)", "lnfree fixed"} <= set(variants), site
    for table in [*results["steps"].values(), *results["sites"].values()]:
        for name, row in table.items():
            assert all(math.isfinite(row[key]) and row[key] > 0 for key in (
                "median_ms", "wall_ratio_min", "wall_ratio_median", "cpu_ratio_median", "cpu_best_ratio")), name


def test_throughput_runs_lnfree_remove_with_and_without_the_steady_allocator(tmp_path):
    from lnfree.removal.config import load_preset

    config = tmp_path / "tiny.json"
    config.write_text(load_preset("tiny").model_dump_json())
    out = tmp_path / "throughput"
    results = run_benchmark("throughput.py", out, "--config", str(config), "--steps", "5", "--warmup", "1",
                            "--rounds", "1")
    glibc = platform.libc_ver()[0] == "glibc"
    for name, runs in results["runs"].items():
        assert [r["steady_allocator"] for r in runs] == [glibc and name != "default malloc"], name
        assert all(len(r["step_seconds"]) == 4 for r in runs)  # steps 2–5
    assert all(math.isfinite(s["tokens_per_hour"]) and s["tokens_per_hour"] > 0 for s in results["summary"].values())
    assert "tokens / hour" in out.with_suffix(".txt").read_text()


@pytest.mark.slow  # about a minute on a CPU without native bf16 (its bf16 profile is emulated there)
def test_cpu_step_profile_groups_a_step_by_operator_in_both_precisions(tmp_path):
    from lnfree.removal.config import load_preset

    config = tmp_path / "tiny.json"
    config.write_text(load_preset("tiny").model_dump_json())
    out = tmp_path / "profile"
    results = run_benchmark("cpu_step_profile.py", out, "--config", str(config),
                            "--set", "train.cpu_fp32_attention=false")
    assert results["settings"] == {"train.cpu_fp32_attention": False}
    for precision in ("fp32", "bf16"):
        seconds = results["profiles"][precision]["seconds"]
        assert seconds["matrix products"] > 0 and seconds["attention"] > 0, precision
        top = results["profiles"][precision]["top"]
        assert len(top) == 10 and top[0][3] >= top[-1][3] > 0 and "[" in top[0][1]  # the largest, with shapes
    assert set(results["attention_kernels"]) == {"flash_attention float32", "math float32",
                                                 "flash_attention bfloat16", "math bfloat16"}
    assert "| attention |" in out.with_suffix(".txt").read_text()


def test_bridge_memory_reports_every_stage(tmp_path):
    out = tmp_path / "bridge_memory"
    (result,) = run_benchmark("bridge_memory.py", out, "tiny")
    assert list(result["stages"]) == ["start", "model loaded", "bridge built", "DLA of 4 × 64 ids", "bridge released"]
    peaks = [m["peak_gb"] for m in result["stages"].values()]
    assert peaks == sorted(peaks) and all(m["rss_gb"] > 0 for m in result["stages"].values())
    assert "| tiny |" in out.with_suffix(".txt").read_text()


def test_cpu_attention_times_each_way_and_marks_the_shapes_lnfree_computes_in_fp32(tmp_path):
    out = tmp_path / "attention"
    rows = run_benchmark("cpu_attention.py", out, "--contexts", "64,256", "--repeats", "1")["rows"]
    assert [(r["head_dim"], r["context"]) for r in rows] == [(h, c) for h in (64, 128, 256) for c in (64, 256)]
    assert all(math.isfinite(ms) and ms > 0 for r in rows for ms in r["ms"].values())
    assert [r["lnfree_fp32"] for r in rows] == [True, False, True, False, False, False]
    assert "| flash bf16 |" in out.with_suffix(".txt").read_text()


def test_frozen_head_benchmark_times_both_ways_and_checks_they_agree(tmp_path):
    out = tmp_path / "frozen_head"
    record = run_benchmark("frozen_head.py", out, "--vocab", "512", "--hidden", "32", "--tokens", "8,16",
                           "--rounds", "2")
    assert [r["tokens"] for r in record["results"]] == [8, 16]
    for r in record["results"]:
        assert r["logits_equal"] and r["grad_max_relative_difference"] < 0.02
        assert len(r["ratio_per_round"]) == 2 and all(x > 0 for x in r["ratio_per_round"])
    assert "kept transposed copy" in out.with_suffix(".txt").read_text()


def test_held_gradients_benchmark_times_both_ways_and_checks_they_agree(tmp_path):
    earlier = "e35ef27"  # the last commit with the copying `gradients` / `cap_share`
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{earlier}:src/lnfree/removal/losses/coverage.py"],
                            capture_output=True, text=True)
    if source.returncode:
        pytest.skip(f"this checkout has no history back to {earlier}")
    module = tmp_path / "before" / "src/lnfree/removal/losses/coverage.py"
    module.parent.mkdir(parents=True)
    module.write_text(source.stdout)
    out = tmp_path / "held"
    record = run_benchmark("held_gradients.py", out, "--before", str(tmp_path / "before"), "--model", "tiny",
                           "--rounds", "2")
    assert record["max_relative_difference"] < 1e-5 and len(record["ratios"]) == 2
    assert all(t > 0 for way in ("before", "now") for t in record["seconds"][way])
    assert "| now |" in out.with_suffix(".txt").read_text()


def test_vocab_loss_benchmark_times_eager_and_compiled_and_checks_they_agree(tmp_path):
    out = tmp_path / "vocab"
    record = run_benchmark("vocab_loss.py", out, "--tokens", "32", "--vocab", "3000", "--rounds", "1", "--calls", "2")
    assert max(record["relative_difference"].values()) < 1e-4 and len(record["ratios"]) == 1
    assert all(run["median_seconds"] > 0 for way in ("eager", "compiled") for run in record["runs"][way])
    assert "| compiled |" in out.with_suffix(".txt").read_text()
