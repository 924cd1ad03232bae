"""`train.teacher`: distillation from another model with real norms, such as a vanilla run's fine-tuned model."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from lnfree.removal.config import ConfigError, with_overrides
from lnfree.removal.layout import LOG, latest_checkpoint
from lnfree.removal.losses.distill import TeacherError, load_teacher, vanilla_checkpoint
from lnfree.removal.records import read_records
from lnfree.removal.train import RunError, run


def test_it_needs_distillation(run_config):
    with pytest.raises(ConfigError, match="distill_alpha > 0"):
        with_overrides(run_config(max_steps=2), {"train.distill_alpha": 0.0, "train.teacher": "somewhere"})


def _records(output_dir) -> list[dict]:
    return read_records(output_dir / LOG)


def _first_kl(output_dir) -> float:
    return next(r["kl"] for r in _records(output_dir) if "kl" in r)


def test_a_removal_distils_from_a_vanilla_runs_newest_checkpoint_and_refuses_a_removal_run(run_config, model_dir):
    base = with_overrides(run_config(max_steps=12, learning_rate=5e-3, eval_every=0), {"train.distill_alpha": 0.5})
    vanilla = run(with_overrides(base, {"removal.mode": "vanilla", "output_dir": str(base.output_dir) + "-vanilla"}),
                  progress=False).output_dir
    newest = latest_checkpoint(vanilla)
    assert vanilla_checkpoint(str(vanilla)) == newest and vanilla_checkpoint(str(newest)) == newest
    assert vanilla_checkpoint(str(model_dir)) is None  # a model directory: loaded as a model
    teacher = load_teacher(str(vanilla), torch.device("cpu"), "fp32")
    stored = load_file(newest / "model.safetensors")
    name, weight = next((k, v) for k, v in stored.items() if k.endswith("mlp.c_fc.weight"))
    assert torch.equal(teacher.state_dict()[name], weight)  # the fine-tuned weights, not the original's
    assert not torch.equal(load_teacher(str(model_dir), torch.device("cpu"), "fp32").state_dict()[name], weight)
    assert not any(p.requires_grad for p in teacher.parameters())

    original = run(base, progress=False).output_dir
    distilled = run(with_overrides(base, {"train.teacher": str(vanilla), "output_dir": str(base.output_dir) + "-t"}),
                    progress=False).output_dir
    assert _first_kl(distilled) > _first_kl(original)  # step 1: the same student, a teacher it has not yet matched
    with pytest.raises(TeacherError, match="fixed norms"):
        vanilla_checkpoint(str(original))


def test_a_branch_switches_teachers_at_its_checkpoint_as_a_run_planned_so_from_step_0(run_config, tmp_path):
    base = with_overrides(run_config(max_steps=12, learning_rate=5e-3, eval_every=0, save_every=6, log_every=1),
                          {"train.distill_alpha": 0.5})
    vanilla = run(with_overrides(base, {"removal.mode": "vanilla", "output_dir": str(tmp_path / "vanilla")}),
                  progress=False).output_dir
    out = run(base, progress=False).output_dir
    original_kl = [r["kl"] for r in _records(out) if "kl" in r]
    shutil.rmtree(out / "checkpoints" / "step_000012")
    switched = with_overrides(base, {"train.teacher": str(vanilla), "train.teacher_start": 6})
    with pytest.raises(RunError, match="the distillation teacher before step 6"):
        run(with_overrides(switched, {"train.teacher_start": 3}), resume=True, progress=False)
    resumed = run(switched, resume=True, progress=False)
    assert {"event": "amend", "step": 6, "changed": ["train.teacher", "train.teacher_start"]} in _records(out)

    planned = run(with_overrides(switched, {"output_dir": str(tmp_path / "planned")}), progress=False)
    planned_kl = [r["kl"] for r in _records(planned.output_dir) if "kl" in r]
    assert planned_kl[:6] == original_kl[:6]  # the original teaches steps 0–5
    assert abs(planned_kl[6] - original_kl[6]) > 1e-3  # from step 6 on, another teacher
    resumed_kl = [r["kl"] for r in _records(out) if "kl" in r][-6:]
    assert resumed_kl == pytest.approx(planned_kl[6:], rel=1e-4)
    for name, value in planned.model.state_dict().items():  # switched in the run or at its resume: the same run
        torch.testing.assert_close(resumed.model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
