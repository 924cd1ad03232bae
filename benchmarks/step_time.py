"""Training-step and per-site cost of lnfree's norms relative to the plain model, robust to machine load.

Full step (forward + backward + AdamW, plus the σ update for the removal models) at a GPT-2-small
shape and a Llama-family shape (SmolLM2-135M's), random weights (the Llama rescaled so that its
all-fixed forward stays finite), `--batch` × `--seq` tokens; every variant's loss is checked to be
finite before timing:
- plain: the transformers model with its own LayerNorm / RMSNorm (the baseline of every ratio);
- plain, second copy: the same model again, a control: its ratio shows how far two identical
  models drift apart in this run (memory placement, load), the benchmark's resolution (the
  sites have one too);
- lnfree all real / all fixed: the installed model with every slot real (statistics gathered)
  or every slot fixed;
- published FakeLayerNorm (GPT-2 only): a re-implementation of the research code's approach, a
  real LayerNorm per norm that gathers its std with a host sync (`.item()`) every training
  forward and, once fake, centres and divides by a stored Python float;
- compiled (`--compile`): every block compiled as `train.compile` does, for the plain model and the
  lnfree models; their ratios are to the compiled plain model.

Per site (forward + backward of one norm and, for the attention-input norm, the projections
reading it, `--batch` × `--seq` tokens): each norm kind real and fixed against the plain module.

Every round runs each variant once, in an order rotated from round to round, so drift in machine
load hits all variants alike. Each round yields a ratio to the plain variant of that same round,
for wall time and for process CPU time; the script prints the minimum and the median of the
per-round ratios, and the ratio of each variant's fastest round to its baseline's fastest round
(CPU time; other load only adds time, so the fastest rounds are the least disturbed). Use
`--threads 1` on a shared machine. Unless `--default-malloc`, glibc is told to keep freed memory
(see `steady_allocator`), so large tensors are not page-faulted in again every step.

    python benchmarks/step_time.py [--threads 1] [--rounds 10] [--batch 2] [--seq 256] [--compile]
                                   [--shapes gpt2 llama] [--sites-only | --steps-only] [--default-malloc]
                                   [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.pytorch_utils import Conv1D

from lnfree.fixedscale import surgery
from lnfree.arch import architecture
from lnfree.fixedscale.norms import FixedScaleNorm, NormalisedProjection, SplitNorm
from lnfree.fixedscale.state import ScaleState
from lnfree.removal.runtime import steady_allocator
from lnfree.removal.train import compile_blocks

PLAIN = "plain"
COMPILED_PLAIN = "compiled plain"
SECOND_COPY = ", second copy"  # a control: the baseline again, as a separate deep copy


# ----------------------------------------------------------------------------- timing


def baseline(name: str) -> str:
    """The variant a variant is compared with: the compiled plain model for compiled variants, else plain."""
    return COMPILED_PLAIN if name.startswith("compiled") else PLAIN


def interleaved(variants: dict[str, Callable[[], None]], rounds: int, warmup: int) -> dict[str, dict]:
    """Per-round wall and CPU ratios of every variant to its baseline (min and median over rounds)."""
    names = list(variants)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for round_ in range(warmup + rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            wall0, cpu0 = time.perf_counter(), time.process_time()
            variants[name]()
            if round_ >= warmup:
                wall[name].append(time.perf_counter() - wall0)
                cpu[name].append(time.process_time() - cpu0)
    result = {}
    for name in names:
        wall_ratios = [a / b for a, b in zip(wall[name], wall[baseline(name)])]
        cpu_ratios = [a / b for a, b in zip(cpu[name], cpu[baseline(name)])]
        result[name] = {
            "median_ms": 1000 * statistics.median(wall[name]), "baseline": baseline(name),
            "wall_ratio_to_plain_median": statistics.median(a / b for a, b in zip(wall[name], wall[PLAIN])),
            "wall_ratio_min": min(wall_ratios), "wall_ratio_median": statistics.median(wall_ratios),
            "cpu_ratio_min": min(cpu_ratios), "cpu_ratio_median": statistics.median(cpu_ratios),
            # Load only ever slows a run down: each variant's fastest round is its least disturbed.
            "cpu_best_ratio": min(cpu[name]) / min(cpu[baseline(name)]),
        }
    return result


def print_table(title: str, result: dict[str, dict]) -> None:
    """One line per variant: median time and the per-round ratios to its baseline."""
    print(f"\n{title}; compiled variants against the compiled plain one")
    print(f"  {'variant':<34} {'median ms':>10} {'wall ratio min/median':>22} {'CPU ratio min/median':>21}"
          f" {'best/best CPU':>14}")
    for name, r in result.items():
        print(f"  {name:<34} {r['median_ms']:10.2f} {r['wall_ratio_min']:10.3f} / {r['wall_ratio_median']:.3f}"
              f" {r['cpu_ratio_min']:9.3f} / {r['cpu_ratio_median']:.3f} {r['cpu_best_ratio']:14.3f}")


# ----------------------------------------------------------------------------- the published reference


class PublishedFakeLayerNorm(nn.LayerNorm):
    """The research code's fake LayerNorm, re-implemented from its description (not lnfree's method).

    A real LayerNorm that, in every training forward, computes the batch-mean per-token std and
    reads it to the host (`.item()`) into a Python running average; once `fake`, it centres its
    input and divides by that stored float.
    """

    def __init__(self, ln: nn.LayerNorm, momentum: float = 0.9):
        super().__init__(ln.normalized_shape, eps=ln.eps)
        self.load_state_dict(ln.state_dict())
        self.momentum = momentum
        self.std = 1.0
        self.fake = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            std = torch.sqrt(x.detach().var(-1, unbiased=False) + self.eps).mean().item()  # a host sync
            if not self.fake:
                self.std = self.momentum * self.std + (1 - self.momentum) * std
        if not self.fake:
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        centred = x - x.mean(-1, keepdim=True)
        return centred / self.std * self.weight + self.bias


def published_fake(model: GPT2LMHeadModel) -> GPT2LMHeadModel:
    """Every LayerNorm of a GPT-2 replaced by a fake `PublishedFakeLayerNorm` (std from the plain model)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.LayerNorm):
            fake = PublishedFakeLayerNorm(module)
            fake.fake = True
            model.set_submodule(name, fake)
    return model


