"""Removal strategies: distillation's KL term, gradual removal, adaptive timing, and runs using them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from lnfree.fixedscale import surgery
from lnfree.fixedscale.functional import real_norm
from lnfree.fixedscale.norms import FixedScaleNorm
from lnfree.fixedscale.state import ScaleState
from lnfree.removal.config import with_overrides
from lnfree.removal.losses.distill import kl_to_teacher
from lnfree.forms.export import ExportError, export_run, to_eps_trick
from lnfree.forms.load import load
from lnfree.removal.schedule import Adaptive, Event, Schedule, Stage, ScheduleError
from lnfree.removal.timeline import Timeline
from lnfree.removal.train import run

# ----------------------------------------------------------------------------- distillation


def test_kl_is_zero_against_itself_and_matches_a_hand_computation():
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(2, 5, 11, generator=gen) * 3
    teacher = torch.randn(2, 5, 11, generator=gen) * 3
    assert kl_to_teacher(student, student).abs() < 1e-6
    for temperature in (1.0, 2.5):
        p = torch.softmax(teacher.double() / temperature, -1)
        q = torch.softmax(student.double() / temperature, -1)
        by_hand = (p * (p.log() - q.log())).sum(-1).mean() * temperature**2
        assert kl_to_teacher(student, teacher, temperature).item() == pytest.approx(by_hand.item(), rel=1e-5)


def test_kl_is_computed_in_chunks_without_changing_it(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(3, 7, 13, generator=gen), torch.randn(3, 7, 13, generator=gen)
    whole = kl_to_teacher(student, teacher)
    monkeypatch.setattr("lnfree.removal.losses.distill.KL_CHUNK_TOKENS", 4)  # 21 tokens in 6 chunks
    torch.testing.assert_close(kl_to_teacher(student, teacher), whole, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ce_and_kl_together_are_transformers_ce_and_the_kl_with_their_gradients(monkeypatch, temperature, dtype):
    from transformers.loss.loss_utils import ForCausalLMLoss

    from lnfree.removal.losses.distill import IGNORE, ce_and_kl_to_teacher

    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 7, 13, generator=gen) * 3).to(dtype)
    teacher = (torch.randn(3, 7, 13, generator=gen) * 3).to(dtype)
    ids = torch.randint(0, 13, (3, 7), generator=gen)
    monkeypatch.setattr("lnfree.removal.losses.distill.KL_CHUNK_TOKENS", 4)  # 21 tokens in 6 chunks

    def terms(together: bool):
        student = logits.clone().requires_grad_()
        if together:
            ce, kl = ce_and_kl_to_teacher(student, teacher, F.pad(ids[:, 1:], (0, 1), value=IGNORE), temperature)
        else:
            ce, kl = ForCausalLMLoss(student, ids, vocab_size=13), kl_to_teacher(student, teacher, temperature)
        (0.3 * ce + 0.7 * kl).backward()
        return ce.detach(), kl.detach(), student.grad.float()

    (ce, kl, grad), (ce_hf, kl_alone, grad_apart) = terms(True), terms(False)
    torch.testing.assert_close(ce, ce_hf, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kl, kl_alone, rtol=1e-6, atol=1e-6)
    # apart, each term's fp32 gradient is cast to the logits' dtype before the two are summed there
    torch.testing.assert_close(grad, grad_apart, **({} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-4}))
    assert grad.abs().max() > 1e-3


# ----------------------------------------------------------------------------- gradual removal


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_blend_is_the_real_norm_at_its_start_and_the_fixed_norm_at_its_end(kind):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, 16, generator=gen) * 2 + 0.5
    weight, bias = torch.rand(16, generator=gen) + 0.5, (torch.randn(16, generator=gen) if kind == "layer" else None)
    state = ScaleState(1e-5, kind)
    state.sigma.fill_(1.7)
    norm = FixedScaleNorm(weight, bias, state).eval()
    real = real_norm(x, kind, weight, bias, 1e-5)
    torch.testing.assert_close(norm(x), real)

    state.set_fixed_fraction(1e-9)  # the blend's start: (almost) all real scale
    assert state.is_blending and not state.is_fixed
    torch.testing.assert_close(norm(x), real, rtol=1e-5, atol=1e-5)

    state.set_fixed_fraction(0.25)
    scale = torch.sqrt((x.var(-1, unbiased=False) if kind == "layer" else x.pow(2).mean(-1)) + 1e-5)
    blended = (0.75 * scale + 0.25 * 1.7).unsqueeze(-1)
    centred = x - x.mean(-1, keepdim=True) if kind == "layer" else x
    by_hand = centred / blended * weight + (bias if bias is not None else 0)
    torch.testing.assert_close(norm(x), by_hand, rtol=1e-5, atol=1e-6)

    state.set_fixed_fraction(1.0)  # the end: exactly the fixed-scale norm
    fixed_state = ScaleState(1e-5, kind)
    fixed_state.sigma.fill_(1.7)
    fixed_state.switch_to_fixed()
    assert state.is_fixed and not state.is_blending and float(state.mix) == 0
    assert torch.equal(norm(x), FixedScaleNorm(weight, bias, fixed_state)(x))


def test_sigma_freezes_when_the_blend_starts():
    state = ScaleState(1e-5, "layer")
    norm = FixedScaleNorm(torch.ones(8), torch.zeros(8), state).train()
    state.set_fixed_fraction(0.5)
    norm(torch.randn(4, 8) * 5)
    assert not state.gathering and state.stats.abs().sum() == 0
    state.commit_ema(torch.tensor([[40.0, 0, 0], [4.0, 0, 0]]), 0.5)
    assert float(state.sigma) == 1.0


def test_a_blending_q_k_path_beside_a_real_v_path_normalises_each_by_its_own_scale():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = surgery.install(LlamaForCausalLM(config).eval())
    norm = model.model.layers[0].input_layernorm
    norm.qk.sigma.fill_(3.0)
    norm.qk.set_fixed_fraction(0.5)
    x = torch.randn(2, 5, 32) * 4
    q_proj, v_proj = model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.v_proj
    rms = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.qk.eps)
    torch.testing.assert_close(q_proj(x), (x / (0.5 * rms + 1.5) * norm.weight) @ q_proj.weight.t())
    torch.testing.assert_close(v_proj(x), (x / rms * norm.weight) @ v_proj.weight.t())


def test_export_refuses_a_norm_in_the_middle_of_its_blend(run_config):
    result = run(run_config(max_steps=12), progress=False)
    surgery.scale_states(result.model)["ln_f"].set_fixed_fraction(0.5)
    with pytest.raises(ExportError, match="gradual removal"):
        to_eps_trick(result.model, allow_partial=True)


# ----------------------------------------------------------------------------- timeline


def _events(n_layer: int = 2) -> list[Event]:
    schedule = Schedule(stages=[Stage(kind="ln_2", start=2, gap=1), Stage(kind="ln_1qk", gap=1),
                                Stage(kind="ln_1v", gap=0), Stage(kind="ln_f")])
    return schedule.events(n_layer)


def test_fixed_gaps_with_a_blend_ramp_each_slot_to_exactly_fixed():
    timeline = Timeline(_events(), blend_steps=3)
    seen = {step: [(e.slot, round(f, 4)) for e, f in timeline.actions(step)] for step in range(12)}
    assert seen[2] == [("blocks.0.ln_2", 0.3333)]
    assert seen[3] == [("blocks.0.ln_2", 0.6667), ("blocks.1.ln_2", 0.3333)]
    assert seen[4] == [("blocks.0.ln_2", 1.0), ("blocks.1.ln_2", 0.6667), ("blocks.0.ln_1qk", 0.3333)]
    assert seen[6][-3:] == [("blocks.0.ln_1v", 0.3333), ("blocks.1.ln_1v", 0.3333), ("ln_f", 0.3333)]
    assert seen[9] == [] and [e.step for e in timeline.applied] == [e.step for e in _events()]


def test_a_stage_blend_overrides_the_run_blend_and_survives_a_restore():
    events = [Event(0, "ln_2", 0, blend_steps=4), Event(1, "ln_2", 1), Event(2, "ln_f", None, blend_steps=1)]
    timeline = Timeline(events, blend_steps=2)
    assert [(e.slot, f) for e, f in timeline.actions(0)] == [("blocks.0.ln_2", 0.25)]
    restored = Timeline(events, blend_steps=2)
    restored.load_state_dict(json.loads(json.dumps(timeline.state_dict())))
    seen = {step: [(e.slot, f) for e, f in restored.actions(step)] for step in range(1, 5)}
    assert seen[1] == [("blocks.0.ln_2", 0.5), ("blocks.1.ln_2", 0.5)]
    assert seen[2] == [("blocks.0.ln_2", 0.75), ("blocks.1.ln_2", 1.0), ("ln_f", 1.0)]
    assert seen[3] == [("blocks.0.ln_2", 1.0)] and seen[4] == []


def test_a_cosine_stage_rises_slowly_at_both_ends_and_keeps_its_shape_through_a_restore():
    schedule = Schedule(stages=[Stage(kind="ln_2", start=0, gap=1, blend_steps=4, blend_shape="cosine"),
                                Stage(kind="ln_f", start=0, blend_steps=4)])
    events = schedule.events(n_layer=2)
    assert "on a half cosine" in schedule.describe(2).splitlines()[0] and "cosine" not in schedule.describe(2).splitlines()[1]
    timeline = Timeline(events)
    assert [(e.slot, round(f, 4)) for e, f in timeline.actions(0)] == [("blocks.0.ln_2", 0.1464), ("ln_f", 0.25)]
    restored = Timeline(events)
    restored.load_state_dict(json.loads(json.dumps(timeline.state_dict())))
    fractions = [dict((e.slot, round(f, 4)) for e, f in restored.actions(step)) for step in range(1, 5)]
    assert [f["blocks.0.ln_2"] for f in fractions[:3]] == [0.5, 0.8536, 1.0]  # the cosine's middle and its slow end
    assert [f["blocks.1.ln_2"] for f in fractions] == [0.1464, 0.5, 0.8536, 1.0] and fractions[2]["ln_f"] == 1.0
    legacy = Timeline(events)  # a checkpoint written before blend shapes: four entries per event, linear
    legacy.load_state_dict({"applied": [[0, "ln_2", 0, 4]], "next_group": 1, "reference": None, "recent": []})
    assert [round(f, 4) for e, f in legacy.actions(1)][0] == 0.5 and legacy.applied[0].blend_shape == "linear"


def test_a_special_sigma_fades_only_over_its_own_stage_blend():
    events = [Event(0, "ln_f"), Event(1, "pos0_special", blend_steps=4), Event(1, "eot_special")]
    timeline = Timeline(events, blend_steps=2)
    seen = {step: [(e.slot, f) for e, f in timeline.actions(step)] for step in range(6)}
    assert seen[0] == [("ln_f", 0.5)]
    assert seen[1] == [("ln_f", 1.0), ("pos0_special", 0.25), ("eot_special", 1.0)]
    assert seen[4] == [("pos0_special", 1.0)] and seen[5] == []


def _drive(timeline: Timeline, losses: dict[int, float], steps: range) -> list[tuple[int, str]]:
    happened = []
    for step in steps:
        happened += [(step, e.slot) for e, f in timeline.actions(step) if e.step == step]
        timeline.record(torch.tensor(losses[step]))
    return happened


def test_adaptive_timing_waits_for_recovery_between_min_and_max_gap():
    adaptive = Adaptive(delta=0.05, min_gap=2, max_gap=5, window=2)
    # Loss 3.0, +0.5 after every removal, recovering by 0.1 per step.
    losses, level, happened, timeline = {}, 3.0, [], Timeline(_events(), adaptive=adaptive)
    for step in range(40):
        new = [(step, e.slot) for e, f in timeline.actions(step) if e.step == step]
        level = level + 0.5 if new else max(3.0, level - 0.1)
        losses[step] = level
        timeline.record(torch.tensor(level))
        happened += new
    steps = [s for s, _ in happened]
    assert steps[0] == 2 and len({slot for _, slot in happened}) == 7
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b != a]
    assert all(2 <= g <= 5 for g in gaps)
    assert 5 in gaps  # 0.5 nats do not recover within 4 steps: max_gap forces the next removal
    # The ln_1v + ln_f group (one step in the schedule) stays together.
    assert [s for s, slot in happened if slot.endswith("ln_1v")] == [steps[4]] * 2

    # The same losses, fast recovery: removals as soon as min_gap allows.
    quick = Timeline(_events(), adaptive=adaptive)
    flat = _drive(quick, {s: 3.0 for s in range(40)}, range(40))
    assert [s for s, _ in flat] == [2, 4, 6, 8, 10, 10, 10]  # ln_1v (gap 0) and ln_f share a step in the schedule


def test_adaptive_decisions_are_identical_after_restoring_the_state():
    adaptive = Adaptive(delta=0.02, min_gap=1, max_gap=6, window=3)
    gen = torch.Generator().manual_seed(0)
    losses = {s: 3 + float(torch.rand((), generator=gen)) * 0.1 for s in range(40)}
    full = _drive(Timeline(_events(), adaptive=adaptive), losses, range(40))
    first = Timeline(_events(), adaptive=adaptive)
    before = _drive(first, losses, range(9))
    restored = Timeline(_events(), adaptive=adaptive)
    restored.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert before + _drive(restored, losses, range(9, 40)) == full


def test_a_run_that_could_not_finish_its_adaptive_schedule_is_refused(run_config):
    config = with_overrides(run_config(max_steps=16), ['removal.adaptive={"max_gap": 4}'])
    with pytest.raises(ScheduleError, match="adaptive max_gap"):
        run(config, progress=False)


# ----------------------------------------------------------------------------- runs


def strategies_config(run_config, **train):
    """Distillation + gradual removal + adaptive timing on the 2-layer test model (7 removal groups)."""
    config = run_config(max_steps=30, **train)
    return with_overrides(config, {
        "train.distill_alpha": 0.5, "train.distill_temperature": 2.0, "removal.blend_steps": 3,
        "removal.adaptive": {"delta": 0.05, "min_gap": 1, "max_gap": 3, "window": 2},
    })


def test_every_strategy_resumes_exactly_mid_removal_and_exports_exactly(run_config, tmp_path):
    config = strategies_config(run_config, save_every=7)
    full = run(config, progress=False)
    assert surgery.is_fully_removed(full.model)
    log = [json.loads(line) for line in (full.output_dir / "log.jsonl").read_text().splitlines()]
    assert all("kl" in r for r in log if "loss" in r)

    moved = tmp_path / "moved"
    shutil.copytree(full.output_dir, moved)
    for later in sorted((moved / "checkpoints").iterdir())[1:]:  # keep step 7: mid-removal and mid-blend
        shutil.rmtree(later)
    state = json.loads((moved / "checkpoints/step_000007/trainer_state.json").read_text())
    assert any("fixed_fraction" in s for s in state["removal_state"].values())
    resumed = run(with_overrides(config, {"output_dir": str(moved)}), resume=True, progress=False)
    assert resumed.events == full.events
    assert surgery.removal_state(resumed.model) == surgery.removal_state(full.model)
    assert resumed.held_out_ce_end == pytest.approx(full.held_out_ce_end, rel=1e-6)

    export = export_run(full)
    ids = torch.randint(0, full.model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    full.model.eval()
    with torch.no_grad():
        reference = full.model(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(export).eval()(input_ids=ids).logits
        loaded = load(export)
        torch.testing.assert_close(plain, reference, rtol=0, atol=1e-4)
        torch.testing.assert_close(loaded.hf()(input_ids=ids).logits, reference, rtol=0, atol=1e-4)
        torch.testing.assert_close(loaded.folded()(input_ids=ids).logits, reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("strategy", [
    {"train.distill_alpha": 1.0}, {"removal.blend_steps": 4}, {"removal.adaptive": {"max_gap": 2}},
])
def test_each_strategy_alone_removes_every_norm_and_exports(run_config, strategy):
    result = run(with_overrides(run_config(max_steps=20), strategy), progress=False)
    assert surgery.is_fully_removed(result.model)
    export = export_run(result)
    assert load(export).fully_ln_free


def test_distillation_with_the_student_equal_to_the_teacher_starts_at_zero_kl(run_config):
    config = with_overrides(run_config(max_steps=1, log_every=1), {
        "train.distill_alpha": 1.0, "removal.mode": "vanilla", "train.aux_loss_weight": 0.0, "train.learning_rate": 1e-9,
        "train.min_learning_rate": 0.0})
    result = run(config, progress=False)
    first = [json.loads(line) for line in (result.output_dir / "log.jsonl").read_text().splitlines()][1]
    assert first["kl"] == pytest.approx(0.0, abs=1e-6) and first["loss"] == pytest.approx(0.0, abs=1e-6)


def test_teacher_is_frozen_and_not_trained(run_config):
    from lnfree.removal.losses.distill import load_teacher

    config = run_config()
    teacher = load_teacher(config.model, torch.device("cpu"))
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert not any(isinstance(m, nn.Dropout) and m.training for m in teacher.modules())


@pytest.mark.parametrize("name, n_layer", [("tiny-distill", 4), ("realtext-distill", 4), ("gpt2-distill", 12)])
def test_strategy_presets_distil_and_otherwise_follow_their_base_preset(name, n_layer):
    from lnfree.removal.config import load_preset
    from lnfree.removal.train import resolve_run

    config, events = resolve_run(load_preset(name), n_layer)
    base, _ = resolve_run(load_preset(name.removesuffix("-distill")), n_layer)
    assert config.train.distill_alpha == 0.5 and base.train.distill_alpha == 0
    assert config.removal == base.removal and len(events) == 3 * n_layer + 1
