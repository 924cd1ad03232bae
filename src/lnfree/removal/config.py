"""Typed run configuration, presets shipped as TOML files, and dotted CLI overrides."""

from __future__ import annotations

import json
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lnfree.errors import LnfreeError
from lnfree.fixedscale.ceiling import ScaleCeiling
from lnfree.removal.losses.attention import AttentionKl
from lnfree.removal.losses.coverage import Coverage
from lnfree.removal.losses.margin import StabilityMargin
from lnfree.removal.losses.massive import MassiveNeurons, Position0Tail, ScaleTail, check_pieces
from lnfree.removal.losses.gain import NeuronGain
from lnfree.removal.losses.growth import LocalGrowth
from lnfree.removal.losses.neuron_range import NeuronRange
from lnfree.removal.losses.position0_mlp import Position0Mlp
from lnfree.removal.schedule import Adaptive, Schedule
from lnfree.data.config import DataConfig  # the `[data]` table; its home is the data stage


class ConfigError(LnfreeError, ValueError):
    """A run config that cannot be read or does not validate (a one-line message)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


#: The losses whose setting is a function of the step: one setting with its `start`, or a list of
#: them (a later `start` takes over: how a run changes a hinge's ratio or weight from some step on).
STEP_LOSSES = ("scale_tail", "position0_tail", "position0_mlp", "neuron_range", "neuron_gain", "stability_margin",
               "coverage", "local_growth", "attention_kl")


class LearningRateRestart(_Strict):
    """A second warm-up and cosine from `start` on (SGDR's warm restart): a recovery phase after the last
    removal at a learning rate above the first curve's minimum."""

    start: int = Field(ge=1, description="the first step of the second curve")
    learning_rate: float = Field(gt=0)
    min_learning_rate: float = Field(ge=0)
    warmup_steps: int = Field(0, ge=0)
    cosine_steps: int | None = Field(None, ge=1, description="length of the second cosine; default: to max_steps")

    @model_validator(mode="after")
    def _lr_order(self) -> LearningRateRestart:
        if self.min_learning_rate > self.learning_rate:
            raise ValueError("learning_rate_restart.min_learning_rate must not exceed its learning_rate")
        return self


class TrainConfig(_Strict):
    """Optimisation: AdamW, linear warm-up then cosine decay to a minimum learning rate."""

    max_steps: int | None = Field(None, ge=1, description="default: 3 × the schedule's last event")
    learning_rate: float = Field(6e-4, gt=0)
    min_learning_rate: float = Field(3e-4, ge=0)
    warmup_steps: int = Field(25, ge=0)
    cosine_steps: int | None = Field(None, ge=1, description="length of the cosine; default max_steps")
    learning_rate_restart: LearningRateRestart | None = Field(
        None, description="from its start on, a second warm-up and cosine replaces the first curve; None: one curve"
    )
    tokens_per_step: int = Field(524_288, ge=1, description="reached by gradient accumulation")
    micro_batch_size: int | None = Field(
        None, ge=1, description="sequences per device per forward; default: the largest that divides the step, "
        "up to max_micro_batch_size"
    )
    max_micro_batch_size: int = Field(8, ge=1, description="upper bound of the automatic micro-batch (memory)")
    weight_decay: float = 0.01
    vector_lr_scale: float = Field(
        1.0, gt=0, description="the learning rate of the 1-D parameters (norm weights, biases) over the matrices'. "
        "AdamW moves a weight by about the learning rate a step whatever its size: about 1e-2 of a typical matrix "
        "entry at 1e-4, but 1e-4 of a Gemma 3 norm weight (|w| 2-95), which then barely moves in a whole removal"
    )
    freeze_embeddings: bool = Field(
        False, description="train everything but the token embedding (and a head tied to it): a large-vocabulary "
        "model's embedding is most of its parameters and of the optimiser's work. On in the modern models' presets "
        "and for a model without a preset (Gemma 3 270M, 100 steps: validation CE 0.026 nats lower frozen than "
        "trained, at 0.6x the CPU time)"
    )
    betas: tuple[float, float] = (0.9, 0.999)
    fused_optimizer: bool = Field(
        True, description="torch's fused AdamW (one kernel over all parameters; on one CPU thread a 100M-parameter "
        "step takes ~0.1 s instead of ~0.45 s); false: the per-parameter loop of lnfree before 2026-11. A resumed "
        "run keeps the implementation its checkpoint was written with"
    )
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="muon: torch's Muon (momentum orthogonalised, its update scaled to AdamW's RMS) for "
        "the hidden weight matrices, AdamW for embeddings, the head and vectors (lnfree.removal.muon)"
    )
    grad_clip: float = Field(1.0, gt=0)
    skip_grad_norm: float | None = Field(
        None, gt=0, description="skip the optimiser step (and log it) when the gradient norm before clipping exceeds "
        "this: a spike from one runaway token then moves no weight; costs one host sync per step; None: never"
    )
    aux_loss_weight: float = Field(0.1, ge=0)
    scale_loss_weight: float = Field(
        0.0, ge=0, description="auxiliary loss on every norm input: mean over norms of mean over tokens of "
        "(per-token scale / typical scale − 1)², typical = the mean over tokens neither at position 0 nor EOT; 0 is off"
    )
    head_scale_loss_weight: float = Field(
        0.0, ge=0, description="the scale loss (`scale_loss_form`) at the per-head norms' inputs too (q_norm, "
        "k_norm of Qwen3 and Gemma 3): per token and head, against the typical scale over every head of the norm "
        "(one σ per norm). While such a norm is real its input's scale is free; fixed, a key's scale sets its "
        "attention logits. 0 is off"
    )
    position0_key_scale_weight: float = Field(
        0.0, ge=0, description="log(scale / typical)² of position 0's input to each key norm (k_norm of Qwen3 and "
        "Gemma 3), per head, against the other tokens' typical scale there. While the key norm is real the scale "
        "is free; once it is fixed with one σ, a position 0 that enters it small (Gemma 3 270M's BOS: 0.17–0.84× "
        "the median token) gets a key too small for the attention sink. 0 is off"
    )
    scale_loss_form: Literal["relative", "log"] = Field(
        "relative", description="the scale loss per token: (scale / typical − 1)², or log(scale / typical)²"
    )
    scale_tail: ScaleTail | list[ScaleTail] | None = Field(
        None, description="a hinge on the tokens above ratio × the typical scale at every norm input (lnfree.removal.losses.massive)"
    )
    position0_tail: Position0Tail | list[Position0Tail] | None = Field(
        None, description="the same hinge on position 0 alone: pulls a massive first token in before its own σ "
        "(removal.special_pos0) is faded out"
    )
    position0_mlp: Position0Mlp | list[Position0Mlp] | None = Field(
        None, description="pull what position 0's own MLPs write towards zero, so that its σ can fade at the "
        "MLP-input norms without its MLPs running away (lnfree.removal.losses.position0_mlp)"
    )
    neuron_range: NeuronRange | list[NeuronRange] | None = Field(
        None, description="a hinge on every MLP neuron's activation above ratio × its largest in the original "
        "(measured on the distillation teacher: needs distill_alpha > 0; lnfree.removal.losses.neuron_range)"
    )
    neuron_gain: NeuronGain | list[NeuronGain] | None = Field(
        None, description="a bound, in weight space, on every MLP neuron's gain (|gate|·|up|·(1 + |cos|)/2·|down|, the "
        "input norm's weight folded in) above ratio × its block's median: bounds what a neuron can write for an "
        "input of any size, on every token (lnfree.removal.losses.gain)"
    )
    stability_margin: StabilityMargin | list[StabilityMargin] | None = Field(
        None, description="in a forward of its own over a few of each micro-batch's sequences, one token's residual "
        "scaled up at one block and its growth downstream hinged (lnfree.removal.losses.margin); None is off"
    )
    local_growth: LocalGrowth | list[LocalGrowth] | None = Field(
        None, description="a hinge on each MLP sublayer's growth factor for a token scaled by `factor` (its norms "
        "as fixed, every block, a few tokens of each micro-batch; lnfree.removal.losses.growth); None is off"
    )
    attention_kl: AttentionKl | list[AttentionKl] | None = Field(
        None, description="KL from the teacher's attention rows to the model's, every head and block: keeps the "
        "attention sink that fixed key norms break (needs distill_alpha > 0; lnfree.removal.losses.attention)"
    )
    coverage: Coverage | list[Coverage] | None = Field(
        None, description="generated rows of random and repeated ids beside each micro-batch, trained towards the "
        "teacher and within the text's typical scale at every norm input (lnfree.removal.losses.coverage; a list: "
        "settings by start); None is off"
    )
    distill_alpha: float = Field(
        0.0, ge=0, le=1, description="distillation to the original model (or train.teacher): loss = (1 − α)·CE + "
        "α·T²·KL(teacher ‖ student) per token; 0 is off"
    )
    distill_temperature: float = Field(1.0, gt=0, description="softmax temperature T of the distillation term")
    teacher: str | None = Field(
        None, description="the distillation teacher, a model with real norms and the run's vocabulary: a model name, "
        "Hub id or directory, or a vanilla run folder (its newest checkpoint) or checkpoint; None: the run's own "
        "model (the original). neuron_range and attention_kl read it too"
    )
    teacher_start: int = Field(
        0, ge=0, description="the step from which train.teacher teaches; the original teaches before it (a branch "
        "switches teachers from its checkpoint on; neuron_range's ranges stay the first teacher's)"
    )
    teacher_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="the frozen teacher's weights (auto: bf16 on a bf16-capable GPU, else fp32)"
    )
    chunked_vocab_loss: int | None = Field(
        None, ge=1, description="tokens per chunk of a fused CE + distillation KL computed straight from the final "
        "hidden states and the head, its gradient taken in the same pass (lnfree.removal.losses.vocab_loss): no logits tensor of "
        "the whole micro-batch, the same loss; None: the plain loss on the model's logits"
    )
    compile_vocab_loss: bool | Literal["auto"] = Field(
        "auto", description="compile the per-chunk CE + KL over the vocabulary and its gradient into fused kernels "
        "(torch.compile; lnfree.removal.losses.vocab_loss): fewer passes over the logits, the same values to rounding. "
        "auto: on a CPU with a large vocabulary (vocab_loss.COMPILE_VOCABULARY: Gemma 3, Qwen), where those passes are "
        "a large part of a step; a compile that fails falls back to the eager kernels with a warning"
    )
    sigma_momentum: float = Field(0.9, ge=0, lt=1, description="EMA momentum per `sigma_momentum_sequences`")
    sigma_momentum_sequences: int = Field(32, ge=1)
    sigma_init_batches: int = Field(8, ge=1, description="micro-batches in the initial σ measurement")
    dropout: float | None = Field(
        0.0, ge=0, le=1, description="every dropout probability during fine-tuning; None keeps the model's own "
        "(P25 kept GPT-2's 0.1, as the GPT-2 presets do)"
    )
    seed: int = 0
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    auto_cpu_bf16: bool = Field(
        False, description="let mixed_precision and teacher_dtype 'auto' choose bf16 on a CPU with native bf16 "
        "(avx512_bf16 or AMX, lnfree.removal.precision) too: on in the modern models' presets and for a model "
        "without a preset; off in the tiny and GPT-2 presets, whose runs then compute alike on CPUs with and without it"
    )
    cpu_fp32_attention: bool = Field(
        True, description="under a CPU's bf16 autocast, attention in fp32 at short contexts and head sizes, where "
        "PyTorch's bf16 kernel is the slower one (lnfree.removal.precision.attention_in_fp32)"
    )
    gradient_checkpointing: bool = False
    compile: bool = Field(False, description="torch.compile every block (one graph per state of its norms)")
    steady_allocator: bool = Field(
        True, description="on a CPU, keep freed memory in glibc's heap instead of returning it to the kernel "
        "(lnfree.removal.runtime): large-vocabulary steps stop page-faulting their logits in again"
    )
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int | None = Field(
        None, ge=1, description="keep only the newest N complete checkpoints (a big model's are GBs each); None: all"
    )
    keep_steps: list[int] = Field(
        [], description="checkpoints saved at these steps too, which keep_checkpoints never prunes: branch points "
        "for pilots (a run may resume with other steps)"
    )
    eval_every: int = Field(0, ge=0, description="held-out CE every N steps (0: start and end only)")
    log_every: int = Field(10, ge=1)
    report_to: list[Literal["wandb", "tensorboard"]] = []

    @model_validator(mode="after")
    def _lr_order(self) -> TrainConfig:
        if self.min_learning_rate > self.learning_rate:
            raise ValueError("min_learning_rate must not exceed learning_rate")
        for name in STEP_LOSSES:
            check_pieces(getattr(self, name), name)
        if self.neuron_range is not None and self.distill_alpha == 0:
            raise ValueError("train.neuron_range measures each neuron's range on the distillation teacher: set "
                             "train.distill_alpha > 0")
        if self.teacher is not None and self.distill_alpha == 0:
            raise ValueError("train.teacher is the distillation teacher: it needs train.distill_alpha > 0")
        if self.teacher_start > 0 and self.teacher is None:
            raise ValueError("train.teacher_start is the step from which train.teacher teaches: set train.teacher")
        if self.attention_kl is not None and self.distill_alpha == 0:
            raise ValueError("train.attention_kl compares with the distillation teacher's attention: set "
                             "train.distill_alpha > 0")
        return self

    def teacher_at(self, step: int) -> str | None:
        """The distillation teacher at `step`: `teacher` from `teacher_start` on, else None (the original)."""
        return self.teacher if step >= self.teacher_start else None

    def saves_after(self, done: int) -> bool:
        """Whether a run saves a checkpoint after `done` steps, before its end (which always saves one): every
        `save_every` steps, and at each of `keep_steps`."""
        every = self.save_every > 0 and done % self.save_every == 0
        return done < self.max_steps and (every or done in self.keep_steps)


