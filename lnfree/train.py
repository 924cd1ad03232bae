"""The removal (or vanilla-control) fine-tuning run, readable top to bottom.

One optimiser step: apply the schedule's events for this step, run the micro-batches
(cross-entropy + auxiliary loss at the ln_f input, bf16 autocast over fp32 weights on GPU),
clip, step AdamW at the warm-up/cosine learning rate, then fold the gathered per-token std
statistics into every real norm's σ (pooled over ranks). Data, learning rate and events are
pure functions of the step, so a run resumed from any checkpoint continues exactly.
Multi-GPU runs go through accelerate (``torchrun`` or ``accelerate launch``: DDP, or FSDP
through an accelerate config).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, set_seed
from torch import nn
from tqdm.auto import tqdm

from lnfree import surgery
from lnfree.config import RunConfig
from lnfree.data import StepBatches, TokenData, prepare_data
from lnfree.models import load_base
from lnfree.schedule import Event, derive_schedule

RUN_CONFIG = "run_config.json"
CHECKPOINTS = "checkpoints"
TOKENIZER = "tokenizer"


class RunError(ValueError):
    """A run that cannot start as configured."""


@dataclass
class RunResult:
    """What a finished run produced."""

    output_dir: Path
    config: RunConfig
    held_out_ce_start: float
    held_out_ce_end: float
    events: list[dict] = field(default_factory=list)
    checkpoint: Path | None = None
    model: nn.Module | None = None


# ----------------------------------------------------------------------------- pieces


def resolve_run(config: RunConfig, n_layer: int) -> tuple[RunConfig, list[Event]]:
    """Fill in derived defaults (schedule, max_steps) and validate the schedule."""
    removal, train = config.removal, config.train
    schedule = removal.schedule or derive_schedule(n_layer)
    last = schedule.events(n_layer)[-1].step
    max_steps = train.max_steps or max(3 * last, last + 1)
    config = config.model_copy(
        update={
            "removal": removal.model_copy(update={"schedule": schedule}),
            "train": train.model_copy(update={"max_steps": max_steps}),
        }
    )
    if removal.mode == "vanilla":
        return config, []
    return config, schedule.check(n_layer, max_steps, removal.special_pos0, removal.special_eot)


def learning_rate(step: int, config: RunConfig) -> float:
    """Linear warm-up to the peak, then cosine decay to the minimum over `cosine_steps`."""
    train = config.train
    if step < train.warmup_steps:
        return train.learning_rate * (step + 1) / train.warmup_steps
    total = train.cosine_steps or train.max_steps
    progress = min(1.0, (step - train.warmup_steps) / max(1, total - train.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return train.min_learning_rate + cosine * (train.learning_rate - train.min_learning_rate)


def make_optimizer(model: nn.Module, config: RunConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, norm weights or embeddings' biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.train.learning_rate, betas=config.train.betas)


class LnfInput:
    """Keeps the input of ln_f from the latest forward pass (a registered forward pre-hook)."""

    def __init__(self, ln_f: nn.Module):
        self.value: torch.Tensor | None = None
        self.handle = ln_f.register_forward_pre_hook(self._keep)

    def _keep(self, module: nn.Module, args: tuple) -> None:
        self.value = args[0]


def auxiliary_loss(resid: torch.Tensor, input_ids: torch.Tensor, eot_token_id: int, eps: float) -> torch.Tensor:
    """Mean squared deviation of the per-token std at the ln_f input from its typical value.

    The target is the detached mean std over tokens that are neither at position 0 nor EOT
    (DESIGN.md §1); the loss covers every token, pulling the outliers towards the target.
    """
    std = torch.sqrt(resid.float().var(dim=-1, unbiased=False) + eps)
    typical = input_ids != eot_token_id
    typical[:, 0] = False
    target = (std * typical).sum() / typical.sum().clamp_min(1)
    return ((std - target.detach()) ** 2).mean()


@torch.no_grad()
def held_out_ce(model: nn.Module, data: TokenData, n_sequences: int, batch_size: int, autocast) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) on the first `n_sequences` held-out sequences."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokens = data.eval_batch(n_sequences)
    total = torch.zeros((), device=device, dtype=torch.float64)
    for chunk in tokens.split(batch_size):
        chunk = chunk.to(device)
        with autocast():
            logits = model(input_ids=chunk).logits
        total += F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="sum")
    model.train(was_training)
    return total / (tokens.shape[0] * (tokens.shape[1] - 1))


def _autocast_factory(config: RunConfig, device: torch.device):
    choice = config.train.mixed_precision
    if choice == "auto":
        choice = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "no"
    if choice == "no":
        return contextlib.nullcontext, "no"
    dtype = torch.bfloat16 if choice == "bf16" else torch.float16
    return (lambda: torch.autocast(device.type, dtype=dtype)), choice


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest `checkpoints/step_N` folder of a run, if any."""
    folders = sorted((output_dir / CHECKPOINTS).glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return folders[-1] if folders else None


def _prepare_output_dir(config: RunConfig, resume: bool, overwrite: bool) -> Path:
    out = Path(config.output_dir)
    previous = out / RUN_CONFIG
    if previous.exists():
        # A run folder may have been moved: compare everything but where it lives.
        stored = {**json.loads(previous.read_text()), "output_dir": config.output_dir}
        same = stored == json.loads(config.model_dump_json())
        if resume and not same:
            raise RunError(f"{out} holds a run with a different config; cannot resume it with this one")
        if not resume and not overwrite:
            what = "this same run" if same else "a different run"
            raise RunError(f"{out} already holds {what}; continue it with resume=True (CLI: --resume) or replace it with overwrite=True (--overwrite)")
        if overwrite:
            shutil.rmtree(out)
    elif resume:
        raise RunError(f"nothing to resume in {out}")
    elif out.exists() and any(out.iterdir()) and not overwrite:
        raise RunError(f"{out} is not empty and holds no lnfree run; choose another output_dir (CLI: --output-dir)")
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_CONFIG).write_text(config.model_dump_json(indent=2))
    return out


