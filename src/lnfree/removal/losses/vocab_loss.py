"""The vocabulary terms of the loss, CE and the distillation KL, computed chunk by chunk straight from
the final hidden states and the head (`train.chunked_vocab_loss`): no logits tensor of a whole
micro-batch, neither the student's nor the teacher's.

`vocab_loss` returns w_ce·CE + w_kl·T²·KL(teacher ‖ student), the value of the plain loss (CE as
transformers computes it, the KL as `lnfree.removal.losses.distill.kl_to_teacher`), and takes its gradient with
respect to the hidden states and the head's weight in the same pass, as Liger Kernel's fused linear
cross-entropy does on a GPU: each chunk's logits are computed once (in the autocast dtype under
autocast, as the model's own head would), turned into fp32 log-probabilities, the loss and its
gradient, which is multiplied back through the head at once; the backward only scales the stored
gradients (so it runs once: no `retain_graph`). Nothing is recomputed: the head's matmuls are the
plain loss's three. Memory: a few chunk × vocabulary fp32 temporaries, plus the gradients of the
hidden states and (a trainable head) of the head's weight, held from the forward to the backward.
Each chunk passes once over the head's weight gradient, so where the head trains (not a tied head
under `train.freeze_embeddings`) chunks of a micro-batch's tokens or more are cheapest on a CPU.

`HeadInput` makes a model skip its own logits. The head's weight is read outside the forward, so
this does not run under FSDP (whose weights are whole only inside it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

from lnfree.errors import UsageError
from lnfree.removal.losses.distill import IGNORE


class HeadInput:
    """The input of `model`'s unembedding (`arch.unembedding`): the final hidden states, the final
    norm's output, kept from the latest forward run while `skipping()`, during which the head
    computes no logits (it returns an empty tensor)."""

    def __init__(self, model: nn.Module, arch):
        self.head = model.get_submodule(arch.unembedding)
        if getattr(self.head, "bias", None) is not None:
            raise UsageError("train.chunked_vocab_loss: this model's head has a bias, which the chunked loss omits")
        if getattr(model.config, "final_logit_softcapping", None) is not None:
            raise UsageError("train.chunked_vocab_loss: this model caps its logits (final_logit_softcapping), which "
                             "the chunked loss omits")
        self.value: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:
        """The head's weight (vocabulary × hidden)."""
        return self.head.weight

    def _keep(self, hidden: torch.Tensor) -> torch.Tensor:
        self.value = hidden
        return hidden.new_empty(*hidden.shape[:-1], 0)

    @contextlib.contextmanager
    def skipping(self, wrapper: nn.Module | None = None):
        """Within: the head keeps its input and computes no logits; `wrapper`: what the forward calls (refused
        when it shards the weights)."""
        if isinstance(wrapper, (FullyShardedDataParallel, FSDPModule)):
            raise UsageError("train.chunked_vocab_loss does not run under FSDP (the head's weight is sharded outside "
                             "the forward); turn it off")
        self.head.forward = self._keep
        try:
            yield
        finally:
            del self.head.forward


@dataclass(frozen=True)
class _Spec:
    """How `vocab_loss` weighs and splits its terms, and the dtypes of the heads' products."""

    ce_weight: float
    kl_weight: float
    temperature: float
    chunk: int
    dtype: torch.dtype  # of the student's head product
    teacher_dtype: torch.dtype | None


def head_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype a head of `weight` multiplies in here: autocast's where it is on, else the weight's."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def vocab_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None = None,
               teacher: tuple[torch.Tensor, torch.Tensor] | None = None, *, ce_weight: float = 1.0,
               kl_weight: float = 0.0, temperature: float = 1.0, chunk: int = 1024):
    """(ce_weight·CE + kl_weight·T²·KL, CE, KL) of the logits `hidden` @ `weight`ᵀ, `chunk` tokens at a
    time; CE and KL detached, each zero where it is off. `hidden` (…, d): final hidden states;
    `weight` (V, d): the head's; `labels` (…): each position's next token, `IGNORE` where none (CE off
    without); `teacher`: the frozen teacher's (hidden states, head weight) on the same tokens (KL off
    without). CE is the mean over labelled positions, KL the mean over all (`kl_to_teacher`)."""
    if labels is None and teacher is None:
        zero = hidden.new_zeros((), dtype=torch.float32)
        return zero, zero, zero
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = None if labels is None else labels.reshape(-1)
    if teacher is not None:
        teacher = (teacher[0].reshape(-1, teacher[0].shape[-1]).detach(), teacher[1].detach())
    spec = _Spec(ce_weight, kl_weight, temperature, chunk, head_dtype(weight),
                 None if teacher is None else head_dtype(teacher[1]))
    return _FusedVocabLoss.apply(hidden, weight, labels, teacher, spec, torch.is_grad_enabled())