class RemovalConfig(_Strict):
    """What to remove and when. `vanilla` runs the control: the same training, nothing removed."""

    mode: Literal["remove", "vanilla"] = "remove"
    schedule: Schedule | None = Field(None, description="default: derived from the model's depth")
    special_pos0: bool = False
    special_pos0_per_head: bool = Field(
        False, description="with special_pos0, give the per-head q/k norms their own position-0 σ too (faded with the "
        "others by the pos0_special stage): Gemma 3 270M's BOS key is 0.2–0.8× the other tokens' before k_norm"
    )
    special_pos0_span: int = Field(
        1, ge=1, description="with special_pos0, the leading positions that position 0's σ covers (1: position 0 "
        "alone; 2: the token after the sink too, which some models make a second sink). A frozen σ_pos0 is one value "
        "for all of them, so a span above 1 is meant with the pos0_real stage (each token its own real scale)"
    )
    special_eot: bool = False
    blend_steps: int = Field(
        0, ge=0, description="gradual removal: steps over which each norm moves from its real per-token scale to "
        "its frozen σ (0 or 1: an instant switch)"
    )
    adaptive: Adaptive | None = Field(None, description="time removals by the training loss instead of fixed gaps")
    massive_neurons: MassiveNeurons | None = Field(
        None, description="first damp out the MLP neurons that write massive activations (lnfree.removal.losses.massive)"
    )
    scale_ceiling: ScaleCeiling | None = Field(
        None, description="while training, no token leaves a fixed norm above ratio × σ (lnfree.fixedscale.ceiling)"
    )

    @model_validator(mode="after")
    def _per_head_pos0(self) -> RemovalConfig:
        if self.special_pos0_per_head and not self.special_pos0:
            raise ValueError("removal.special_pos0_per_head needs removal.special_pos0")
        if self.special_pos0_span > 1 and not self.special_pos0:
            raise ValueError("removal.special_pos0_span needs removal.special_pos0")
        return self


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


