"""The `[data]` table of a run's config: where the fine-tuning tokens come from (`lnfree.removal.config`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DataConfig(BaseModel):
    """Where the fine-tuning tokens come from and how held-out data is made."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field("tiny", description="'tiny', 'realtext', a Hub dataset id, or a local file/folder")
    document_separator: str | None = Field(
        None, description="split a single .txt file into documents at this exact text (e.g. '\\n\\n'); default: one document"
    )
    revision: str | None = None
    split: str = "train"
    text_field: str = "text"
    val_fraction: float = Field(0.0005, gt=0, lt=1, description="held-out share of documents (nanoGPT split)")
    val_seed: int = 2357
    context_length: int | None = Field(None, ge=2, description="default: the model's n_positions")
    max_documents: int | None = Field(None, ge=2, description="cap on documents read (quick runs)")
    bos: Literal["family", "always"] = Field(
        "family", description="start each sequence with the tokenizer's BOS token where the model's family reads one "
        "('family': Gemma), or for every model ('always': a model whose first token otherwise becomes the attention "
        "sink, such as SmolLM2)"
    )
    eval_sequences: int = Field(64, ge=1, description="held-out sequences used for CE")
    eval_spread: bool = Field(
        False, description="the in-run held-out CE on `eval_sequences` spread evenly over the held-out sequences "
        "instead of the first ones: neighbouring sequences share their few documents (on Gemma 3's realtext "
        "validation half 64 neighbouring sequences read a model pair's gap with a standard deviation of 0.024, 64 "
        "evenly spaced ones 0.014: experiments/robust/in_run_noise.py)"
    )
    min_held_out_tokens: int = Field(4096, ge=0, description="warn when the held-out CE scores fewer tokens")
    num_proc: int = Field(1, ge=1, description="tokenising processes (capped by the available cores)")
    cache_dir: str | None = Field(None, description="default: ~/.cache/lnfree/data")
