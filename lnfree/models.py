"""Loading GPT-2-architecture checkpoints (local folders, Hub ids, the bundled tiny model)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, GPT2LMHeadModel

EPS_TRICK_THRESHOLD = 1e6


class ModelError(ValueError):
    """A model that lnfree cannot use as asked."""


def resolve_model_source(name: str) -> str:
    """'tiny' / 'realtext' → a bundled model's folder; anything else is a local folder or a Hub id."""
    if name == "tiny":
        from lnfree.tiny import TINY_MODEL_DIR

        return str(TINY_MODEL_DIR)
    if name == "realtext":
        from lnfree.realtext import REALTEXT_MODEL_DIR

        return str(REALTEXT_MODEL_DIR)
    return str(Path(name).expanduser()) if Path(name).expanduser().exists() else name


def load_config(name: str):
    """The model's config, with one clear error for anything that is not GPT-2."""
    source = resolve_model_source(name)
    try:
        config = AutoConfig.from_pretrained(source)
    except Exception as err:
        raise ModelError(f"could not load a model config from {name!r}: {err}") from err
    if config.model_type != "gpt2":
        arch = ", ".join(getattr(config, "architectures", None) or [config.model_type])
        raise ModelError(f"{name!r} is a {arch} model; lnfree supports the GPT-2 architecture only")
    return config


def load_base(name: str, dtype: torch.dtype = torch.float32):
    """(GPT2LMHeadModel, tokenizer) for a model with real LayerNorms, checked for consistency."""
    config = load_config(name)
    source = resolve_model_source(name)
    if config.layer_norm_epsilon >= EPS_TRICK_THRESHOLD:
        raise ModelError(f"{name!r} is already LayerNorm-free (eps {config.layer_norm_epsilon:g})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as err:
        raise ModelError(f"could not load the tokenizer of {name!r}: {err}") from err
    if len(tokenizer) > config.vocab_size:
        raise ModelError(
            f"the tokenizer of {name!r} has {len(tokenizer)} tokens but the model's vocabulary is {config.vocab_size}"
        )
    if tokenizer.eos_token_id is None:
        raise ModelError(f"the tokenizer of {name!r} has no eos (EOT) token")
    model = GPT2LMHeadModel.from_pretrained(source, dtype=dtype)
    if any(m.eps >= EPS_TRICK_THRESHOLD for m in model.modules() if isinstance(m, torch.nn.LayerNorm)):
        raise ModelError(f"{name!r} is already LayerNorm-free (its LayerNorm modules carry eps ≥ 1e6)")
    return model, tokenizer
