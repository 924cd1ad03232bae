"""`train.coverage`: generated rows of random and repeated ids, their loss, and σ left to the text."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lnfree.fixedscale import surgery
from lnfree.removal.config import with_overrides
from lnfree.removal.losses.coverage import (
    COPY_SPAN_MIN, REPLAY_DENSITY, Coverage, HeldGradients, coverage_hinge, coverage_ids, first_token_ids,
    typical_log_scales,
)
from lnfree.removal.train import RunError, run


def test_rows_are_a_pure_function_of_step_and_rank_and_start_with_bos():
    cov = Coverage(rows=6, repeated_share=0.5)
    args = {"context": 16, "vocab_size": 1000, "bos": 3, "seed": 0}
    rows = coverage_ids(cov, 5, 1, 0, **args)
    assert torch.equal(rows, coverage_ids(cov, 5, 1, 0, **args))
    assert not torch.equal(rows, coverage_ids(cov, 6, 1, 0, **args))
    assert not torch.equal(rows, coverage_ids(cov, 5, 1, 1, **args))
    assert (rows[:, 0] == 3).all() and rows.shape == (6, 16)
    repeated = [bool((r[1:] == r[1]).all()) for r in rows]
    assert any(repeated) and not all(repeated)
    assert (coverage_ids(Coverage(rows=2), 0, 0, 0, context=8, vocab_size=50, bos=None, seed=1) < 50).all()


def test_the_hinge_is_zero_within_the_ratio_and_grows_beyond_it_against_the_texts_scale():
    text = torch.ones(2, 5, 4)  # RMS 1 everywhere
    typical = typical_log_scales([text], torch.ones(2, 5, dtype=torch.long), eot_token_id=0, kind="rms")
    assert abs(float(typical[0])) < 1e-6
    inside = torch.ones(1, 5, 4) * 1.9
    beyond = inside.clone().requires_grad_(False)
    beyond[0, 3] *= 10  # one token at 19× the text's typical scale
    assert coverage_hinge([inside], typical, "rms", ratio=2.0) == 0
    big = beyond.clone().requires_grad_(True)
    loss = coverage_hinge([big], typical, "rms", ratio=2.0)
    loss.backward()
    assert loss > 0 and big.grad[0, 3].sum() > 0 and big.grad[0, 2].abs().sum() == 0
    position0 = inside.clone()
    position0[0, 0] *= 100  # position 0 (BOS, the sink) is not hinged
    assert coverage_hinge([position0], typical, "rms", ratio=2.0) == 0


def test_the_hinge_reads_position_0_of_the_rows_without_bos_where_asked():
    text = torch.ones(2, 5, 4)
    typical = typical_log_scales([text], torch.ones(2, 5, dtype=torch.long), eot_token_id=0, kind="rms")
    rows = torch.ones(2, 5, 4) * 1.9
    rows[:, 0] *= 100  # both rows' first token far beyond the text's scale
    alone = coverage_hinge([rows[1:]], typical, "rms", ratio=2.0, position0=torch.tensor([True]))
    assert alone > 0
    assert coverage_hinge([rows], typical, "rms", ratio=2.0, position0=torch.tensor([False, False])) == 0
    both = coverage_hinge([rows], typical, "rms", ratio=2.0, position0=torch.tensor([False, True]))
    assert torch.allclose(both, alone / 2)  # the sum is per sequence: two rows, one of them hinged


@pytest.mark.parametrize("in_place", [False, True])
def test_the_rows_gradient_is_capped_at_its_share_of_the_texts(in_place):
    a, b, c, frozen = (torch.zeros(n, requires_grad=True) for n in (3, 2, 1, 1))
    frozen.requires_grad_(False)
    a.grad, b.grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0])  # the text's: norm 5; c has none
    text_a, text_b = a.grad.clone(), b.grad.clone()
    held = HeldGradients([a, b, c], in_place)
    assert (a.grad is not None) == in_place  # taken out, so that the rows' backward writes its own
    (a * torch.tensor([0.0, 30.0, 0.0])).sum().backward()  # the rows add a gradient of norm 50 to a and b
    (b * torch.tensor([40.0, 0.0])).sum().backward()
    ratio = held.add_back(0.5)
    assert float(ratio) == 10.0  # 50 / 5, before the cap
    gained = torch.cat([a.grad - text_a, b.grad - text_b])
    assert torch.allclose(torch.linalg.vector_norm(gained), torch.tensor(2.5))  # 0.5 × 5, its direction kept
    assert torch.allclose(gained / gained.norm(), torch.tensor([0.0, 0.6, 0.0, 0.8, 0.0]))
    assert c.grad is None and frozen.grad is None
    before = a.grad.clone()
    held = HeldGradients([a, b, c], in_place)
    (c * 2.0).sum().backward()  # a parameter without a text gradient keeps the rows' own
    assert float(held.add_back(None)) > 0 and torch.equal(a.grad, before) and torch.equal(c.grad, torch.tensor([2.0]))
    held = HeldGradients([a, b, c], in_place)
    (a * 0.01).sum().backward()
    held.add_back(None)  # no cap
    assert torch.allclose(a.grad, before + 0.01) and torch.equal(c.grad, torch.tensor([2.0]))


def test_paused_statistics_leave_sigma_to_the_text(run_config):
    from lnfree.models.base import load_base

    model, _ = load_base(run_config().model)
    surgery.install(model)
    model.train()
    states = surgery.scale_states(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    with surgery.statistics_paused(model):
        model(input_ids=ids).logits.sum().backward()
    assert all(float(s.stats[1].sum()) == 0 for s in states.values())
    model(input_ids=ids).logits.sum().backward()
    assert all(float(s.stats[1].sum()) > 0 for s in states.values())


def test_a_run_with_coverage_logs_its_terms_and_its_control_sees_the_same_rows(run_config, tmp_path):
    settings = {"train.coverage": {"rows": 2, "ratio": 1.2, "start": 3, "max_grad_share": 0.3},
                "train.distill_alpha": 0.5,
                "train.eval_every": 0}
    config = with_overrides(run_config(max_steps=12), settings)
    result = run(config, progress=False)
    records = [json.loads(line) for line in (result.output_dir / "log.jsonl").read_text().splitlines()]
    losses = {r["step"]: r for r in records if "loss" in r}
    assert losses[2]["cov_kl"] == 0 and losses[2]["cov_tail"] == 0  # step 2 done: before `start`
    assert losses[12]["cov_kl"] > 0 and losses[12]["cov_tail"] > 0 and losses[12]["cov_share"] > 0
    vanilla = with_overrides(config, {"removal.mode": "vanilla", "output_dir": str(tmp_path / "vanilla")})
    run(vanilla, progress=False)
    control = [json.loads(line) for line in (tmp_path / "vanilla" / "log.jsonl").read_text().splitlines()]
    assert any(r.get("cov_kl", 0) > 0 for r in control)


def test_replay_ids_take_their_share_of_the_repeated_rows_and_read_from_a_mined_file(tmp_path):
    args = {"context": 8, "vocab_size": 1000, "bos": 3, "seed": 0}
    only = Coverage(rows=64, repeated_share=1.0, replay=[7, 9], replay_share=1.0)
    assert set(coverage_ids(only, 0, 0, 0, **args)[:, 1:].unique().tolist()) == {7, 9}
    half = coverage_ids(Coverage(rows=400, repeated_share=1.0, replay=[7, 9], replay_share=0.5), 0, 0, 0, **args)
    replayed = float(((half[:, 1] == 7) | (half[:, 1] == 9)).float().mean())
    assert 0.4 < replayed < 0.6
    mined = tmp_path / "ids.json"
    mined.write_text(json.dumps({"overflow": [11, 5], "ids": [1, 5, 11]}))
    assert Coverage(replay=str(mined)).replay == [11, 5]
    with pytest.raises(ValueError, match="overflow"):
        Coverage(replay=str(tmp_path / "missing.json"))


def test_a_replay_list_may_join_the_coverage_of_a_resumed_run_from_its_checkpoint_on(run_config, tmp_path):
    cov = {"rows": 2, "ratio": 1.2, "start": 0, "max_grad_share": 0.3}
    config = with_overrides(run_config(max_steps=12, save_every=4), {
        "train.coverage": cov, "train.distill_alpha": 0.5, "train.eval_every": 0})
    out = run(config, progress=False).output_dir
    for later in ("step_000008", "step_000012"):
        shutil.rmtree(out / "checkpoints" / later)
    replay = [cov, {**cov, "start": 4, "replay": [5, 6], "replay_share": 1.0}]
    with pytest.raises(RunError, match="the coverage loss before step 4"):
        run(with_overrides(config, {"train.coverage": [cov, {**replay[1], "start": 2}]}), resume=True, progress=False)
    with pytest.raises(RunError, match="outside the vocabulary"):
        run(with_overrides(config, {"train.coverage": [cov, {**replay[1], "replay": [10**9]}]}), resume=True,
            progress=False)
    run(with_overrides(config, {"train.coverage": replay}), resume=True, progress=False)
    lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert {"event": "amend", "step": 4, "changed": ["train.coverage"]} in lines
    assert [r for r in lines if r.get("step") == 12 and "cov_kl" in r][-1]["cov_kl"] > 0


def test_a_share_of_the_rows_may_start_without_bos():
    args = {"context": 8, "vocab_size": 1000, "bos": 3, "seed": 0}
    plain = coverage_ids(Coverage(rows=200), 4, 0, 0, **args)
    assert (plain[:, 0] == 3).all()
    mixed = coverage_ids(Coverage(rows=200, no_bos_share=0.5), 4, 0, 0, **args)
    without = mixed[:, 0] != 3
    assert 0.35 < float(without.float().mean()) < 0.65
    assert torch.equal(mixed[:, 1:], plain[:, 1:])  # the same rows otherwise
    repeated = (mixed[:, 1:] == mixed[:, 1:2]).all(dim=1) & without
    assert (mixed[repeated, 0] == mixed[repeated, 1]).all()  # a repeated row without BOS repeats from position 0


def test_generated_rows_start_with_bos_under_data_bos_always_as_the_text_does(run_config):
    from transformers import AutoTokenizer

    from lnfree.models.base import load_base
    from lnfree.removal.generated import coverage_rows

    settings = {"train.coverage": {"rows": 3, "repeated_share": 0.5}}
    model, _ = load_base(run_config().model)
    tokenizer = AutoTokenizer.from_pretrained(run_config().model)
    for rule, starts_with_bos in (("family", False), ("always", True)):  # GPT-2's family reads no BOS
        config = with_overrides(run_config(max_steps=4), {**settings, "data.bos": rule})
        rows, _ = coverage_rows(config, 0, 16, model, tokenizer)
        ids = torch.cat([rows(step, 0, config.train.coverage) for step in range(8)])
        assert bool((ids[:, 0] == tokenizer.bos_token_id).all()) == starts_with_bos


def test_replay_in_random_rows_takes_its_share_of_positions_and_leaves_other_settings_unchanged():
    args = {"context": 64, "vocab_size": 100_000, "bos": 3, "seed": 0}
    plain = coverage_ids(Coverage(rows=32, repeated_share=0.0), 5, 0, 0, **args)
    assert torch.equal(coverage_ids(Coverage(rows=32, repeated_share=0.0, replay=[7, 9]), 5, 0, 0, **args), plain)
    rows = coverage_ids(Coverage(rows=200, repeated_share=0.0, replay=[7, 9], replay_random=1.0), 5, 0, 0, **args)
    share = float(((rows[:, 1:] == 7) | (rows[:, 1:] == 9)).float().mean())
    assert abs(share - REPLAY_DENSITY) < 0.02 and (rows[:, 0] == 3).all()
    half = coverage_ids(Coverage(rows=400, repeated_share=0.0, replay=[7, 9], replay_random=0.5), 5, 0, 0, **args)
    carrying = float(((half[:, 1:] == 7) | (half[:, 1:] == 9)).any(dim=1).float().mean())
    assert 0.4 < carrying < 0.6


def test_copy_rows_repeat_a_span_of_their_random_ids_and_leave_other_settings_unchanged():
    args = {"context": 64, "vocab_size": 100_000, "bos": 3, "seed": 0}
    plain = coverage_ids(Coverage(rows=64, repeated_share=0.5), 5, 0, 0, **args)
    assert torch.equal(coverage_ids(Coverage(rows=64, repeated_share=0.5, copy_share=0.0), 5, 0, 0, **args), plain)
    rows = coverage_ids(Coverage(rows=200, repeated_share=0.0, copy_share=1.0), 5, 0, 0, **args)
    assert (rows[:, 0] == 3).all()
    spans = []
    for row in rows[:, 1:]:
        span = next(s for s in range(COPY_SPAN_MIN, 32) if torch.equal(row[s:], row[:-s]))
        assert len(set(row[:span].tolist())) > span // 2  # random ids, not one repeated id
        spans.append(span)
    assert min(spans) == COPY_SPAN_MIN and max(spans) >= 28
    half = coverage_ids(Coverage(rows=400, repeated_share=0.0, copy_share=0.5), 5, 0, 0, **args)
    copying = sum(any(torch.equal(r[1 + s:], r[1:-s]) for s in range(COPY_SPAN_MIN, 32)) for r in half) / 400
    assert 0.4 < copying < 0.6


def test_one_token_rows_are_a_pure_function_of_the_step_and_apart_from_the_other_rows():
    cov = Coverage(rows=4, first_token_rows=64)
    args = dict(vocab_size=1000, seed=3)
    rows = first_token_ids(cov, 7, 0, 0, **args)
    assert rows.shape == (64, 1) and rows.min() >= 0 and rows.max() < 1000
    assert torch.equal(rows, first_token_ids(cov, 7, 0, 0, **args))
    assert not torch.equal(rows, first_token_ids(cov, 8, 0, 0, **args))
    assert not torch.equal(rows, first_token_ids(cov, 7, 0, 1, **args))  # another rank
    assert first_token_ids(Coverage(), 7, 0, 0, **args).shape == (0, 1)


def test_one_token_rows_draw_their_text_share_from_the_micro_batch():
    text = torch.full((4, 16), 5000)  # ids the uniform draw over 1000 never gives
    args = dict(vocab_size=1000, seed=3, text=text)
    rows = first_token_ids(Coverage(first_token_rows=64, first_text_share=0.25), 7, 0, 0, **args)
    assert rows.shape == (64, 1) and (rows == 5000).sum() == 16 and rows[16:].max() < 1000
    uniform = first_token_ids(Coverage(first_token_rows=64), 7, 0, 0, **args)
    assert torch.equal(rows[16:], uniform[16:])  # the uniform part is the same stream
    assert torch.equal(first_token_ids(Coverage(first_token_rows=64, first_text_share=1.0), 7, 0, 0, vocab_size=1000,
                                       seed=3), uniform)  # no text given: all uniform


def test_one_token_rows_draw_their_replay_share_from_the_replayed_ids_after_the_text():
    text = torch.full((4, 16), 5000)
    args = dict(vocab_size=1000, seed=3, text=text)
    both = Coverage(first_token_rows=64, first_text_share=0.25, first_replay_share=0.5, replay=[2000, 3000])
    rows = first_token_ids(both, 7, 0, 0, **args)
    assert (rows[:16] == 5000).all() and set(rows[16:48, 0].tolist()) == {2000, 3000} and rows[48:].max() < 1000
    text_only = first_token_ids(Coverage(first_token_rows=64, first_text_share=0.25), 7, 0, 0, **args)
    assert torch.equal(rows[48:], text_only[48:])  # the rest is the same stream as without replay
    mined = first_token_ids(both, 7, 0, 0, replay=[4000], **args)  # the run's mined ids, given apart
    assert (mined[16:48] == 4000).all()
    assert torch.equal(first_token_ids(both, 7, 0, 0, replay=[], **args), text_only)  # nothing mined: uniform


def test_the_one_token_rows_shares_must_fit_and_have_ids_to_replay():
    with pytest.raises(ValueError, match="more than 1"):
        Coverage(first_token_rows=8, first_text_share=0.6, first_replay_share=0.5, replay=[1])
    with pytest.raises(ValueError, match="nothing to replay"):
        Coverage(first_token_rows=8, first_replay_share=0.5)
    Coverage(first_token_rows=8, first_replay_share=0.5, mine={"part": 0, "of": 1, "repeated": False, "alone": True})
