"""`train.position0_mlp`: the loss that silences position 0's own MLPs, measured and trained."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import GPT2LMHeadModel

from lnfree.removal.config import ConfigError, with_overrides
from lnfree.removal.losses.position0_mlp import MlpOutputs, Position0Mlp, position0_mlp_loss
from lnfree.data.tiny import TINY_MODEL_DIR
from lnfree.removal.train import RunError, run


def test_the_loss_is_position0s_mlp_output_over_the_typical_tokens_squared():
    y = torch.ones(2, 5, 4)  # RMS 1 everywhere
    y[:, 0] *= 3  # position 0 at 3× the typical token
    y[:, 4] *= 100  # EOT: left out of the typical scale
    ids = torch.tensor([[1, 5, 6, 7, 0], [1, 8, 9, 5, 0]])
    assert float(position0_mlp_loss([y], ids, eot_token_id=0)) == pytest.approx(9.0)
    assert float(position0_mlp_loss([y, y / 3], ids, eot_token_id=0)) == pytest.approx(18.0)
    y[:, 0] = 0
    assert float(position0_mlp_loss([y], ids, eot_token_id=0)) == pytest.approx(0.0, abs=1e-9)


def test_it_hooks_the_mlp_outputs_from_its_first_block():
    model = GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR).eval()
    outputs = MlpOutputs(model, [2, 1])  # a list of settings: from the lowest block
    with torch.no_grad():
        model(input_ids=torch.arange(8)[None])
    taken = outputs.take()
    assert len(taken) == model.config.n_layer - 1 and taken[0].shape == (1, 8, model.config.n_embd)
    outputs.remove()
    with pytest.raises(ValueError, match="from_block is 9"):
        MlpOutputs(model, [1, 9])
    with pytest.raises(ValueError):
        Position0Mlp(weight=-1)


def position0_mlp_ratio(model, ids: torch.Tensor) -> float:
    """The mean over blocks from 1 of position 0's MLP-output RMS over the median token's."""
    outputs = MlpOutputs(model, [1])
    with torch.no_grad():
        model(input_ids=ids)
    rms = [y.pow(2).mean(-1).sqrt() for y in outputs.take()]
    outputs.remove()
    return sum(float(r[:, 0].median() / r[:, 1:].median()) for r in rms) / len(rms)


def test_a_run_silences_position0s_mlps_and_logs_it_from_its_start(run_config):
    base = run_config(max_steps=24, learning_rate=5e-3, eval_every=0)
    plain = run(base, progress=False)
    silenced = run(with_overrides(base, {"train.position0_mlp": {"weight": 1.0, "start": 2},
                                         "output_dir": str(base.output_dir) + "-silenced"}), progress=False)
    records = [json.loads(line) for line in (silenced.output_dir / "log.jsonl").read_text().splitlines()]
    losses = {r["step"]: r for r in records if "loss" in r}
    assert losses[1]["mlp0"] == 0 and losses[24]["mlp0"] > 0  # step 1 done: before `start`
    plain_records = (plain.output_dir / "log.jsonl").read_text()
    assert "mlp0" not in plain_records  # not configured: not logged
    ids = torch.randint(2, plain.model.config.vocab_size, (16, 32), generator=torch.Generator().manual_seed(1))
    ids[:, 0] = 1
    before, after = position0_mlp_ratio(plain.model, ids), position0_mlp_ratio(silenced.model, ids)
    assert after < 0.5 * before
    saved = json.loads((silenced.output_dir / "run_config.json").read_text())
    assert saved["train"]["position0_mlp"] == {"weight": 1.0, "start": 2, "from_block": 1}


def test_it_may_be_added_from_the_resume_step_but_not_before(run_config):
    config = run_config(max_steps=12, save_every=5, eval_every=0)
    config = with_overrides(config, {"train.scale_tail": {"ratio": 2.0, "start": 2}})
    first = run(config, progress=False)
    for later in ("step_000010", "step_000012"):
        shutil.rmtree(first.output_dir / "checkpoints" / later)
    with pytest.raises(RunError, match="the position0_mlp loss before step 5"):
        run(with_overrides(config, {"train.position0_mlp": {"start": 3}}), resume=True, progress=False)
    with pytest.raises(RunError, match="the scale_tail loss before step 5"):  # a new ratio from step 4
        run(with_overrides(config, {"train.scale_tail": [{"ratio": 2.0, "start": 2}, {"ratio": 1.5, "start": 4}]}),
            resume=True, progress=False)
    with pytest.raises(ConfigError, match="each with its own start"):
        with_overrides(config, {"train.scale_tail": [{"ratio": 2.0, "start": 2}, {"ratio": 1.5, "start": 2}]})
    amended = with_overrides(config, {"train.position0_mlp": {"start": 5},
                                      "train.scale_tail": [{"ratio": 2.0, "start": 2}, {"ratio": 1.5, "start": 5}]})
    resumed = run(amended, resume=True, progress=False)
    records = [json.loads(line) for line in (resumed.output_dir / "log.jsonl").read_text().splitlines()]
    assert {"event": "amend", "step": 5, "changed": ["train.position0_mlp", "train.scale_tail"]} in records
    saved = json.loads((resumed.output_dir / "run_config.json").read_text())
    assert [piece["ratio"] for piece in saved["train"]["scale_tail"]] == [2.0, 1.5]
