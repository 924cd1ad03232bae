"""The memory plan: its components, its choice for the GPT-2 presets, and `lnfree plan`."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config
from typer.testing import CliRunner

from conftest import small_gpt2

from lnfree.fixedscale import surgery
from lnfree.cli import app
from lnfree.removal.config import load_preset, with_overrides
from lnfree.removal.plan import GB, Setup, Teacher, model_shape, plan_preset, plan_run, predict

XL = model_shape(GPT2Config(n_layer=48, n_embd=1600, n_head=25))


def test_shape_counts_parameters_once_and_the_matrices():
    assert 1.55e9 < XL.parameters < 1.56e9  # GPT-2 XL, tied embeddings counted once
    assert XL.matrix_parameters == 48 * 12 * 1600**2 + 50257 * 1600  # blocks' Conv1Ds and the head


def held_by_training(model) -> dict[str, int]:
    """Bytes of the weights, AdamW's state and the gradients after one real training step of `model`."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    unique = {id(p): p for p in model.parameters()}.values()
    size = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    return {"weights": size(unique), "gradients": size(p.grad for p in unique if p.grad is not None),
            "optimizer": size(t for state in optimizer.state.values() for t in state.values() if t.dim() > 0)}


def test_weights_optimizer_and_gradients_are_what_a_training_step_holds():
    model = small_gpt2()
    measured = held_by_training(model)
    prediction = predict(model_shape(model.config), Setup(context=8, micro_batch=1))
    assert {name: getattr(prediction, name) for name in measured} == measured


def test_components_scale_as_the_layout_says():
    base = Setup(context=1024, micro_batch=4)
    one = predict(XL, base)
    assert predict(XL, base.model_copy(update={"micro_batch": 8})).activations == 2 * one.activations
    assert predict(XL, base.model_copy(update={"checkpointing": True})).activations < one.activations / 10
    ddp = predict(XL, base.model_copy(update={"gpus": 8}))
    assert ddp.buckets == ddp.gradients and ddp.weights == one.weights
    fsdp = predict(XL, base.model_copy(update={"gpus": 8, "sharded": True}))
    assert fsdp.weights == one.weights / 8 and fsdp.buckets == 0
    teacher = predict(XL, base, Teacher(parameters=XL.parameters, bytes_per_parameter=2))
    assert teacher.total - one.total > 2 * XL.parameters


def test_gpt2_xl_removal_fits_one_80gb_gpu():
    for gpus in (1, 8):
        plan = plan_preset("gpt2-xl", gpus, 80.0)
        assert plan.fits and plan.prediction.total <= 80 * GB
        assert plan.setup.micro_batch >= 1 and 524288 % (plan.setup.micro_batch * 1024 * gpus) == 0
    smaller = plan_preset("gpt2-xl", 1, 40.0)  # less memory: checkpointing turns on, and it still fits
    assert smaller.fits and smaller.setup.checkpointing
    assert not plan_preset("gpt2-xl", 1, 24.0).fits


def test_plan_command_prints_the_plan_and_the_settings():
    result = CliRunner().invoke(app, ["plan", "--preset", "gpt2-xl", "--gpus", "8", "--gpu-memory", "80GB"])
    assert result.exit_code == 0, result.output
    assert "8 GPU(s) DDP" in result.output and "fits in 80 GB" in result.output
    assert "--set train.micro_batch_size=" in result.output


def test_a_distillation_run_plans_its_teacher():
    plain = load_preset("gpt2-xl")
    distilled = with_overrides(plain, ["train.distill_alpha=0.5"])
    without, with_teacher = (plan_run(c, XL, 1024, 1, 80.0, autocast=True) for c in (plain, distilled))
    assert without.prediction.teacher == 0
    assert with_teacher.prediction.teacher > 2 * XL.parameters  # bf16 weights and the KL's logits
    assert with_teacher.fits and with_teacher.setup.micro_batch <= without.setup.micro_batch


@pytest.mark.parametrize("family", ["gemma3", "mistral"])  # a tied and an untied head
def test_frozen_embeddings_leave_the_optimiser_and_gradients_only_what_training_updates(family):
    from families import tiny_family

    from lnfree.removal.train import freeze_token_embedding

    model = tiny_family(family)
    shape = model_shape(model.config)
    freeze_token_embedding(model)
    measured = held_by_training(model)
    frozen = predict(shape, Setup(context=16, micro_batch=1, freeze_embeddings=True))
    assert 0 < frozen.optimizer == measured["optimizer"] < predict(shape, Setup(context=16, micro_batch=1)).optimizer
    assert frozen.gradients == measured["gradients"] and frozen.weights == measured["weights"]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "olmo2", "neox-parallel"])
def test_each_family_counts_its_own_block(family):
    from families import tiny_family

    from lnfree.arch import architecture

    model = tiny_family(family)
    arch, shape = architecture(model), model_shape(model.config)
    assert shape.family == arch.family and shape.layers == arch.n_layers
    assert shape.scale_states == len(surgery.scale_states(surgery.install(model)))
    rms_norms_per_block = {"llama": 2, "qwen3": 4, "gemma3": 6, "olmo2": 4}.get(family)
    if rms_norms_per_block:  # an RMSNorm keeps its input and its normalised value in fp32
        widths = shape.block_fp32 / 2
        assert rms_norms_per_block * min(arch.head_dim, arch.hidden) <= widths <= rms_norms_per_block * max(
            arch.heads * arch.head_dim, arch.hidden)