# ----------------------------------------------------------------------------- full steps


def shape_config(shape: str, layers: int | None, vocab: int | None = None):
    """Random-init model config of GPT-2 small or SmolLM2-135M (Llama family)."""
    if shape == "gpt2":
        return GPT2Config(n_layer=layers or 12, n_embd=768, n_head=12, n_positions=1024, vocab_size=vocab or 50257,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return LlamaConfig(num_hidden_layers=layers or 30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=vocab or 49152, max_position_embeddings=2048,
                       tie_word_embeddings=True)


def stable_under_fixed_norms(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Rescale a random-init Llama so that its forward stays finite with every norm fixed.

    At random init the residual is tiny at the embedding and grows block by block. With one σ per
    norm the gated MLPs then amplify the larger tokens until fp32 overflows by block 6, and every
    later step of the benchmark would time NaN arithmetic (slower on CPU). A 50× embedding and
    residual writers scaled by 0.1 keep every token near the same scale. The shapes and hence the
    compute are unchanged.
    """
    with torch.no_grad():
        arch = architecture(model)
        model.get_submodule(arch.token_embedding).weight.mul_(50)
        for layer in range(arch.n_layers):
            for writer in (arch.attn_out, arch.mlp_out):
                model.get_submodule(arch.block(layer, writer)).weight.mul_(0.1)
    return model


def make_step(model: nn.Module, ids: torch.Tensor, removal: bool) -> Callable[[], torch.Tensor]:
    """One training step of `model` (forward, backward, AdamW, the σ update if `removal`); returns the loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()

    def step() -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if removal:
            surgery.update_sigmas(model, 0.9)
        return loss.detach()

    return step


def check_finite(variants: dict[str, Callable[[], torch.Tensor]]) -> None:
    """Run every step variant once; stop if a loss is not finite (its timings would be NaN arithmetic's)."""
    for name, step in variants.items():
        loss = step()
        if not torch.isfinite(loss):
            raise SystemExit(f"{name}: the training loss is {float(loss)}; timings of non-finite arithmetic are meaningless")


def step_variants(shape: str, args) -> dict[str, Callable[[], None]]:
    """Every full-step variant of one model shape (plain first)."""
    torch.manual_seed(0)
    config = shape_config(shape, args.layers, args.vocab)
    cls = GPT2LMHeadModel if shape == "gpt2" else LlamaForCausalLM
    base = cls(config) if shape == "gpt2" else stable_under_fixed_norms(cls(config))
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    real = surgery.install(copy.deepcopy(base))
    surgery.initialise_sigmas(real, [ids])
    fixed = copy.deepcopy(real)
    for state in surgery.scale_states(fixed).values():
        state.switch_to_fixed()
    # Every variant times a deep copy (the plain one too), so that no model keeps the scattered
    # memory of its random initialisation.
    variants = {PLAIN: make_step(copy.deepcopy(base), ids, False),
                PLAIN + SECOND_COPY: make_step(copy.deepcopy(base), ids, False),
                "lnfree all real": make_step(real, ids, True), "lnfree all fixed": make_step(fixed, ids, True)}
    if shape == "gpt2":
        variants["published FakeLayerNorm, all fake"] = make_step(published_fake(copy.deepcopy(base)), ids, False)
    if args.compile:  # as `train.compile` does it: every block compiled, on copies
        for label, model, removal in ((PLAIN, base, False), (PLAIN + SECOND_COPY, base, False),
                                      ("lnfree all real", real, True), ("lnfree all fixed", fixed, True)):
            twin = copy.deepcopy(model)
            compile_blocks(twin)
            variants[f"compiled {label}"] = make_step(twin, ids, removal)
    return variants


# ----------------------------------------------------------------------------- per site


def fwd_bwd(module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: list[nn.Parameter], reps: int):
    """`reps` forward + backward passes of `module` at input `x` (gradients returned, not accumulated)."""
    grad = torch.randn_like(module(x))

    def run() -> None:
        for _ in range(reps):
            torch.autograd.grad(module(x), [x, *params], grad)

    return run


def _fixed(states: list[ScaleState], sigmas: list[float]) -> None:
    for state, sigma in zip(states, sigmas):
        state.sigma.fill_(sigma)
        state.switch_to_fixed()


Site = dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], list[nn.Parameter]]]


