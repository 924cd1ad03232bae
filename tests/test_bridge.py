"""TransformerLens bridges (lnfree.forms.bridge) around real-LN, eps-trick and folded LN-free GPT-2s."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lnfree.forms.bridge import (  # noqa: E402
    bridge_from_folded,
    bridge_with_own_norms,
    bridge_from_layernorm,
    bridge_logits,
    hook_name,
    is_layernorm_free,
)
from lnfree.analysis.attribution import direct_logit_attribution, residual_decomposition  # noqa: E402

TOL = 1e-4


# ----------------------------------------------------------------------------------------------
# Fixtures: a local tokenizer and random tiny GPT-2s
# ----------------------------------------------------------------------------------------------


def _fallback_tokenizer():
    """A tiny word-level tokenizer built in memory (used only if lnfree.data.tiny is unavailable)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<|unk|>": 1}
    for word in "the a cat dog sat on mat ran to park and saw big small red blue".split():
        vocab[word] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", unk_token="<|unk|>"
    )


@pytest.fixture(scope="module")
def tokenizer():
    try:
        from lnfree.data.tiny import build_tokenizer, generate_documents
    except ImportError:  # pragma: no cover - lnfree.data.tiny is developed concurrently
        return _fallback_tokenizer()
    return build_tokenizer(generate_documents(50, 0))


def random_gpt2(vocab_size: int, *, n_layer=2, n_embd=32, n_head=4, n_positions=32, seed=0, **extra):
    """A random GPT-2 without dropout whose LayerNorms have non-trivial affine parameters."""
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions, vocab_size=vocab_size,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **extra,
    )
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.1)
    return model


def random_ids(model, batch=2, seq=None, seed=1):
    seq = seq or min(16, model.config.n_positions)
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def snapshot(model):
    return (
        {name: p.detach().clone() for name, p in model.state_dict().items()},
        {name: type(m) for name, m in model.named_modules()},
        model.config.to_dict(),
    )


def assert_unchanged(model, snap):
    params, types, config = snap
    now = model.state_dict()
    assert set(now) == set(params)
    for name, value in params.items():
        assert torch.equal(now[name], value), name
    assert {name: type(m) for name, m in model.named_modules()} == types
    assert model.config.to_dict() == config


# ----------------------------------------------------------------------------------------------
# Fixed-scale LayerNorm and its exact fold (built here, independently of lnfree.forms.bridge)
# ----------------------------------------------------------------------------------------------


class FixedScaleLN(nn.Module):
    """LN(x) = (x - mean(x)) / sigma * w + b with a constant sigma."""

    def __init__(self, ln: nn.LayerNorm, sigma: float):
        super().__init__()
        self.weight, self.bias, self.sigma = ln.weight, ln.bias, sigma

    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) / self.sigma * self.weight + self.bias


def fixed_scale_model(model, seed=2):
    """A copy of ``model`` whose every LayerNorm uses a fixed random sigma in [0.5, 2]."""
    fixed = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)

    def sigma():
        return float(torch.empty(1).uniform_(0.5, 2.0, generator=gen))

    for block in fixed.transformer.h:
        block.ln_1 = FixedScaleLN(block.ln_1, sigma())
        block.ln_2 = FixedScaleLN(block.ln_2, sigma())
    fixed.transformer.ln_f = FixedScaleLN(fixed.transformer.ln_f, sigma())
    return fixed


def fold_fixed_scale(fixed):
    """Fold every fixed-scale LN of ``fixed`` into the next linear layer; norms become Identity."""
    folded = copy.deepcopy(fixed)
    d = folded.config.n_embd
    centre = torch.eye(d) - torch.ones(d, d) / d
    with torch.no_grad():
        for block in folded.transformer.h:
            for ln_name, conv in (("ln_1", block.attn.c_attn), ("ln_2", block.mlp.c_fc)):
                ln = getattr(block, ln_name)
                W, c = conv.weight.clone(), conv.bias.clone()  # Conv1D: weight is (in, out)
                conv.weight.copy_(centre @ torch.diag(ln.weight / ln.sigma) @ W)
                conv.bias.copy_(ln.bias @ W + c)
                setattr(block, ln_name, nn.Identity())
        ln = folded.transformer.ln_f
        W_U = folded.transformer.wte.weight.T.clone()  # (d_model, vocab)
        head = nn.Linear(d, folded.config.vocab_size, bias=True)
        head.weight.copy_((centre @ torch.diag(ln.weight / ln.sigma) @ W_U).T)
        head.bias.copy_(ln.bias @ W_U)
        folded.lm_head = head
        folded.transformer.ln_f = nn.Identity()
        folded.config.tie_word_embeddings = False
    return folded.eval()


