"""Distillation to the original model: a frozen teacher and the per-token KL term of the loss.

The teacher is the run's starting checkpoint with every norm real, loaded afresh (so a resumed
run rebuilds the same teacher), in eval mode and without gradients; or, with `train.teacher`, another
model with real norms and the same vocabulary (for example a vanilla run's model, fine-tuned on the same text). It runs under the same
autocast as the student on the same micro-batch. Memory: the teacher adds one copy of the weights
(in bf16 where `auto` means bf16, `lnfree.removal.precision`: 3.1 GB for GPT-2 XL) and one logits tensor per
micro-batch; the KL and the CE beside it are computed in chunks of tokens so that their fp32 temporaries stay small (with
`train.chunked_vocab_loss`, `lnfree.removal.losses.vocab_loss`, no full logits tensor at all). Under DDP every process
holds a full teacher; under FSDP too (it is not sharded).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from lnfree.errors import LnfreeError
from lnfree.models.base import load_base
from lnfree.removal.layout import RUN_CONFIG, TRAINER_STATE, latest_checkpoint
from lnfree.removal.precision import auto_bf16

#: The label of a position without a next token (transformers' and PyTorch's ignore index).
IGNORE = -100

#: Tokens per chunk of the CE and KL computation (bounds their fp32 temporaries to chunk × vocabulary).
KL_CHUNK_TOKENS = 2048


def resolve_teacher_dtype(choice: str, bf16_capable: bool) -> torch.dtype:
    """The teacher's weight dtype for `train.teacher_dtype` = `choice`: `auto` is bf16 where the
    device computes in bf16 (`bf16_capable`: `lnfree.removal.precision.auto_bf16`), fp32 elsewhere."""
    if choice == "auto":
        return torch.bfloat16 if bf16_capable else torch.float32
    return torch.bfloat16 if choice == "bf16" else torch.float32


def teacher_dtype(choice: str, device: torch.device, cpu_bf16: bool = False, auto: bool | None = None) -> torch.dtype:
    """`resolve_teacher_dtype` on `device` (bf16-capable: `lnfree.removal.precision.auto_bf16`, `cpu_bf16` its
    CPU opt-in `train.auto_cpu_bf16`; or `auto`, the choice a resumed run started with)."""
    return resolve_teacher_dtype(choice, auto_bf16(device, cpu_bf16) if auto is None else auto)


class TeacherError(LnfreeError, ValueError):
    """A distillation teacher that cannot serve (fixed norms, no checkpoint)."""


def vanilla_checkpoint(source: str) -> Path | None:
    """The checkpoint folder `source` names when it is an lnfree run (its newest checkpoint) or one of a run's
    checkpoints; None for anything else. A run that fixes norms is refused: a teacher's norms are real."""
    path = Path(source)
    run, checkpoint = ((path, latest_checkpoint(path)) if (path / RUN_CONFIG).is_file()
                       else (path.parent.parent, path) if (path / TRAINER_STATE).is_file() else (None, None))
    if run is None:
        return None
    if checkpoint is None:
        raise TeacherError(f"the run {source} has no complete checkpoint to distil from")
    if json.loads((run / RUN_CONFIG).read_text())["removal"]["mode"] != "vanilla":
        raise TeacherError(f"{source} is a removal run: its model has fixed norms. A teacher has real norms: "
                           "give a vanilla run (lnfree remove --mode vanilla), a model name or a model directory")
    return checkpoint


def load_teacher(model: str, device: torch.device, dtype_choice: str = "auto", cpu_bf16: bool = False,
                 auto: bool | None = None) -> nn.Module:
    """The frozen teacher `model` (every norm real) on `device`, for distillation (`teacher_dtype`): a model
    lnfree loads by name, Hub id or directory, or a vanilla run (`vanilla_checkpoint`)."""
    checkpoint = vanilla_checkpoint(model)
    teacher = (AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32) if checkpoint is not None
               else load_base(model)[0])
    teacher.eval().requires_grad_(False)
    return teacher.to(device=device, dtype=teacher_dtype(dtype_choice, device, cpu_bf16, auto))


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over tokens of T²·KL(softmax(teacher/T) ‖ softmax(student/T)), in fp32.

    The T² factor keeps the gradient's scale independent of the temperature (Hinton et al. 2015).
    """
    return ce_and_kl_to_teacher(student_logits, teacher_logits, None, temperature)[1]


def ce_and_kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor | None,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE, `kl_to_teacher`) of the student's logits in fp32 chunks of tokens: CE the mean over the
    positions whose `labels` (each position's next token, `IGNORE` where none) are not `IGNORE`, as
    transformers computes it (zero without `labels`). The plain autograd definition: a run's loss takes
    the same value and gradient from `lnfree.removal.losses.vocab_loss.logits_loss`, which computes one
    softmax per distribution and the gradient in the same pass (over Gemma 3 270M's 262,144-token
    vocabulary, the passes over the logits are a large part of a CPU step)."""
    vocab = student_logits.shape[-1]
    student = student_logits.reshape(-1, vocab)
    teacher = teacher_logits.detach().reshape(-1, vocab)
    chunks = [student.split(KL_CHUNK_TOKENS), teacher.split(KL_CHUNK_TOKENS)]
    if labels is not None:
        chunks.append(labels.reshape(-1).split(KL_CHUNK_TOKENS))
    ce_sum = student.new_zeros((), dtype=torch.float32)
    kl_sum = student.new_zeros((), dtype=torch.float32)
    for s, t, *y in zip(*chunks):
        s = s.float()
        log_q = F.log_softmax(s if temperature == 1 else s / temperature, dim=-1)
        log_p = F.log_softmax(t.float() if temperature == 1 else t.float() / temperature, dim=-1)
        kl_sum = kl_sum + F.kl_div(log_q, log_p, log_target=True, reduction="sum")
        if y:
            log_probs = log_q if temperature == 1 else F.log_softmax(s, dim=-1)
            ce_sum = ce_sum + F.nll_loss(log_probs, y[0], ignore_index=IGNORE, reduction="sum")
    ce = ce_sum / (labels != IGNORE).sum() if labels is not None else ce_sum
    return ce, kl_sum * temperature**2 / student.shape[0]
