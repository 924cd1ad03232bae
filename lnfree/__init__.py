"""lnfree: remove LayerNorm from pretrained GPT-2 models by fine-tuning."""

__version__ = "0.1.0"
