"""The scale loss at the per-head norms' inputs (`train.head_scale_loss_weight`): queries' and keys' scales,
per token and head, pulled towards one typical scale per norm before their norms are fixed."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from families import tiny_family

from lnfree.arch import architecture
from lnfree.fixedscale import surgery
from lnfree.removal.config import TrainConfig, with_overrides
from lnfree.removal.losses.massive import scale_loss
from lnfree.removal.losses.objective import TERMS, HeadNormInputs, Objective
from lnfree.removal.train import run


def head_inputs(model, ids):
    """Every per-head norm's input of one forward of `model` on `ids`, as `HeadNormInputs` gives them."""
    inputs = HeadNormInputs(model)
    with torch.no_grad(), inputs.capturing():
        model(input_ids=ids)
    inputs.remove()
    return inputs.take()


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])  # heads before positions (Gemma 3) or after (Qwen3)
def test_per_head_inputs_come_as_tokens_then_heads_whatever_the_family_layout(family):
    model = tiny_family(family)
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    inputs = head_inputs(model, ids)
    attn = model.get_submodule(f"{architecture(model).layers}.0.self_attn")
    assert len(inputs) == 2 * 2  # q_norm and k_norm of both blocks
    with torch.no_grad():  # block 0's query norm reads q_proj of the embedding's block-0 norm, per head
        hidden = model.get_submodule(f"{architecture(model).layers}.0.input_layernorm")(
            model.get_input_embeddings()(ids))
        query = attn.q_proj(hidden).view(2, 12, -1, attn.head_dim)
    torch.testing.assert_close(inputs[0], query)
    assert inputs[1].shape == (2, 12, model.config.num_key_value_heads, attn.head_dim)
    assert not head_inputs(tiny_family("llama"), ids)  # no per-head norm: nothing to pull


def test_one_typical_scale_per_norm_over_every_head():
    ids = torch.tensor([[5, 6, 7, 0, 8]])  # position 0 and the EOT (id 0) are not typical
    x = torch.randn(1, 5, 4, 8)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()  # every token and head at RMS 1
    assert float(scale_loss([x], ids, 0, "rms", form="log")) == pytest.approx(0, abs=1e-6)
    louder = x.clone()
    louder[:, :, 1] *= 2  # one head at 2× on every token: one σ for the norm leaves it 2× too loud
    logs = torch.tensor([0.0, 1.0, 0.0, 0.0]) * torch.tensor(2.0).log()
    expected = float(((logs - logs.mean()) ** 2).mean())
    assert float(scale_loss([louder], ids, 0, "rms", form="log")) == pytest.approx(expected, rel=1e-5)


def test_the_term_reaches_the_projections_that_make_queries_and_keys():
    model = surgery.install(tiny_family("gemma3")).train()
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    objective = Objective(model, TrainConfig(head_scale_loss_weight=1.0, distill_alpha=0.0, aux_loss_weight=0.0),
                          architecture(model), None, 0, contextlib.nullcontext)
    loss, terms = objective(model, ids, objective.tails_at(0))
    ce = terms[TERMS.index("ce")]
    assert terms[TERMS.index("head_scale")] > 0
    torch.testing.assert_close(terms[0], ce + terms[TERMS.index("head_scale")])
    loss.backward()
    k_proj = model.get_submodule(f"{architecture(model).layers}.0.self_attn.k_proj").weight
    assert k_proj.grad.abs().sum() > 0
    objective.remove()


def test_a_run_with_the_term_logs_it_and_narrows_the_heads_scales(tmp_path):
    from conftest import quick_run_config
    from lnfree.data.tiny import PRETRAIN_SEED, build_tokenizer, generate_documents

    tokenizer = build_tokenizer(generate_documents(200, PRETRAIN_SEED))
    tiny_family("gemma3", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    base = with_overrides(quick_run_config(tmp_path / "plain", tmp_path / "m", tmp_path / "cache"),
                          {"removal.mode": "vanilla"})  # the norms stay real: the inputs' scales are free
    plain = run(base, progress=False)
    pulled = run(with_overrides(base, {"output_dir": str(tmp_path / "pulled"), "train.head_scale_loss_weight": 1.0}),
                 progress=False)
    logged = [json.loads(line) for line in (pulled.output_dir / "log.jsonl").read_text().splitlines()]
    assert all(r["head_scale"] > 0 for r in logged if "loss" in r)
    assert not any("head_scale" in json.loads(line) for line in (plain.output_dir / "log.jsonl").read_text().splitlines())
    ids = torch.randint(1, len(tokenizer), (4, 32), generator=torch.Generator().manual_seed(2))

    def spread(model) -> float:
        return float(scale_loss(head_inputs(model, ids), ids, tokenizer.eos_token_id, "rms", form="log"))

    assert spread(pulled.model) < 0.8 * spread(plain.model)  # measured 0.65×


def test_position_0s_key_scale_against_the_other_tokens_typical_one():
    ids = torch.tensor([[9, 6, 7, 0, 8], [9, 5, 5, 5, 5]])  # position 0 and the EOT (id 0) are not typical
    x = torch.randn(2, 5, 1, 8)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()  # every token at RMS 1
    assert float(scale_loss([x], ids, 0, "rms", position0=True)) == pytest.approx(0, abs=1e-6)
    small = x.clone()
    small[0, 0] *= 0.25  # the first row's position 0 enters at a quarter of the typical scale
    small[:, 2] *= 4  # another token loud: the typical scale is their geometric mean over both rows
    typical = 4 ** (2 / 7)  # 7 typical tokens, 2 of them at log 4
    expected = (torch.tensor(0.25 / typical).log() ** 2 + torch.tensor(1 / typical).log() ** 2) / 2
    assert float(scale_loss([small], ids, 0, "rms", position0=True)) == pytest.approx(float(expected), rel=1e-5)


def test_position_0s_key_scale_reaches_the_key_projections_and_no_query():
    model = surgery.install(tiny_family("gemma3")).train()
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    keys = HeadNormInputs(model, ("k_norm",))
    with keys.capturing():
        model(input_ids=ids)
    inputs = keys.take()
    keys.remove()
    assert len(inputs) == 2 and inputs[0].shape == (2, 12, model.config.num_key_value_heads, 8)
    scale_loss(inputs, ids, 0, "rms", position0=True).backward()
    attn = [model.get_submodule(f"{architecture(model).layers}.{i}.self_attn") for i in (0, 1)]
    keys_grad = [float(a.k_proj.weight.grad.abs().sum()) for a in attn]
    assert min(keys_grad) > 0
    # position 0 attends to itself alone: its query moves nothing (up to the attention's rounding, ~1e-6 here)
    assert all(a.q_proj.weight.grad is None or a.q_proj.weight.grad.abs().sum() < 1e-4 * keys_grad[1] for a in attn)


def test_a_run_logs_position_0s_key_scale_in_the_loss():
    model = surgery.install(tiny_family("gemma3")).train()
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    train = TrainConfig(position0_key_scale_weight=2.0, distill_alpha=0.0, aux_loss_weight=0.0)
    objective = Objective(model, train, architecture(model), None, 0, contextlib.nullcontext)
    _, terms = objective(model, ids, objective.tails_at(0))
    key0 = terms[TERMS.index("key0")]
    assert key0 > 0
    torch.testing.assert_close(terms[0], terms[TERMS.index("ce")] + 2 * key0)
    record = objective.record([0.0] * (len(TERMS) + 1))
    assert "key0" in record and "head_scale" not in record
    objective.remove()
