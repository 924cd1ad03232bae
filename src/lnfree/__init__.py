"""lnfree: remove LayerNorm / RMSNorm from pretrained language models by fine-tuning, and study them side by side.

Supported families: GPT-2, Llama / Mistral / Qwen2, Qwen3, GPT-NeoX / Pythia (`lnfree.arch`).
`lnfree.load(source)` loads any checkpoint of them (see `lnfree.forms.load.load`) and `lnfree.run(config)`
runs a removal (`lnfree.removal.train.run`); the heavy imports happen on first use, so `import lnfree`
stays fast. The package is one sub-package per stage of the pipeline (docs/reference/layout.md).
"""

import importlib

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "load":  # the module `lnfree.forms.load` is callable: `lnfree.load(source)`
        return importlib.import_module("lnfree.forms.load")
    if name == "run":
        return importlib.import_module("lnfree.removal.train").run
    raise AttributeError(f"module 'lnfree' has no attribute {name!r}")
