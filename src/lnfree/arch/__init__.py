"""Architecture adapters: one small module per model family behind one interface (`Architecture`).

`architecture(model_or_config)` returns the adapter of a supported model and raises one clear
`UnsupportedModel` error, naming the supported families, for anything else. Adding a family is one
module here (a subclass of `Architecture` listing its norm sites) plus its tests.
"""

from __future__ import annotations

from lnfree.arch.base import Architecture, Consumer, NormSite, UnsupportedModel
from lnfree.arch.gemma3 import Gemma3
from lnfree.arch.gpt2 import GPT2
from lnfree.arch.gpt_neox import GPTNeoX
from lnfree.arch.llama import Llama
from lnfree.arch.olmo2 import Olmo2
from lnfree.arch.qwen3 import Qwen3

FAMILIES: tuple[type[Architecture], ...] = (GPT2, Llama, Qwen3, GPTNeoX, Gemma3, Olmo2)
SUPPORTED = ", ".join(f"{f.family} ({'/'.join(f.model_types)})" for f in FAMILIES)

__all__ = ["Architecture", "Consumer", "NormSite", "UnsupportedModel", "FAMILIES", "SUPPORTED", "architecture"]


def architecture(model_or_config) -> Architecture:
    """The adapter for a transformers model or config; `UnsupportedModel` for other architectures."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family(config)
    arch = ", ".join(getattr(config, "architectures", None) or [str(model_type)])
    raise UnsupportedModel(f"lnfree does not support {arch} models; supported families: {SUPPORTED}")