def _problem(error: dict) -> str:
    where = ".".join(str(part) for part in error["loc"]) or "config"
    got = error.get("input")
    shown = "" if isinstance(got, (dict, list)) or error["type"] == "missing" else f" (got {got!r})"
    return f"{where}: {error['msg'].removeprefix('Value error, ')}{shown}"


def validate_config(data: dict, where: str = "config") -> RunConfig:
    """`RunConfig` from plain data; a `ConfigError` naming every bad field in one line."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(_problem(e) for e in err.errors(include_url=False))
        raise ConfigError(f"invalid {where}: {problems}") from None


def load_preset(name: str) -> RunConfig:
    """The shipped preset `name` (e.g. 'gpt2', 'gpt2-xl', 'tiny')."""
    path = resources.files("lnfree") / "presets" / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(preset_names())}")
    return validate_config(tomllib.loads(path.read_text()), f"preset {name!r}")


def load_config(path: str | Path) -> RunConfig:
    """A run config from a TOML or JSON file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except ValueError as err:  # JSONDecodeError and TOMLDecodeError
        raise ConfigError(f"cannot parse {path}: {err}") from None
    return validate_config(data, str(path))


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
                raise ConfigError(f"override {item!r} is not of the form key=value")
            pairs[key.strip()] = _parse_value(raw)
        overrides = pairs
    data = config.model_dump()
    for key, value in overrides.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise ConfigError(_unknown_key(key, data))
            node = node[part]
        if leaf not in node:
            raise ConfigError(_unknown_key(key, data))
        node[leaf] = value
    return validate_config(data)


def _dotted_keys(data: dict, prefix: str = "") -> list[str]:
    keys = []
    for name, value in data.items():
        keys.append(prefix + name)
        if isinstance(value, dict):
            keys += _dotted_keys(value, f"{prefix}{name}.")
    return keys


def _unknown_key(key: str, data: dict) -> str:
    import difflib

    close = difflib.get_close_matches(key, _dotted_keys(data), n=1, cutoff=0.6)
    return f"unknown config key {key!r}" + (f"; did you mean {close[0]!r}?" if close else "")