@pytest.fixture(scope="module")
def folded_pair(tokenizer):
    fixed = fixed_scale_model(random_gpt2(len(tokenizer)))
    return fixed, fold_fixed_scale(fixed)


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


def test_real_layernorm_bridge_matches_hf(tokenizer):
    model = random_gpt2(len(tokenizer))
    ids = random_ids(model)
    bridge = bridge_from_layernorm(model, tokenizer)
    assert bridge.compatibility_mode
    err = (bridge_logits(bridge, ids) - hf_logits(model, ids)).abs().max().item()
    assert err < TOL, err


def test_real_layernorm_bridge_without_compatibility_mode(tokenizer):
    model = random_gpt2(len(tokenizer), seed=3)
    ids = random_ids(model)
    bridge = bridge_from_layernorm(model, tokenizer, compatibility_mode=False)
    assert not bridge.compatibility_mode
    err = (bridge_logits(bridge, ids) - hf_logits(model, ids)).abs().max().item()
    assert err < TOL, err


def test_eps_trick_bridge_matches_hf(tokenizer):
    model = random_gpt2(len(tokenizer), seed=4)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                sigma = float(torch.empty(1).uniform_(0.5, 2.0, generator=gen))
                module.eps = 1e12
                module.weight.mul_(1e6 / sigma)
    model.config.layer_norm_epsilon = 1e12
    ids = random_ids(model)
    reference = hf_logits(model, ids)
    bridge = bridge_from_layernorm(model, tokenizer)
    err = (bridge_logits(bridge, ids) - reference).abs().max().item()
    assert err < TOL, err
    # A stale config eps must not matter: the bridge reads the modules' eps.
    model.config.layer_norm_epsilon = 1e-5
    bridge = bridge_from_layernorm(model, tokenizer)
    err = (bridge_logits(bridge, ids) - reference).abs().max().item()
    assert err < TOL, err


def test_folded_model_reproduces_fixed_scale_model(folded_pair):
    fixed, folded = folded_pair
    assert is_layernorm_free(folded) and not is_layernorm_free(fixed)
    ids = random_ids(folded)
    err = (hf_logits(folded, ids) - hf_logits(fixed, ids)).abs().max().item()
    assert err < TOL, err


def test_folded_bridge_matches_hf_and_decomposes_exactly(folded_pair, tokenizer):
    _, folded = folded_pair
    ids = random_ids(folded)
    reference = hf_logits(folded, ids)
    bridge = bridge_from_folded(folded, tokenizer)
    assert bridge.cfg.normalization_type is None
    assert torch.equal(bridge.b_U.detach(), folded.lm_head.bias.detach())
    assert bridge.b_U.abs().max() > 0
    err = (bridge_logits(bridge, ids) - reference).abs().max().item()
    assert err < TOL, err

    # By hand from the cache: embeddings + every attention / MLP output, then W_U and b_U.
    names = [hook_name("embed"), hook_name("pos_embed")]
    names += [hook_name(kind, layer) for layer in range(bridge.cfg.n_layers) for kind in ("attn_out", "mlp_out")]
    _, cache = bridge.run_with_cache(ids)
    resid = sum(cache[name] for name in names)
    rebuilt = resid @ bridge.W_U + bridge.b_U
    err = (rebuilt - reference).abs().max().item()
    assert err < TOL, err

    # And with the helpers, per layer and per head.
    for per_head in (False, True):
        decomposition = residual_decomposition(bridge, ids, per_head=per_head)
        n_comp = 2 + bridge.cfg.n_layers * (2 + (bridge.cfg.n_heads if per_head else 0))
        assert decomposition.components.shape[0] == n_comp == len(decomposition.labels)
        assert decomposition.final_scale is None
        err = (decomposition.components.sum(0) - decomposition.final_resid).abs().max().item()
        assert err < TOL, err
        contributions, bias = direct_logit_attribution(bridge, decomposition)
        err = (contributions.sum(0) + bias - reference).abs().max().item()
        assert err < TOL, err
    assert not getattr(bridge.cfg, "use_attn_result", False)  # restored after per-head run


