"""`train.optimizer = "muon"`: which parameters Muon takes, that it trains, and that it resumes exactly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lnfree.removal.config import with_overrides
from lnfree.removal.muon import Muon, MuonWithAdamW, muon_matrices
from lnfree.removal.precision import cpu_has_native_bf16
from lnfree.removal.preparation import make_optimizer
from lnfree.removal.train import run

from conftest import small_gpt2


def losses(path, after_resume=False):
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    if after_resume:
        lines = lines[max(i for i, r in enumerate(lines) if r.get("event") == "resume") + 1:]
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
def test_muon_is_torchs_update_and_its_fp32_iteration_is_close(shape):
    torch.manual_seed(0)
    start = torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(3)]
    params = {}
    for name, make in {
        "torch": lambda p: torch.optim.Muon([p], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
        "bf16": lambda p: Muon([p], lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16),
        "fp32": lambda p: Muon([p], lr=0.02, weight_decay=0.1, ns_dtype=torch.float32),
    }.items():
        p = torch.nn.Parameter(start.clone())
        optimizer = make(p)
        for g in grads:
            p.grad = g.clone()
            optimizer.step()
        params[name] = p.detach()
    assert not torch.equal(params["torch"], start)
    torch.testing.assert_close(params["bf16"], params["torch"], rtol=0, atol=1e-6)
    torch.testing.assert_close(params["fp32"], params["torch"], rtol=0, atol=2e-3)  # bf16 rounding of 3 updates of ~0.013


def test_muon_takes_the_hidden_matrices_and_adamw_the_embeddings_head_and_vectors(run_config):
    model = small_gpt2(n_layer=2)
    config = with_overrides(run_config(), {"train.optimizer": "muon"})
    optimizer = make_optimizer(model, config)
    assert isinstance(optimizer, MuonWithAdamW)
    muon = {id(p) for g in optimizer.muon.param_groups for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in muon}
    assert names == {f"transformer.h.{i}.{m}.weight" for i in range(2)
                     for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    adamw = {id(p) for g in optimizer.adamw.param_groups for p in g["params"]}
    assert muon.isdisjoint(adamw) and len(muon) + len(adamw) == len(list(model.parameters()))
    assert id(model.transformer.wte.weight) in adamw  # the tied head with it
    assert muon_matrices(model, []) == []
    for group in optimizer.param_groups:  # one learning-rate curve reaches both parts
        group["lr"] = 0.5
    assert {g["lr"] for g in optimizer.muon.param_groups + optimizer.adamw.param_groups} == {0.5}


def test_a_muon_run_trains_differs_from_adamw_and_resumes_exactly(run_config, tmp_path):
    config = with_overrides(run_config(max_steps=8, save_every=4, eval_every=0),
                            {"train.optimizer": "muon", "removal.mode": "vanilla"})
    full = run(config, progress=False)
    adamw = run(with_overrides(config, {"train.optimizer": "adamw", "output_dir": str(tmp_path / "adamw")}),
                progress=False)
    a, b = losses(full.output_dir / "log.jsonl"), losses(adamw.output_dir / "log.jsonl")
    assert a[1] == pytest.approx(b[1], rel=1e-5)  # the same first batch before any step
    assert a[8] != pytest.approx(b[8], rel=1e-3)
    assert a[8] < a[1]

    moved = tmp_path / "moved"
    shutil.copytree(full.output_dir, moved)
    shutil.rmtree(moved / "checkpoints" / "step_000008")
    run(with_overrides(config, {"output_dir": str(moved)}), resume=True, progress=False)
    continued = losses(moved / "log.jsonl", after_resume=True)
    assert sorted(continued) == [5, 6, 7, 8]
    for step in continued:
        assert continued[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), step
    state = torch.load(moved / "checkpoints" / "step_000008" / "optimizer.bin", weights_only=False)
    assert set(state) == {"muon", "adamw", "ns_dtype"} and state["muon"]["state"]
    # this CPU's choice travels with the run: a resume on another machine continues exactly
    assert state["ns_dtype"] == ("bfloat16" if cpu_has_native_bf16() else "float32")
    state["ns_dtype"] = "bfloat16" if state["ns_dtype"] == "float32" else "float32"
    optimizer = make_optimizer(full.model, config)
    optimizer.load_state_dict(state)
    assert str(optimizer.muon.ns_dtype) == f"torch.{state['ns_dtype']}"
