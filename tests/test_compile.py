"""torch.compile of installed models: no graph breaks in the norm modules, no stale graph after a switch."""

from __future__ import annotations

import copy

import pytest
import torch
from families import tiny_family
from torch._dynamo.utils import counters

from lnfree.fixedscale import surgery
from lnfree.arch import architecture
from lnfree.removal.train import compile_blocks

TOLERANCE = 1e-5  # fp32 logits of a 2-block model of width 32; compiled kernels reorder sums


def train_forward(model, ids):
    """Logits and parameter gradients of one training forward + backward."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    logits.pow(2).mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def eager_and_compiled(family: str):
    """(an installed tiny model with σ measured, its copy with every block compiled, the ids), counters cleared."""
    torch.manual_seed(0)
    eager = surgery.install(tiny_family(family)).train()
    ids = torch.randint(0, 64, (2, 9))
    surgery.initialise_sigmas(eager, [ids])
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(compiled, backend="aot_eager")
    return eager, compiled, ids


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_compiled_blocks_follow_every_switch_like_eager(family):
    eager, compiled, ids = eager_and_compiled(family)
    states = [surgery.scale_states(m) for m in (eager, compiled)]
    # all real, then one slot at a time in schedule order (the first block's, then the rest)
    switches = [None, "blocks.0.ln_2", "blocks.0.ln_1qk", "blocks.0.ln_1v", "blocks.1.ln_2", "blocks.1.ln_1qk",
                "blocks.1.ln_1v", "ln_f"]
    for slot in switches:
        if slot is not None:
            for s in states:
                s[slot].switch_to_fixed()
        (logits_e, grads_e), (logits_c, grads_c) = train_forward(eager, ids), train_forward(compiled, ids)
        torch.testing.assert_close(logits_c, logits_e, rtol=TOLERANCE, atol=TOLERANCE)
        for g_c, g_e in zip(grads_c, grads_e):
            torch.testing.assert_close(g_c, g_e, rtol=1e-4, atol=1e-5)
        for name in states[0]:  # statistics gathered alike (real slots only)
            torch.testing.assert_close(states[1][name].stats, states[0][name].stats, rtol=1e-5, atol=1e-5)
        surgery.update_sigmas(eager, 0.9)
        surgery.update_sigmas(compiled, 0.9)
    # Blocks share graphs: 4 states of a block's norms (real, ln_2 fixed, + Q/K, + V), not 4 per block.
    assert counters["stats"]["unique_graphs"] <= 4


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "neox-parallel"])
@pytest.mark.parametrize("state", ["real", "fixed", "fixed, special σ"])
def test_no_graph_breaks_in_a_block_with_installed_norms(family, state):
    # Fixed without special σ is the split norm's shared "fixed" mode (RescaledProjection); with a
    # special σ at position 0 each projection normalises per path.
    model = surgery.install(tiny_family(family), special_pos0=state != "fixed").train()
    if state != "real":
        for slot_state in surgery.scale_states(model).values():
            slot_state.switch_to_fixed()
    block = model.get_submodule(architecture(model).layers)[0]
    captured = {}

    def keep(module, args, kwargs):
        captured.update(args=args, kwargs=kwargs)

    handle = block.register_forward_pre_hook(keep, with_kwargs=True)
    model(input_ids=torch.randint(0, 64, (2, 9)))
    handle.remove()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(*captured["args"], **captured["kwargs"])
    assert explained.graph_break_count == 0, explained.break_reasons


def test_captured_tensors_match_eager_and_every_block_shares_one_graph():
    # The training losses' hooks (norm inputs, MLP outputs) run inside compiled blocks: captured by a
    # growing list, each block's graph was guarded on its length (one recompile per block and step).
    from lnfree.removal.losses.massive import NormInputs
    from lnfree.removal.losses.position0_mlp import MlpOutputs

    eager, compiled, ids = eager_and_compiled("llama")
    captures = {m: (NormInputs(m), MlpOutputs(m, [0])) for m in (eager, compiled)}
    taken = {}
    for step in range(3):
        for model, hooks in captures.items():
            for h in hooks:
                h.clear()
            model(input_ids=ids, use_cache=False)
            taken[model] = [h.take() for h in hooks]
        for kind_e, kind_c in zip(taken[eager], taken[compiled]):
            assert len(kind_c) == len(kind_e) > 0
            for c, e in zip(kind_c, kind_e):
                torch.testing.assert_close(c, e, rtol=TOLERANCE, atol=TOLERANCE)
        assert captures[compiled][0].sources == captures[compiled][0].modules
    assert counters["stats"]["unique_graphs"] == 1
