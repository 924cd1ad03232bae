"""Memory plan: predicted peak memory per GPU of a removal run, and the micro-batch / checkpointing that fit.

The prediction adds, per GPU:
- persistent state: fp32 master weights (4 B/parameter), AdamW's two moments (8 B), fp32
  gradients (4 B, held across micro-batches by gradient accumulation), DDP's gradient buckets
  (4 B, when more than one process), the last three only for trained parameters
  (`freeze_embeddings` leaves the token embedding out) and, under bf16/fp16 autocast, the 16-bit copies of the
  matrix weights that autocast makes and the backward keeps (2 B per matrix parameter);
  FSDP (`sharded`) divides the first four by the number of GPUs;
- activations of one micro-batch kept for the backward, counted per token and layer from the
  tensors each block saves (`activation_bytes_per_token`), or, with activation checkpointing,
  each block's input;
- the largest transient of the backward on top of them (`backward_peak`): the cross-entropy over
  the vocabulary at its start (log-probabilities, their gradient and the logits' gradient, fp32:
  12 B per token and vocabulary entry) or, with checkpointing, one block recomputed with its
  backward's working gradients, whichever is larger;
- the distillation teacher, if any (`lnfree.removal.losses.distill`): its parameters (frozen, bf16 on a GPU by
  default) and its logits, kept through the student's forward (the KL beside the CE runs in chunks of
  tokens, within the CE's transient; measured on an H200, GPT-2 small distilled peaked 1.8 GB above the
  same run without a teacher, where weights and logits count 3.5 GB: `benchmarks/results/gpu/`);
- the per-token scales real norms gathered for σ and not yet summed (`ScaleState.gather`): fewer
  than `FOLD_ELEMENTS` per scale state (4 B each);
- a fixed reserve for the CUDA context and allocator fragmentation (`reserve_gb`).
`benchmarks/memory_plan.py` checks the formula against measured peaks on CPU at small shapes, and
`benchmarks/gpu_presets.py` against the GPT-2 presets on a GPU (`--replan` re-predicts its recorded runs).
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from lnfree.arch import architecture
from lnfree.arch.gpt2 import published_config
from lnfree.removal.config import load_preset
from lnfree.removal.losses.distill import resolve_teacher_dtype
from lnfree.fixedscale.state import FOLD_ELEMENTS
from lnfree.models.base import load_config
from lnfree.errors import UsageError

GB = 1e9
#: Share of a GPU's memory a plan may fill: the rest absorbs allocator fragmentation.
USABLE = 0.9


class ModelShape(BaseModel):
    """What the memory of a run depends on: sizes of a causal LM of a supported family."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    family: str
    layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    intermediate: int = Field(ge=1)
    block_fp32: int = Field(ge=0, description="elements per token a block keeps in fp32 for its backward")
    block_low: int = Field(ge=0, description="… and in the autocast dtype (`Architecture.block_activations`)")
    vocab: int = Field(ge=1)
    scale_states: int = Field(1, ge=1, description="the norms' scale states once installed (`lnfree.fixedscale.surgery`)")
    parameters: int = Field(ge=1, description="every parameter (tied ones once)")
    matrix_parameters: int = Field(ge=0, description="parameters of matmul weights (autocast copies them)")
    embedding_parameters: int = Field(0, ge=0, description="the token embedding's (`train.freeze_embeddings` freezes it)")


class Teacher(BaseModel):
    """A frozen copy of the model used for distillation: parameters only, in `bytes_per_parameter`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    parameters: int = Field(ge=1)
    bytes_per_parameter: int = Field(2, ge=1, description="2 for a bf16 teacher, 4 for fp32")


class Setup(BaseModel):
    """How a run is laid out on its GPUs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    context: int = Field(ge=1)
    micro_batch: int = Field(ge=1)
    checkpointing: bool = False
    autocast: bool = True  # bf16 / fp16 autocast over fp32 master weights
    gpus: int = Field(1, ge=1)
    sharded: bool = False  # FSDP full shard (else DDP replicas)
    dropout: bool = True
    freeze_embeddings: bool = False  # the token embedding (and a head tied to it) gets no gradient or optimiser state
    reserve_gb: float = Field(2.0, ge=0, description="CUDA context and allocator fragmentation")


class Prediction(BaseModel):
    """Predicted peak bytes per GPU, by component."""

    weights: float
    optimizer: float
    gradients: float
    buckets: float
    autocast_copies: float
    activations: float
    backward_peak: float
    teacher: float
    statistics: float
    reserve: float

    @property
    def total(self) -> float:
        """The predicted peak, bytes."""
        return sum(self.model_dump().values())

    def line(self) -> str:
        """A one-line breakdown."""
        parts = ", ".join(f"{k} {_size(v)}" for k, v in self.model_dump().items() if v)
        return f"{_size(self.total)} ({parts})"


