"""`train.neuron_range`: each MLP neuron held within a multiple of its range in the original."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import GPT2LMHeadModel

from lnfree.removal.config import ConfigError, with_overrides
from lnfree.removal.losses.neuron_range import NeuronActivations, neuron_range_loss, neuron_ranges
from lnfree.data.tiny import TINY_MODEL_DIR
from lnfree.removal.train import run


def test_only_activations_above_ratio_times_the_range_count_and_descent_shrinks_them():
    ranges = [torch.tensor([1.0, 2.0])]
    a = torch.tensor([[[50.0, -50.0], [1.5, -3.9], [0.1, 0.2]]])  # position 0 is never hinged
    assert float(neuron_range_loss([a], ranges, ratio=2.0)) == 0
    a[0, 2, 1] = -16.0  # 8× its range of 2: 4× above the ratio
    a.requires_grad_(True)
    loss = neuron_range_loss([a], ranges, ratio=2.0)
    assert float(loss.detach()) == pytest.approx(math.log(4.0) ** 2, rel=1e-5)
    loss.backward()
    assert a.grad[0, 2, 1] < 0 and a.grad.abs().sum() == a.grad[0, 2, 1].abs()  # pulls -16 towards 0


def test_ranges_are_the_largest_activation_after_position_0_over_the_batches():
    model = GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR).eval()
    batches = [torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(s))
               for s in range(2)]
    ranges = neuron_ranges(model, batches, torch.no_grad)
    assert len(ranges) == model.config.n_layer and ranges[0].shape == (4 * model.config.n_embd,)
    hooks = NeuronActivations(model)
    seen = []
    for ids in batches:
        hooks.clear()
        with torch.no_grad():
            model(input_ids=ids)
        seen.append(hooks.take())
    hooks.remove()
    for layer, limit in enumerate(ranges):
        expected = torch.stack([s[layer][:, 1:].abs().flatten(0, 1).amax(0) for s in seen]).amax(0)
        torch.testing.assert_close(limit, expected.clamp_min(expected.median()))
        assert (limit > expected).any()  # the quieter half of the neurons are raised to the median
    assert hooks.held() == 0


def test_a_run_holds_its_neurons_closer_to_the_original_and_logs_the_term(run_config):
    base = with_overrides(run_config(max_steps=16, learning_rate=5e-3, eval_every=0),
                          {"train.distill_alpha": 0.5, "removal.mode": "vanilla"})
    free = run(base, progress=False)
    held = run(with_overrides(base, {"train.neuron_range": {"ratio": 1.05, "weight": 10.0, "start": 4},
                                     "output_dir": str(base.output_dir) + "-held"}), progress=False)
    records = [json.loads(line) for line in (held.output_dir / "log.jsonl").read_text().splitlines()]
    assert any(r.get("range", 0) > 0 for r in records if "loss" in r)
    assert '"range"' not in (free.output_dir / "log.jsonl").read_text()  # not configured: not logged
    original = GPT2LMHeadModel.from_pretrained(base.model).eval()
    probe = [torch.randint(0, original.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(3))]
    limits = neuron_ranges(original, probe, torch.no_grad)

    def beyond(model) -> float:  # the summed hinge of the trained model on the probe
        hooks = NeuronActivations(model)
        with torch.no_grad():
            model(input_ids=probe[0])
        hooks.remove()
        return float(neuron_range_loss(hooks.take(), limits, 1.05))

    assert beyond(held.model.eval()) < 0.5 * beyond(free.model.eval())


def test_it_needs_a_teacher(run_config):
    with pytest.raises(ConfigError, match="distill_alpha"):
        with_overrides(run_config(max_steps=4), {"train.neuron_range": {"ratio": 2.0}, "train.distill_alpha": 0.0})


def test_it_and_the_position0_mlp_loss_hook_the_same_modules_without_taking_each_others_tensors():
    from lnfree.removal.losses.position0_mlp import MlpOutputs

    model = GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR).eval()
    inputs, outputs = NeuronActivations(model), MlpOutputs(model, [0])  # both on every block's output projection
    with torch.no_grad():
        model(input_ids=torch.randint(0, model.config.vocab_size, (2, 8)))
    kept_in, kept_out = inputs.take(), outputs.take()
    assert len(kept_in) == len(kept_out) == model.config.n_layer
    assert kept_in[0].shape[-1] == 4 * kept_out[0].shape[-1]  # the neurons, and what they write