def save_checkpoint(accelerator: Accelerator, model: nn.Module, out: Path, step: int, model_config) -> Path:
    """Model (with removal buffers), optimiser and RNG states, after `step` completed steps."""
    folder = out / CHECKPOINTS / f"step_{step:06d}"
    accelerator.save_state(str(folder))
    if accelerator.is_main_process:
        model_config.save_pretrained(folder)
        state = {"step": step}
        if surgery.is_installed(model):
            state["removal_state"] = surgery.removal_state(model)
        (folder / "trainer_state.json").write_text(json.dumps(state, indent=1))
    accelerator.wait_for_everyone()
    return folder


# ----------------------------------------------------------------------------- the run


def run(config: RunConfig, *, resume: bool = False, overwrite: bool = False, progress: bool = True) -> RunResult:
    """Fine-tune `config.model` with LayerNorm removal (or the vanilla control) and return the result.

    Everything that can be checked (model, tokenizer, data, schedule) is checked before the
    output folder is touched.
    """
    accelerator = Accelerator(
        cpu=not torch.accelerator.is_available(),  # lets torchrun start gloo processes on CPU-only hosts
        mixed_precision="no",  # autocast is applied explicitly below; weights stay fp32
        log_with=config.train.report_to or None,
        project_dir=config.output_dir,
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
    )
    set_seed(config.train.seed)
    model, tokenizer = load_base(config.model)
    config, events = resolve_run(config, model.config.n_layer)
    train = config.train
    context = config.data.context_length or model.config.n_positions
    if context > model.config.n_positions:
        raise RunError(f"context_length {context} exceeds the model's n_positions {model.config.n_positions}")
    world = accelerator.num_processes
    sequences = train.tokens_per_step // context
    accumulation = sequences // (train.micro_batch_size * world)
    if accumulation < 1 or accumulation * train.micro_batch_size * world * context != train.tokens_per_step:
        raise RunError(
            f"tokens_per_step {train.tokens_per_step} must be a multiple of micro_batch_size × processes × context "
            f"= {train.micro_batch_size} × {world} × {context}"
        )
    with accelerator.main_process_first():
        data = prepare_data(config.data, tokenizer, context, model.config.vocab_size)
    if accelerator.is_main_process:
        _prepare_output_dir(config, resume, overwrite)
        tokenizer.save_pretrained(Path(config.output_dir) / TOKENIZER)
    accelerator.wait_for_everyone()
    out = Path(config.output_dir)

    removing = config.removal.mode == "remove"
    if removing:
        surgery.install(
            model, special_pos0=config.removal.special_pos0, special_eot=config.removal.special_eot,
            eot_token_id=data.eot_token_id,
        )
    if train.dropout is not None:
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = train.dropout
    if train.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.to(accelerator.device)
    autocast, precision = _autocast_factory(config, accelerator.device)
    batches = StepBatches(data.train, train.micro_batch_size, accumulation, world, train.seed)
    momentum = train.sigma_momentum ** (batches.sequences_per_step / train.sigma_momentum_sequences)
    log_path = out / "log.jsonl"

    def log(record: dict) -> None:
        if accelerator.is_main_process:
            with log_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if train.report_to:
                accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record.get("step"))

    if train.report_to:
        accelerator.init_trackers("lnfree", config=json.loads(config.model_dump_json()))
    if not resume:  # measured on the plain module, before any DDP/FSDP wrapping
        ce_start = held_out_ce(model, data, config.data.eval_sequences, train.micro_batch_size, autocast).item()
        if removing:
            init = (batches.get(0, i % accumulation, accelerator.process_index).to(accelerator.device)
                    for i in range(train.sigma_init_batches))
            surgery.initialise_sigmas(model, init)
        if accelerator.is_main_process:
            (out / "start.json").write_text(json.dumps({"held_out_ce": ce_start}))
        log({"event": "start", "step": 0, "held_out_ce": ce_start, "mode": config.removal.mode, "precision": precision,
             "processes": world, "accumulation": accumulation, "data": data.description,
             "sigma_momentum_per_step": momentum})

    optimizer = make_optimizer(model, config)
    model, optimizer = accelerator.prepare(model, optimizer)
    bare = accelerator.unwrap_model(model)
    eval_ce = lambda: held_out_ce(model, data, config.data.eval_sequences, train.micro_batch_size, autocast)  # noqa: E731
    start_step = 0
    if resume:
        checkpoint = latest_checkpoint(out)
        if checkpoint is None:
            raise RunError(f"no checkpoint to resume in {out / CHECKPOINTS}")
        accelerator.load_state(str(checkpoint))
        start_step = json.loads((checkpoint / "trainer_state.json").read_text())["step"]
        ce_start = json.loads((out / "start.json").read_text())["held_out_ce"]
        log({"event": "resume", "step": start_step, "checkpoint": str(checkpoint)})
    lnf_input = LnfInput(bare.transformer.ln_f)
    eps = bare.config.layer_norm_epsilon
    events_by_step: dict[int, list[Event]] = {}
    for event in events:
        events_by_step.setdefault(event.step, []).append(event)
    event_log: list[dict] = []
    pending: list[torch.Tensor] = []  # per-step (loss, ce, aux, grad_norm), read once per log interval
    bar = tqdm(range(start_step, train.max_steps), initial=start_step, total=train.max_steps,
               disable=not (progress and accelerator.is_main_process), desc=config.removal.mode)
    model.train()
    started = time.perf_counter()
    for step in bar:
        for event in events_by_step.get(step, []):
            surgery.apply_event(bare, event)
            record = {"event": "remove", "step": step, "slot": event.slot}
            if event.kind not in surgery.SPECIALS:
                record["sigma"] = float(surgery.scale_states(bare)[event.slot].sigma)
            event_log.append(record)
            log(record)
        lr = learning_rate(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        totals = torch.zeros(3, device=accelerator.device)
        for micro in range(accumulation):
            input_ids = batches.get(step, micro, accelerator.process_index).to(accelerator.device)
            sync = contextlib.nullcontext() if micro == accumulation - 1 else accelerator.no_sync(model)
            with sync:
                with autocast():
                    ce = model(input_ids=input_ids, labels=input_ids).loss
                aux = auxiliary_loss(lnf_input.value, input_ids, data.eot_token_id, eps)
                loss = ce + train.aux_loss_weight * aux
                accelerator.backward(loss / accumulation)
            totals += torch.stack([loss.detach(), ce.detach(), aux.detach()]) / accumulation
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if removing:
            surgery.update_sigmas(bare, momentum)
        pending.append(torch.cat([totals, grad_norm.detach().reshape(1).to(totals)]))

        done = step + 1
        if done % train.log_every == 0 or done == train.max_steps:
            values = torch.stack(pending).mean(0).tolist()
            pending.clear()
            record = dict(zip(("loss", "ce", "aux", "grad_norm"), values))
            record.update(step=done, lr=lr, tokens=done * train.tokens_per_step,
                          seconds=round(time.perf_counter() - started, 2))
            log(record)
            bar.set_postfix(ce=f"{record['ce']:.3f}", aux=f"{record['aux']:.3g}")
        if train.eval_every and done % train.eval_every == 0 and done != train.max_steps:
            log({"event": "eval", "step": done, "held_out_ce": eval_ce().item()})
        if train.save_every and done % train.save_every == 0 and done != train.max_steps:
            save_checkpoint(accelerator, bare, out, done, bare.config)
    lnf_input.handle.remove()

    ce_end = eval_ce().item()
    log({"event": "end", "step": train.max_steps, "held_out_ce": ce_end})
    checkpoint = save_checkpoint(accelerator, bare, out, train.max_steps, bare.config)
    if train.report_to:
        accelerator.end_training()
    return RunResult(out, config, ce_start, ce_end, event_log, checkpoint, bare)