def layer_norm_site(d: int) -> Site:
    """A LayerNorm whose output feeds its consumers directly (GPT-2's ln_2)."""
    ln = nn.LayerNorm(d)
    real = FixedScaleNorm(ln.weight, ln.bias, ScaleState(ln.eps, "layer")).train()
    fixed = FixedScaleNorm(ln.weight, ln.bias, ScaleState(ln.eps, "layer"))
    _fixed([fixed.state], [2.0])
    published = PublishedFakeLayerNorm(ln).train()
    published.fake = True
    twin = copy.deepcopy(ln)
    return {PLAIN: (ln, list(ln.parameters())), PLAIN + SECOND_COPY: (twin, list(twin.parameters())),
            "lnfree real (gathering)": (real, list(real.parameters())),
            "lnfree fixed": (fixed, list(fixed.parameters())),
            "published FakeLayerNorm, fake": (published, list(published.parameters()))}


def rms_norm_site(d: int) -> Site:
    """An RMSNorm whose output feeds its consumers directly (Llama's post_attention_layernorm)."""
    rms = LlamaRMSNorm(d, eps=1e-5)
    real = FixedScaleNorm(rms.weight, None, ScaleState(1e-5, "rms")).train()
    fixed = FixedScaleNorm(rms.weight, None, ScaleState(1e-5, "rms"))
    _fixed([fixed.state], [2.0])
    twin = copy.deepcopy(rms)
    return {PLAIN: (rms, [rms.weight]), PLAIN + SECOND_COPY: (twin, [twin.weight]),
            "lnfree real (gathering)": (real, [real.weight]), "lnfree fixed": (fixed, [fixed.weight])}


def split_site(norm: nn.Module, projections: list[nn.Module], kind: str, v_columns: list, in_out: bool) -> Site:
    """An attention-input norm and the projections reading it, plain and as lnfree's split norm."""
    bias = getattr(norm, "bias", None)
    eps = getattr(norm, "eps", None) or norm.variance_epsilon

    def installed(fixed: bool) -> tuple[Callable, list[nn.Parameter]]:
        split = SplitNorm(norm.weight, bias, ScaleState(eps, kind), ScaleState(eps, kind)).train()
        projs = [NormalisedProjection(p, split, v, in_out) for p, v in zip(projections, v_columns)]
        if fixed:
            _fixed([split.qk, split.v], [2.0, 3.0])

        def forward(h: torch.Tensor) -> torch.Tensor:  # as in the model: the norm module, then each projection
            n = split(h)
            return torch.cat([proj(n) for proj in projs], -1)

        return forward, list(split.parameters()) + [p for proj in projs for p in proj.parameters()]

    def plain(norm: nn.Module, projections: list[nn.Module]) -> tuple[Callable, list[nn.Parameter]]:
        def forward(h: torch.Tensor) -> torch.Tensor:
            n = norm(h)
            return torch.cat([p(n) for p in projections], -1)

        return forward, list(norm.parameters()) + [p for proj in projections for p in proj.parameters()]

    return {PLAIN: plain(norm, projections), PLAIN + SECOND_COPY: plain(*copy.deepcopy((norm, projections))),
            "lnfree real (gathering)": installed(False), "lnfree fixed": installed(True)}


