"""The stability margin (`train.stability_margin`, lnfree.removal.losses.margin): one token's residual scaled up at
one block, and a hinge on how much it grows downstream."""

from __future__ import annotations

import contextlib
import json
import math
import shutil

import pytest
import torch
from families import tiny_family

from lnfree.arch import architecture
from lnfree.fixedscale import surgery
from lnfree.removal.config import TrainConfig, with_overrides
from lnfree.removal.losses.margin import StabilityMargin, margin_loss, margin_site, perturbed
from lnfree.removal.losses.massive import NormInputs
from lnfree.removal.losses.objective import TERMS, Objective
from lnfree.removal.losses.vocab_loss import HeadInput
from lnfree.removal.train import run


def norm_inputs(model, ids, context=contextlib.nullcontext()):
    captured = NormInputs(model)
    with torch.no_grad(), captured.capturing(), context:
        model(input_ids=ids)
    inputs, sources = captured.take(), captured.sources
    captured.remove()
    return inputs, sources


def test_the_site_is_a_pure_function_of_seed_step_and_micro_step_within_the_model():
    sites = {margin_site(0, step, micro, 0, layers=3, context=16) for step in range(50) for micro in range(2)}
    assert all(0 <= block < 3 and 1 <= position < 16 for block, position in sites)
    assert len({b for b, _ in sites}) == 3 and len(sites) > 20  # spread over blocks and positions
    assert margin_site(0, 7, 1, 0, layers=3, context=16) == margin_site(0, 7, 1, 0, layers=3, context=16)
    assert margin_site(1, 7, 1, 0, layers=3, context=16) != margin_site(0, 7, 1, 0, layers=3, context=16) or \
        margin_site(1, 8, 1, 0, layers=3, context=16) != margin_site(0, 8, 1, 0, layers=3, context=16)


def test_the_perturbation_scales_one_position_entering_one_block_and_nothing_before_it():
    model = tiny_family("llama")
    arch = architecture(model)
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    clean, sources = norm_inputs(model, ids)
    block = model.get_submodule(arch.layers)[1]
    moved, _ = norm_inputs(model, ids, perturbed(block, 5, 4.0))
    first = sources.index(model.get_submodule(arch.block(1, "input_layernorm")))
    for i, (a, b) in enumerate(zip(clean, moved)):
        assert torch.equal(a[:, :5], b[:, :5])  # causal: the positions before the perturbed one never see it
        if i < first:
            assert torch.equal(a, b)  # block 0 runs before the perturbation
    torch.testing.assert_close(moved[first][:, 5], 4.0 * clean[first][:, 5])
    assert torch.equal(moved[first][:, 6:], clean[first][:, 6:])
    again, _ = norm_inputs(model, ids)  # the hook is gone
    assert all(torch.equal(a, b) for a, b in zip(clean, again))


def test_the_hinge_is_zero_within_the_margin_and_squares_the_log_excess_beyond_it():
    clean = [torch.rand(2, 6, 8) + 0.5 for _ in range(3)]
    p, factor, ratio = 2, 4.0, 2.0
    linear = [x.clone() for x in clean]
    for x in linear[1:]:
        x[:, p:] *= factor  # grows with the perturbation, no more: inside the margin
    assert margin_loss(clean, linear, p, "rms", factor, ratio).item() == 0.0
    beyond = [x.clone() for x in linear]
    beyond[2][:, p:] *= 3 * ratio  # 3× past the margin at one norm input, every token from p on
    expected = 4 * math.log(3) ** 2  # 2 rows × 4 tokens, per sequence: 4 tokens × log(3)²
    assert margin_loss(clean, beyond, p, "rms", factor, ratio).item() == pytest.approx(expected, rel=1e-5)


def planted(model):
    """A tiny Llama whose block-1 neuron 0 has a high gain: its gate and up rows and its output column 30×."""
    mlp = model.get_submodule(f"{architecture(model).layers}.1.mlp")
    with torch.no_grad():
        mlp.gate_proj.weight[0] *= 30
        mlp.up_proj.weight[0] *= 30
        mlp.down_proj.weight[:, 0] *= 30
    return model


