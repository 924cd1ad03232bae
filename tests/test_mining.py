"""`lnfree.removal.mining`: the repeated-id sweep a run uses to find ids to replay (`train.coverage.mine`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lnfree.removal.config import with_overrides
from lnfree.removal.losses.coverage import Coverage
from lnfree.evaluate.stress import sweep_sequences
from lnfree.removal.mining import MinedIds, Mining, mine, random_order, random_rows, text_envelope, vocabulary_part
from lnfree.removal.train import run


def test_parts_of_the_vocabulary_are_disjoint_and_cover_it():
    with pytest.raises(ValueError, match="must be below"):
        Mining(part=4, of=4)
    parts = [set(vocabulary_part(103, [k], 4, seed=0).tolist()) for k in range(4)]
    assert set().union(*parts) == set(range(103)) and sum(map(len, parts)) == 103
    assert set(vocabulary_part(103, [0, 1], 4, seed=0).tolist()) == parts[0] | parts[1]
    assert set(vocabulary_part(103, [0], 4, seed=1).tolist()) != parts[0]


def test_a_setting_replays_its_own_list_and_what_it_and_earlier_settings_mined(tmp_path):
    mined = MinedIds(tmp_path / "mined.json")
    mined.add(10, [7, 3], write=True)
    mined.add(20, [9], write=True)
    again = MinedIds(tmp_path / "mined.json")  # a resumed run reads the file
    assert again.found == {10: [3, 7], 20: [9]}
    assert again.replay(Coverage(start=15, mine=Mining(), replay=[1])) == [1, 3, 7]
    assert again.replay(Coverage(start=20, mine=Mining())) == [3, 7, 9]
    assert again.replay(Coverage(start=30, replay=[5])) == [5]  # lists, does not mine: its own list only
    assert again.replay(Coverage(start=20, mine=Mining(earlier=False), replay=[1])) == [1, 9]  # its own finds only
    assert again.replay(Coverage(start=30)) is None


def test_mining_finds_an_id_planted_to_run_away_when_repeated(run_config):
    from lnfree.models.base import load_base

    model, _ = load_base(run_config().model)
    text = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    text[text == 11] = 12  # the planted id must not be in the text: it would widen the envelope it is judged by
    assert text_envelope(model, text).shape == (model.config.n_layer + 1,)
    clean = mine(model, Mining(of=1), text, bos=None, seed=0)
    swept = clean.swept
    assert swept == model.config.vocab_size
    with torch.no_grad():
        model.transformer.wte.weight[11] *= 1e3
    found = mine(model, Mining(of=1), text, bos=None, seed=0)
    assert 11 in found.repeated and 11 not in clean.repeated and found.random == []
    halves = [mine(model, Mining(of=1), text, bos=None, seed=0, rank=r, world=2) for r in range(2)]
    assert sorted(halves[0].ids + halves[1].ids) == sorted(found.ids) and halves[0].swept + halves[1].swept == swept


def test_the_random_sweep_mines_the_first_id_that_overflows_among_random_ids(run_config):
    """An id made to run away (a huge embedding row) is the first overflowing token of its random row;
    the tokens after it, which attend to it, are not mined in its place."""
    from lnfree.models.base import load_base

    model, _ = load_base(run_config().model)
    text = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    text[text == 11] = 12  # the planted id must not be in the text: it would widen the envelope it is judged by
    clean = mine(model, Mining(of=1, random=True, random_context=16), text, bos=None, seed=0)
    with torch.no_grad():
        model.transformer.wte.weight[11] *= 1e3
    found = mine(model, Mining(of=1, random=True, random_context=16), text, bos=None, seed=0)
    assert 11 not in clean.random and found.random[:1] == [11] and found.ids.count(11) == 1
    assert set(found.random) - set(clean.random) == {11}


def test_the_alone_sweep_reads_each_id_as_a_one_token_row_and_mines_those_that_overflow(run_config):
    """`Mining.alone`: each id's ratio is that of its own one-token row, whatever the batching; an id made to run
    away is mined once, after the repeated ones; without the setting nothing is swept alone."""
    from lnfree.models.base import load_base
    from lnfree.removal.mining import alone_sweep, residual_norms, residual_stream

    model, _ = load_base(run_config().model)
    text = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    text[text == 11] = 12  # the planted id must not be in the text: it would widen the envelope it is judged by
    limits = text_envelope(model, text)
    ids = torch.arange(20)
    ratio = alone_sweep(model, ids, limits, batch_size=1)  # 8 rows a forward: three batches
    for i in (0, 8, 19):
        stream, _ = residual_stream(model, ids[i:i + 1, None], head=False)
        assert float(ratio[i]) == pytest.approx(float((residual_norms(stream)[:, 0, 0] / limits).max()), rel=1e-5)
    with torch.no_grad():
        model.transformer.wte.weight[11] *= 1e3
    found = mine(model, Mining(of=1, alone=True), text, bos=None, seed=0)
    assert 11 in found.alone and found.ids.count(11) == 1 and found.ids[:len(found.repeated)] == found.repeated
    assert mine(model, Mining(of=1), text, bos=None, seed=0).alone == []
    only = mine(model, Mining(of=1, repeated=False, alone=True), text, bos=None, seed=0)
    assert only.repeated == [] and only.alone == found.alone
    with pytest.raises(ValueError, match="sweeps nothing"):
        Mining(repeated=False)


def test_the_random_rows_are_not_the_stress_sweeps_rows():
    """Mining's order of a part is its own, so a run that replays what it mines never trains on the rows that
    `lnfree stress` measures (which cut the same seed's permutation of the vocabulary in order)."""
    ids = vocabulary_part(1000, [0], 1, seed=0)
    mined, stress = random_rows(random_order(ids, seed=0), 16, bos=3), sweep_sequences(1000, 16, bos=3, n_ids=None, seed=0)
    assert mined.shape == stress.shape and set(mined[:, 1:].flatten().tolist()) == set(range(1000))
    shared = {tuple(r) for r in mined[:, 1:].tolist()} & {tuple(r) for r in stress[:, 1:].tolist()}
    assert not shared


def test_a_run_mines_once_when_its_setting_starts_and_keeps_the_ids_across_a_resume(run_config):
    cov = {"rows": 2, "ratio": 1.2, "start": 0, "max_grad_share": 0.3}
    mining = {**cov, "start": 4, "repeated_share": 1.0, "replay_share": 1.0,
              "mine": {"of": 2, "part": 1, "random": True, "random_context": 8, "alone": True}}
    config = with_overrides(run_config(max_steps=12, save_every=6), {
        "train.coverage": [cov, mining], "train.distill_alpha": 0.5, "train.eval_every": 0})
    out = run(config, progress=False).output_dir
    lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    mines = [r for r in lines if r.get("event") == "mine"]
    vocab = json.loads((out / "checkpoints" / "step_000006" / "config.json").read_text())["vocab_size"]
    assert len(mines) == 1 and mines[0]["step"] == 4 and {"random_rows_overflow", "alone_overflow"} <= set(mines[0])
    assert mines[0]["swept"] == len(vocabulary_part(vocab, [1], 2, seed=config.train.seed))
    found = json.loads((out / "mined_ids.json").read_text())
    assert list(found) == ["4"] and len(found["4"]) == mines[0]["overflow"]
    for later in ("step_000012",):
        shutil.rmtree(out / "checkpoints" / later)
    run(config, resume=True, progress=False)
    lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert len([r for r in lines if r.get("event") == "mine"]) == 1  # resumed after step 4: not mined again
    assert np.isfinite([r["cov_kl"] for r in lines if "cov_kl" in r]).all()


def test_a_runs_one_token_rows_replay_what_it_mined(run_config, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lnfree.removal.generated import coverage_rows
    from lnfree.removal.layout import MINED

    setting = {"rows": 1, "start": 4, "first_token_rows": 16, "first_replay_share": 0.5,
               "mine": {"of": 1, "repeated": False, "alone": True}}
    config = with_overrides(run_config(max_steps=8), {"train.coverage": setting})
    Path(config.output_dir).mkdir(parents=True)
    (Path(config.output_dir) / MINED).write_text(json.dumps({"4": [7, 9]}))
    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    rows, _ = coverage_rows(config, 0, 8, model, tokenizer)
    one = rows(5, 0, config.train.coverage, True)
    assert one.shape == (16, 1) and set(one[:8, 0].tolist()) <= {7, 9}
    text = torch.full((2, 8), 11)  # with text, its share comes first: 4 text rows, 8 replayed, 4 uniform
    cov = config.train.coverage.model_copy(update={"first_text_share": 0.25})
    whole, replayed, rest = (rows(5, 0, cov, True, text, part) for part in (None, True, False))
    assert replayed.shape == (8, 1) and set(replayed[:, 0].tolist()) <= {7, 9}
    assert torch.equal(whole, torch.cat([rest[:4], replayed, rest[4:]])) and (rest[:4] == 11).all()


def test_every_process_sweeps_as_many_ids_whatever_its_share(monkeypatch):
    # Under FSDP every forward gathers the weights from all processes: a share one id shorter whose sweep ran one
    # batch fewer would leave the others waiting.
    from lnfree.removal import mining as module

    swept = []
    monkeypatch.setattr(module, "text_envelope", lambda *a, **k: torch.ones(3))
    monkeypatch.setattr(module, "repeated_sweep", lambda model, ids, *a, **k: swept.append(len(ids)) or torch.zeros(len(ids)))
    model = torch.nn.Linear(1, 1)
    model.config = type("Config", (), {"vocab_size": 7})()
    found = [mine(model, Mining(of=1), torch.zeros(1, 4), bos=None, seed=0, rank=r, world=2) for r in (0, 1)]
    assert swept == [4, 4] and [f.swept for f in found] == [4, 3]


def test_a_run_mines_while_position_0_keeps_its_own_sigma(run_config):
    # The sweep's rows are shorter than the text's; position 0's σ reads the positions of the forward it runs in
    # (the model's hook): a sweep of the body alone read the last text forward's and stopped on the shapes.
    cov = {"rows": 1, "ratio": 1.2, "start": 0, "max_grad_share": 0.3}
    stages = [*run_config().removal.schedule.model_dump(exclude_none=True)["stages"],
              {"kind": "pos0_special", "start": 12, "blend_steps": 1}]
    config = with_overrides(run_config(max_steps=14), {
        "train.coverage": [cov, {**cov, "start": 8, "mine": {"of": 1, "context": 8}}], "train.distill_alpha": 0.5,
        "train.eval_every": 0, "removal.special_pos0": True, "removal.schedule": {"stages": stages}})
    out = run(config, progress=False).output_dir
    lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r.get("event") == "mine"] == [8]
    assert [r["step"] for r in lines if r.get("slot") == "pos0_special"] == [12]  # after the sweep


def test_a_vanilla_control_skips_the_sweep(run_config):
    cov = {"rows": 1, "start": 0}
    config = with_overrides(run_config(max_steps=6), {
        "train.coverage": [cov, {**cov, "start": 2, "mine": {"of": 1}}], "removal.mode": "vanilla",
        "train.distill_alpha": 0.5, "train.eval_every": 0})
    out = run(config, progress=False).output_dir
    lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r for r in lines if r.get("event") == "mine"] == [
        {"event": "mine", "step": 2, "skipped": "vanilla: every norm is real"}]
    assert json.loads((out / "mined_ids.json").read_text()) == {"2": []}


