"""Fixed-scale norm modules and their installation into a transformers GPT-2."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import small_gpt2
from families import FAMILIES, tiny_family

from lnfree.fixedscale import surgery
from lnfree.arch import architecture
from lnfree.fixedscale.functional import centred_times, second_moment
from lnfree.fixedscale.norms import FixedScaleNorm, NormalisedProjection, SplitNorm
from lnfree.fixedscale.state import FOLD_ELEMENTS, FOLD_EVERY, ScaleState
from lnfree.fixedscale.rescaled import RescaledProjection
from lnfree.removal.config import RemovalConfig
from lnfree.removal.schedule import Event


def fixed_sigma_ln(x, weight, bias, sigma):
    return (x - x.mean(-1, keepdim=True)) / sigma * weight + bias


def make_fixed_ln(d=16, **special):
    ln = torch.nn.LayerNorm(d)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.normal_()
    return ln, FixedScaleNorm(ln.weight, ln.bias, ScaleState(ln.eps, "layer", **special))


def test_a_fixed_ln_is_the_real_ln_until_switched_then_fixed_sigma_and_real_again():
    torch.manual_seed(0)
    ln, fixed = make_fixed_ln()
    x = torch.randn(3, 5, 16) * 4
    assert torch.equal(fixed(x), ln(x))
    fixed.state.sigma.fill_(2.5)
    fixed.state.switch_to_fixed()
    expected = fixed_sigma_ln(x, ln.weight, ln.bias, 2.5)
    torch.testing.assert_close(fixed(x), expected, rtol=0, atol=1e-6)
    assert not torch.allclose(fixed(x), ln(x), atol=1e-3)
    fixed.state.switch_to_real()
    assert torch.equal(fixed(x), ln(x)) and float(fixed.state.sigma) == 2.5


def test_ema_matches_hand_computation_and_ignores_eval_passes():
    torch.manual_seed(0)
    _, fixed = make_fixed_ln()
    state = fixed.state
    state.sigma.fill_(1.0)
    a, b = torch.randn(2, 4, 16) * 3, torch.randn(2, 4, 16) * 5

    def mean_std(x):
        return torch.sqrt(x.var(-1, unbiased=False) + state.eps).mean()

    fixed.eval()
    fixed(a)  # eval passes must not feed the EMA
    assert state.stats.abs().sum() == 0
    fixed.train()
    with torch.no_grad():
        fixed(a)  # nor must a no-grad pass in train mode (a user's metric)
    assert state.stats.abs().sum() == 0
    fixed(a)
    fixed(b)
    state.commit_ema(state.stats.clone(), momentum=0.9)
    expected = 0.9 * 1.0 + 0.1 * (mean_std(a) + mean_std(b)) / 2
    torch.testing.assert_close(state.sigma, expected)
    frozen = state.sigma.clone()
    state.switch_to_fixed()
    fixed(b * 10)
    state.commit_ema(state.stats.clone(), momentum=0.9)
    assert torch.equal(state.sigma, frozen)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_statistics_pending_over_many_calls_sum_exactly(kind):
    """Gathered reciprocal scales wait in a short list and are reduced in batches: after any number of
    calls, of any token counts, `stats` holds the sum and count of every per-token scale seen, the
    list stays shorter than FOLD_EVERY calls and FOLD_ELEMENTS scales, and clearing drops pending ones too."""
    torch.manual_seed(0)
    d = 16
    norm = FixedScaleNorm(torch.rand(d) + 0.5, torch.randn(d) if kind == "layer" else None, ScaleState(1e-5, kind)).train()
    inputs = [torch.randn(2, n, d, requires_grad=True) * (1 + n) for n in range(1, 2 * FOLD_EVERY + 4)]
    total = torch.zeros((), dtype=torch.float64)
    for x in inputs:
        norm(x).sum().backward()
        total += torch.sqrt(second_moment(x.detach().double(), kind) + 1e-5).sum()
        assert len(norm.state._pending) < FOLD_EVERY and norm.state._pending_numel < FOLD_ELEMENTS
    assert norm.state._pending  # some are pending: reading `stats` must include them
    stats = norm.state.stats
    torch.testing.assert_close(stats[0, 0].double(), total, rtol=1e-5, atol=0)
    assert stats[1, 0] == sum(x.shape[0] * x.shape[1] for x in inputs)
    assert stats[:, 1:].abs().sum() == 0
    norm(inputs[0])
    norm.state.clear_stats()
    assert norm.state.stats.abs().sum() == 0
    for _ in range(2):  # a batch of FOLD_ELEMENTS tokens or more is summed at once
        norm(torch.randn(FOLD_ELEMENTS, 2, d))
        assert not norm.state._pending
    assert norm.state.totals[1, 0] == 4 * FOLD_ELEMENTS


def test_casts_keep_statistics_and_sigma_fp32_and_moves_take_pending_scales():
    """A model cast to bf16 / fp16 keeps σ, the blend and the statistics in fp32 (pending scales
    included); a move sums pending scales first, so nothing is left behind on the old device."""
    torch.manual_seed(0)
    norm = FixedScaleNorm(torch.rand(16) + 0.5, torch.randn(16), ScaleState(1e-5)).train()
    norm.state.sigma.fill_(0.1234567)
    x = torch.randn(3, 5, 16) * 2
    norm(x)
    assert norm.state._pending
    expected = torch.zeros(2, 3)
    expected[:, 0] = torch.stack([torch.sqrt(second_moment(x, "layer") + 1e-5).sum(), torch.tensor(15.0)])
    norm.to(torch.bfloat16)
    assert not norm.state._pending and norm.weight.dtype == torch.bfloat16
    for buffer in (norm.state.sigma, norm.state.mix, norm.state.totals):
        assert buffer.dtype == torch.float32
    assert float(norm.state.sigma) == torch.tensor(0.1234567).item()
    torch.testing.assert_close(norm.state.totals, expected)
    norm(x.bfloat16())  # gathering in a bf16 model sums into the fp32 accumulator
    norm.to("meta")
    assert not norm.state._pending and norm.state.totals.device.type == "meta"
    assert norm.state.sigma.dtype == torch.float32


def test_qk_and_v_paths_switch_independently():
    torch.manual_seed(0)
    model = small_gpt2(n_layer=1)
    block = model.transformer.h[0]
    ln_1, c_attn = copy.deepcopy(block.ln_1), copy.deepcopy(block.attn.c_attn)
    split = SplitNorm(ln_1.weight, ln_1.bias, ScaleState(ln_1.eps), ScaleState(ln_1.eps))
    projection = NormalisedProjection(c_attn, split, slice(64, 96), in_out=True)

    def qkv(x):  # the norm module sits before the projection, as in the model
        return projection(split(x))

    qkv.qk, qkv.v = split.qk, split.v
    x = torch.randn(2, 6, 32) * 3
    reference = c_attn(ln_1(x))
    torch.testing.assert_close(qkv(x), reference, rtol=0, atol=1e-6)
    d = 32
    qkv.qk.sigma.fill_(3.0)
    qkv.qk.switch_to_fixed()
    out = qkv(x)
    fixed_q = c_attn(fixed_sigma_ln(x, ln_1.weight, ln_1.bias, 3.0))
    torch.testing.assert_close(out[..., : 2 * d], fixed_q[..., : 2 * d], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[..., 2 * d :], reference[..., 2 * d :], rtol=0, atol=1e-5)
    qkv.v.sigma.fill_(0.5)
    qkv.v.switch_to_fixed()
    fixed_v = c_attn(fixed_sigma_ln(x, ln_1.weight, ln_1.bias, 0.5))
    torch.testing.assert_close(qkv(x)[..., 2 * d :], fixed_v[..., 2 * d :], rtol=0, atol=1e-5)
    torch.testing.assert_close(qkv(x)[..., : 2 * d], fixed_q[..., : 2 * d], rtol=0, atol=1e-5)


def _fixed_ln_f_with_position0_sigma():
    """A 1-block GPT-2 whose fixed ln_f divides by σ = 2 and, at position 0, by 50; its inputs and
    outputs are captured on every forward."""
    model = small_gpt2(n_layer=1)
    surgery.install(model, special_pos0=True)
    ln_f = model.transformer.ln_f
    ln_f.state.sigma.fill_(2.0)
    ln_f.state.sigma_pos0.fill_(50.0)
    ln_f.state.switch_to_fixed()
    captured = {}
    ln_f.register_forward_hook(lambda m, args, out: captured.update(x=args[0], y=out))
    return model, ln_f, captured


def test_position0_sigma_is_applied_per_position_not_per_channel():
    model, ln_f, captured = _fixed_ln_f_with_position0_sigma()
    model(input_ids=torch.randint(0, 64, (2, 7)))
    x, y = captured["x"], captured["y"]
    torch.testing.assert_close(y[:, 0], fixed_sigma_ln(x[:, 0], ln_f.weight, ln_f.bias, 50.0))
    torch.testing.assert_close(y[:, 1:], fixed_sigma_ln(x[:, 1:], ln_f.weight, ln_f.bias, 2.0))
    surgery.apply_event(model, Event(0, "pos0_special"))
    model(input_ids=torch.randint(0, 64, (2, 7)))
    x, y = captured["x"], captured["y"]
    torch.testing.assert_close(y, fixed_sigma_ln(x, ln_f.weight, ln_f.bias, 2.0))


def test_a_span_of_two_gives_position_1_position_0s_real_scale_and_the_rest_sigma():
    model = small_gpt2(n_layer=1)
    surgery.install(model, special_pos0=True, pos0_span=2)
    ln_f = model.transformer.ln_f
    ln_f.state.sigma.fill_(2.0)
    ln_f.state.switch_to_fixed()
    captured = {}
    ln_f.register_forward_hook(lambda m, args, out: captured.update(x=args[0], y=out))
    surgery.apply_event(model, Event(0, "pos0_real"))
    model(input_ids=torch.randint(0, 64, (2, 7)), attention_mask=torch.tensor([[1] * 7, [0] + [1] * 6]))
    x, y = captured["x"], captured["y"]
    real = torch.nn.functional.layer_norm(x, (x.shape[-1],), ln_f.weight, ln_f.bias, ln_f.state.eps)
    fixed = fixed_sigma_ln(x, ln_f.weight, ln_f.bias, 2.0)
    # row 0: positions 0-1 real; row 1 is left-padded, so its first real tokens are columns 1-2
    for row, real_columns in ((0, {0, 1}), (1, {1, 2})):
        for column in range(7):
            expected = real if column in real_columns else fixed
            torch.testing.assert_close(y[row, column], expected[row, column], msg=f"{row}, {column}")
    with pytest.raises(ValueError, match="special_pos0_span needs removal.special_pos0"):
        RemovalConfig(special_pos0_span=2)


def test_a_faded_position0_sigma_moves_geometrically_to_the_general_sigma_and_survives_a_reload():
    model, ln_f, captured = _fixed_ln_f_with_position0_sigma()
    tokens = torch.randint(0, 64, (2, 7))
    for fraction, pos0_sigma in ((0.5, 10.0), (0.25, 50.0 * 0.04**0.25)):  # √(50·2) = 10
        surgery.apply_event(model, Event(0, "pos0_special"), fraction)
        model(input_ids=tokens)
        x, y = captured["x"], captured["y"]
        torch.testing.assert_close(y[:, 0], fixed_sigma_ln(x[:, 0], ln_f.weight, ln_f.bias, pos0_sigma))
        torch.testing.assert_close(y[:, 1:], fixed_sigma_ln(x[:, 1:], ln_f.weight, ln_f.bias, 2.0))
        torch.testing.assert_close(ln_f.state.position0_divisor(), torch.tensor(pos0_sigma))
    assert surgery.removal_state(model)["ln_f"]["pos0_fade"] == 0.25
    reloaded = small_gpt2(n_layer=1)
    surgery.install(reloaded, special_pos0=True)
    reloaded.load_state_dict(model.state_dict())
    torch.testing.assert_close(reloaded(input_ids=tokens).logits, model(input_ids=tokens).logits)
    surgery.apply_event(model, Event(0, "pos0_special"), 1.0)
    assert not ln_f.state.pos0_on and float(ln_f.state.pos0_fade) == 0
    model(input_ids=tokens)
    torch.testing.assert_close(captured["y"], fixed_sigma_ln(captured["x"], ln_f.weight, ln_f.bias, 2.0))


def test_position0_at_its_real_scale_is_scale_invariant_there_fades_to_sigma_and_survives_a_reload():
    model, ln_f, captured = _fixed_ln_f_with_position0_sigma()
    tokens = torch.randint(0, 64, (2, 7))
    surgery.apply_event(model, Event(0, "pos0_real"))
    assert ln_f.state.pos0_real_on and surgery.removal_state(model)["ln_f"]["pos0_real"]
    model(input_ids=tokens)
    x, y = captured["x"], captured["y"]
    real = torch.nn.functional.layer_norm(x[:, 0], (x.shape[-1],), ln_f.weight, ln_f.bias, ln_f.state.eps)
    torch.testing.assert_close(y[:, 0], real)  # the real norm at position 0, whatever its scale
    torch.testing.assert_close(y[:, 1:], fixed_sigma_ln(x[:, 1:], ln_f.weight, ln_f.bias, 2.0))
    # Its gradient is the real norm's too: none along position 0's own (centred) input, where a
    # detached scale would leave a generic vector.
    x = (torch.randn_like(x) * 10).requires_grad_()
    out = ln_f(x)
    (out[:, 0] * torch.randn_like(out[:, 0])).sum().backward()
    centred = x[:, 0] - x[:, 0].mean(-1, keepdim=True)
    cosine = torch.nn.functional.cosine_similarity(x.grad[:, 0], centred, dim=-1)
    assert cosine.abs().max() < 1e-4 and x.grad[:, 1:].eq(0).all()
    reloaded = small_gpt2(n_layer=1)
    surgery.install(reloaded, special_pos0=True)
    reloaded.load_state_dict(model.state_dict())
    assert reloaded.transformer.ln_f.state.pos0_real_on
    torch.testing.assert_close(reloaded(input_ids=tokens).logits, model(input_ids=tokens).logits)
    surgery.apply_event(model, Event(0, "pos0_special"), 0.5)  # half way from the real scale to σ
    model(input_ids=tokens)
    x, y = captured["x"], captured["y"]
    std = (x[:, 0].var(-1, unbiased=False, keepdim=True) + ln_f.state.eps).sqrt()
    torch.testing.assert_close(y[:, 0], fixed_sigma_ln(x[:, 0], ln_f.weight, ln_f.bias, (std * 2.0).sqrt()))
    torch.testing.assert_close(ln_f.state.position0_divisor(std), (std * 2.0).sqrt())
    with pytest.raises(ValueError, match="real_scale"):
        ln_f.state.position0_divisor()
    surgery.apply_event(model, Event(0, "pos0_special"), 1.0)
    assert not ln_f.state.pos0_real_on
    assert float(ln_f.state.position0_divisor()) == 2.0
    model(input_ids=tokens)
    torch.testing.assert_close(captured["y"], fixed_sigma_ln(captured["x"], ln_f.weight, ln_f.bias, 2.0))


def test_position0_real_scale_reaches_the_input_side_norms_only():
    model = tiny_family("gemma3")
    surgery.install(model, special_pos0=True)
    surgery.apply_event(model, Event(0, "pos0_real"))
    real = {slot for slot, state in surgery.scale_states(model).items() if state.pos0_real_on}
    kinds = {slot.rsplit(".", 1)[-1] for slot in real}
    assert kinds == {"ln_1qk", "ln_1v", "ln_2", "ln_f"}  # not post_attn / post_mlp, and q/k norms have no pos0 σ
    saved = model.state_dict()
    assert any(key.endswith("pos0_real") for key in saved)
    old = {k: v for k, v in saved.items() if not k.endswith("pos0_real")}  # a checkpoint from before the flag
    fresh = tiny_family("gemma3")
    surgery.install(fresh, special_pos0=True)
    fresh.load_state_dict(old)
    assert not any(s.pos0_real_on for s in surgery.scale_states(fresh).values())


def test_eot_sigma_only_on_v_path_and_only_at_eot_tokens():
    model = small_gpt2(n_layer=1)
    surgery.install(model, special_eot=True, eot_token_id=5)
    qkv = model.transformer.h[0].attn.c_attn
    norm = model.transformer.h[0].ln_1
    qkv.qk, qkv.v = norm.qk, norm.v
    assert not qkv.qk.has_eot and qkv.v.has_eot
    for state in (qkv.qk, qkv.v):
        state.sigma.fill_(1.5)
        state.switch_to_fixed()
    qkv.v.sigma_eot.fill_(9.0)
    ids = torch.tensor([[1, 5, 2, 5, 3]])
    captured = {}
    qkv.register_forward_hook(lambda m, args, out: captured.update(x=args[0], y=out))
    model(input_ids=ids)
    x, y = captured["x"], captured["y"]
    d = 32
    v_weight, v_bias = qkv.weight[:, 2 * d :], qkv.bias[2 * d :]
    for position, sigma in enumerate([1.5, 9.0, 1.5, 9.0, 1.5]):
        h = fixed_sigma_ln(x[0, position], norm.weight, norm.bias, sigma)
        torch.testing.assert_close(y[0, position, 2 * d :], h @ v_weight + v_bias, rtol=1e-5, atol=1e-5)


def fully_fixed(model):
    x = torch.randint(0, model.config.vocab_size, (4, 16))
    surgery.initialise_sigmas(model, [x])
    for state in surgery.scale_states(model).values():
        state.switch_to_fixed()
    return model


@pytest.mark.parametrize("removed", [False, True])
def test_installed_model_matches_original_while_real_and_honours_attention_mask(removed):
    base = small_gpt2()
    model = surgery.install(copy.deepcopy(base))
    ids = torch.randint(1, 64, (2, 10))
    if not removed:
        assert torch.equal(model(input_ids=ids).logits, base(input_ids=ids).logits)
    else:
        fully_fixed(model)
    # Left padding with an attention mask must give the unpadded logits at real positions.
    padded = torch.cat([torch.zeros(2, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(2, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    out = model(input_ids=padded, attention_mask=mask, position_ids=position_ids).logits[:, 3:]
    torch.testing.assert_close(out, model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_generate_with_kv_cache_matches_full_recompute():
    model = fully_fixed(surgery.install(small_gpt2()))
    prompt = torch.randint(1, 64, (2, 5))
    cached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    uncached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False, pad_token_id=0)
    assert torch.equal(cached, uncached)
    # And greedy decoding by hand agrees.
    ids = prompt
    for _ in range(8):
        ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(cached, ids)


def test_gradient_checkpointing_gives_the_same_gradients_and_statistics():
    ids = torch.randint(0, 64, (2, 12))
    grads, stats = [], []
    for checkpointing in (False, True):
        model = surgery.install(small_gpt2())
        surgery.scale_states(model)["blocks.0.ln_2"].switch_to_fixed()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        state = surgery.scale_states(model)["blocks.1.ln_2"]
        stats.append(state.stats[0, 0] / state.stats[1, 0])
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(stats[0], stats[1])


def test_state_dict_carries_removal_state():
    model = fully_fixed(surgery.install(small_gpt2()))
    surgery.scale_states(model)["blocks.1.ln_1v"].sigma.fill_(7.0)
    fresh = surgery.install(small_gpt2(seed=1))
    assert not any(s.is_fixed for s in surgery.scale_states(fresh).values())
    fresh.load_state_dict(model.state_dict())
    assert surgery.removal_state(fresh) == surgery.removal_state(model)
    assert surgery.is_fully_removed(fresh)
    ids = torch.randint(0, 64, (2, 9))
    torch.testing.assert_close(fresh(input_ids=ids).logits, model(input_ids=ids).logits)
    keys = fresh.state_dict().keys()
    assert "transformer.h.0.ln_1.qk.fixed" in keys and "transformer.ln_f.state.sigma" in keys
    assert "transformer.h.0.attn.c_attn.weight" in keys  # the projection keeps its key
    assert not any(k.endswith((".stats", ".totals")) for k in keys)
    older = {k.removesuffix(".fixed") + ".fake" if k.endswith(".fixed") else k: v for k, v in model.state_dict().items()}
    again = surgery.install(small_gpt2(seed=1))
    again.load_state_dict(older)  # checkpoints of an lnfree that called the flag `fake`
    assert surgery.removal_state(again) == surgery.removal_state(model)


def test_install_refuses_other_models_and_double_installs():
    model = surgery.install(small_gpt2())
    with pytest.raises(ValueError, match="already"):
        surgery.install(model)
    with pytest.raises(ValueError, match="supported families"):
        surgery.install(torch.nn.Linear(2, 2))


def test_rmsnorm_slots_equal_the_hand_computed_fixed_scale_norm():
    model = surgery.install(tiny_family("llama"))
    layer = model.model.layers[0]
    norm = layer.input_layernorm
    x = torch.randn(2, 5, 32) * 3

    def q_proj(x):  # the attention-input norm module, then the projection reading it
        return layer.self_attn.q_proj(norm(x))

    reference = layer.self_attn.q_proj.weight @ (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.qk.eps)
                                                  * norm.weight).unsqueeze(-1)
    torch.testing.assert_close(q_proj(x), reference.squeeze(-1), rtol=1e-5, atol=1e-5)
    norm.qk.sigma.fill_(2.5)
    norm.qk.switch_to_fixed()
    fixed = (layer.self_attn.q_proj.weight @ (x / 2.5 * norm.weight).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(q_proj(x), fixed, rtol=1e-5, atol=1e-5)
    post = layer.post_attention_layernorm
    post.state.sigma.fill_(4.0)
    post.state.switch_to_fixed()
    torch.testing.assert_close(post(x), x / 4.0 * post.weight, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "olmo2"])  # OLMo 2 has no attention-input norm
def test_attention_input_norm_modes_agree_with_the_per_path_computation(family):
    """All real: one real norm feeds both paths' statistics. All fixed: the shared centred-times-weight
    input with σ applied after the matmul equals the per-path computation (forced by an active pos0 σ
    equal to σ)."""
    model = surgery.install(tiny_family(family), special_pos0=True)
    model.train()
    x = torch.randint(0, 64, (2, 7))
    norm = model.get_submodule(architecture(model).sites()[0].module)
    seen = []
    norm.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    model(input_ids=x)
    scale = torch.sqrt(second_moment(seen[0].double(), norm.kind) + norm.qk.eps)
    for state in (norm.qk, norm.v):
        expected = torch.stack([scale[:, 1:].sum(), scale[:, 0].sum()]).float()
        torch.testing.assert_close(state.stats[0, :2], expected, rtol=1e-5, atol=0)
    model.eval()
    for state in surgery.scale_states(model).values():
        if state is norm.v:
            state.sigma.mul_(1.7)  # the V path's σ differs from the Q/K path's
        if state.has_pos0:
            state.sigma_pos0.copy_(state.sigma)
        state.switch_to_fixed()
    if norm.bias is not None:  # a norm bias exercises the V columns' offset
        with torch.no_grad():
            norm.bias.normal_(0, 0.5)

    def logits_and_gradients():
        model.zero_grad()
        logits = model(input_ids=x).logits
        logits.square().mean().backward()
        return logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    assert norm.mode() == "split"
    per_path, per_path_grads = logits_and_gradients()
    surgery.apply_event(model, Event(0, "pos0_special"))
    assert norm.mode() == "fixed"
    shared, shared_grads = logits_and_gradients()
    torch.testing.assert_close(shared, per_path, rtol=1e-5, atol=1e-5)
    assert shared_grads.keys() == per_path_grads.keys()
    for name, grad in shared_grads.items():  # tolerance relative to each gradient's size (some are ~1e-8)
        reference = per_path_grads[name]
        atol = 1e-5 * reference.abs().max().item()
        torch.testing.assert_close(grad, reference, rtol=1e-4, atol=atol, msg=name)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4, 1e10])  # input variances up to 1e20 (< 2^76)
def test_centred_times_is_the_centring_weight_sigma_and_bias_with_their_gradients(scale):
    torch.manual_seed(0)
    x = (torch.randn(6, 48) * scale + 3 * scale).requires_grad_()
    weight = torch.rand(48).add(0.5).requires_grad_()
    bias = torch.randn(48).requires_grad_()
    grad = torch.randn(6, 48)
    sigma = torch.tensor(1.7)
    out = centred_times(x, weight, bias, sigma)
    got = torch.autograd.grad(out, (x, weight, bias), grad)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, weight, bias))
    ref = (x64 - x64.mean(-1, keepdim=True)) * w64 / 1.7 + b64
    expected = torch.autograd.grad(ref, (x64, w64, b64), grad.double())
    # fp32 results against float64: a few roundings of values of size |x| (and |x|·|grad| summed over 6 rows)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6 * scale * 4)
    for g, e, size in zip(got, expected, (1.0, 6 * 4 * scale, 6.0)):
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-5 * size)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_blending_attention_input_norm_is_normalised_per_path(family):
    model = surgery.install(tiny_family(family))
    site = architecture(model).sites()[0]
    norm, projection = model.get_submodule(site.module), model.get_submodule(site.consumers[0].path)
    x = torch.randn(2, 7, 32) * 3

    def project():
        return projection(norm(x))

    real = project()
    norm.qk.sigma.fill_(0.3)
    norm.qk.set_fixed_fraction(1e-6)  # a blend this close to real divides by the real scale
    assert norm.mode() == "split"
    torch.testing.assert_close(project(), real, rtol=1e-4, atol=1e-4)
    norm.qk.set_fixed_fraction(0.5)  # halfway to σ = 0.3 from a real scale near 3: the Q/K columns grow
    assert project().abs().max() > 1.5 * real.abs().max()  # divided by 0.5·3 + 0.5·0.3 instead of 3


def test_centred_times_keeps_fp16_weights_finite():
    x, weight, bias = torch.randn(4, 16), torch.rand(16) + 0.5, torch.randn(16)
    expected = (x - x.mean(-1, keepdim=True)) * weight + bias
    half = centred_times(x.half(), weight.half(), bias.half())
    torch.testing.assert_close(half.float(), expected, rtol=1e-2, atol=1e-2)  # fp16: 3 decimal digits


@pytest.mark.parametrize("columns", [slice(8, 16), slice(16, None), slice(None), torch.tensor([1, 5, 9, 20])])
@pytest.mark.parametrize("in_out", [True, False])
@pytest.mark.parametrize("autocast", [False, True])
def test_rescaled_projection_matches_autograd_through_the_formula(columns, in_out, autocast):
    """RescaledProjection's forward and hand-written backward equal autograd through
    h @ (W·s) + bias + (1 − s)·(b @ W), s = r on the V columns and 1 elsewhere, in fp32 and under
    bf16 autocast (fp32 weights, bf16 matmuls)."""
    torch.manual_seed(0)
    h = torch.randn(20, 16, requires_grad=True)
    weight = torch.randn((16, 24) if in_out else (24, 16), requires_grad=True)
    bias, norm_bias = torch.randn(24, requires_grad=True), torch.randn(16, requires_grad=True)
    r = torch.tensor(0.6)
    scale = torch.ones(24)
    scale[columns] = r
    grad = torch.randn(20, 24)
    inputs = [h, weight, bias, norm_bias]

    def formula():
        matrix = weight if in_out else weight.t()
        return h @ (matrix * scale) + bias + (1 - scale) * (norm_bias @ matrix)

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = RescaledProjection.apply(h, weight, bias, norm_bias, r, columns, in_out)
    grads = torch.autograd.grad(out, inputs, grad.to(out.dtype))
    expected = formula()
    expected_grads = torch.autograd.grad(expected, inputs, grad)
    assert out.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert [g.dtype for g in grads] == [torch.float32] * 4
    tolerance = dict(rtol=2e-2, atol=0.15) if autocast else dict(rtol=1e-5, atol=1e-5)  # bf16: 8-bit mantissa, sums of 16–20 terms
    torch.testing.assert_close(out.float(), expected, **tolerance)
    for got, want, name in zip(grads, expected_grads, ["h", "weight", "bias", "norm_bias"]):
        torch.testing.assert_close(got, want, **tolerance, msg=name)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_left_padding_gives_the_first_real_token_the_position_0_sigma(family):
    model = surgery.install(tiny_family(family), special_pos0=True)
    x = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    surgery.initialise_sigmas(model, [x])
    for state in surgery.scale_states(model).values():
        if state.has_pos0:
            state.sigma_pos0.mul_(3.0)  # position 0's σ clearly differs from the general one
        state.switch_to_fixed()
    padded = torch.cat([torch.zeros(2, 3, dtype=torch.long), x], dim=1)
    mask = torch.cat([torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)], dim=1)
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)  # what a padded batch's positions are (generate() passes them)
    with torch.no_grad():
        plain = model(input_ids=x).logits
        left = model(input_ids=padded, attention_mask=mask, position_ids=position_ids).logits[:, 3:]
        implied = model(input_ids=padded, attention_mask=mask).logits[:, 3:]
    torch.testing.assert_close(left, plain, rtol=1e-4, atol=1e-4)
    if family == "llama":  # rotary attention is relative: the positions transformers infers give the same logits
        torch.testing.assert_close(implied, plain, rtol=1e-4, atol=1e-4)


def test_install_finds_the_scale_states_once(monkeypatch):
    model = surgery.install(small_gpt2())
    states = surgery.scale_states(model)
    monkeypatch.setattr(surgery, "architecture", lambda model: pytest.fail("re-derived the adapter"))
    surgery.update_sigmas(model, 0.9)  # what the training loop calls every step
    assert surgery.scale_states(model) == states and list(states)[0] == "blocks.0.ln_1qk"
    copied = copy.deepcopy(model)  # a copy's states are its own modules
    assert all(a is not b for a, b in zip(surgery.scale_states(copied).values(), states.values()))
    assert set(surgery.scale_states(copied).values()) <= set(copied.modules())
