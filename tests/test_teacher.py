"""`train.teacher`: distillation from another model with real norms, such as a vanilla run's fine-tuned model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lnfree.removal.config import ConfigError, with_overrides
from lnfree.removal.layout import LOG, latest_checkpoint
from lnfree.removal.losses.distill import TeacherError, load_teacher, vanilla_checkpoint
from lnfree.removal.train import run


def test_it_needs_distillation(run_config):
    with pytest.raises(ConfigError, match="distill_alpha > 0"):
        with_overrides(run_config(max_steps=2), {"train.distill_alpha": 0.0, "train.teacher": "somewhere"})


def _first_kl(output_dir) -> float:
    records = [json.loads(line) for line in (output_dir / LOG).read_text().splitlines()]
    return next(r["kl"] for r in records if "kl" in r)


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
