"""`train.attention_kl`: the KL from the teacher's attention rows to the model's, measured and trained."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import GPT2LMHeadModel

from lnfree.data.tiny import TINY_MODEL_DIR
from lnfree.removal.config import ConfigError, with_overrides
from lnfree.removal.losses.attention import AttentionPatterns, attention_kl_loss
from lnfree.removal.train import run


def test_the_loss_is_the_mean_row_kl_from_position_1_averaged_over_blocks():
    teacher = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.25, 0.25, 0.5]])[None, None]  # (1, 1, 3, 3)
    student = torch.tensor([[1.0, 0.0, 0.0], [0.9, 0.1, 0.0], [0.25, 0.25, 0.5]])[None, None]
    row1 = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # query 0 is left out, query 2 matches
    assert float(attention_kl_loss([student], [teacher])) == pytest.approx(row1 / 2)
    assert float(attention_kl_loss([student, teacher], [teacher, teacher])) == pytest.approx(row1 / 4)
    assert float(attention_kl_loss([teacher], [teacher])) == pytest.approx(0.0, abs=1e-9)
    starved = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.25, 0.25, 0.5]])[None, None]  # a zero weight:
    assert math.isfinite(float(attention_kl_loss([starved], [teacher])))  # finite, large
    with pytest.raises(ValueError, match="1 student and 2 teacher"):
        attention_kl_loss([student], [teacher, teacher])


def test_it_keeps_each_blocks_attention_probabilities():
    model = GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR).eval()
    patterns = AttentionPatterns(model)
    with torch.no_grad():
        model(input_ids=torch.arange(8)[None])
    taken = patterns.take()
    assert len(taken) == model.config.n_layer
    assert taken[0].shape == (1, model.config.n_head, 8, 8)
    assert torch.allclose(taken[-1].sum(-1), torch.ones(1, model.config.n_head, 8), atol=1e-5)
    assert float(taken[0][0, :, 0, 1:].abs().max()) == 0  # causal: the first query sees only itself
    patterns.active = False
    with torch.no_grad():
        model(input_ids=torch.arange(8)[None])
    assert patterns.held() == 0
    patterns.remove()


def test_it_needs_a_teacher(run_config):
    with pytest.raises(ConfigError, match="distill_alpha > 0"):
        with_overrides(run_config(max_steps=2), {"train.distill_alpha": 0.0, "train.attention_kl": {"weight": 1.0}})


def test_a_run_with_it_keeps_the_teachers_attention_closer_and_logs_it_from_its_start(run_config, model_dir):
    base = with_overrides(run_config(max_steps=24, learning_rate=5e-3, eval_every=0), {"train.distill_alpha": 0.5})
    plain = run(base, progress=False)
    kept = run(with_overrides(base, {"train.attention_kl": {"weight": 5.0, "start": 2},
                                     "output_dir": str(base.output_dir) + "-kept"}), progress=False)
    records = [json.loads(line) for line in (kept.output_dir / "log.jsonl").read_text().splitlines()]
    losses = {r["step"]: r for r in records if "loss" in r}
    assert losses[1]["attn"] == 0 and losses[24]["attn"] > 0  # step 1 done: before `start`
    assert "attn" not in (plain.output_dir / "log.jsonl").read_text()  # not configured: not logged
    teacher = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    ids = torch.randint(2, teacher.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(1))
    distances = []
    for model in (teacher, plain.model, kept.model):
        patterns = AttentionPatterns(model)
        with torch.no_grad():
            model.eval()(input_ids=ids)
        distances.append(patterns.take())
        patterns.remove()
    reference = distances[0]
    plain_kl, kept_kl = (float(attention_kl_loss(d, reference)) for d in distances[1:])
    assert kept_kl < 0.7 * plain_kl
