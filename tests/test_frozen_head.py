"""`lnfree.removal.frozen_head`: a frozen head under autocast multiplies by one kept transposed 16-bit copy of its
weight, with autocast's logits and the plain gradient, and the swap leaves the model's parameters as they were."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conftest import small_gpt2
from lnfree.arch import architecture
from lnfree.removal.frozen_head import FrozenHead, kept_transposed, product_backward, use_frozen_head


def test_a_frozen_weights_copy_is_kept_until_the_weight_changes():
    w = torch.randn(8, 4)
    first = kept_transposed(w, torch.bfloat16)
    assert first.shape == (4, 8) and first.is_contiguous() and torch.equal(first, w.bfloat16().t())
    assert kept_transposed(w, torch.bfloat16) is first
    w.mul_(2)  # as a checkpoint's load or an in-place update would
    again = kept_transposed(w, torch.bfloat16)
    assert again is not first and torch.equal(again, w.bfloat16().t())
    trained = w.clone().requires_grad_()
    assert kept_transposed(trained, torch.bfloat16) is not kept_transposed(trained, torch.bfloat16)


def _heads(bias: bool = False) -> tuple[nn.Linear, FrozenHead]:
    torch.manual_seed(0)
    plain = nn.Linear(48, 300, bias=bias)
    plain.weight.requires_grad_(False)
    holder = nn.Module()
    holder.head = plain
    use_frozen_head(holder, "head")
    assert isinstance(holder.head, FrozenHead) and holder.head.weight is plain.weight
    return plain, holder.head


def test_under_autocast_the_logits_are_autocasts_and_the_gradient_the_plain_one():
    plain, frozen = _heads()
    x = torch.randn(2, 5, 48)
    grads = []
    outs = []
    for head in (plain, frozen):
        leaf = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = head(leaf)
        (out.float() ** 2).sum().backward()
        outs.append(out)
        grads.append(leaf.grad)
    assert outs[1].dtype == torch.bfloat16 and torch.equal(outs[0], outs[1])
    torch.testing.assert_close(grads[1], grads[0], rtol=2e-2, atol=1e-2)  # bf16 products summed in another order
    assert not torch.equal(grads[1], torch.zeros_like(grads[1]))


def test_outside_autocast_or_while_it_trains_it_is_the_plain_linear():
    plain, frozen = _heads(bias=True)
    x = torch.randn(3, 48)
    assert torch.equal(frozen(x), plain(x))
    frozen.weight.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = frozen(x)
    out.float().sum().backward()
    assert frozen.weight.grad is not None  # trained heads take autocast's own path, with their weight gradient
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.linear(x, plain.weight, plain.bias)
    torch.testing.assert_close(out, expected)


def test_the_swap_keeps_a_tied_heads_parameters_and_state_dict():
    model = small_gpt2()
    arch = architecture(model)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    embedding = model.get_submodule(arch.token_embedding).weight
    embedding.requires_grad_(False)
    use_frozen_head(model, arch.unembedding)
    head = model.get_submodule(arch.unembedding)
    assert isinstance(head, FrozenHead) and head.weight is embedding  # still tied
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        swapped = model(ids).logits
    use_frozen_head(model, arch.unembedding)  # a second swap leaves it as it is
    assert model.get_submodule(arch.unembedding) is head
    model.lm_head = nn.Linear(head.in_features, head.out_features, bias=False)
    model.lm_head.weight = embedding
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(ids).logits, swapped)


def test_a_head_with_hooks_is_left_alone():
    holder = nn.Module()
    holder.head = nn.Linear(4, 6)
    holder.head.register_forward_hook(lambda *args: None)
    use_frozen_head(holder, "head")
    assert type(holder.head) is nn.Linear


def test_a_weight_in_its_own_dtype_or_trained_is_a_view_multiplied_as_linear_does():
    x, grad = torch.randn(6, 4), torch.randn(6, 8)
    for w in (torch.randn(8, 4), torch.randn(8, 4, dtype=torch.bfloat16).float().requires_grad_()):
        view = kept_transposed(w, torch.float32)
        assert not view.is_contiguous() and torch.equal(view, w.detach().t())
        assert torch.equal(x @ view, F.linear(x, w.detach()))
        assert torch.equal(product_backward(grad, view), grad @ w.detach())
