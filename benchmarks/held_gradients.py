"""What a capped pass (coverage rows, the stability margin, the one-token rows) costs beyond its forward and
backward: the text's gradients held apart, the pass's gradient accumulated, capped and added back (issue 38).

Over the trained parameters of a model (default Gemma 3 270M with its tied embedding frozen, as its recipe
trains it: 100M parameters; shapes from its config, random values), interleaved rounds (the order swapped every
round), the process CPU time of:
- before: an lnfree checkout's way (`--before DIR`, its `gradients` and `cap_share`): a copy of the text's
  gradients, the pass's gradient added into them (what a backward's accumulation does), then the gained part
  taken as a difference, capped and written back;
- now: `lnfree.removal.losses.coverage.HeldGradients`: the text's gradients taken out of the parameters, the
  pass's gradient written in their place (what a backward does into an empty gradient: no pass over memory),
  then capped and added back in one fused pass.
Under the steady allocator a run uses (`lnfree.removal.runtime`: freed memory kept, so neither way pays page
faults for its temporaries). Prints the median time per way and the per-round ratio, checks that the two ways'
gradients agree, and writes
`benchmarks/results/held_gradients.json` / `.txt`. A recipe step from step 1401 runs three such passes.

    python benchmarks/held_gradients.py --before DIR [--model gemma3-270m] [--threads 1] [--rounds 5] [--out PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lnfree.models.base import resolve_model_source
from lnfree.removal.losses.coverage import HeldGradients
from lnfree.removal.precision import cpu_description
from lnfree.removal.runtime import steady_allocator

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("before", "now")
SHARE = 0.25  # the recipe's max_grad_share


def trained_shapes(model: str) -> list[torch.Size]:
    """The shapes of `model`'s parameters but its token embedding (frozen, with the tied head, in the recipes)."""
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve_model_source(model)))
    embedding = module.get_input_embeddings().weight
    return [p.shape for p in module.parameters() if p is not embedding]


def earlier_coverage(checkout: Path):
    """The coverage module of an lnfree checkout (its `gradients` and `cap_share`)."""
    path = checkout / "src/lnfree/removal/losses/coverage.py"
    spec = importlib.util.spec_from_file_location("coverage_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_pass(way: str, params, text, rows, before_module) -> float:
    """CPU seconds of holding the text's gradients, taking in the pass's and adding the text's back, capped."""
    for p, t in zip(params, text):
        p.grad = t.clone()  # the text's gradients as the step left them (not timed)
    pass_grads = [r.clone() for r in rows]  # what the pass's backward produces (not timed)
    start = time.process_time()
    if way == "before":
        held = before_module.gradients(params)
        for p, g in zip(params, pass_grads):
            p.grad.add_(g)  # a backward accumulates into the existing gradient
        before_module.cap_share(params, held, SHARE)
    else:
        held = HeldGradients(params)
        for p, g in zip(params, pass_grads):
            p.grad = g  # a backward into an empty gradient keeps its own tensor
        held.add_back(SHARE)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="an lnfree checkout from before HeldGradients")
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/held_gradients")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steady_allocator()  # as a run keeps freed memory: neither way pays page faults for its temporaries
    before_module = earlier_coverage(args.before)
    shapes = trained_shapes(args.model)
    torch.manual_seed(0)
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    text = [torch.randn(s) for s in shapes]
    rows = [torch.randn(s) * 10 for s in shapes]  # the pass's gradient 10× the text's: the cap acts
    results = {}
    for way in WAYS:  # the two ways' capped gradients agree
        one_pass(way, params, text, rows, before_module)
        results[way] = torch.cat([p.grad.flatten() for p in params])
    error = float((results["before"] - results["now"]).abs().max() / results["before"].abs().max())
    del results
    seconds = {way: [] for way in WAYS}
    for r in range(args.rounds + 1):  # round 0 warms up
        for way in WAYS if r % 2 == 0 else WAYS[::-1]:
            t = one_pass(way, params, text, rows, before_module)
            if r:
                seconds[way].append(t)
    count = sum(p.numel() for p in params)
    ratios = [b / n for b, n in zip(seconds["before"], seconds["now"])]
    lines = [f"# {args.model}: one capped pass over its {count:,} trained parameters (the embedding frozen), "
             f"process CPU seconds, {args.rounds} interleaved rounds, OMP_NUM_THREADS={args.threads}, CPU: "
             f"{cpu_description()}", "",
             "| way | median s | per round s |", "|---|---|---|"]
    lines += [f"| {way} | {statistics.median(seconds[way]):.3f} | "
              f"{', '.join(f'{t:.3f}' for t in seconds[way])} |" for way in WAYS]
    lines += ["", f"before / now per round: {', '.join(f'{r:.2f}' for r in ratios)} (median "
              f"{statistics.median(ratios):.2f}); the two ways' gradients differ by at most {error:.1e} of the "
              "largest (rounding: the gained part taken as a difference before, kept apart now)"]
    text_out = "\n".join(lines) + "\n"
    print(text_out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".txt").write_text(text_out)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "model": args.model, "parameters": count,
         "cpu": cpu_description(), "seconds": seconds, "ratios": ratios, "max_relative_difference": error},
        indent=1))


if __name__ == "__main__":
    main()
