"""End-to-end overhead of `lnfree remove` (tiny preset, removal only) against a minimal PyTorch loop.

Variants, timed interleaved with the order rotated every round:
- minimal loop: the same maths with nothing else: the tiny model with lnfree's norms, the same
  micro-batches, schedule events, cross-entropy + auxiliary loss, clipping, AdamW at the same
  learning rates, σ updates; no accelerate, logging, evaluation or checkpoints;
- lnfree run: `lnfree.removal.train.run` of the preset as shipped (held-out CE every 20 steps,
  checkpoints every 40);
- lnfree run, no periodic eval/checkpoints: the same with eval_every = save_every = 0 (the
  held-out CE at start and end and the final checkpoint remain).
For the runs both the whole call and the training loop alone (`RunResult.seconds`) are timed.
Ratios are to the minimal loop of the same round (wall time; min and median over rounds).

    python benchmarks/end_to_end.py [--rounds 3] [--threads 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from lnfree.fixedscale import surgery
from lnfree.arch import architecture
from lnfree.removal.config import load_preset
from lnfree.data.documents import StepBatches, prepare_data
from lnfree.models.base import load_base
from lnfree.removal.losses.objective import auxiliary_loss
from lnfree.removal.train import learning_rate, make_optimizer, micro_batches, resolve_run, run


def minimal_loop(config) -> float:
    """Seconds of the training loop of a removal run done with nothing but the maths."""
    torch.manual_seed(config.train.seed)
    model, tokenizer = load_base(config.model)
    arch = architecture(model)
    config, events = resolve_run(config, arch.n_layers, arch.stages)
    train, context = config.train, config.data.context_length
    micro, accumulation = micro_batches(train, context, 1)
    data = prepare_data(config.data, tokenizer, context, model.config.vocab_size)
    surgery.install(model)
    batches = StepBatches(data.train, micro, accumulation, 1, train.seed)
    surgery.initialise_sigmas(model, (batches.get(0, i % accumulation, 0) for i in range(train.sigma_init_batches)))
    optimizer = make_optimizer(model, config)
    momentum = train.sigma_momentum ** (batches.sequences_per_step / train.sigma_momentum_sequences)
    captured = {}
    model.get_submodule(arch.final_norm).register_forward_pre_hook(lambda m, args: captured.update(x=args[0]))
    model.train()
    started = time.perf_counter()
    for step in range(train.max_steps):
        for event in (e for e in events if e.step == step):
            surgery.apply_event(model, event)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, config)
        for m in range(accumulation):
            ids = batches.get(step, m, 0)
            ce = model(input_ids=ids, labels=ids, use_cache=False).loss
            aux = auxiliary_loss(captured["x"], ids, data.eot_token_id, arch.eps, arch.norm_kind)
            ((ce + train.aux_loss_weight * aux) / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        surgery.update_sigmas(model, momentum)
    return time.perf_counter() - started


def lnfree_run(config) -> tuple[float, float]:
    """(whole call, training loop) seconds of `lnfree.removal.train.run` in a temporary folder."""
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        result = run(config.model_copy(update={"output_dir": folder}), progress=False)
        return time.perf_counter() - started, result.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shipped = load_preset("tiny")
    quiet = shipped.model_copy(update={"train": shipped.train.model_copy(update={"eval_every": 0, "save_every": 0})})
    variants = {"minimal loop": lambda: {"loop": minimal_loop(shipped)},
                "lnfree run": lambda: dict(zip(("call", "loop"), lnfree_run(shipped))),
                "lnfree run, no periodic eval/checkpoints": lambda: dict(zip(("call", "loop"), lnfree_run(quiet)))}
    names = list(variants)
    times: dict[str, list[dict]] = {n: [] for n in names}
    lnfree_run(quiet)  # warm-up: the data cache and imports
    for round_ in range(args.rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(variants[name]())
    base = [t["loop"] for t in times["minimal loop"]]
    results = {}
    print(f"tiny preset, removal only, {args.threads} thread(s), {args.rounds} rounds; ratios to the minimal loop")
    for name in names[1:]:
        for part in ("call", "loop"):
            ratios = [t[part] / b for t, b in zip(times[name], base)]
            results[f"{name} ({part})"] = {"median_s": statistics.median(t[part] for t in times[name]),
                                          "ratio_min": min(ratios), "ratio_median": statistics.median(ratios)}
    results["minimal loop"] = {"median_s": statistics.median(base), "ratio_min": 1.0, "ratio_median": 1.0}
    for name, r in results.items():
        print(f"  {name:<52} median {r['median_s']:6.1f} s   ratio min {r['ratio_min']:.3f} median {r['ratio_median']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