def test_a_run_with_one_token_rows_trains_and_logs_their_hinge_apart(run_config):
    cov = {"rows": 1, "ratio": 1.2, "start": 0, "max_grad_share": 0.3, "first_token_rows": 8,
           "first_text_share": 0.5}
    config = with_overrides(run_config(max_steps=12), {"train.coverage": cov, "train.distill_alpha": 0.5,
                                                       "train.eval_every": 0, "train.log_every": 1})
    out = run(config, progress=False).output_dir
    lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "first_tail" in r]
    assert len(steps) == 12 and np.isfinite([r["first_tail"] for r in steps]).all()
    assert any(r["first_tail"] > 0 and r["first_share"] > 0 for r in steps)  # the hinge fired and had a gradient
    plain = with_overrides(run_config(max_steps=12), {"train.coverage": {**cov, "first_token_rows": 0}})
    assert "first_tail" not in objective_record_keys(plain)


def test_replayed_one_token_rows_capped_apart_train_and_log_their_own_hinge(run_config):
    cov = {"rows": 1, "ratio": 1.2, "start": 0, "max_grad_share": 0.3, "first_token_rows": 8, "first_text_share": 0.25,
           "first_replay_share": 0.5, "replay": [3, 4], "first_replay_apart": True}
    config = with_overrides(run_config(max_steps=12), {"train.coverage": cov, "train.distill_alpha": 0.5,
                                                      "train.eval_every": 0, "train.log_every": 1})
    out = run(config, progress=False).output_dir
    steps = [r for r in (json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(steps) == 12 and np.isfinite([[r["first_tail"], r["first_replay_tail"]] for r in steps]).all()
    assert any(r["first_replay_tail"] > 0 and r["first_replay_share"] > 0 for r in steps)
    assert {"first_tail", "first_share"} <= objective_record_keys(config)
    assert "first_replay_tail" not in objective_record_keys(with_overrides(config, {"train.coverage": {
        **cov, "first_replay_apart": False}}))
    with pytest.raises(ValueError, match="no replayed one-token rows"):
        Coverage(first_token_rows=8, first_replay_apart=True)


def objective_record_keys(config) -> set:
    """The keys a run of `config`'s objective would log (no training)."""
    from lnfree.removal.losses.objective import TERMS, Objective

    objective = object.__new__(Objective)
    objective.train, objective.teacher = config.train, None
    return set(objective.record([0.0] * (len(TERMS) + 1)))


def test_cpu_hours_counts_a_mining_that_a_resume_dropped(tmp_path):
    from lnfree.removal.layout import LOG
    from lnfree.removal.records import cpu_hours

    def hours(*records):
        (tmp_path / LOG).write_text("".join(json.dumps(r) + "\n" for r in records))
        return cpu_hours(tmp_path)

    trained = [{"step": 10, "cpu_seconds": 3600.0}, {"event": "mine", "step": 10, "cpu_seconds": 1800.0}]
    # one process: its clock ran through the mining
    assert hours(*trained, {"step": 15, "cpu_seconds": 5500.0}, {"event": "end", "step": 20, "cpu_seconds": 7200.0}) == 2.0
    # resumed from step 10's checkpoint (taken before the mining), the ids already mined: the clock lost it
    resumed = [*trained, {"event": "resume", "step": 10}, {"event": "end", "step": 20, "cpu_seconds": 5400.0}]
    assert hours(*resumed) == 2.0
    # mined again after the resume: counted once, by the new clock
    again = [*trained, {"event": "resume", "step": 10}, {"event": "mine", "step": 10, "cpu_seconds": 1800.0},
             {"event": "end", "step": 20, "cpu_seconds": 7200.0}]
    assert hours(*again) == 2.0
