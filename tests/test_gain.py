"""`train.neuron_gain`: every MLP neuron's gain bounded in weight space."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2LMHeadModel

from lnfree.removal.config import with_overrides
from lnfree.removal.losses.gain import GainWeights, neuron_gain_loss, neuron_gains, project_gains
from lnfree.removal.train import run
from families import FAMILIES, tiny_family


def test_the_gain_is_what_a_gated_neuron_writes_for_a_large_input_of_unit_direction_at_its_worst():
    torch.manual_seed(0)
    gate, up, down, norm = torch.randn(3, 16), torch.randn(3, 16), torch.randn(3, 8), torch.rand(16) + 0.5
    gains = neuron_gains([gate, up], down, norm)
    scale = 1e3
    for i in range(3):
        g, u = gate[i] * norm, up[i] * norm
        sign = torch.sign(g @ u)  # the unit input that maximises |(g·v)(u·v)| bisects g and ±u, with g·v > 0
        worst = g / g.norm() + sign * u / u.norm()
        v = worst / worst.norm()
        written = F.silu(scale * g @ v) * (scale * u @ v) * down[i]
        assert float(written.norm() / scale**2) == pytest.approx(float(gains[i]), rel=1e-3)
        others = F.normalize(torch.randn(2000, 16), dim=1)  # no other direction writes more
        assert float(((others @ g) * (others @ u)).abs().max() * down[i].norm()) <= float(gains[i]) * (1 + 1e-5)
    assert (torch.sign((gate * norm * up * norm).sum(1)) < 0).any()  # an anti-aligned pair is among them


def test_a_plain_mlps_gain_is_its_input_row_norm_times_its_output_row_norm():
    w, d = torch.randn(5, 4), torch.randn(5, 3)
    torch.testing.assert_close(neuron_gains([w], d, None), w.norm(dim=1) * d.norm(dim=1))


def test_only_gains_above_ratio_times_the_blocks_median_count_and_descent_shrinks_them():
    gains = torch.tensor([1.0, 1.0, 2.0, 3.0, 12.0], requires_grad=True)  # median 2
    loss = neuron_gain_loss([gains], ratio=3.0)
    assert float(loss.detach()) == pytest.approx(math.log(2.0) ** 2, rel=1e-5)  # 12 is 2× above 3 × 2
    loss.backward()
    assert gains.grad[4] > 0 and gains.grad[:4].abs().sum() == 0


def test_a_run_pulls_its_largest_gains_towards_the_median_and_logs_the_term(run_config):
    base = with_overrides(run_config(max_steps=16, learning_rate=5e-3, eval_every=0), {"removal.mode": "vanilla"})
    free = run(base, progress=False)
    bound = run(with_overrides(base, {"train.neuron_gain": {"ratio": 1.5, "weight": 10.0, "start": 4},
                                      "output_dir": str(base.output_dir) + "-bound"}), progress=False)
    records = [json.loads(line) for line in (bound.output_dir / "log.jsonl").read_text().splitlines()]
    assert any(r.get("gain", 0) > 0 for r in records if "loss" in r)
    assert '"gain"' not in (free.output_dir / "log.jsonl").read_text()  # not configured: not logged

    def excess(model) -> float:
        with torch.no_grad():
            return float(neuron_gain_loss(GainWeights(model).gains(), 1.5))

    original = GPT2LMHeadModel.from_pretrained(base.model)
    assert len(GainWeights(original).gains()) == original.config.n_layer
    assert excess(bound.model) < 0.5 * excess(free.model)


@pytest.mark.parametrize("family", FAMILIES)
def test_gains_are_the_same_on_the_plain_model_and_once_its_norms_are_installed(family):
    from lnfree.fixedscale import surgery

    model = tiny_family(family)
    plain = [g.detach().clone() for g in GainWeights(model).gains()]  # Gemma's plain norms store weight − 1
    installed = GainWeights(surgery.install(model)).gains()
    assert len(plain) == 2 and all(bool((g > 0).all()) for g in plain)
    for a, b in zip(plain, installed):
        torch.testing.assert_close(a, b.detach())


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3"])
def test_projection_brings_every_gain_to_the_bound_by_scaling_what_the_neuron_writes(family):
    model = tiny_family(family)
    weights = GainWeights(model)
    before = [g.detach().clone() for g in weights.gains()]
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    project_gains(weights, ratio=1.2)
    for old, new in zip(before, weights.gains()):
        bound = 1.2 * old.median()
        assert bool((old > bound).any())
        torch.testing.assert_close(new, torch.minimum(old, bound))  # the others untouched
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_a_run_that_projects_ends_with_every_gain_within_the_bound(run_config):
    config = with_overrides(run_config(max_steps=12, eval_every=0),
                            {"train.neuron_gain": {"ratio": 2.0, "weight": 1.0, "start": 0, "project": True}})
    gains = GainWeights(run(config, progress=False).model).gains()
    assert all(bool((g <= 2.0 * g.median() * (1 + 1e-3)).all()) for g in gains)
