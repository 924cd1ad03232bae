"""The shell helpers of experiments/lib.sh and the order of experiments/robust/run.sh's steps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conftest import experiment_script

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _bash(script: str, tmp_path: Path, cores: int) -> subprocess.CompletedProcess:
    """Run `script` after sourcing lib.sh, with `nproc` answering `cores` and REPO_ROOT = tmp_path."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "nproc").write_text(f"#!/bin/sh\necho {cores}\n")
    (fake / "nproc").chmod(0o755)
    env = os.environ | {"PATH": f"{fake}:{os.environ['PATH']}"}
    body = f"set -euo pipefail\nsource {ROOT}/experiments/lib.sh\nREPO_ROOT={tmp_path}\n{script}"
    return subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True, timeout=60)


FUNCTIONS = """
first() { echo "first ${OMP_NUM_THREADS:-unset} $(date +%s.%N)"; sleep 1; echo "first done $(date +%s.%N)"; }
second() { echo "second ${OMP_NUM_THREADS:-unset} $(date +%s.%N)"; sleep 1; echo "second done $(date +%s.%N)"; }
broken() { echo broken; return 3; }
"""


def test_side_by_side_shares_the_cores_and_runs_at_once(tmp_path):
    done = _bash(FUNCTIONS + 'side_by_side logs first second\necho "status $?"', tmp_path, cores=4)
    assert done.returncode == 0, done.stderr
    first = (tmp_path / "logs/first.log").read_text().split()
    second = (tmp_path / "logs/second.log").read_text().split()
    assert first[1] == second[1] == "2"  # 4 cores / 2 functions
    # each started before the other finished
    assert float(first[2]) < float(second[-1]) and float(second[2]) < float(first[-1])


def test_side_by_side_gives_a_lone_function_every_core_and_none_nothing(tmp_path):
    # run.sh passes only the arms left to train or choose: one left (its twin finished) gets every core
    done = _bash(FUNCTIONS + 'side_by_side logs first\nside_by_side none\necho "status $?"', tmp_path, cores=4)
    assert done.returncode == 0 and "status 0" in done.stdout, done.stderr
    assert (tmp_path / "logs/first.log").read_text().split()[1] == "4"
    assert not (tmp_path / "none").exists()


def test_side_by_side_fails_when_one_function_fails(tmp_path):
    done = _bash(FUNCTIONS + "side_by_side logs first broken", tmp_path, cores=2)
    assert done.returncode != 0
    assert (tmp_path / "logs/broken.log").read_text().strip() == "broken"
    assert "done" in (tmp_path / "logs/first.log").read_text()  # the other one still ran to its end


def test_a_failed_run_fails_where_set_e_is_off_and_records_no_command(tmp_path):
    # the removal's step of robust/run.sh is `run … || [[ -f summary.json ]]`: a run killed for memory after its
    # last checkpoint went on to the measurements without the run's summary
    done = _bash(FUNCTIONS + 'run out broken || echo "caught $?"\nrun done echo fine', tmp_path, cores=2)
    assert done.returncode == 0, done.stderr
    assert "caught 3" in done.stdout and "fine" in done.stdout
    assert not (tmp_path / "out").exists() and (tmp_path / "done/command.txt").read_text().strip() == "echo fine"


def test_side_by_side_runs_in_turn_on_one_core(tmp_path):
    done = _bash(FUNCTIONS + "side_by_side logs first second", tmp_path, cores=1)
    assert done.returncode == 0, done.stderr
    events = [line.split()[1] if line.split()[1] == "done" else line.split()[0] for line in done.stdout.splitlines()]
    assert events == ["first", "done", "second", "done"]  # one after the other, to the terminal
    assert not (tmp_path / "logs").exists()


