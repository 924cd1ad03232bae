"""Removal schedules: presets against the published table, derivation, and refusals."""

from __future__ import annotations

import pytest

from lnfree.removal.config import RunConfig, load_preset, preset_names, with_overrides
from lnfree.removal.schedule import Schedule, ScheduleError, Stage, derive_schedule
from lnfree.removal.train import resolve_run

# Baroni et al. 2025 (arXiv 2507.02559), their released configs: layers, first ln_2 step, ln_f step, released step, peak LR, min LR, warm-up, aux weight.
PUBLISHED = {
    "gpt2": (12, 20, 104, 300, 6e-4, 3e-4, 25, 0.1),
    "gpt2-medium": (24, 20, 188, 500, 6e-4, 3e-4, 10, 0.1),
    "gpt2-large": (36, 30, 534, 600, 3e-4, 4e-5, 15, 0.03),
    "gpt2-xl": (48, 50, 722, 800, 1e-4, 2e-5, 20, 0.01),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_reproduce_the_published_schedules(name):
    n_layer, first_ln2, lnf, final, lr, min_lr, warmup, aux = PUBLISHED[name]
    config = load_preset(name)
    config, events = resolve_run(config, n_layer)
    assert events[0].step == first_ln2 and events[0].slot == "blocks.0.ln_2"
    assert events[-1].slot == "ln_f" and events[-1].step == lnf
    assert config.train.max_steps == final
    assert (config.train.learning_rate, config.train.min_learning_rate) == (lr, min_lr)
    assert config.train.warmup_steps == warmup and config.train.aux_loss_weight == aux
    assert config.train.tokens_per_step == 2**19
    assert len(events) == 3 * n_layer + 1
    order = [e.kind for e in events]
    assert order == ["ln_2"] * n_layer + ["ln_1qk"] * n_layer + ["ln_1v"] * n_layer + ["ln_f"]
    assert [e.layer for e in events[:n_layer]] == list(range(n_layer))


def test_a_learning_rate_restart_warms_up_again_and_decays_to_its_own_minimum():
    from lnfree.removal.resolve import learning_rate

    config = with_overrides(load_preset("gpt2"), ["train.max_steps=100", "train.warmup_steps=10",
                                                  "train.cosine_steps=50", "train.learning_rate=1e-3",
                                                  "train.min_learning_rate=1e-4"])
    plain = [learning_rate(s, config) for s in range(100)]
    assert plain[9] == pytest.approx(1e-3) and plain[60:] == [pytest.approx(1e-4)] * 40
    restarted = with_overrides(config, ['train.learning_rate_restart={"start": 70, "learning_rate": 5e-4, '
                                        '"min_learning_rate": 2e-4, "warmup_steps": 5}'])
    curve = [learning_rate(s, restarted) for s in range(100)]
    assert curve[:70] == plain[:70]  # the first curve untouched before the restart
    assert curve[70] == pytest.approx(1e-4) and curve[74] == pytest.approx(5e-4)  # warm-up from the restart on
    assert curve[99] == pytest.approx(2e-4, rel=0.01) and all(a >= b for a, b in zip(curve[74:], curve[75:]))
    with pytest.raises(ValueError, match="must not exceed its learning_rate"):
        with_overrides(config, ['train.learning_rate_restart={"start": 70, "learning_rate": 1e-4, '
                                '"min_learning_rate": 2e-4}'])


def test_large_and_xl_stop_mid_cosine():
    assert load_preset("gpt2-large").train.cosine_steps == 1200
    assert load_preset("gpt2-xl").train.cosine_steps == 1200


@pytest.mark.parametrize("name", ["tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"])
def test_a_gpt2_preset_resolves_to_a_run_that_fixes_every_norm_once_and_in_time(name):
    from lnfree.removal.plan import config_of

    assert name in preset_names()
    config = load_preset(name)
    n_layer = config_of(config.model).n_layer
    resolved, events = resolve_run(config, n_layer)
    every = {f"blocks.{i}.{kind}" for i in range(n_layer) for kind in ("ln_2", "ln_1qk", "ln_1v")} | {"ln_f"}
    assert sorted(e.slot for e in events) == sorted(every)  # each exactly once
    assert events[-1].slot == "ln_f" and events[-1].step < resolved.train.max_steps
    assert resolved.removal.schedule.events(n_layer) == events


@pytest.mark.parametrize("n_layer", [1, 3, 12, 30, 60])
def test_derived_schedule_works_for_any_depth(n_layer):
    events = derive_schedule(n_layer).check(n_layer, max_steps=10_000)
    assert len(events) == 3 * n_layer + 1 and events[-1].kind == "ln_f"
    assert events == sorted(events, key=lambda e: e.step)


def test_derived_schedule_matches_small_and_xl_spacing():
    assert derive_schedule(12).events(12)[-1].step == 104
    assert [s.gap for s in derive_schedule(48).stages[:3]] == [4, 4, 6]


def test_gap_zero_removes_a_whole_kind_at_one_step():
    schedule = Schedule(stages=[Stage(kind="ln_2", start=5), Stage(kind="ln_1qk"), Stage(kind="ln_1v"), Stage(kind="ln_f")])
    assert {e.step for e in schedule.check(6, max_steps=6)} == {5}


def test_refuses_schedules_that_cannot_run():
    with pytest.raises(ScheduleError, match="removes no"):
        Schedule(stages=[]).check(4, 100)
    with pytest.raises(ScheduleError, match="before the last ln_1 V"):
        Schedule(stages=[Stage(kind="ln_2", start=1, gap=1), Stage(kind="ln_f", start=3),
                         Stage(kind="ln_1v", start=4, gap=1)]).check(4, 100)
    with pytest.raises(ScheduleError, match="before the last ln_1 V"):
        Schedule(stages=[Stage(kind="ln_2", start=1, gap=1), Stage(kind="ln_f")]).check(4, 100)
    only_lnf = Schedule(stages=[Stage(kind="ln_f", start=3)]).check(4, 100)  # the DLA-exact partial removal
    assert [(e.step, e.slot) for e in only_lnf] == [(3, "ln_f")]
    with pytest.raises(ScheduleError, match="run ends after 50"):
        derive_schedule(12).check(12, max_steps=50)
    with pytest.raises(ScheduleError, match="never turns it off"):
        derive_schedule(2).check(2, 100, special_eot=True)
    with pytest.raises(ScheduleError, match="give each of them its 'layers'"):
        Schedule(stages=[Stage(kind="ln_2"), Stage(kind="ln_2")]).check(2, 100)
    with pytest.raises(ScheduleError, match="may appear once"):
        Schedule(stages=[Stage(kind="ln_2"), Stage(kind="ln_f"), Stage(kind="ln_f")]).check(2, 100)
    lnf, real = Stage(kind="ln_f", start=3), Stage(kind="pos0_real", start=5)
    fade = Stage(kind="pos0_special", start=6, blend_steps=3)
    events = Schedule(stages=[lnf, real, fade]).check(2, 100, special_pos0=True)
    assert [(e.step, e.kind) for e in events] == [(3, "ln_f"), (5, "pos0_real"), (6, "pos0_special")]
    with pytest.raises(ScheduleError, match="special_pos0"):
        Schedule(stages=[lnf, real]).check(2, 100)
    with pytest.raises(ScheduleError, match="must come before 'pos0_special'"):
        Schedule(stages=[lnf, fade, Stage(kind="pos0_real", start=7)]).check(2, 100, special_pos0=True)
    with pytest.raises(ValueError, match="switches at once"):
        Stage(kind="pos0_real", blend_steps=10)


def test_stages_can_split_a_kind_over_blocks_in_any_order_with_their_own_blend():
    schedule = Schedule(stages=[
        Stage(kind="ln_2", start=2, gap=1, layers=[3, 2]),
        Stage(kind="ln_1qk", gap=0),
        Stage(kind="ln_1v", gap=1),
        Stage(kind="ln_f"),
        Stage(kind="ln_2", gap=5, layers=[1, 0], blend_steps=4),
    ])
    events = schedule.check(4, max_steps=30)
    assert [(e.step, e.slot, e.blend_steps) for e in events if e.kind == "ln_2"] == [
        (2, "blocks.3.ln_2", None), (3, "blocks.2.ln_2", None), (8, "blocks.1.ln_2", 4), (13, "blocks.0.ln_2", 4)]
    assert [e.step for e in events if e.kind == "ln_1v"] == [4, 5, 6, 7]
    assert [(e.step, e.slot) for e in events[-3:]] == [(8, "ln_f"), (8, "blocks.1.ln_2"), (13, "blocks.0.ln_2")]
    assert "2 × ln_2 (blocks 1, 0): steps 8–13 (every 5), each blended over 4 steps" in schedule.describe(4)
    # The run is long enough only if the last blend (block 0's, steps 13–16) ends inside it.
    config = RunConfig(model="tiny", train={"max_steps": 17},
                       removal={"schedule": schedule.model_dump(), "blend_steps": 0})
    assert resolve_run(config, 4)[0].train.max_steps == 17
    with pytest.raises(ScheduleError, match="end at step 16"):
        resolve_run(config.model_copy(update={"train": config.train.model_copy(update={"max_steps": 16})}), 4)


@pytest.mark.parametrize("layers, match", [
    ([[0, 1], [1, 2]], "exactly once"),
    ([[0, 1], [3]], "exactly once"),
    ([[0, 1, 2, 3, 4], None], "give each"),
])
def test_stages_that_split_a_kind_must_cover_every_block_once(layers, match):
    stages = [Stage(kind="ln_2", gap=1, layers=chosen) for chosen in layers]
    with pytest.raises(ScheduleError, match=match):
        Schedule(stages=[*stages, Stage(kind="ln_1qk"), Stage(kind="ln_1v"), Stage(kind="ln_f")]).check(4, 100)


def test_stage_fields_are_checked_when_the_config_is_read():
    with pytest.raises(ValueError, match="per-layer stages"):
        Stage(kind="ln_f", layers=[0])
    with pytest.raises(ValueError, match="distinct"):
        Stage(kind="ln_2", layers=[1, 1])


def test_resolving_a_preset_with_too_few_steps_is_an_error_before_training():
    config = with_overrides(load_preset("gpt2"), ["train.max_steps=100"])
    with pytest.raises(ScheduleError, match="ends after 100"):
        resolve_run(config, 12)


def test_overrides_reach_any_field_and_reject_unknown_keys():
    config = with_overrides(load_preset("gpt2"), ["train.learning_rate=1e-4", "train.min_learning_rate=1e-5",
                                                  "data.source=/tmp/x.jsonl", "removal.mode=vanilla"])
    assert config.train.learning_rate == 1e-4 and config.data.source == "/tmp/x.jsonl"
    assert config.removal.mode == "vanilla"
    with pytest.raises(ValueError, match="unknown config key 'train.learning_rat'; did you mean 'train.learning_rate'"):
        with_overrides(config, ["train.learning_rat=1"])
    with pytest.raises(ValueError, match="unknown config key 'trian.max_steps'; did you mean 'train.max_steps'"):
        with_overrides(config, ["trian.max_steps=1"])
    with pytest.raises(ValueError, match=r"unknown config key 'zzz'$"):
        with_overrides(config, ["zzz=1"])
    with pytest.raises(ValueError):
        with_overrides(config, ["train.max_steps=-3"])
