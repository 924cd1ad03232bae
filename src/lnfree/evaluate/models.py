"""The models under evaluation: any lnfree format or transformers model, under a label, on a device."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lnfree.arch import architecture
from lnfree.arch.base import norm_eps
from lnfree.evaluate.datasets import EvalError
from lnfree.removal.layout import RUN_CONFIG, TRAINER_STATE
from lnfree.forms.load import load
from lnfree.models.base import EPS_TRICK_THRESHOLD, EPS_TRICK_WEIGHT, resolve_model_source
from lnfree.evaluate.results import model_labels

FORMS = ("hf", "folded", "plain")
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


@dataclass
class EvalModel:
    """A model under a label, in the form it is evaluated in (any module whose output has `.logits`)."""

    label: str
    module: nn.Module
    tokenizer: Any
    source: str = ""
    stored_as: str = ""  # `LoadedModel.stored_as`
    form: str = "hf"
    dtype: str = "float32"
    fully_ln_free: bool | None = None

    @property
    def vocab_size(self) -> int:
        config = getattr(self.module, "config", None)
        return int(config.vocab_size) if config is not None else len(self.tokenizer)

    @property
    def n_positions(self) -> int | None:
        """The longest context the model takes (GPT-2's n_positions, else max_position_embeddings)."""
        config = getattr(self.module, "config", None)
        return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def resolve_device(device: str) -> torch.device:
    """'auto' → CUDA when available, else CPU; anything else as torch spells it, if this torch has it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as err:
        raise EvalError(f"unknown device {device!r} ({err}); use auto, cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise EvalError(f"device {device!r}: this torch build has no usable CUDA (torch {torch.__version__}); "
                        "use --device cpu (or auto)")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise EvalError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return resolved


def _plain_module(source: str, dtype: torch.dtype) -> nn.Module:
    """The checkpoint exactly as `transformers` loads it (an export's eps-trick norms included)."""
    from transformers import AutoModelForCausalLM


    location = resolve_model_source(source)
    if (Path(location) / RUN_CONFIG).is_file() or (Path(location) / TRAINER_STATE).is_file():
        raise EvalError(f"{source} is an lnfree run or checkpoint; --form plain needs a transformers model "
                        "folder or Hub id (use --form hf or folded)")
    module = AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, local_files_only=Path(location).exists())
    norms = [module.get_submodule(site.module) for site in architecture(module).sites()]
    scaled = [m for m in norms if m.weight.abs().mean() > EPS_TRICK_WEIGHT]  # eps-trick weights, w·√E/σ
    if any(norm_eps(m) < EPS_TRICK_THRESHOLD for m in scaled):
        raise EvalError(f"{source} carries eps-trick norm weights but eps {norm_eps(scaled[0]):g} in its config: "
                        "transformers computes garbage from it; use --form hf or folded (lnfree.load fixes the eps)")
    eps_trick = any(norm_eps(m) >= EPS_TRICK_THRESHOLD for m in norms)
    if eps_trick and dtype == torch.float16:
        raise EvalError(f"{source} is in the eps-trick format, whose scaled weights overflow fp16; "
                        "use --dtype fp32/bf16 or --form hf/folded")
    return module.to(dtype).eval()


def load_models(
    sources: Sequence[str], labels: Sequence[str] | None = None, *, form: str = "hf", dtype: str = "fp32",
) -> list[EvalModel]:
    """Load each source with `lnfree.load` (exact fixed-scale form) and put it in the requested form.

    `form`: ``hf`` lnfree's exact fixed-scale model; ``folded`` the exactly LN-free folded weights
    (models that still have real norms stay in ``hf`` form, recorded as such); ``plain`` the
    checkpoint as `GPT2LMHeadModel.from_pretrained` gives it (eps-trick norms for exports).
    """
    if form not in FORMS:
        raise EvalError(f"unknown form {form!r}; use one of {', '.join(FORMS)}")
    if dtype not in DTYPES:
        raise EvalError(f"unknown dtype {dtype!r}; use fp32, bf16 or fp16")
    if not sources:
        raise EvalError("give at least one model")
    try:
        labels = model_labels(sources, labels)
    except ValueError as err:
        raise EvalError(str(err)) from err
    torch_dtype = DTYPES[dtype]
    models = []
    for label, source in zip(labels, sources):
        try:
            loaded = load(source)  # fp32: folding happens before any cast
        except (ValueError, OSError) as err:
            raise EvalError(f"could not load model {source!r}: {err}") from err
        used, ln_free = form, loaded.fully_ln_free
        if form == "folded" and ln_free:
            module = loaded.folded().to(torch_dtype)
        elif form == "plain":
            module = _plain_module(source, torch_dtype)
        else:
            module, used = loaded.model.to(torch_dtype), "hf" if form == "hf" else "hf (not foldable)"
        models.append(EvalModel(label, module.eval(), loaded.tokenizer, str(source), loaded.stored_as, used,
                                str(torch_dtype).removeprefix("torch."), ln_free))
    return models
