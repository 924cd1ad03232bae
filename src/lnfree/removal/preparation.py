"""The model and optimiser a run trains: the fixed-scale norms installed (a removal run), dropout,
activation checkpointing and compiled blocks (`prepare_model`, `compile_blocks`), the distillation
teacher, the mixed-precision autocast (`autocast_factory`) and its attention (`choose_attention`), a frozen
token embedding (`freeze_token_embedding`) and the optimiser (`make_optimizer`: AdamW, or Muon with AdamW).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from lnfree.fixedscale import surgery
from lnfree.arch import architecture
from lnfree.removal.config import ConfigError, RunConfig
from lnfree.removal.losses.distill import load_teacher
from lnfree.removal.muon import MuonWithAdamW, muon_matrices
from lnfree.removal.runtime import allow_recompiles
from lnfree.removal.precision import attention_in_fp32, auto_bf16, cpu_has_native_bf16, use_fp32_attention

logger = logging.getLogger("lnfree")


def prepare_model(model: nn.Module, config: RunConfig, eot_token_id: int, device: torch.device, precision: str,
                  context: int, auto: bool | None = None) -> nn.Module | None:
    """Install the fixed-scale norms (a removal run), set dropout, checkpointing and compilation, choose the
    attention for the run's autocast `precision` at `context` tokens (`choose_attention`), and move `model` to
    `device`; return the distillation teacher (None without distillation; `auto` as in `autocast_factory`)."""
    removal, train = config.removal, config.train
    if removal.mode == "remove":
        surgery.install(model, special_pos0=removal.special_pos0, per_head_pos0=removal.special_pos0_per_head,
                        pos0_span=removal.special_pos0_span, special_eot=removal.special_eot,
                        eot_token_id=eot_token_id)
    if train.dropout is not None:
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = train.dropout
    teacher = (run_teacher(config, train.teacher_at(0) or config.model, model, device, precision, context, auto)
               if train.distill_alpha > 0 else None)
    choose_attention(config, device, precision, context, architecture(model).head_dim, model)
    if train.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    if train.compile:
        compile_blocks(model)
    return teacher


def run_teacher(config: RunConfig, name: str, model: nn.Module, device: torch.device, precision: str, context: int,
                auto: bool | None = None) -> nn.Module:
    """The frozen distillation teacher `name` of a run training `model` (`load_teacher`; `precision`, `context`
    and `auto` as in `prepare_model`), its attention chosen as the student's; refused unless its vocabulary is
    the model's."""
    train = config.train
    teacher = load_teacher(name, device, train.teacher_dtype, train.auto_cpu_bf16, auto)
    if teacher.config.vocab_size != model.config.vocab_size:
        raise ConfigError(f"the teacher {name} has a vocabulary of {teacher.config.vocab_size} tokens, "
                          f"the model {model.config.vocab_size}: distillation compares the two per token id")
    choose_attention(config, device, precision, context, architecture(model).head_dim, teacher)
    return teacher


def compile_blocks(model: nn.Module, **options) -> None:
    """`torch.compile` every block of `model` in place (state-dict keys and hooks unchanged); `options`
    go to `torch.compile`.

    Blocks share graphs: there is one per state of a block's norms (real, fixed, train/eval), not
    one per block. Each graph is guarded on the norms' Python mirrors, so switching a slot
    compiles (or reuses) the graph of the new state and never runs a stale one.
    """
    allow_recompiles()
    for block in model.get_submodule(architecture(model).layers):
        block.compile(**options)


def autocast_factory(config: RunConfig, device: torch.device, auto: bool | None = None):
    """(a function returning the run's autocast context, the precision it resolved to: "bf16",
    "fp16" or "no"); `train.mixed_precision = "auto"` is bf16 where `lnfree.removal.precision.auto_bf16` says
    (a GPU that supports it; a CPU with native bf16 under `train.auto_cpu_bf16`), else none; or, given `auto`,
    where that is True: a resumed run keeps what `auto` chose at its start, on whatever machine it goes on."""
    choice = config.train.mixed_precision
    if choice == "auto":
        choice = "bf16" if (auto_bf16(device, config.train.auto_cpu_bf16) if auto is None else auto) else "no"
    if choice == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        logger.warning("train.mixed_precision = bf16 on a CPU without native bf16 (avx512_bf16 or AMX): emulated, "
                       "likely slower than fp32")
    if choice == "no":
        return contextlib.nullcontext, "no"
    dtype = torch.bfloat16 if choice == "bf16" else torch.float16
    return (lambda: torch.autocast(device.type, dtype=dtype)), choice


def choose_attention(config: RunConfig, device: torch.device, precision: str, context: int, head_dim: int,
                     *models: nn.Module | None) -> None:
    """`train.cpu_fp32_attention`: switch `models` (the student, the teacher or None) to fp32 attention where
    `lnfree.removal.precision.attention_in_fp32` says it is the faster under the run's autocast."""
    if config.train.cpu_fp32_attention and attention_in_fp32(device, precision, context, head_dim):
        use_fp32_attention(*models)
        logger.info("attention in fp32 under the CPU's bf16 autocast at %d-token contexts (train.cpu_fp32_attention)",
                    context)


def freeze_token_embedding(model: nn.Module) -> None:
    """`train.freeze_embeddings`: no gradient for the token embedding (nor a head tied to it)."""
    model.get_submodule(architecture(model).token_embedding).weight.requires_grad_(False)


def make_optimizer(model: nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on biases, norm weights or embeddings' biases), fused
    under `train.fused_optimizer`; under `train.optimizer = "muon"` the hidden matrices take Muon instead."""
    train = config.train
    params = [p for p in model.parameters() if p.requires_grad]
    muon = muon_matrices(model, params) if train.optimizer == "muon" else []
    if train.optimizer == "muon" and not muon:
        raise ValueError("train.optimizer = 'muon' found no trained 2-D weight matrix besides embeddings and head")
    taken = {id(p) for p in muon}
    decay = [p for p in params if p.dim() >= 2 and id(p) not in taken]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = train.fused_optimizer or None
    if muon:
        return MuonWithAdamW(muon, groups, lr=train.learning_rate, weight_decay=train.weight_decay,
                             betas=train.betas, fused=fused)
    return torch.optim.AdamW(groups, lr=train.learning_rate, betas=train.betas, fused=fused)


def lr_scales(optimizer: torch.optim.Optimizer, config: RunConfig) -> list[float]:
    """Each of the optimiser's parameter groups' factor on the run's learning rate: `train.vector_lr_scale` for a
    group of 1-D parameters only, else 1 (read from the parameters, so a resumed optimiser's groups agree)."""
    return [config.train.vector_lr_scale if group["params"] and all(p.dim() < 2 for p in group["params"]) else 1.0
            for group in optimizer.param_groups]