def test_layernorm_bridge_direct_logit_attribution_is_exact(tokenizer):
    model = random_gpt2(len(tokenizer), seed=6)
    ids = random_ids(model)
    reference = hf_logits(model, ids)
    token_ids = [3, 7, 11]
    for compatibility_mode in (True, False):
        bridge = bridge_from_layernorm(model, tokenizer, compatibility_mode=compatibility_mode)
        decomposition = residual_decomposition(bridge, ids, per_head=True)
        assert decomposition.final_scale is not None
        contributions, bias = direct_logit_attribution(bridge, decomposition, token_ids=token_ids)
        assert contributions.shape[-1] == len(token_ids)
        err = (contributions.sum(0) + bias - reference[..., token_ids]).abs().max().item()
        assert err < TOL, (compatibility_mode, err)


@pytest.mark.parametrize(
    "shape",
    [
        dict(n_layer=1, n_embd=16, n_head=1, n_positions=8),
        dict(n_layer=3, n_embd=48, n_head=6, n_positions=20, n_inner=40, activation_function="relu"),
    ],
)
def test_arbitrary_shapes(tokenizer, shape):
    vocab = len(tokenizer) + 13
    model = random_gpt2(vocab, seed=7, **shape)
    ids = random_ids(model)
    err = (bridge_logits(bridge_from_layernorm(model, tokenizer), ids) - hf_logits(model, ids)).abs().max().item()
    assert err < TOL, err
    folded = fold_fixed_scale(fixed_scale_model(model))
    err = (bridge_logits(bridge_from_folded(folded, tokenizer), ids) - hf_logits(folded, ids)).abs().max().item()
    assert err < TOL, err


def test_bridges_never_mutate_the_callers_model(folded_pair, tokenizer):
    _, folded = folded_pair
    model = random_gpt2(len(tokenizer), seed=8)
    tok_snapshot = (tokenizer.pad_token, tokenizer.padding_side, len(tokenizer))
    for build, source in (
        (lambda m: bridge_from_layernorm(m, tokenizer), model),
        (lambda m: bridge_from_layernorm(m, tokenizer, compatibility_mode=False), model),
        (lambda m: bridge_from_folded(m, tokenizer), folded),
    ):
        snap = snapshot(source)
        bridge = build(source)
        ids = random_ids(source)
        bridge_logits(bridge, ids)
        residual_decomposition(bridge, ids, per_head=True)
        assert_unchanged(source, snap)
        assert bridge.original_model is not source
    assert (tokenizer.pad_token, tokenizer.padding_side, len(tokenizer)) == tok_snapshot


def test_gradients_through_backward_hooks(folded_pair, tokenizer):
    _, folded = folded_pair
    bridge = bridge_from_folded(folded, tokenizer)
    bridge.set_use_attn_result(True)
    ids = random_ids(folded)
    kinds = ("resid_pre", "z", "result", "mlp_post", "pattern")
    grads = {}

    def keeper(kind):
        def fn(grad, hook):
            grads[kind] = grad.detach().clone()

        return fn

    with bridge.hooks(bwd_hooks=[(hook_name(kind, 1), keeper(kind)) for kind in kinds]):
        logits = bridge(ids, return_type="logits")
        logits[:, -1, 5].sum().backward()
    bridge.zero_grad(set_to_none=True)
    n_heads, d_head, d_model = bridge.cfg.n_heads, bridge.cfg.d_head, bridge.cfg.d_model
    batch, seq = ids.shape
    assert grads["resid_pre"].shape == (batch, seq, d_model)
    assert grads["z"].shape == (batch, seq, n_heads, d_head)
    assert grads["result"].shape == (batch, seq, n_heads, d_model)
    assert grads["mlp_post"].shape == (batch, seq, bridge.cfg.d_mlp)
    assert grads["pattern"].shape == (batch, n_heads, seq, seq)
    assert grads["resid_pre"][:, -1].abs().sum() > 0


def test_rejects_wrong_inputs(folded_pair, tokenizer):
    fixed, folded = folded_pair
    with pytest.raises(ValueError, match="not LayerNorm-free"):
        bridge_from_folded(random_gpt2(len(tokenizer)), tokenizer)
    with pytest.raises(TypeError):
        bridge_from_layernorm(folded, tokenizer)
    mixed = random_gpt2(len(tokenizer))
    mixed.transformer.ln_f.eps = 1e-3
    with pytest.raises(ValueError, match="different eps"):
        bridge_from_layernorm(mixed, tokenizer)


