"""Pre-train the bundled tiny GPT-2 (4 layers, d_model 128) on the synthetic story corpus.

    python experiments/tiny_pretrain/train_tiny.py --out lnfree/assets/tiny-gpt2

Deterministic given the seeds (corpus streams from ``lnfree.data.tiny`` + ``--seed`` for torch), CPU
only, two threads. Writes ``model.safetensors``, ``config.json``, ``generation_config.json``, the
tokenizer files and ``training_summary.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import GPT2Config, GPT2LMHeadModel

from lnfree.data.tiny import (
    FINETUNE_SEED,
    HELDOUT_SEED,
    PRETRAIN_SEED,
    build_tokenizer,
    encode_documents,
    generate_documents,
)

CONTEXT = 128


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--n-docs", type=int, default=45_000, help="pre-training documents")
    p.add_argument("--n-heldout-docs", type=int, default=500, help="held-out evaluation documents")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=32, help="sequences of 128 tokens per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr (cosine)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=0, help="torch seed (init and batch order)")
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def to_sequences(stream: list[int], context: int) -> torch.Tensor:
    """Cut a token stream into full sequences of ``context`` tokens (the remainder is dropped)."""
    n = len(stream) // context
    return torch.tensor(stream[: n * context], dtype=torch.long).view(n, context)


@torch.no_grad()
def evaluate_ce(model: GPT2LMHeadModel, stream: list[int], context: int, batch_size: int = 64):
    """Mean next-token cross-entropy (nats) over a packed stream cut into ``context`` chunks.

    The final partial chunk is kept, so every token after the first of each chunk is predicted.
    """
    model.eval()
    n_full = len(stream) // context
    full = [stream[i * context : (i + 1) * context] for i in range(n_full)]
    batches = [full[i : i + batch_size] for i in range(0, n_full, batch_size)]
    if len(stream) - n_full * context > 1:
        batches.append([stream[n_full * context :]])  # the final partial chunk, on its own
    total, count = 0.0, 0
    for batch in batches:
        ids = torch.tensor(batch, dtype=torch.long)
        logits = model(input_ids=ids).logits[:, :-1].float()
        targets = ids[:, 1:]
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum"
        ).item()
        count += targets.numel()
    model.train()
    return total / count


def optimiser_step(model: GPT2LMHeadModel, optimizer: torch.optim.Optimizer, batch: torch.Tensor, lr: float,
                   grad_clip: float) -> float:
    """One clipped optimiser step at learning rate `lr` on a batch of token windows; returns its loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = model(input_ids=batch, labels=batch).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.item()


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def model_config(tokenizer) -> GPT2Config:
    """The bundled tiny model's architecture (`tests/test_tiny.py` checks the bundled config against it)."""
    eot = tokenizer.eos_token_id
    return GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=CONTEXT,
        n_embd=128,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=eot,
        eos_token_id=eot,
        tie_word_embeddings=True,
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()

    print(f"generating {args.n_docs} pre-training documents (seed {PRETRAIN_SEED}) ...")
    docs = generate_documents(args.n_docs, PRETRAIN_SEED)
    tokenizer = build_tokenizer(docs)
    stream = encode_documents(tokenizer, docs)
    data = to_sequences(stream, CONTEXT)
    heldout_docs = generate_documents(args.n_heldout_docs, HELDOUT_SEED)
    heldout_stream = encode_documents(tokenizer, heldout_docs)
    n_unk_heldout = sum(1 for t in heldout_stream if t == tokenizer.unk_token_id)
    eval_stream = heldout_stream[: 200 * CONTEXT]  # cheap periodic evaluation
    print(
        f"vocab {len(tokenizer)}, train tokens {len(stream):,} ({data.shape[0]:,} sequences), "
        f"held-out tokens {len(heldout_stream):,} ({n_unk_heldout} unknown)"
    )

    model = GPT2LMHeadModel(model_config(tokenizer))
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model parameters: {n_params:,}")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(data.shape[0], generator=gen)
    cursor, epochs = 0, 0
    history: list[dict] = []
    ema_loss = None
    t_train = time.time()
    pbar = tqdm(range(args.steps), desc="train", mininterval=2.0)
    for step in pbar:
        if cursor + args.batch_size > len(order):
            order = torch.randperm(data.shape[0], generator=gen)
            cursor, epochs = 0, epochs + 1
        batch = data[order[cursor : cursor + args.batch_size]]
        cursor += args.batch_size
        loss = optimiser_step(model, optimizer, batch, lr_at(step, args), args.grad_clip)
        ema_loss = loss if ema_loss is None else 0.95 * ema_loss + 0.05 * loss
        pbar.set_postfix(loss=f"{ema_loss:.3f}", lr=f"{lr_at(step, args):.2e}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            ce = evaluate_ce(model, eval_stream, CONTEXT)
            history.append({"step": step + 1, "train_loss_ema": ema_loss, "heldout_ce_subset": ce})
            tqdm.write(f"step {step + 1}: train loss (ema) {ema_loss:.4f}, held-out CE {ce:.4f}")
    train_seconds = time.time() - t_train

    print(f"evaluating on {args.n_heldout_docs} held-out documents (seed {HELDOUT_SEED}) ...")
    heldout_ce = evaluate_ce(model, heldout_stream, CONTEXT)
    print(f"held-out CE {heldout_ce:.4f} nats (log vocab = {math.log(len(tokenizer)):.3f})")

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    summary = {
        "description": "Tiny GPT-2 pre-trained on lnfree.data.tiny.corpus synthetic stories",
        "steps": args.steps,
        "batch_size": args.batch_size,
        "context": CONTEXT,
        "tokens_seen": args.steps * args.batch_size * CONTEXT,
        "epochs_completed": epochs,
        "final_train_loss_ema": ema_loss,
        "final_train_loss_last_batch": loss,
        "heldout_ce": heldout_ce,
        "heldout_tokens": len(heldout_stream),
        "log_vocab": math.log(len(tokenizer)),
        "eval_history": history,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "seeds": {
            "pretrain_corpus": PRETRAIN_SEED,
            "finetune_corpus": FINETUNE_SEED,
            "heldout_corpus": HELDOUT_SEED,
            "torch": args.seed,
        },
        # sha256 of "\n".join(generate_documents(100, PRETRAIN_SEED)): detects generator changes.
        "corpus_digest_first_100_docs": hashlib.sha256("\n".join(docs[:100]).encode()).hexdigest(),
        "corpus": {
            "pretrain_documents": args.n_docs,
            "pretrain_tokens": len(stream),
            "pretrain_sequences": int(data.shape[0]),
            "heldout_documents": args.n_heldout_docs,
            "heldout_tokens": len(heldout_stream),
        },
        "vocab_size": len(tokenizer),
        "n_parameters": n_params,
        "hyperparameters": {
            "lr": args.lr,
            "min_lr_ratio": args.min_lr_ratio,
            "warmup": args.warmup,
            "weight_decay": args.weight_decay,
            "grad_clip": args.grad_clip,
            "betas": [0.9, 0.95],
            "schedule": "linear warmup + cosine",
        },
        "environment": {
            "torch": torch.__version__,
            "threads": args.threads,
            "machine": platform.machine(),
        },
    }
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for path in args.out.iterdir():  # save_pretrained may create 0600 files; they ship in the wheel
        if path.is_file():
            path.chmod(0o644)
    print(f"wrote {args.out} in {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