def _size(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:.1f} MB"


def model_shape(config) -> ModelShape:
    """The shape of a transformers causal-LM config of a supported family (its adapter's answers), with
    parameter counts from a meta-device model."""
    from transformers import AutoModelForCausalLM

    arch = architecture(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    unique = {id(p): p for p in model.parameters()}.values()
    matrices = sum(m.weight.numel() for m in model.modules()
                   if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")
    fp32, low = arch.block_activations()
    return ModelShape(
        family=arch.family, layers=arch.n_layers, hidden=arch.hidden, intermediate=arch.intermediate,
        block_fp32=fp32, block_low=low, vocab=config.vocab_size, scale_states=sum(len(s.slots) for s in arch.sites()),
        parameters=sum(p.numel() for p in unique), matrix_parameters=matrices,
        embedding_parameters=model.get_input_embeddings().weight.numel(),
    )


def activation_bytes_per_token(shape: ModelShape, autocast: bool, dropout: bool) -> tuple[float, float]:
    """(bytes one block saves for its backward, bytes of its input) per token: the elements its family's
    adapter counts (`Architecture.block_activations`), the autocast ones in 2 bytes, plus dropout masks."""
    masks = 2 * shape.hidden if dropout else 0
    return shape.block_fp32 * 4 + shape.block_low * (2 if autocast else 4) + masks, 4 * shape.hidden


def predict(shape: ModelShape, setup: Setup, teacher: Teacher | None = None) -> Prediction:
    """Predicted peak memory per GPU of one removal run (see the module docstring)."""
    shard = setup.gpus if setup.sharded else 1
    p = shape.parameters
    tokens = setup.micro_batch * setup.context
    block, block_input = activation_bytes_per_token(shape, setup.autocast, setup.dropout)
    cross_entropy = 12 * tokens * shape.vocab
    if setup.checkpointing:
        activations = tokens * shape.layers * block_input
        working = 4 * (2 * shape.hidden + shape.intermediate)  # fp32 gradients flowing through the block
        backward_peak = max(cross_entropy, tokens * (block + working))
    else:
        activations = tokens * shape.layers * block
        backward_peak = cross_entropy
    teacher_bytes = 0.0
    if teacher is not None:
        act = 2 if setup.autocast else 4
        teacher_bytes = teacher.parameters * teacher.bytes_per_parameter + act * tokens * shape.vocab
    trained = p - (shape.embedding_parameters if setup.freeze_embeddings else 0)
    return Prediction(
        weights=4 * p / shard, optimizer=8 * trained / shard, gradients=4 * trained / shard,
        buckets=4 * trained / shard if setup.gpus > 1 and not setup.sharded else 0.0,
        autocast_copies=2 * shape.matrix_parameters / shard if setup.autocast else 0.0,
        activations=activations, backward_peak=backward_peak, teacher=teacher_bytes,
        statistics=4 * FOLD_ELEMENTS * shape.scale_states, reserve=setup.reserve_gb * GB,
    )


class Plan(BaseModel):
    """The chosen layout and its prediction."""

    setup: Setup
    prediction: Prediction
    gpu_memory_gb: float
    fits: bool  # the prediction is at most `USABLE` of the GPU's memory

    def describe(self) -> str:
        """One human-readable line."""
        s = self.setup
        verdict = "fits" if self.fits else "does NOT fit"
        return (f"memory plan: micro-batch {s.micro_batch} × {s.context} tokens, checkpointing "
                f"{'on' if s.checkpointing else 'off'}, {s.gpus} GPU(s){' FSDP' if s.sharded else ' DDP' if s.gpus > 1 else ''}"
                f" → peak {self.prediction.line()} per GPU; {verdict} in {self.gpu_memory_gb:g} GB")


def choose(
    shape: ModelShape, sequences_per_gpu: int, gpu_memory_gb: float, base: Setup, teacher: Teacher | None = None,
    max_micro_batch: int = 64,
) -> Plan:
    """The fastest layout that fits: the largest micro-batch (a divisor of the sequences per GPU
    and step) without checkpointing if it is at least 4 (or at least the checkpointed one), else
    the largest with checkpointing; the smallest checkpointed one if nothing fits. A layout fits
    when its predicted peak is at most `USABLE` of `gpu_memory_gb`."""
    limit = USABLE * gpu_memory_gb * GB
    divisors = [m for m in range(1, min(sequences_per_gpu, max_micro_batch) + 1) if sequences_per_gpu % m == 0]

    def best(checkpointing: bool) -> Setup | None:
        fitting = [m for m in divisors if predict(shape, base.model_copy(update={
            "micro_batch": m, "checkpointing": checkpointing}), teacher).total <= limit]
        return base.model_copy(update={"micro_batch": max(fitting), "checkpointing": checkpointing}) if fitting else None

    plain, checkpointed = best(False), best(True)
    if plain is not None and (checkpointed is None or plain.micro_batch >= min(4, checkpointed.micro_batch)):
        chosen = plain
    else:
        chosen = checkpointed or base.model_copy(update={"micro_batch": 1, "checkpointing": True})
    prediction = predict(shape, chosen, teacher)
    return Plan(setup=chosen, prediction=prediction, gpu_memory_gb=gpu_memory_gb, fits=prediction.total <= limit)


def config_of(model: str):
    """The transformers config of `model`: a published GPT-2 size (no Hub needed), else as
    `lnfree.models.base.load_config` finds it."""
    return published_config(model) or load_config(model)


def run_teacher(config, shape: ModelShape, gpu: bool) -> Teacher | None:
    """The distillation teacher a run config loads, if any (`lnfree.removal.losses.distill.teacher_dtype`'s choice)."""
    train = config.train
    if train.distill_alpha <= 0:
        return None
    dtype = resolve_teacher_dtype(train.teacher_dtype, bf16_capable=gpu)
    return Teacher(parameters=shape.parameters, bytes_per_parameter=dtype.itemsize)


def plan_run(config, shape: ModelShape, context: int, gpus: int, gpu_memory_gb: float, autocast: bool,
             sharded: bool = False) -> Plan:
    """The plan of a run config (`lnfree.removal.config.RunConfig`, its teacher included) on `gpus` GPUs of
    `gpu_memory_gb`."""
    train = config.train
    per_gpu, rest = divmod(train.tokens_per_step, context * gpus)
    if rest or per_gpu < 1:
        raise UsageError(f"tokens_per_step {train.tokens_per_step} is not a multiple of {gpus} GPU(s) × {context}")
    base = Setup(context=context, micro_batch=1, autocast=autocast, gpus=gpus, sharded=sharded,
                 dropout=bool(train.dropout), freeze_embeddings=train.freeze_embeddings)
    return choose(shape, per_gpu, gpu_memory_gb, base, run_teacher(config, shape, gpu=True))


def plan_preset(name: str, gpus: int = 1, gpu_memory_gb: float = 80.0, sharded: bool = False) -> Plan:
    """The plan of preset `name` on `gpus` GPUs of `gpu_memory_gb` (bf16 autocast)."""
    return plan_config(load_preset(name), gpus, gpu_memory_gb, sharded)


def plan_config(config, gpus: int = 1, gpu_memory_gb: float = 80.0, sharded: bool = False) -> Plan:
    """The plan of a run config on `gpus` GPUs of `gpu_memory_gb` (bf16 autocast), its context the
    config's or the model's."""
    model_config = config_of(config.model)
    context = config.data.context_length or architecture(model_config).n_positions
    return plan_run(config, model_shape(model_config), context, gpus, gpu_memory_gb, True, sharded=sharded)


def run_prediction(config, model_config, context: int, micro_batch: int, gpus: int, device: torch.device,
                   autocast: bool) -> Prediction:
    """The predicted peak per device of a run as configured, its teacher included (on a CPU without the
    GPU's reserve)."""
    shape = model_shape(model_config)
    setup = Setup(context=context, micro_batch=micro_batch, checkpointing=config.train.gradient_checkpointing,
                  autocast=autocast, gpus=gpus, dropout=bool(config.train.dropout),
                  freeze_embeddings=config.train.freeze_embeddings,
                  reserve_gb=Setup.model_fields["reserve_gb"].default if device.type == "cuda" else 0.0)
    return predict(shape, setup, run_teacher(config, shape, gpu=device.type == "cuda"))


def describe_run(config, model_config, context: int, micro_batch: int, gpus: int, device: torch.device,
                 autocast: bool) -> str:
    """The predicted peak of a run as configured (its teacher included), and on a GPU whether it
    fits (else what would)."""
    prediction = run_prediction(config, model_config, context, micro_batch, gpus, device, autocast)
    line = f"memory plan: predicted peak {prediction.line()} per device"
    if device.type != "cuda":
        return line
    memory_gb = torch.cuda.get_device_properties(device).total_memory / GB
    if prediction.total <= USABLE * memory_gb * GB:
        return f"{line}; fits in {memory_gb:.0f} GB"
    better = plan_run(config, model_shape(model_config), context, gpus, memory_gb, autocast)
    return f"{line}; may NOT fit in {memory_gb:.0f} GB. {better.describe()}"
