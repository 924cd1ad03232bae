"""Pre-train the bundled real-text GPT-2 (4 layers, d_model 128, context 256) on Django's docs.

    python experiments/realtext_pretrain/train_realtext.py --out lnfree/assets/realtext-gpt2

Fetches the corpus with pip if it is not cached (``lnfree.data.realtext.corpus``), splits it by whole
documents, trains a 4096-token byte-level BPE on the train documents and a GPT-2 with LayerNorm
from scratch, on one CPU thread. A checkpoint in ``--work-dir`` is written every
``--checkpoint-every`` steps and the run resumes from it when restarted with the same arguments.
Writes ``model.safetensors``, the config and tokenizer files and ``training_summary.json``
(held-out CE and data provenance) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tiny_pretrain"))
from train_tiny import evaluate_ce, optimiser_step  # noqa: E402  (the tiny model's CE and step)

from lnfree.data.realtext import corpus  # noqa: E402
from lnfree.data.realtext import build_tokenizer  # noqa: E402
from lnfree.data.tiny import encode_documents  # noqa: E402

CONTEXT = 256


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--work-dir", type=Path, default=corpus.default_cache_dir() / "pretrain",
                   help="resume checkpoint and tokenizer of the run in progress")  # fmt: skip
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--steps", type=int, default=1800)
    p.add_argument("--batch-size", type=int, default=16, help="sequences of 256 tokens per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr (cosine)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0, help="torch seed (init and batch windows)")
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def make_model(vocab_size: int, eot: int) -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=vocab_size, n_positions=CONTEXT, n_embd=128, n_layer=4, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=eot, eos_token_id=eot,
        tie_word_embeddings=True,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


@torch.no_grad()
def chunk_ce(model: GPT2LMHeadModel, stream: list[int], n_chunks: int) -> list[float]:
    """Mean next-token CE of each of the first ``n_chunks`` 256-token chunks of ``stream``."""
    model.eval()
    ids = torch.tensor(stream[: n_chunks * CONTEXT], dtype=torch.long).view(n_chunks, CONTEXT)
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1).tolist()


def save_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: an interruption leaves the previous checkpoint intact


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.time()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.work_dir / "checkpoint.pt"
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "work_dir")}

    print(f"corpus: {corpus.SDIST_NAME} docs/ (fetching with pip if not cached) ...")
    docs = corpus.load_documents()
    train_names, heldout_names = corpus.split_documents(list(docs))
    train_docs, heldout_docs = [docs[n] for n in train_names], [docs[n] for n in heldout_names]
    tok_dir = args.work_dir / "tokenizer"
    if ckpt_path.exists() and tok_dir.exists():
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)  # the run's own tokenizer, on resume
    else:
        tokenizer = build_tokenizer(train_docs, args.vocab_size)
        tokenizer.save_pretrained(tok_dir)
    stream = torch.tensor(encode_documents(tokenizer, train_docs), dtype=torch.long)
    heldout_stream = encode_documents(tokenizer, heldout_docs)
    print(f"vocab {len(tokenizer)}, {len(train_docs)} train documents ({len(stream):,} tokens), "
          f"{len(heldout_docs)} held-out documents ({len(heldout_stream):,} tokens)")  # fmt: skip

    torch.manual_seed(args.seed)
    model = make_model(len(tokenizer), tokenizer.eos_token_id)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(args.seed)
    start, history, ema_loss, train_seconds = 0, [], None, 0.0
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        if state["settings"] != settings:
            sys.exit(f"error: {ckpt_path} was written with other settings; delete {args.work_dir} to start over")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        start, history, ema_loss, train_seconds = state["step"], state["history"], state["ema_loss"], state["seconds"]
        print(f"resuming at step {start}")
    model.train()
    n_params = sum(p.numel() for p in model.parameters())

    t_train = time.time() - train_seconds
    pbar = tqdm(range(start, args.steps), desc="train", initial=start, total=args.steps, mininterval=5.0)
    for step in pbar:
        # Random 256-token windows of the packed train stream (documents joined by EOT).
        offsets = torch.randint(0, len(stream) - CONTEXT, (args.batch_size,), generator=gen)
        batch = torch.stack([stream[o : o + CONTEXT] for o in offsets.tolist()])
        loss = optimiser_step(model, optimizer, batch, lr_at(step, args), args.grad_clip)
        ema_loss = loss if ema_loss is None else 0.95 * ema_loss + 0.05 * loss
        pbar.set_postfix(loss=f"{ema_loss:.3f}", lr=f"{lr_at(step, args):.2e}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            ce = evaluate_ce(model, heldout_stream, CONTEXT)
            history.append({"step": step + 1, "train_loss_ema": ema_loss, "heldout_ce": ce})
            tqdm.write(f"step {step + 1}: train loss (ema) {ema_loss:.4f}, held-out CE {ce:.4f}")
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            save_checkpoint(ckpt_path, {
                "settings": settings, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "generator": gen.get_state(), "step": step + 1, "history": history, "ema_loss": ema_loss,
                "seconds": time.time() - t_train,
            })  # fmt: skip
    train_seconds = time.time() - t_train

    heldout_ce = evaluate_ce(model, heldout_stream, CONTEXT)
    print(f"held-out CE {heldout_ce:.4f} nats (log vocab = {math.log(len(tokenizer)):.3f})")
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    summary = {
        "description": "GPT-2 with LayerNorm pre-trained on Django's documentation (real English text)",
        "data": {
            "source": f"PyPI sdist {corpus.SDIST_NAME}, files docs/**/*.txt (reStructuredText), one document each",
            "fetch": " ".join(["python"] + corpus.fetch_command(Path("~/.cache/lnfree/realtext"))[1:]),
            "sdist_sha256": corpus.SDIST_SHA256,
            "license": "BSD-3-Clause (Django Software Foundation and individual contributors)",
            "characters": sum(map(len, docs.values())),
            "split": f"seeded shuffle (random.Random({corpus.SPLIT_SEED})) of the sorted paths; "
                     f"{corpus.HELDOUT_FRACTION:.0%} of whole documents held out",
            "heldout_documents": heldout_names,
        },  # fmt: skip
        "steps": args.steps,
        "batch_size": args.batch_size,
        "context": CONTEXT,
        "tokens_seen": args.steps * args.batch_size * CONTEXT,
        "epochs": round(args.steps * args.batch_size * CONTEXT / len(stream), 2),
        "final_train_loss_ema": ema_loss,
        "heldout_ce": heldout_ce,
        "heldout_ce_definition": "mean next-token CE of the held-out documents joined by EOT and cut "
                                 "into consecutive 256-token chunks (last partial chunk kept)",
        "heldout_tokens": len(heldout_stream),
        # Recomputable in seconds (tests/test_realtext.py): the same stream's first 16 chunks, one CE each.
        "heldout_ce_first_16_chunks": chunk_ce(model, heldout_stream, 16),
        "train_documents": len(train_docs),
        "train_tokens": len(stream),
        "log_vocab": math.log(len(tokenizer)),
        "eval_history": history,
        "train_seconds": round(train_seconds, 1),
        "vocab_size": len(tokenizer),
        "n_parameters": n_params,
        "hyperparameters": {
            "lr": args.lr, "min_lr_ratio": args.min_lr_ratio, "warmup": args.warmup,
            "weight_decay": args.weight_decay, "grad_clip": args.grad_clip, "betas": [0.9, 0.95],
            "schedule": "linear warmup + cosine", "seed": args.seed,
        },  # fmt: skip
        "environment": {"torch": torch.__version__, "threads": args.threads, "machine": platform.machine()},
    }
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for path in args.out.iterdir():  # save_pretrained may create 0600 files; they ship in the wheel
        if path.is_file():
            path.chmod(0o644)
    print(f"wrote {args.out} in {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
