"""The scale ceiling: exactly the fixed norm below it, the real norm times the ceiling above it, in
every family and every kind of slot; bounded where the plain fixed norms explode; released on
schedule, resumable, never saved."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from families import FAMILIES, tiny_family
from lnfree.fixedscale import surgery
from lnfree.fixedscale.functional import real_norm
from lnfree.fixedscale.norms import FixedScaleNorm
from lnfree.fixedscale.state import ScaleState
from lnfree.fixedscale.ceiling import RELEASE_RISE, ScaleCeiling, set_ceiling, watching
from lnfree.removal.config import with_overrides
from lnfree.removal.train import run


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("blending", [False, True])
def test_below_the_ceiling_the_fixed_norm_above_it_the_real_norm_times_the_ceiling(kind, blending):
    torch.manual_seed(0)
    state = ScaleState(1e-6, kind)
    state.sigma.fill_(2.0)
    state.set_fixed_fraction(0.95 if blending else 1.0)  # blending divides by ≥ 0.05 × the real scale
    weight, bias = torch.randn(16), (torch.randn(16) if kind == "layer" else None)
    norm = FixedScaleNorm(weight, bias, state).requires_grad_(False)
    x = torch.randn(4, 16)
    x[1] *= 300  # far above any ceiling below
    plain = norm(x)
    state.ceiling = 8.0
    guarded = norm(x)
    # The same arithmetic up to rounding (a LayerNorm's fused kernel against its per-token form).
    torch.testing.assert_close(guarded[[0, 2, 3]], plain[[0, 2, 3]], rtol=1e-6, atol=1e-6)
    no_bias = real_norm(x[1:2], kind, weight, None, 1e-6)[0]
    torch.testing.assert_close(guarded[1] - (0 if bias is None else bias), 8.0 * no_bias, rtol=1e-4, atol=1e-4)
    assert float(plain[1].abs().max()) > (2 if blending else 10) * float(guarded[1].abs().max())


def all_fixed(family: str, ids: torch.Tensor):
    model = surgery.install(tiny_family(family))
    surgery.initialise_sigmas(model, [ids])
    for state in surgery.scale_states(model).values():
        state.switch_to_fixed()
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_a_ceiling_nothing_reaches_changes_no_logit_and_a_low_one_bounds_a_runaway_token(family):
    ids = torch.randint(2, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    model = all_fixed(family, ids)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        set_ceiling(model, 1e9)  # guarded: the split attention norm takes its per-path route
        torch.testing.assert_close(model(input_ids=ids).logits, plain, rtol=1e-5, atol=1e-5)
        set_ceiling(model, math.inf)
        token = int(ids[0, 3])
        model.get_input_embeddings().weight[token] *= 1e4  # one token enters every fixed norm 10⁴× too large
        others = torch.arange(64) != token  # a tied head's row of that token is 10⁴× too large as well
        exploded = model(input_ids=ids).logits[0, 3, others].abs().max()
        set_ceiling(model, 4.0)
        bounded = model(input_ids=ids).logits[0, 3, others].abs().max()
    assert float(bounded) < 1e-3 * float(exploded)
    assert float(bounded) < 100 * float(plain.abs().max())


@pytest.mark.parametrize("family", ["gpt2", "gemma3"])
def test_watching_counts_the_tokens_the_ceiling_raised_and_zero_means_the_unguarded_passes(family):
    ids = torch.randint(2, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    model = all_fixed(family, ids)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        set_ceiling(model, 1e9)
        with watching(model) as hits:
            guarded = model(input_ids=ids).logits
            assert hits() == 0
        # the same function (the guarded route rounds differently): the training loop logs it as unguarded
        torch.testing.assert_close(guarded, plain, rtol=1e-5, atol=1e-5)
        model.get_input_embeddings().weight[int(ids[0, 3])] *= 1e4
        set_ceiling(model, 4.0)
        with watching(model) as hits:
            model(input_ids=ids)
            assert hits() > 0
    assert all(s.ceiling_hits is None for s in surgery.scale_states(model).values())


@pytest.mark.parametrize("family", ["gpt2", "gemma3"])
def test_a_ceiling_can_spare_position0_which_then_computes_as_without_it(family):
    ids = torch.randint(2, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    model = surgery.install(tiny_family(family), special_pos0=True)
    surgery.initialise_sigmas(model, [ids])
    for state in surgery.scale_states(model).values():
        state.switch_to_fixed()
    surgery.scale_states(model)["ln_f"].sigma_pos0.mul_(1e-3)  # position 0 leaves the final norm 10³× too large
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        set_ceiling(model, 50.0)
        with watching(model) as hits:
            bounded = model(input_ids=ids).logits
            assert hits() > 0
        set_ceiling(model, 50.0, position0=False)
        with watching(model) as hits:
            spared = model(input_ids=ids).logits
            assert hits() == 0  # nothing else reaches the ceiling
        set_ceiling(model, 50.0)  # position0 unset: the spare stays
        assert all(s.ceiling_spares_pos0 for s in surgery.scale_states(model).values())
    torch.testing.assert_close(spared, plain, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(bounded[:, 1:], plain[:, 1:], rtol=1e-4, atol=1e-4)
    assert float((bounded[:, 0] - plain[:, 0]).abs().max()) > 10 * float(plain[:, 1:].abs().max())


def test_sparing_position0_needs_its_own_sigma(run_config):
    from lnfree.removal.schedule import ScheduleError

    config = with_overrides(run_config(max_steps=24), {"removal.scale_ceiling": {"position0": False, "release_steps": 4}})
    with pytest.raises(ScheduleError, match="special_pos0"):
        run(config, progress=False)


def test_the_ceiling_holds_then_rises_geometrically_and_is_gone():
    ceiling = ScaleCeiling(ratio=8, release_steps=10)
    assert ceiling.release_at(100) == 80
    assert ceiling.at(0, 100) == ceiling.at(79, 100) == 8
    assert ceiling.at(85, 100) == pytest.approx(8 * RELEASE_RISE**0.5)
    assert ceiling.at(90, 100) == math.inf == ceiling.at(99, 100)
    assert ScaleCeiling(release_start=5, release_steps=10).at(15, 100) == math.inf


def test_a_guarded_run_logs_the_model_without_its_guard_resumes_exactly_and_ends_plain(run_config, tmp_path):
    config = with_overrides(run_config(max_steps=24, save_every=5, eval_every=5, learning_rate=1e-3), {
        "removal.schedule": {"stages": [{"kind": "ln_2", "start": 2, "gap": 1}, {"kind": "ln_1qk", "gap": 1},
                                        {"kind": "ln_1v", "gap": 1}, {"kind": "ln_f", "gap": 1}]},
        "removal.scale_ceiling": {"ratio": 3.0, "release_steps": 4},
        "train.scale_loss_weight": 0.1,
    })
    full = run(config, progress=False)
    records = [json.loads(line) for line in (full.output_dir / "log.jsonl").read_text().splitlines()]
    assert [(r["step"], r["ceiling"]) for r in records if r.get("event") == "scale_ceiling"] == [(0, 3.0), (20, "none")]
    evals = [r for r in records if r.get("event") == "eval"]
    assert all("held_out_ce_unguarded" in r for r in evals if r["step"] <= 15)
    assert all(math.isfinite(r["held_out_ce_unguarded"]) for r in evals if r["step"] <= 15)
    assert all(r["ceiling_hits"] > 0 or r["held_out_ce_unguarded"] == r["held_out_ce"] for r in evals if r["step"] <= 15)
    assert all(s.ceiling == math.inf for s in surgery.scale_states(full.model).values())
    saved = json.loads((full.output_dir / "run_config.json").read_text())
    assert saved["removal"]["scale_ceiling"]["ratio"] == 3.0

    moved = tmp_path / "moved"
    shutil.copytree(full.output_dir, moved)
    for later in ("step_000015", "step_000020", "step_000024"):
        shutil.rmtree(moved / "checkpoints" / later)
    resumed = run(with_overrides(config, {"output_dir": str(moved)}), resume=True, progress=False)
    for name, value in full.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_release_that_does_not_fit_the_run_is_refused(run_config):
    from lnfree.removal.schedule import ScheduleError

    config = with_overrides(run_config(max_steps=24), {"removal.scale_ceiling": {"release_start": 20,
                                                                                 "release_steps": 10}})
    with pytest.raises(ScheduleError, match="scale ceiling"):
        run(config, progress=False)
