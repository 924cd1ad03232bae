"""The local growth hinge (`train.local_growth`, lnfree.removal.losses.growth): how much each MLP sublayer, its
norms as fixed, amplifies a token scaled up."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
from families import tiny_family
from test_margin import fixed, planted, planted_folder

from lnfree.arch import architecture
from lnfree.fixedscale import surgery
from lnfree.removal.config import TrainConfig, with_overrides
from lnfree.removal.losses.growth import LocalGrowth, MlpSublayers, growth_factors, local_growth_loss, strided
from lnfree.removal.losses.objective import TERMS, Objective
from lnfree.removal.train import run


def inputs_of(model, ids):
    """(the sublayers, each block's MLP-input norm input) of one forward of `model` on `ids`."""
    sublayers = MlpSublayers(model)
    with torch.no_grad(), sublayers.capturing():
        model(input_ids=ids)
    return sublayers, sublayers.take()


def test_a_sublayer_is_measured_as_fixed_whatever_its_state_and_g_is_exact_for_homogeneous_maps():
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    real = surgery.install(tiny_family("llama"))
    surgery.initialise_sigmas(real, [ids])
    model = fixed(tiny_family("llama"), ids)  # the same weights and σ, every norm fixed
    for a, b in zip(surgery.scale_states(real).values(), surgery.scale_states(model).values()):
        b.sigma.copy_(a.sigma)
    (sub_real, h_real), (sub_fixed, h_fixed) = inputs_of(real, ids), inputs_of(model, ids)
    h = strided(h_real[1], 8)
    assert h.shape == (8, h_real[1].shape[-1])
    with torch.no_grad():  # the same h, weights and σ: the same measure, the norms real or fixed
        torch.testing.assert_close(growth_factors(sub_real, 1, h, 2.0), growth_factors(sub_fixed, 1, h, 2.0))
        mlp = sub_fixed.blocks[1][1]
        mlp.forward = lambda x: 0.5 * x  # a 1-homogeneous sublayer passes a scaled token on scaled: g = 1
        g = growth_factors(sub_fixed, 1, h, 2.0)
        torch.testing.assert_close(g, torch.ones_like(g))
    sub_real.remove(), sub_fixed.remove()


def test_a_planted_high_gain_neuron_grows_a_scaled_token_and_the_hinge_reaches_it():
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model = fixed(planted(tiny_family("llama")), ids)
    plain = fixed(tiny_family("llama"), ids)
    setting = LocalGrowth(factor=2.0, limit=1.1, tokens=16)
    arch = architecture(model)

    def growth(model):
        objective = Objective(model.train(), TrainConfig(local_growth=setting), arch, None, 0, contextlib.nullcontext)
        loss, terms = objective(model, ids, objective.tails_at(0))
        loss.backward()
        objective.remove()
        return terms[TERMS.index("growth")]

    planted_growth, plain_growth = growth(model), growth(plain)  # measured: 0.40 and 0
    assert planted_growth > 0.1 and plain_growth < 0.01
    model.zero_grad(set_to_none=True)
    sublayers = MlpSublayers(model)
    with sublayers.capturing():
        model(input_ids=ids)
    local_growth_loss(sublayers, sublayers.take(), setting).backward()
    sublayers.remove()
    down = model.get_submodule(f"{arch.layers}.1.mlp.down_proj").weight.grad
    assert down[:, 0].abs().sum() > 0 and torch.isfinite(down).all()  # the planted neuron is pulled in
    assert model.get_submodule(arch.token_embedding).weight.grad is None  # h is detached: the loss stays local


def test_the_hinge_averages_over_tokens_and_sums_over_blocks():
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    model = fixed(planted(tiny_family("llama")), ids)
    sublayers, inputs = inputs_of(model, ids)
    setting = LocalGrowth(factor=3.0, limit=1.05, tokens=10)
    with torch.no_grad():
        expected = sum(float((growth_factors(sublayers, i, strided(h, 10), 3.0) - 1.05).clamp_min(0).pow(2).mean())
                       for i, h in enumerate(inputs))
        assert float(local_growth_loss(sublayers, inputs, setting)) == pytest.approx(expected, rel=1e-5)
    sublayers.remove()


def test_on_gemma_the_sublayer_includes_the_output_norm():
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    model = fixed(tiny_family("gemma3"), ids)
    sublayers, inputs = inputs_of(model, ids)
    names = {name for name, module in model.named_modules() for _, _, post in sublayers.blocks if module is post}
    assert names == {f"model.layers.{i}.post_feedforward_layernorm" for i in range(2)}
    layer = model.get_submodule(f"{architecture(model).layers}.1")
    with torch.no_grad():  # M(h) is what the block adds after attention: the post-norm's output
        h = inputs[1]
        added = layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        torch.testing.assert_close(sublayers.added(1, h), added)
    sublayers.remove()


def test_a_run_with_the_hinge_logs_it_and_a_run_without_it_does_not(tmp_path):
    from conftest import quick_run_config

    planted_folder(tmp_path / "model")
    config = quick_run_config(tmp_path / "run", tmp_path / "model", tmp_path / "cache",
                              local_growth={"factor": 2.0, "limit": 1.1, "tokens": 16, "start": 3})
    logged = [json.loads(line) for line in (run(config, progress=False).output_dir / "log.jsonl").read_text().splitlines()]
    growth = {r["step"]: r["growth"] for r in logged if "growth" in r}
    assert sorted(growth) == list(range(1, 17)) and growth[1] == growth[3] == 0  # on from step index 3
    assert any(g > 0 for g in growth.values()) and all(math.isfinite(g) for g in growth.values())
    plain = quick_run_config(tmp_path / "plain", tmp_path / "model", tmp_path / "cache")
    logged = [json.loads(line) for line in (run(plain, progress=False).output_dir / "log.jsonl").read_text().splitlines()]
    assert not any("growth" in r for r in logged)
    control = with_overrides(config, {"output_dir": str(tmp_path / "control"), "removal.mode": "vanilla"})
    logged = [json.loads(line) for line in (run(control, progress=False).output_dir / "log.jsonl").read_text().splitlines()]
    assert {r["growth"] for r in logged if "growth" in r} == {0.0}  # no σ to measure a real norm as fixed with