class _FusedVocabLoss(torch.autograd.Function):
    """`vocab_loss` with its gradients taken in the forward (`_fused`); the backward scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, teacher, spec, grad_enabled):
        needs = (grad_enabled and hidden.requires_grad, grad_enabled and weight.requires_grad)
        with torch.autocast(hidden.device.type, enabled=False):
            loss, ce, kl, ctx.grads = _fused(hidden, weight, labels, teacher, spec, needs)
        ctx.mark_non_differentiable(ce, kl)
        return loss, ce, kl

    @staticmethod
    def backward(ctx, grad_loss, _ce, _kl):
        grads, ctx.grads = ctx.grads, None
        scaled = [None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads]
        return (*scaled, None, None, None, None)


def _fused(hidden, weight, labels, teacher, spec: _Spec, needs: tuple[bool, bool]):
    """(loss, CE, KL, (d loss / d hidden, d loss / d weight)): the chunk loop of `vocab_loss`."""
    tokens, zero = hidden.shape[0], hidden.new_zeros((), dtype=torch.float32)
    ce_sum, kl_sum = zero, zero
    labelled = zero if labels is None else (labels != IGNORE).sum().float()
    scales = (None if labels is None else spec.ce_weight / labelled,  # the factors of d loss / d logits
              spec.kl_weight * spec.temperature / tokens)
    w = weight.detach().to(spec.dtype)
    t_w = None if teacher is None else teacher[1].to(spec.teacher_dtype)
    grad_h = torch.zeros_like(hidden) if needs[0] else None
    grad_w = None
    for start in range(0, tokens, spec.chunk):
        rows = slice(start, start + spec.chunk)
        h = hidden[rows].detach().to(spec.dtype)
        logits = F.linear(h, w).float()
        target = None if teacher is None else F.linear(teacher[0][rows].to(spec.teacher_dtype), t_w).float()
        ce, kl, grad = _chunk_terms(logits, None if labels is None else labels[rows], target, spec.temperature,
                                    scales if any(needs) else None)
        ce_sum, kl_sum = ce_sum + ce, kl_sum + kl
        if grad is None:
            continue
        grad = grad.to(spec.dtype)
        if grad_h is not None:
            grad_h[rows] = grad @ w
        if needs[1]:
            grad_w = _accumulate(grad_w, grad, h, weight.dtype)
    ce = ce_sum / labelled if labels is not None else zero
    kl = kl_sum * spec.temperature**2 / tokens if teacher is not None else zero
    return spec.ce_weight * ce + spec.kl_weight * kl, ce, kl, (grad_h, grad_w)


def _accumulate(total: torch.Tensor | None, grad: torch.Tensor, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`total` + gradᵀ·h, the head weight's gradient over the chunks so far, in `dtype`."""
    if total is None:
        return (grad.T @ h).to(dtype)
    if grad.dtype == dtype:
        return total.addmm_(grad.T, h)
    return total.add_(grad.T @ h)


def _chunk_terms(logits: torch.Tensor, labels: torch.Tensor | None, target: torch.Tensor | None, temperature: float,
                 scales: tuple | None):
    """(CE sum, KL sum, d loss / d logits or None) of one chunk's fp32 `logits`; `target`: the teacher's
    fp32 logits; `scales`: the factors of the CE and KL gradients (None: no gradient)."""
    ce = kl = logits.new_zeros(())
    grad = log_q = None
    if labels is not None:
        log_probs = F.log_softmax(logits, -1)
        ce = F.nll_loss(log_probs, labels, ignore_index=IGNORE, reduction="sum")
        log_q = log_probs if temperature == 1 else None
        if scales is not None:  # (softmax − one-hot) on the labelled rows
            grad = log_probs.exp().scatter_add_(1, labels.clamp(min=0)[:, None], -logits.new_ones(len(labels), 1))
            grad.mul_(((labels != IGNORE).float() * scales[0])[:, None])
    if target is not None:
        if log_q is None:
            log_q = F.log_softmax(logits / temperature, -1)
        log_p = F.log_softmax(target / temperature, -1)
        kl = F.kl_div(log_q, log_p, log_target=True, reduction="sum")
        if scales is not None:  # T²·d KL / d logits = T·(q − p)
            step = log_q.exp_()  # log_q (or the CE's log_probs it may be) is not needed again
            step.sub_(log_p.exp_()).mul_(scales[1])
            grad = step if grad is None else grad.add_(step)
    return ce, kl, grad
