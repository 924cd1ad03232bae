"""Which token ids run away when repeated: a short repeated-id sweep over a whole vocabulary.

`lnfree stress` probes a few hundred repeated ids at the full context with every logit; a 262,144-id
vocabulary would take hours that way. A runaway on a repeated id shows within a few repeats (on the
Gemma 3 270M LN-free checkpoints measured, the ids that overflow at 64 tokens already do at 6–8), and
the overflow measure reads only the residual stream, so this sweep runs BOS and the id repeated to a
short context through the model's body alone (no head: Gemma's 640 × 262,144 unembedding is most of
its forward) and records per id its largest residual norm over the model's envelope
(`lnfree.evaluate.stress.envelope`; inf where a value is non-finite). An id overflows above
`OVERFLOW_RATIO`, as in `stress`.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from lnfree.evaluate.stress import repeated_sequences, residual_norms, residual_stream

#: Tokens per swept row (BOS included): long enough for the runaways seen at 64 tokens.
SWEEP_CONTEXT = 8


def repeated_sweep(model: torch.nn.Module, ids: torch.Tensor, limits: torch.Tensor, *, bos: int | None,
                   context: int = SWEEP_CONTEXT, batch_size: int = 256, bf16: bool = False,
                   progress=None) -> torch.Tensor:
    """Per id of `ids`, the largest residual norm over `limits` (one per layer) of BOS and the id repeated
    to `context` tokens: inf where a value is non-finite. `bf16`: under bf16 autocast (the same verdicts
    on the checkpoints measured, about 2× faster on a CPU with native bf16)."""
    device = next(model.parameters()).device
    worst = []
    for start in range(0, len(ids), batch_size):
        rows = repeated_sequences(ids[start:start + batch_size].numpy(), context, bos)
        with torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext():
            stream, _ = residual_stream(model, rows, head=False)
        ratio = residual_norms(stream) / limits.clamp_min(1e-30)[:, None, None]
        worst.append(ratio.amax(dim=(0, 2)))
        if progress is not None:
            progress.update(len(rows))
    return torch.cat(worst) if worst else torch.zeros(0)