def site_variants(args) -> dict[str, dict[str, Callable[[], None]]]:
    """Per-site variants: GPT-2-small LayerNorm sites and SmolLM2-135M RMSNorm sites (and compiled ones)."""
    torch.manual_seed(0)
    tokens = args.batch * args.seq
    d_gpt2, d_llama, kv = 768, 576, 192
    x = torch.randn(tokens, d_gpt2, requires_grad=True)
    y = torch.randn(tokens, d_llama, requires_grad=True)
    ln_1 = nn.LayerNorm(d_gpt2)
    c_attn = Conv1D(3 * d_gpt2, d_gpt2)
    rms = LlamaRMSNorm(d_llama, eps=1e-5)
    q, k, v = nn.Linear(d_llama, d_llama, bias=False), nn.Linear(d_llama, kv, bias=False), nn.Linear(d_llama, kv, bias=False)
    sites = {
        "GPT-2 ln_2 (LayerNorm)": (layer_norm_site(d_gpt2), x),
        "GPT-2 ln_1 + c_attn (split LayerNorm)": (
            split_site(ln_1, [c_attn], "layer", [slice(2 * d_gpt2, 3 * d_gpt2)], True), x),
        "Llama post_attention_layernorm (RMSNorm)": (rms_norm_site(d_llama), y),
        "Llama input_layernorm + q/k/v (split RMSNorm)": (
            split_site(rms, [q, k, v], "rms", [None, None, "all"], False), y),
    }
    out = {}
    for site, (variants, inputs) in sites.items():
        reps = args.site_reps * (1 if "+" in site else 10)  # a norm alone is ~50× cheaper than with its projections
        out[site] = {name: fwd_bwd(fn, inputs, params, reps) for name, (fn, params) in variants.items()}
        if args.compile:  # the published variant reads σ on the host: not compiled
            out[site].update({f"compiled {name}": fwd_bwd(torch.compile(fn), inputs, params, reps)
                              for name, (fn, params) in variants.items() if not name.startswith("published")})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (each runs every variant once)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, help="override the depth of both shapes (quick runs)")
    parser.add_argument("--vocab", type=int,
                        help="override the vocabulary of both shapes (a small one leaves the blocks to dominate the step)")
    parser.add_argument("--shapes", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    parser.add_argument("--compile", action="store_true", help="add torch.compile variants to the full steps")
    parser.add_argument("--site-rounds", type=int, default=30)
    parser.add_argument("--site-reps", type=int, default=10,
                        help="forward+backward passes per measurement of a norm with its projections (×10 for a norm alone)")
    parser.add_argument("--sites-only", action="store_true")
    parser.add_argument("--steps-only", action="store_true")
    parser.add_argument("--default-malloc", action="store_true",
                        help="keep glibc's default allocator settings (large tensors page-faulted in every step)")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steady = not args.default_malloc and steady_allocator()
    results: dict = {"args": vars(args), "torch": torch.__version__, "steady_allocator": steady, "sites": {}, "steps": {}}
    print(f"{args.batch} × {args.seq} tokens, {args.threads} thread(s), "
          f"{'steady' if steady else 'default'} allocator; ratios are per round, to plain in the same round")
    if not args.steps_only:
        for site, variants in site_variants(args).items():
            results["sites"][site] = interleaved(variants, args.site_rounds, args.warmup)
            print_table(f"site: {site} (forward + backward, {args.site_rounds} rounds)",
                        results["sites"][site])
    if not args.sites_only:
        for shape in args.shapes:
            variants = step_variants(shape, args)
            check_finite(variants)
            results["steps"][shape] = interleaved(variants, args.rounds, args.warmup)
            print_table(f"full step: {shape} shape ({args.rounds} rounds)", results["steps"][shape])
            del variants
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
