"""lnfree: remove LayerNorm from pretrained GPT-2 models by fine-tuning, and study them side by side.

`lnfree.load(source)` loads any GPT-2 checkpoint (see `lnfree.load.load`); the heavy imports
happen on first use, so `import lnfree` stays fast.
"""

import importlib

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "load":  # the module `lnfree.load` is callable: `lnfree.load(source)`
        return importlib.import_module("lnfree.load")
    raise AttributeError(f"module 'lnfree' has no attribute {name!r}")