def planted_folder(folder):
    """`planted` on a tiny Llama over the tiny corpus's tokenizer, saved with it in `folder` (a run's model)."""
    from lnfree.data.tiny import PRETRAIN_SEED, build_tokenizer, generate_documents

    tokenizer = build_tokenizer(generate_documents(200, PRETRAIN_SEED))
    model = planted(tiny_family("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def fixed(model, ids):
    """`model` with lnfree norms installed, every σ measured on `ids` and fixed."""
    model = surgery.install(model)
    surgery.initialise_sigmas(model, [ids])
    for state in surgery.scale_states(model).values():
        state.switch_to_fixed()
    return model


def test_a_fixed_gated_model_pays_a_margin_its_real_norms_do_not_and_the_gradient_reaches_the_runaway_neuron():
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    setting = StabilityMargin(factor=4.0, ratio=2.0)
    arch = architecture(tiny_family("llama"))

    def margin(model):
        """The margin's terms on `model`, its gradient taken inside the context as a run does."""
        objective = Objective(model.train(), TrainConfig(stability_margin=setting), arch, None, 0,
                              contextlib.nullcontext)
        with objective.margin(model, ids, (0, 3), setting) as (loss, terms):
            loss.backward()
        objective.remove()
        return terms

    real = margin(planted(tiny_family("llama")))  # real norms divide the perturbation back out
    model = fixed(planted(tiny_family("llama")), ids)
    terms = margin(model)
    assert terms[TERMS.index("margin")] > 100 * real[TERMS.index("margin")]  # measured: 0.0042 real, 2.1 fixed
    assert terms[TERMS.index("loss")] == terms[TERMS.index("margin")]
    down = f"{arch.layers}.1.mlp.down_proj"
    neuron = model.get_submodule(down).weight.grad[:, 0]
    assert neuron.abs().sum() > 0 and torch.isfinite(neuron).all()
    assert all(not s.paused for s in surgery.scale_states(model).values())  # statistics resumed after it
    checkpointed = fixed(planted(tiny_family("llama")), ids)  # a recompute in the backward sees the perturbation
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert margin(checkpointed)[TERMS.index("margin")] == terms[TERMS.index("margin")]
    torch.testing.assert_close(checkpointed.get_submodule(down).weight.grad, model.get_submodule(down).weight.grad)
    real = surgery.install(planted(tiny_family("llama")))  # real norms gather σ statistics in training forwards
    real.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    before = {name: state.stats.clone() for name, state in surgery.scale_states(real).items()}
    margin(real)  # neither its forwards nor the backward's recompute feed them
    assert all(torch.equal(state.stats, before[name]) for name, state in surgery.scale_states(real).items())


def test_the_margins_forwards_compute_no_logits_and_lose_nothing_by_it(monkeypatch):
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    setting = StabilityMargin(factor=4.0, ratio=2.0)
    arch = architecture(tiny_family("llama"))

    def margin(model):
        """The margin's terms and gradient on `model`, and the width of each logits tensor its head made."""
        widths = []
        hook = model.get_submodule(arch.unembedding).register_forward_hook(
            lambda module, args, out: widths.append(out.shape[-1]))
        objective = Objective(model.train(), TrainConfig(stability_margin=setting), arch, None, 0,
                              contextlib.nullcontext)
        with objective.margin(model, ids, (0, 3), setting) as (loss, terms):
            loss.backward()
        objective.remove()
        hook.remove()
        return terms, widths, model.get_submodule(f"{arch.layers}.1.mlp.down_proj").weight.grad

    terms, widths, grad = margin(fixed(planted(tiny_family("llama")), ids))
    assert widths == [0, 0]  # the clean and the perturbed forward: the head skipped in both
    monkeypatch.setattr(HeadInput, "skips", staticmethod(lambda wrapper: False))  # as under FSDP
    with_logits, widths, grad_with_logits = margin(fixed(planted(tiny_family("llama")), ids))
    assert widths == [64, 64]  # the tiny vocabulary
    assert torch.equal(terms, with_logits) and torch.equal(grad, grad_with_logits)


def test_a_run_with_the_margin_logs_it_and_resumes_exactly(tmp_path):
    from conftest import quick_run_config

    planted_folder(tmp_path / "model")
    config = quick_run_config(tmp_path / "run", tmp_path / "model", tmp_path / "cache", save_every=5,
                              stability_margin={"factor": 4.0, "ratio": 1.5, "rows": 2, "start": 3})
    full = run(config, progress=False)
    logged = [json.loads(line) for line in (full.output_dir / "log.jsonl").read_text().splitlines()]
    margins = {r["step"]: r["margin"] for r in logged if "margin" in r}
    shares = {r["step"]: r["margin_share"] for r in logged if "margin_share" in r}  # its gradient over the text's
    assert set(shares) == set(margins) and shares[1] == 0 and max(shares.values()) > 0
    assert sorted(margins) == list(range(1, 17)) and margins[1] == margins[3] == 0  # on from step index 3
    assert any(m > 0 for m in margins.values()) and all(math.isfinite(m) for m in margins.values())
    moved = tmp_path / "moved"
    shutil.copytree(full.output_dir, moved)
    for later in ("step_000010", "step_000015", "step_000016"):
        shutil.rmtree(moved / "checkpoints" / later)
    resumed = run(with_overrides(config, {"output_dir": str(moved)}), resume=True, progress=False)
    lines = [json.loads(line) for line in (moved / "log.jsonl").read_text().splitlines()]
    after = lines[max(i for i, r in enumerate(lines) if r.get("event") == "resume") + 1:]
    again = {r["step"]: r for r in after if "margin" in r}
    assert sorted(again) == list(range(6, 17))
    for step, record in again.items():  # the same sites, the same losses
        assert record["margin"] == pytest.approx(margins[step], rel=1e-5, abs=1e-6), step
    for name, value in resumed.model.state_dict().items():
        torch.testing.assert_close(value, full.model.state_dict()[name], msg=name)


def test_on_gemma_the_margin_reads_the_residual_not_the_sublayer_output_norms():
    model = tiny_family("gemma3")
    arch = architecture(model)
    objective = Objective(model.train(), TrainConfig(stability_margin=StabilityMargin()), arch, None, 0,
                          contextlib.nullcontext)
    names = {name for name, module in model.named_modules() if module in objective.residual_reads}
    reads = ("input_layernorm", "pre_feedforward_layernorm")  # not post_attention / post_feedforward
    assert names == {f"model.layers.{i}.{n}" for i in range(2) for n in reads} | {"model.norm"}
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with objective.margin(model, ids, (1, 4), StabilityMargin()) as (loss, terms):
        assert torch.isfinite(loss)
    objective.remove()


def test_the_timeline_previews_the_norm_switches_not_yet_complete_in_schedule_order():
    from lnfree.removal.schedule import Event
    from lnfree.removal.timeline import Timeline

    events = [Event(2, "ln_2", 0, 3), Event(4, "ln_2", 1, 3), Event(6, "pos0_special", None, 2),
              Event(7, "ln_f", None, 1)]
    timeline = Timeline(events)
    slots = []
    for step in range(9):
        timeline.actions(step)
        slots.append([e.slot for e in timeline.upcoming(step, 2)])
    assert slots[0] == slots[1] == ["blocks.0.ln_2", "blocks.1.ln_2"]
    assert slots[3] == ["blocks.0.ln_2", "blocks.1.ln_2"]  # block 0 blends over 2–4: 2/3 fixed at step 3
    assert slots[4] == ["blocks.1.ln_2", "ln_f"]  # block 0 complete at step 4; the special σ is no norm switch
    assert slots[6] == ["ln_f"] and slots[7] == slots[8] == []  # ln_f is fixed at once at step 7
    assert [e.slot for e in timeline.upcoming(0, 0)] == []


def test_a_preview_fixes_the_upcoming_norms_only_within_and_trains_a_planted_neuron_while_they_are_real():
    from lnfree.removal.schedule import Event

    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    setting = StabilityMargin(ratio=1.5, preview=2)
    model = surgery.install(planted(tiny_family("llama")))
    surgery.initialise_sigmas(model, [ids])
    states = surgery.scale_states(model)
    events = [Event(0, "ln_2", 0, 4), Event(4, "ln_2", 1, 4)]
    ahead = [states["blocks.0.ln_2"], states["blocks.1.ln_2"]]
    ahead[0].set_fixed_fraction(0.5)  # one blending, one real
    before = [(s.mix.clone(), s.fixed.clone(), s.is_fixed, s.is_blending) for s in states.values()]
    arch = architecture(model)
    objective = Objective(model.train(), TrainConfig(stability_margin=setting), arch, None, 0, contextlib.nullcontext)
    with objective.margin(model, ids, (0, 3), setting, events) as (loss, terms):
        assert all(s.is_fixed and not s.is_blending for s in ahead)
        assert not any(s.is_fixed or s.is_blending for name, s in states.items() if name != "blocks.0.ln_2"
                       and s not in ahead)
        loss.backward()
    after = [(s.mix, s.fixed, s.is_fixed, s.is_blending) for s in states.values()]
    for (m0, f0, x0, b0), (m1, f1, x1, b1) in zip(before, after):  # restored exactly
        assert torch.equal(m0, m1) and torch.equal(f0, f1) and (x0, b0) == (x1, b1)
    assert terms[TERMS.index("margin")] > 0  # the planted neuron behind block 1's ln_2 runs away once it is fixed
    neuron = model.get_submodule(f"{arch.layers}.1.mlp.down_proj").weight.grad[:, 0]
    assert neuron.abs().sum() > 0 and torch.isfinite(neuron).all()
    with objective.margin(model, ids, (0, 3), setting, []) as (loss, terms):  # nothing ahead: the same forward
        assert terms[TERMS.index("margin")] == 0
    objective.remove()


def test_a_run_previews_the_switches_ahead_and_its_vanilla_control_reads_zero(tmp_path):
    from conftest import quick_run_config

    planted_folder(tmp_path / "model")
    config = quick_run_config(tmp_path / "run", tmp_path / "model", tmp_path / "cache", max_steps=12,
                              stability_margin={"ratio": 1.2, "rows": 2, "preview": 2})

    def margins(config):
        out = run(config, progress=False).output_dir
        return [r["margin"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "margin" in r]

    removal = margins(config)
    assert len(removal) == 12 and all(math.isfinite(m) for m in removal) and max(removal) > 0
    vanilla = margins(with_overrides(config, {"removal.mode": "vanilla", "output_dir": str(tmp_path / "vanilla")}))
    assert vanilla == [0.0] * 12  # no norm switch ahead: the preview forward is the clean one
