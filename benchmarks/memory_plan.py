"""The memory plan (lnfree.removal.plan) against measured peak memory on CPU, and its plan for the GPT-2 presets.

Each measurement runs in a fresh process with glibc's mmap threshold fixed at 64 KiB, so every
tensor buffer is its own mapping, returned to the system when freed, and the process's resident
set follows the live tensors. The process resets its peak resident set (/proc/self/clear_refs)
right before the measured step and reads it (VmHWM) afterwards. One measured step: a removal
model (lnfree norms installed, all real) of a small shape, fp32, two micro-batches of gradient
accumulation (so gradients are held during the second backward, as in a run), AdamW. Reported:
measured and predicted peak above the process's resident set before the model existed (total),
and measured and predicted peak above the resident set right before the second micro-batch
(its transient: activations and the backward's peak; the gradients exist already).

    python benchmarks/memory_plan.py [--out benchmarks/results/memory_plan.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASES = [  # (family, layers, hidden, heads, vocab, context, micro_batch, checkpointing)
    ("gpt2", 4, 256, 4, 8192, 256, 4, False),
    ("gpt2", 4, 256, 4, 8192, 256, 8, False),
    ("gpt2", 8, 384, 6, 4096, 256, 8, False),
    ("gpt2", 8, 384, 6, 4096, 256, 8, True),
    ("llama", 4, 256, 4, 8192, 256, 8, False),
    ("llama", 6, 384, 6, 4096, 256, 8, True),
]


def rss_bytes(field: str) -> int:
    """VmRSS or VmHWM of this process, bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def measure(case: tuple) -> dict:
    """Run one measured step of `case` in this process; predicted and measured peaks."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from lnfree.fixedscale import surgery
    from lnfree.removal.plan import Setup, model_shape, predict

    family, layers, hidden, heads, vocab, context, micro, checkpointing = case
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if family == "gpt2":
        config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=context,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        config = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                             num_attention_heads=heads, num_key_value_heads=heads // 2, vocab_size=vocab,
                             max_position_embeddings=context, tie_word_embeddings=True)
    ids = [torch.randint(0, vocab, (micro, context)) for _ in range(2)]
    before_model = rss_bytes("VmRSS")
    model = (GPT2LMHeadModel if family == "gpt2" else LlamaForCausalLM)(config)
    surgery.install(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step(measured: bool) -> int:
        peak_above = 0
        for batch in ids:
            if measured and batch is ids[1]:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset the peak resident set
                start = rss_bytes("VmRSS")
            (model(input_ids=batch, labels=batch, use_cache=False).loss / 2).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if measured:
            peak_above = rss_bytes("VmHWM") - start
        return peak_above

    step(False)  # the optimizer's states exist from now on
    measured_step = step(True)
    total = rss_bytes("VmHWM") - before_model
    prediction = predict(model_shape(config), Setup(context=context, micro_batch=micro, checkpointing=checkpointing,
                                                    autocast=False, dropout=False, reserve_gb=0.0))
    transient = prediction.activations + prediction.backward_peak  # gradients exist from the first micro-batch
    return {"case": dict(zip(("family", "layers", "hidden", "heads", "vocab", "context", "micro_batch",
                              "checkpointing"), case)),
            "measured_total": total, "predicted_total": prediction.total,
            "measured_step": measured_step, "predicted_step": transient,
            "prediction": prediction.model_dump()}


def preset_plans() -> list[dict]:
    """The plan of every GPT-2 preset on 1 and 8 GPUs of 80 GB."""
    from lnfree.removal.plan import plan_preset

    rows = []
    for preset in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"):
        for gpus in (1, 8):
            plan = plan_preset(preset, gpus, 80.0)
            rows.append({"preset": preset, "gpus": gpus, "plan": plan.describe(),
                         "micro_batch": plan.setup.micro_batch, "checkpointing": plan.setup.checkpointing,
                         "predicted_gb": plan.prediction.total / 1e9, "fits": plan.fits})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", type=int, help=argparse.SUPPRESS)  # internal: measure one case, print JSON
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    if args.case is not None:
        print(json.dumps(measure(CASES[args.case])))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    results = []
    print("predicted vs measured peak memory (CPU, fp32, one measured step, MB)")
    print(f"  {'case':<46} {'total pred/meas':>18} {'ratio':>6}   {'step pred/meas':>16} {'ratio':>6}")
    for index in range(len(CASES)):
        out = subprocess.run([sys.executable, __file__, "--case", str(index)], env=env, check=True,
                             capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        results.append(r)
        c = r["case"]
        label = (f"{c['family']} {c['layers']}×{c['hidden']} V{c['vocab']} {c['micro_batch']}×{c['context']}"
                 f"{' ckpt' if c['checkpointing'] else ''}")
        print(f"  {label:<46} {r['predicted_total'] / 2**20:8.0f} / {r['measured_total'] / 2**20:<8.0f}"
              f" {r['predicted_total'] / r['measured_total']:6.3f}   {r['predicted_step'] / 2**20:7.0f} / "
              f"{r['measured_step'] / 2**20:<7.0f} {r['predicted_step'] / r['measured_step']:6.3f}")
    plans = preset_plans()
    print("\nplans for the GPT-2 presets on 80 GB GPUs (bf16 autocast, dropout as in the presets)")
    for row in plans:
        print(f"  {row['preset']:<12} {row['gpus']} GPU(s): {row['plan']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"measurements": results, "preset_plans": plans}, f, indent=1)


if __name__ == "__main__":
    main()
