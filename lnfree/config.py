"""Typed run configuration, presets shipped as TOML files, and dotted CLI overrides."""

from __future__ import annotations

import json
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lnfree.schedule import Schedule


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataConfig(_Strict):
    """Where the fine-tuning tokens come from and how held-out data is made."""

    source: str = Field("tiny", description="'tiny', 'realtext', a Hub dataset id, or a local file/folder")
    revision: str | None = None
    split: str = "train"
    text_field: str = "text"
    val_fraction: float = Field(0.0005, gt=0, lt=1, description="held-out share of documents (nanoGPT split)")
    val_seed: int = 2357
    context_length: int | None = Field(None, ge=2, description="default: the model's n_positions")
    max_documents: int | None = Field(None, ge=2, description="cap on documents read (quick runs)")
    eval_sequences: int = Field(64, ge=1, description="held-out sequences used for CE")
    num_proc: int = Field(1, ge=1)
    cache_dir: str | None = Field(None, description="default: ~/.cache/lnfree/data")


class TrainConfig(_Strict):
    """Optimisation: AdamW, linear warm-up then cosine decay to a minimum learning rate."""

    max_steps: int | None = Field(None, ge=1, description="default: 3 × the schedule's last event")
    learning_rate: float = Field(6e-4, gt=0)
    min_learning_rate: float = Field(3e-4, ge=0)
    warmup_steps: int = Field(25, ge=0)
    cosine_steps: int | None = Field(None, ge=1, description="length of the cosine; default max_steps")
    tokens_per_step: int = Field(524_288, ge=1, description="reached by gradient accumulation")
    micro_batch_size: int = Field(8, ge=1, description="sequences per device per forward")
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    aux_loss_weight: float = Field(0.1, ge=0)
    sigma_momentum: float = Field(0.9, ge=0, lt=1, description="EMA momentum per `sigma_momentum_sequences`")
    sigma_momentum_sequences: int = Field(32, ge=1)
    sigma_init_batches: int = Field(8, ge=1, description="micro-batches in the initial σ measurement")
    dropout: float | None = Field(0.0, ge=0, le=1, description="None keeps the model's own dropout")
    seed: int = 0
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    gradient_checkpointing: bool = False
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0: only at the end)")
    eval_every: int = Field(0, ge=0, description="held-out CE every N steps (0: start and end only)")
    log_every: int = Field(10, ge=1)
    report_to: list[Literal["wandb", "tensorboard"]] = []

    @model_validator(mode="after")
    def _lr_order(self) -> TrainConfig:
        if self.min_learning_rate > self.learning_rate:
            raise ValueError("min_learning_rate must not exceed learning_rate")
        return self


class RemovalConfig(_Strict):
    """What to remove and when. `vanilla` runs the control: the same training, nothing removed."""

    mode: Literal["remove", "vanilla"] = "remove"
    schedule: Schedule | None = Field(None, description="default: derived from the model's depth")
    special_pos0: bool = False
    special_eot: bool = False


class RunConfig(_Strict):
    """Everything one removal (or control) run needs."""

    description: str = ""
    model: str = Field("tiny", description="'tiny', a local directory or a Hub id")
    output_dir: str = "runs/tiny"
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    removal: RemovalConfig = RemovalConfig()


def preset_names() -> list[str]:
    """Names of the presets shipped with lnfree."""
    folder = resources.files("lnfree") / "presets"
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))


def load_preset(name: str) -> RunConfig:
    """The shipped preset `name` (e.g. 'gpt2', 'gpt2-xl', 'tiny')."""
    path = resources.files("lnfree") / "presets" / f"{name}.toml"
    if not path.is_file():
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(preset_names())}")
    return RunConfig.model_validate(tomllib.loads(path.read_text()))


def load_config(path: str | Path) -> RunConfig:
    """A run config from a TOML or JSON file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    return RunConfig.model_validate(data)


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def with_overrides(config: RunConfig, overrides: dict[str, Any] | list[str]) -> RunConfig:
    """A copy of `config` with dotted-path overrides, e.g. ``["train.max_steps=50"]``.

    Values are parsed as JSON when possible (numbers, booleans, null, lists), else kept as text.
    Unknown keys are an error.
    """
    if isinstance(overrides, list):
        pairs = {}
        for item in overrides:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ValueError(f"override {item!r} is not of the form key=value")
            pairs[key.strip()] = _parse_value(raw)
        overrides = pairs
    data = config.model_dump()
    for key, value in overrides.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise ValueError(f"unknown config key {key!r}")
            node = node[part]
        if leaf not in node:
            raise ValueError(f"unknown config key {key!r}")
        node[leaf] = value
    return RunConfig.model_validate(data)