def _robust_dry_run(tmp_path: Path, *args: str) -> list[str]:
    """The commands `experiments/robust/run.sh --dry-run gemma3 ARGS` prints, run from a copy of the scripts in
    `tmp_path` (so that run folders of this checkout, where a finished run prints no command, do not count)."""
    shutil.copytree(ROOT / "experiments/robust", tmp_path / "experiments/robust", dirs_exist_ok=True)
    shutil.copy(ROOT / "experiments/lib.sh", tmp_path / "experiments/lib.sh")
    done = subprocess.run(["bash", "experiments/robust/run.sh", "--dry-run", "gemma3", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr
    return [line[2:] for line in done.stdout.splitlines() if line.startswith("+ ")]


def test_robust_run_trains_side_by_side_and_measures_the_original_first(tmp_path):
    commands = _robust_dry_run(tmp_path)
    assert commands[0].startswith("lnfree remove") and "--mode vanilla" not in commands[0]
    assert commands[1].startswith("lnfree remove") and "--mode vanilla" in commands[1]  # (--resume where it ran)
    stress = [c.split(" --labels ")[1].split(" --")[0] for c in commands if c.startswith("lnfree stress")]
    assert stress == ["original", "original vanilla", "original ln_free", "original vanilla ln_free"]
    assert all("--resume" in c for c in commands if c.startswith("lnfree stress"))
    copying = [i for i, c in enumerate(commands) if "experiments/robust/induction.py" in c]
    assert len(copying) == 1 and "--labels original vanilla ln_free" in commands[copying[0]]
    assert copying[0] > max(i for i, c in enumerate(commands) if c.startswith("lnfree stress"))
    temperature = [c for c in commands if "experiments/robust/temperature.py" in c]
    assert len(temperature) == 1 and "--labels vanilla ln_free original" in temperature[0]
    # each run's end chosen on the validation half before anything reads the test half, and then measured
    choose = [i for i, c in enumerate(commands) if "experiments/robust/choose_step.py" in c]
    assert [commands[i].split("choose_step.py ")[1].split()[0] for i in choose] == [
        "runs/robust/gemma3/ln_free", "runs/robust/gemma3/vanilla"]
    assert all("--dataset realtext-val" in commands[i] for i in choose)
    assert "--export" in commands[choose[0]] and "--export" not in commands[choose[1]]
    test_eval = next(i for i, c in enumerate(commands) if c.startswith("lnfree eval"))
    assert max(choose) < test_eval and "--dataset realtext " in commands[test_eval]
    assert "gemma3/vanilla/checkpoints/CHOSEN runs/robust/gemma3/ln_free/checkpoints/CHOSEN" in commands[test_eval]
    verify = next(c for c in commands if c.startswith("lnfree verify"))
    assert verify.split()[2] == commands[choose[0]].split("--export ")[1].split()[0]


def test_a_robust_run_with_a_seed_trains_with_it_and_keeps_every_file_in_its_own_folders(tmp_path):
    commands = _robust_dry_run(tmp_path, "1")
    removals = [c for c in commands if c.startswith("lnfree remove")]
    assert len(removals) == 2 and all(c.endswith(" --seed 1") for c in removals)
    assert "-o runs/robust/gemma3-seed1/ln_free " in removals[0] and "-o runs/robust/gemma3-seed1/vanilla " in removals[1]
    outs = [c.split("--out ")[1].split()[0] for c in commands if "--out " in c]
    assert outs and all(o.startswith("experiments/results/gemma3-270m/robust/seed1/") for o in outs), outs
    assert not any("runs/robust/gemma3/" in c for c in commands)
    assert "--seed" not in " ".join(_robust_dry_run(tmp_path / "default"))
    done = subprocess.run(["bash", "experiments/robust/run.sh", "--dry-run", "gemma3", "one"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "SEED must be a whole number" in done.stderr


def test_robust_run_resumes_a_run_with_a_checkpoint_and_restarts_one_stopped_before_its_first(tmp_path):
    runs = tmp_path / "runs/robust/gemma3"
    for arm in ("ln_free", "vanilla"):  # both started; only the control saved a complete checkpoint
        (runs / arm).mkdir(parents=True)
        (runs / arm / "run_config.json").write_text("{}")
    (runs / "ln_free/checkpoints/.partial-step_000050").mkdir(parents=True)  # interrupted while being written
    (runs / "vanilla/checkpoints/step_000050").mkdir(parents=True)
    (runs / "vanilla/checkpoints/step_000050/trainer_state.json").write_text("{}")
    removals = [c for c in _robust_dry_run(tmp_path) if c.startswith("lnfree remove")]
    assert removals[0].endswith(" --overwrite") and "--mode vanilla" not in removals[0]
    assert removals[1].endswith(" --resume") and "--mode vanilla" in removals[1]
    # a resumed run keeps the config it started with; a restarted one reads the recipe's file again
    assert "--config runs/robust/gemma3/vanilla/run_config.json " in removals[1]
    assert "--config experiments/robust/gemma3.toml " in removals[0]


def test_recovery_continues_both_finished_runs_from_their_last_step_and_compares_them_on_validation(tmp_path):
    shutil.copytree(ROOT / "experiments/robust", tmp_path / "experiments/robust")
    shutil.copy(ROOT / "experiments/lib.sh", tmp_path / "experiments/lib.sh")
    for arm, cosine in (("ln_free", 900), ("vanilla", None)):  # a finished run, its newest checkpoint the last
        run_dir = tmp_path / "runs/robust/gemma3" / arm
        for step in (1400, 1500, 1551):
            (run_dir / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
        for name in ("summary.json", "start.json", "log.jsonl"):
            (run_dir / name).write_text("{}\n")
        (run_dir / "tokenizer").mkdir()
        (run_dir / "run_config.json").write_text(json.dumps({"train": {"cosine_steps": cosine, "max_steps": 1551}}))
    fake = tmp_path / "bin"  # lnfree: records its arguments
    fake.mkdir()
    (fake / "lnfree").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/calls.txt\n')
    (fake / "lnfree").chmod(0o755)
    env = os.environ | {"PATH": f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    script = ["bash", "experiments/robust/recovery.sh", "gemma3"]
    assert subprocess.run(script + ["ten"], cwd=tmp_path, env=env, capture_output=True).returncode == 2
    done = subprocess.run(script + ["500"], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    calls = sorted((tmp_path / "calls.txt").read_text().splitlines())
    branches = "runs/robust/gemma3/recovery-500"
    assert calls[0].startswith("eval runs/robust/gemma3/vanilla runs/robust/gemma3/ln_free "
                               f"{branches}/vanilla {branches}/ln_free --labels vanilla ln_free vanilla+500 ln_free+500 "
                               "--dataset realtext-val")  # the validation half: never the test half
    release = " --set removal.scale_ceiling.release_start=2050"  # the removal's ceiling released at its new end
    for call, arm, cosine, tail in ((calls[1], "ln_free", 900, release), (calls[2], "vanilla", 1551, "")):
        assert call == (f"remove --config {branches}/{arm}/run_config.json -o {branches}/{arm} --resume "
                        f"--set train.max_steps=2051 --set train.cosine_steps={cosine}{tail}")
        assert (tmp_path / branches / arm / "checkpoints/step_001551").is_dir()  # branched at the last step
        assert not (tmp_path / branches / arm / "checkpoints/step_001500").exists()


def test_the_robust_summary_names_each_runs_precision_and_the_cpus_it_started_and_resumed_on(tmp_path):
    summary = experiment_script("robust", "summary")
    records = [{"event": "start", "step": 0, "precision": "bf16", "cpu": "a CPU (avx512_bf16)"}, {"step": 1, "loss": 3.0},
               {"event": "resume", "step": 1, "checkpoint": "c", "precision": "bf16", "cpu": "another (amx_bf16)"},
               {"event": "resume", "step": 1, "checkpoint": "c", "precision": "bf16", "cpu": "a CPU (avx512_bf16)"}]
    (tmp_path / "log.jsonl").write_text("".join(f"{json.dumps(r)}\n" for r in records))
    assert summary.machine(tmp_path) == {"precision": "bf16", "cpu": "a CPU (avx512_bf16)",
                                         "resumed_on": ["a CPU (avx512_bf16)", "another (amx_bf16)"]}
    records = [{k: v for k, v in r.items() if k != "cpu"} for r in records]  # a log from before lnfree recorded the CPU
    (tmp_path / "log.jsonl").write_text("".join(f"{json.dumps(r)}\n" for r in records))
    assert summary.machine(tmp_path) == {"precision": "bf16", "cpu": None, "resumed_on": []}


def test_the_temperature_probe_finds_the_scale_by_which_an_arm_is_too_sharp(tmp_path):
    probe = experiment_script("robust", "temperature")
    torch = pytest.importorskip("torch")
    generator = torch.Generator().manual_seed(0)
    vocab, rows, length = 40, 96, 64
    table = 2.0 * torch.randn(vocab, vocab, generator=generator)  # next-token logits after each token
    ids = torch.zeros(rows, length, dtype=torch.long)
    for t in range(1, length):  # text drawn from the table itself: the control is calibrated
        ids[:, t] = torch.multinomial(table[ids[:, t - 1]].softmax(-1), 1, generator=generator).squeeze(-1)
    control = lambda x: types.SimpleNamespace(logits=table[x])  # noqa: E731
    sharp = lambda x: types.SimpleNamespace(logits=1.25 * table[x])  # noqa: E731
    ce = [probe.ce_by_temperature(model, ids, 16) for model in (control, sharp)]
    result = probe.summarise(["control", "sharp"], ce)
    assert abs(result["models"]["control"]["best_temperature"] - 1.0) <= 0.05
    assert abs(result["models"]["sharp"]["best_temperature"] - 1.25) <= 0.05
    gap = result["gaps"]["sharp"]["all"]
    assert gap["at_1"] > 0.02 and abs(gap["at_best"]) < 0.2 * gap["at_1"]
    assert set(result["gaps"]["sharp"]) == {"all", "1-3", "4-7", "8-15", "16-31", "32-63"}
    from lnfree.evaluate.results import write_experiment  # as the probe writes it, as summary.json reads it

    ce = [probe.ce_by_temperature(model, ids, 16) for model in (control, sharp, control)]
    write_experiment({"split": "validation", "tokens": ids[:, 1:].numel(),
                      **probe.summarise(["vanilla", "ln_free", "original"], ce)}, [], tmp_path / "temperature")
    calibration = experiment_script("robust", "summary").calibration(tmp_path)
    best = {name: m["best_temperature"] for name, m in result["models"].items()}
    assert calibration["best_temperature"] == {"vanilla": best["control"], "ln_free": best["sharp"],
                                               "original": best["control"]}
    assert calibration["gap"] == result["gaps"]["sharp"]["all"] and calibration["tokens"] == 96 * 63


def test_the_copy_lens_ends_at_the_models_own_ce_and_the_induction_score_finds_the_bundled_models_heads():
    torch = pytest.importorskip("torch")
    from transformers import GPT2LMHeadModel

    from lnfree.data.tiny import TINY_MODEL_DIR

    induction, lens = experiment_script("robust", "induction"), experiment_script("robust", "copy_lens")
    model = GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR, local_files_only=True).eval()
    ids = induction.rows(torch.arange(50, model.config.vocab_size).numpy(), 8, lens.SPAN, None, seed=0)
    by_sublayer = lens.lens_ce(model, ids)
    assert by_sublayer.shape == (2, model.config.n_layer)
    # the last block read through the final norm and head is the model's output: its CE over the repeat
    output = induction.token_ce(model, ids, 8)[:, lens.SPAN:].mean()
    assert abs(float(by_sublayer[1, -1]) - float(output)) < 1e-3
    assert induction.copying_ce(model, ids, lens.SPAN, 8) == pytest.approx((float(output), 0), abs=1e-5)
    assert (by_sublayer[0] != by_sublayer[1]).all()  # read inside each block, before its MLP
    scores = induction.induction_scores(model, ids, lens.SPAN, 8)
    assert scores.shape == (model.config.n_layer, model.config.n_head)
    assert ((scores >= 0) & (scores <= 1)).all()
    # measured: blocks 0, 1 and 3 at most 0.02; block 2's heads 2 and 3 at 0.20 and 0.15 (an even spread: 1/32-1/62)
    assert scores[2].max() > 0.1 > scores[[0, 1, 3]].max()

    # only the final norm fixed, at a σ 8× the residuals': read through it, every residual is flattened; --real-final
    # reads it through the real norm again, as in the model with every norm real
    from lnfree.fixedscale import surgery

    final = surgery.scale_states(surgery.install(model))["ln_f"]
    surgery.initialise_sigmas(model, [ids])
    final.sigma.mul_(8.0)
    final.switch_to_fixed()
    assert (lens.lens_ce(model, ids) - by_sublayer).abs().max() > 0.1
    assert torch.allclose(lens.lens_ce(model, ids, real_final=True), by_sublayer, atol=1e-4)
    assert final.is_fixed  # given back as it came


def test_a_pilot_page_names_a_shared_config_once_and_distinct_ones_per_run(tmp_path, monkeypatch):
    summary = experiment_script("smollm2", "gpu_summary")
    evaluation = {"event": "eval", "step": 25, "held_out_ce": 3.5, "held_out_ce_unguarded": 3.5, "held_out_tokens": 64,
                  "outlier_scale": 2.0, "position0_scale": 9.0, "ceiling_hits": 0}

    def page(descriptions: dict[str, str]) -> str:
        for run, description in descriptions.items():
            (tmp_path / run).mkdir(exist_ok=True)
            (tmp_path / run / "log.jsonl").write_text(json.dumps({"step": 25, "loss": 3.0}) + "\n" + json.dumps(evaluation))
            (tmp_path / run / "run_config.json").write_text(json.dumps(
                {"description": description, "train": {"tokens_per_step": 256}}))
        monkeypatch.setattr(sys, "argv", ["gpu_summary.py", "--results", str(tmp_path)])
        summary.main()
        return (tmp_path / "tables.md").read_text()

    shared = page({"control": "ln_2 alone (the control)", "margin": "ln_2 alone (the control)"})
    assert shared.count("ln_2 alone (the control)") == 1  # in the page's header, not under each run's heading
    own = page({"control": "ln_2 alone (the control)", "margin": "the margin arm"})
    assert own.count("ln_2 alone (the control)") == 1 and own.count("the margin arm") == 1
    assert own.index("### margin") < own.index("the margin arm")