def test_folded_bridge_with_tied_bias_free_head(tokenizer):
    """An LN-free model may also keep GPT-2's tied, bias-free head: the bridge's b_U is then zero."""
    model = random_gpt2(len(tokenizer), seed=9)
    for block in model.transformer.h:
        block.ln_1, block.ln_2 = nn.Identity(), nn.Identity()
    model.transformer.ln_f = nn.Identity()
    assert model.lm_head.weight is model.transformer.wte.weight and model.lm_head.bias is None
    ids = random_ids(model)
    bridge = bridge_from_folded(model, tokenizer)
    assert torch.equal(bridge.b_U, torch.zeros(model.config.vocab_size))
    err = (bridge_logits(bridge, ids) - hf_logits(model, ids)).abs().max().item()
    assert err < TOL, err
    assert model.lm_head.bias is None and "bias" not in model.lm_head._buffers  # caller untouched


def test_a_gpt2_without_scaled_attention_is_refused_by_the_bridge():
    from conftest import small_gpt2

    model = small_gpt2()
    model.config.scale_attn_weights = False
    with pytest.raises(ValueError, match="scale_attn_weights=False is not supported"):
        bridge_with_own_norms(model)


# ----------------------------------------------------------------------------------------------
# Memory: no copy the bridge does not need
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "qwen3", "neox-parallel", "gemma3", "olmo2"])
def test_value_bias_fold_is_skipped_only_where_it_changes_nothing(family, monkeypatch):
    """TL's fold_value_biases copies every weight; for an RMSNorm model without attention biases it has
    nothing to fold, and the bridge built without it is the same, weight for weight."""
    import lnfree.forms.bridge as lb
    from families import tiny_family
    from lnfree.arch import architecture

    model = tiny_family(family, vocab_size=50)
    has_biases = family in ("gpt2", "qwen2", "neox-parallel")
    assert lb._folds_value_biases(model, architecture(model)) is has_biases
    if has_biases:
        return
    lean = bridge_from_layernorm(model)
    monkeypatch.setattr(lb, "_folds_value_biases", lambda *args: True)
    folding = bridge_from_layernorm(model)
    lean_state, folding_state = lean.state_dict(), folding.state_dict()
    assert set(lean_state) == set(folding_state)
    for name, value in lean_state.items():
        assert torch.equal(value, folding_state[name]), name
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(bridge_logits(lean, ids), bridge_logits(folding, ids))


@pytest.mark.parametrize("family", ["gpt2", "gemma3"])
def test_loaded_bridges_share_the_embedding_and_never_write_it(family, tokenizer, tmp_path):
    """`LoadedModel.bridge()` builds on a new model whose token embedding is the loaded model's own
    memory (one vocabulary-sized copy fewer): the bridges still match, and the model is unchanged."""
    from families import tiny_family
    from lnfree.fixedscale import surgery
    from lnfree.forms.export import write_export
    from lnfree.forms.load import load

    base = tiny_family(family, vocab_size=len(tokenizer))
    base.save_pretrained(tmp_path / "original")
    tokenizer.save_pretrained(tmp_path / "original")
    installed = surgery.install(copy.deepcopy(base))
    ids = torch.randint(0, len(tokenizer), (2, 12), generator=torch.Generator().manual_seed(0))
    surgery.initialise_sigmas(installed, [ids])
    for state in surgery.scale_states(installed).values():
        state.switch_to_fixed()
    write_export(installed, tokenizer, tmp_path / "ln_free", {"note": "test"})
    for folder in ("original", "ln_free"):
        loaded = load(tmp_path / folder)
        snap = snapshot(loaded.model)
        with torch.no_grad():
            expected = loaded.model(input_ids=ids).logits
        bridge = loaded.bridge()
        err = (bridge_logits(bridge, ids) - expected).abs().max().item()
        assert err < TOL, (folder, err)
        residual_decomposition(bridge, ids, per_head=True)
        assert_unchanged(loaded.model, snap)
        if folder == "ln_free":  # a pass-through bridge runs on the shared embedding itself
            shared = loaded.model.get_input_embeddings().weight
            assert bridge.embed.W_E.data_ptr() == shared.data_ptr()
