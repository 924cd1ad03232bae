"""experiments/robust/average_checkpoints.py: a uniform weight average that refuses checkpoints of different fixed states."""

from __future__ import annotations

import pytest
import torch

from conftest import experiment_script, small_gpt2


def _script():
    return experiment_script("robust", "average_checkpoints")


def _with_state(seed: int, fixed: bool):
    model = small_gpt2(seed=seed)
    model.transformer.h[0].ln_1.register_buffer("fixed", torch.tensor(fixed))
    return model


def test_average_is_the_mean_of_every_parameter():
    models = [_with_state(seed, True) for seed in (0, 1, 2)]
    expected = {name: sum(m.state_dict()[name] for m in models) / 3 for name, _ in models[0].named_parameters()}
    _script().average_into(models[0], models[1:])
    for name, param in models[0].named_parameters():
        torch.testing.assert_close(param.detach(), expected[name])


def test_average_refuses_checkpoints_with_different_fixed_norms():
    with pytest.raises(SystemExit, match="fixed"):
        _script().average_into(_with_state(0, True), [_with_state(1, False)])
