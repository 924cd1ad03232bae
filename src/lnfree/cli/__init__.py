"""The `lnfree` command line."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from lnfree.errors import LnfreeError
from lnfree.cli.analysis import analyze
from lnfree.cli.stress import stress
from lnfree.cli.common import MODEL_NAMES_HELP, base_config, fail, user_errors
from lnfree.removal.layout import CONTROL, RUN_CONFIG, SUMMARY

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Remove LayerNorm/RMSNorm from pretrained language models (GPT-2, Llama, Mistral, Qwen2, Qwen3, GPT-NeoX/Pythia, Gemma 3, OLMo 2) by fine-tuning.")

PRESET_OPT = typer.Option("--preset", "-p", help="A shipped preset (see `lnfree presets`). (default: tiny)")
CONFIG_OPT = typer.Option("--config", "-c", help="A TOML or JSON run config, instead of a preset. (default: none)")


class _MessageLines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        prefix = "warning: " if record.levelno >= logging.WARNING else ""
        typer.secho(prefix + record.getMessage(), err=True, fg=typer.colors.YELLOW if prefix else None)


def _show_messages() -> None:
    """Print lnfree's own log messages (data counts, resume notes, warnings) on stderr."""
    logger = logging.getLogger("lnfree")
    logger.handlers = [h for h in logger.handlers if not isinstance(h, _MessageLines)] + [_MessageLines()]
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _removal_lines(events: list[dict]) -> list[str]:
    by_kind: dict[str, list[str]] = {}
    for e in events:
        kind = e["slot"].split(".")[-1]
        layer = e["slot"].split(".")[1] if e["slot"].startswith("blocks.") else ""
        by_kind.setdefault(kind, []).append(f"{'block ' + layer + ' ' if layer else ''}@{e['step']}")
    return [f"  {kind:>12}: {', '.join(parts)}" for kind, parts in by_kind.items()]


def _summary_lines(summary: dict) -> list[str]:
    tokens = f"{summary['held_out_tokens']:,} tokens" if "held_out_tokens" in summary else "tokens not recorded"
    lines = [f"\n{summary['model']}: {summary['steps']} steps, {summary['tokens']:,} tokens, {summary['seconds']} s",
             "held-out cross-entropy (nats):"]
    lines += [f"  {name:>12}: {value:.4f}  (on {tokens})" for name, value in summary["held_out_ce"].items()]
    if summary["removal_events"]:
        lines += ["removed (block @ step):", *_removal_lines(summary["removal_events"])]
    if "export" in summary:
        lines.append(f"LN-free export: {summary['export']}")
    if "partial" in summary:
        lines.append(f"partial removal: {summary['partial']}")
    return lines


@app.command()
def remove(
    model: Annotated[Optional[str], typer.Option(help=f"Local folder, Hub id or name ({MODEL_NAMES_HELP}) of a supported model. (default: the bundled tiny model)")] = None,
    data: Annotated[Optional[str], typer.Option("--dataset", "--data", help="Training text: 'tiny', 'realtext', a Hub dataset id, or a local file/folder. (default: the preset's)")] = None,
    preset: Annotated[Optional[str], typer.Option("--preset", "-p", help="A shipped preset (see `lnfree presets`). (default: the preset of --model, else distillation with GPT-2 small's settings; tiny without --model)")] = None,
    config: Annotated[Optional[Path], CONFIG_OPT] = None,
    output_dir: Annotated[Optional[str], typer.Option("--output-dir", "-o", help="Run folder. (default: the preset's, runs/NAME)")] = None,
    mode: Annotated[Optional[str], typer.Option(help="'remove' or 'vanilla' (the control: no LN removed). (default: remove)")] = None,
    max_steps: Annotated[Optional[int], typer.Option(help="Optimiser steps. (default: the preset's, else 3 × the last removal)")] = None,
    tokens_per_step: Annotated[Optional[int], typer.Option(help="Tokens per optimiser step. (default: the preset's, 2^19 for GPT-2)")] = None,
    micro_batch_size: Annotated[Optional[int], typer.Option(help="Sequences per device per forward. (default: the preset's; the largest that fits the step if --tokens-per-step is given)")] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help="Peak learning rate; a value below the preset's floor (train.min_learning_rate) lowers the floor to it. (default: the preset's)")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed of the data order and initialisation. (default: the preset's)")] = None,
    control: Annotated[Optional[bool], typer.Option("--control/--no-control", help="Also run the vanilla control. (default: on for the tiny model)")] = None,
    override: Annotated[Optional[list[str]], typer.Option("--set", help="Any config field, e.g. --set train.aux_loss_weight=0.03 (repeatable). (default: none)")] = None,
    resume: Annotated[bool, typer.Option(help="Continue the run in --output-dir from its latest complete checkpoint.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace a run already in --output-dir (files it wrote only).")] = False,
) -> None:
    """Fine-tune a model while removing its norms one by one, then export it LN-free."""
    from lnfree.cli.common import remove_config
    from lnfree.models.sources import check_model_source
    from lnfree.removal.launch import close_distributed, exit_without_teardown

    _show_messages()
    with user_errors():
        named = {
            "model": model, "data.source": data, "output_dir": output_dir, "removal.mode": mode,
            "train.max_steps": max_steps, "train.tokens_per_step": tokens_per_step,
            "train.micro_batch_size": micro_batch_size, "train.learning_rate": lr, "train.seed": seed,
        }
        cfg = remove_config(base_config(preset, config, model), named, override or [])
        check_model_source(cfg.model)
    if resume and not (Path(cfg.output_dir) / RUN_CONFIG).is_file():
        fail(f"nothing to resume in {cfg.output_dir}: it holds no lnfree run (drop --resume to start one)")
    run_control = control if control is not None else (cfg.model == "tiny" and cfg.removal.mode == "remove")
    started = time.perf_counter()
    finished = False
    try:
        with _sigterm_as_interrupt():
            _remove_and_report(cfg, resume, overwrite, run_control, started)
        finished = True
    except KeyboardInterrupt:
        _interrupted(Path(cfg.output_dir))
    finally:
        if close_distributed() and finished:
            exit_without_teardown(0)


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM (a scheduler, `kill`, torchrun stopping its workers) ends a run as Ctrl-C does: with where
    it stands and how to resume it. Background jobs started from a shell ignore SIGINT, so this is how
    they are stopped."""
    import signal
    import threading

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupted(out: Path) -> None:
    """Ctrl-C (or SIGTERM) during `lnfree remove`: say where the run stands and how to continue it; exit 130."""
    import shlex
    import sys

    from lnfree.removal.layout import latest_checkpoint

    latest = latest_checkpoint(out)
    args = [a for a in sys.argv[1:] if a not in ("--resume", "--overwrite")]
    command = " ".join(shlex.quote(a) for a in ["lnfree", *args, "--resume"])
    where = f"its latest complete checkpoint is {latest}" if latest else "it saved no checkpoint yet (start it again)"
    typer.echo(f"interrupted: the run in {out} stopped; {where}. Continue it with:\n  {command}", err=True)
    raise typer.Exit(130)


def _remove_and_report(cfg, resume: bool, overwrite: bool, run_control: bool, started: float) -> None:
    """The removal (and control) runs, the export and the summary of `lnfree remove`."""
    from lnfree.removal.config import with_overrides
    from lnfree.fixedscale import surgery
    from lnfree.forms.export import RunawayError, export_run
    from lnfree.removal.train import quiet_libraries, run

    with user_errors(), quiet_libraries():
        result = run(cfg, resume=resume, overwrite=overwrite)
        control_result = None
        if run_control:
            control_cfg = with_overrides(cfg, {"removal.mode": "vanilla", "output_dir": str(Path(cfg.output_dir) / CONTROL)})
            control_resume = resume and (Path(control_cfg.output_dir) / RUN_CONFIG).exists()
            control_result = run(control_cfg, resume=control_resume, overwrite=False)
        from accelerate import PartialState

        if not PartialState().is_main_process:
            return
        out = result.output_dir
        runs = [result] + ([control_result] if control_result is not None else [])
        if all(r.already_finished for r in runs) and (out / SUMMARY).exists():
            typer.echo(f"{out} is finished already: nothing changed")
            typer.echo("\n".join(_summary_lines(json.loads((out / SUMMARY).read_text()))))
            return
        summary = {
            "model": cfg.model,
            "mode": cfg.removal.mode,
            "held_out_ce": {"original": result.held_out_ce_start,
                            ("ln_free" if cfg.removal.mode == "remove" else "vanilla"): result.held_out_ce_end},
            "held_out_tokens": result.held_out_tokens,
            "steps": result.config.train.max_steps,
            "tokens": result.config.train.max_steps * cfg.train.tokens_per_step,
            "removal_events": result.events,
            "checkpoint": str(result.checkpoint),
            "seconds": round(sum(r.seconds for r in runs), 1),  # fine-tuning, over every process (resumes included)
        }
        if control_result is not None:
            summary["held_out_ce"]["vanilla"] = control_result.held_out_ce_end
            summary["control_dir"] = str(control_result.output_dir)
        if cfg.removal.mode == "remove":
            if surgery.is_fully_removed(result.model):
                try:
                    summary["export"] = str(export_run(result, held_out_ce=summary["held_out_ce"]))
                except RunawayError as err:  # the run stands; the summary says why it has no export
                    summary["export_refused"] = f"{err} (lnfree export {out} OUT --allow-runaway)"
            else:  # a plain model has one eps for every norm: only the run's checkpoints hold a partial removal
                states = surgery.scale_states(result.model).values()
                fixed = sum(s.is_fixed for s in states)
                what = (f"{fixed} of {len(states)} norms fixed" if fixed < len(states)
                        else "every norm fixed but a special σ still active")
                summary["partial"] = (f"{what}: no plain export; lnfree.load, verify, eval and analyze read the run "
                                      f"folder {out}")
            summary["ce_gap_ln_free_minus_original"] = result.held_out_ce_end - result.held_out_ce_start
        (out / SUMMARY).write_text(json.dumps(summary, indent=1))
    typer.echo("\n".join(_summary_lines(summary)))
    typer.echo(f"summary: {out / 'summary.json'} (this invocation: {time.perf_counter() - started:.1f} s)")
    if "export_refused" in summary:
        fail(f"no export: {summary['export_refused']}")


@app.command()
def schedule(
    preset: Annotated[Optional[str], PRESET_OPT] = None,
    config: Annotated[Optional[Path], CONFIG_OPT] = None,
    n_layer: Annotated[Optional[int], typer.Option(help="Depth to expand for. (default: the preset's model's)")] = None,
    events: Annotated[bool, typer.Option("--events", help="List every event, not one line per stage. (default: off)")] = False,
) -> None:
    """Print a preset's removal timeline."""
    from lnfree.arch import architecture
    from lnfree.removal.plan import config_of
    from lnfree.removal.schedule import PER_LAYER_KINDS
    from lnfree.removal.train import resolve_run

    with user_errors():
        cfg = base_config(preset, config, None)
    stages = PER_LAYER_KINDS[:3]
    if n_layer is None:
        try:  # the presets' GPT-2 sizes are known offline (as for `lnfree plan`)
            arch = architecture(config_of(cfg.model))
        except (LnfreeError, ValueError, OSError) as err:  # transformers' AutoConfig: ValueError for an unknown type
            fail(f"{err} (pass --n-layer)")
        n_layer, stages = arch.n_layers, arch.stages
    with user_errors():
        cfg, timeline = resolve_run(cfg, n_layer, stages)
    typer.echo(f"{cfg.description or cfg.model} — {n_layer} blocks, {cfg.train.max_steps} steps")
    if events:
        for e in timeline:
            typer.echo(f"  step {e.step:>5}: {e.slot}")
    else:
        typer.echo(cfg.removal.schedule.describe(n_layer))
    removal = cfg.removal
    if removal.massive_neurons is not None:
        m = removal.massive_neurons
        typer.echo(f"massive-activation neurons (found as the run starts): output damped from 1 to {m.floor:g} over "
                   f"steps {m.start}–{m.start + m.steps - 2}, zeroed at step {m.start + m.steps - 1}")
    if removal.scale_ceiling is not None:
        c = removal.scale_ceiling
        release = c.release_at(cfg.train.max_steps)
        spared = "" if c.position0 else " (position 0 spared)"
        typer.echo(f"scale ceiling: no token leaves a fixed norm above {c.ratio:g}× its σ{spared} until step "
                   f"{release}; released over steps {release}–{release + c.release_steps - 1}")
    if removal.blend_steps > 1:
        typer.echo(f"gradual: each removal blends into its fixed σ over {removal.blend_steps} steps")
    if removal.adaptive:
        a = removal.adaptive
        typer.echo(f"adaptive: after the first, each removal waits {a.min_gap}–{a.max_gap} steps until the "
                   f"training CE (mean of {a.window} steps) is within {a.delta} nats of its level before the "
                   "previous one; the steps above are the schedule's order, not its timing")


@app.command()
def plan(
    preset: Annotated[Optional[str], PRESET_OPT] = None,
    config: Annotated[Optional[Path], CONFIG_OPT] = None,
    gpus: Annotated[int, typer.Option(help="GPUs the run is spread over (DDP).")] = 1,
    gpu_memory: Annotated[str, typer.Option(help="Memory of one GPU, e.g. 80GB.")] = "80GB",
    fsdp: Annotated[bool, typer.Option("--fsdp", help="Shard weights, gradients and optimiser states (FSDP). (default: DDP)")] = False,
) -> None:
    """Predict peak memory per GPU and pick the micro-batch and checkpointing that fit."""
    from lnfree.removal.plan import plan_config

    with user_errors():
        cfg = base_config(preset, config, None)
        memory = float(gpu_memory.upper().removesuffix("GB").strip())
        chosen = plan_config(cfg, gpus, memory, sharded=fsdp)
    typer.echo(f"{cfg.description or cfg.model}")
    typer.echo(chosen.describe())
    s = chosen.setup
    typer.echo(f"settings: --set train.micro_batch_size={s.micro_batch} "
               f"--set train.gradient_checkpointing={str(s.checkpointing).lower()}")


@app.command()
def export(
    checkpoint: Annotated[Path, typer.Argument(help="A run folder (its latest checkpoint) or a checkpoints/step_N folder.")],
    out: Annotated[Path, typer.Argument(help="Folder to write the eps-trick model to.")],
    allow_partial: Annotated[bool, typer.Option(help="Export even if some norms are still real.")] = False,
    allow_runaway: Annotated[bool, typer.Option(help="Export even if the model overflows on some probe rows (rare, repeated or special tokens).")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace OUT if it exists and is not empty.")] = False,
) -> None:
    """Export a training checkpoint as a plain transformers model in the eps-trick format."""
    from lnfree.forms.export import load_checkpoint, write_export
    from lnfree.removal.layout import latest_checkpoint
    from lnfree.removal.train import quiet_libraries

    if not checkpoint.exists():
        fail(f"no such folder: {checkpoint}")
    if (checkpoint / RUN_CONFIG).exists():
        checkpoint = latest_checkpoint(checkpoint) or fail(f"no complete checkpoint in {checkpoint}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        fail(f"{out} already exists and is not empty; pass --overwrite to replace it")
    with user_errors(), quiet_libraries():
        model, tokenizer, cfg = load_checkpoint(checkpoint)
        if cfg.removal.mode != "remove":
            fail(f"{checkpoint} is a vanilla-control run: it has no removed norms to export")
        record = {"run_config": json.loads(cfg.model_dump_json()), "checkpoint": str(checkpoint)}
        write_export(model, tokenizer, out, record, allow_partial=allow_partial, overwrite=overwrite,
                     allow_runaway=allow_runaway)
    typer.echo(f"exported {checkpoint} → {out}")


@app.command()
def verify(
    source: Annotated[str, typer.Argument(help="An export, a run or checkpoint folder, or any supported model's folder / Hub id.")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Also write the report as JSON to this file. (default: none)")] = None,
    tolerance: Annotated[float, typer.Option(help="Largest |Δlogit| / max(1, the token's largest |logit|) accepted "
                                                  "(fp32 rounds relative to the logits' size).")] = 1e-4,
    seed: Annotated[int, typer.Option(help="Seed of the probe's random tokens.")] = 0,
) -> None:
    """Compare every representation of a checkpoint with lnfree's exact form; exit 1 beyond tolerance."""
    from lnfree.removal.train import quiet_libraries
    from lnfree.forms.verify import verify as run_verify, write_report

    with user_errors(), quiet_libraries():
        report = run_verify(source, tolerance=tolerance, seed=seed)
        if out is not None:
            write_report(report, out)
    typer.echo(report["repr"])
    for name, check in report["checks"].items():
        typer.echo(f"  {'ok  ' if check['ok'] else 'FAIL'} {name:>30}: {_check_line(check, tolerance)}")
    fingerprint = report["fingerprint"]
    status = "FAIL" if not fingerprint["ok"] else ("ok  " if fingerprint["checked"] else "note")
    typer.echo(f"  {status} {'export fingerprint':>30}: {fingerprint['note']}")
    if out is not None:
        typer.echo(f"report: {out}")
    if not report["ok"]:
        raise typer.Exit(1)


def _check_line(check: dict, tolerance: float) -> str:
    """One `lnfree verify` check: the value compared with the tolerance first, then the worst token."""
    if check["max_abs_diff"] is None:
        return f"n/a  {check['note']}".rstrip()
    compared = (f"max |Δ| / logit scale {check['max_scaled_diff']:.2e} (tolerance {tolerance:.0e}; "
                f"max |Δ| {check['max_abs_diff']:.2e})")
    worst = check.get("worst_token")
    where = "" if worst is None else (
        f"; worst token {check['worst_token_relative_error']:.1e} relative, row {worst['row']} position "
        f"{worst['position']} ({worst.get('text', worst['token_id'])!r})")
    return f"{compared}{where}  {check['note']}".rstrip()


@app.command()
def push(
    export_dir: Annotated[Path, typer.Argument(help="An lnfree export folder.")],
    repo_id: Annotated[str, typer.Option("--repo-id", help="USER/NAME on the Hugging Face Hub.")],
    private: Annotated[bool, typer.Option(help="Create the repository as private.")] = False,
    revision: Annotated[Optional[str], typer.Option(help="Branch to push to (created if missing). (default: main)")] = None,
    dry_run: Annotated[bool, typer.Option(help="Only write the folder that would be uploaded.")] = False,
    dry_run_dir: Annotated[Optional[Path], typer.Option(help="Where --dry-run writes. (default: EXPORT-hub)")] = None,
    force: Annotated[bool, typer.Option(help="Overwrite a branch that already holds files.")] = False,
    eval_report: Annotated[Optional[list[Path]], typer.Option("--eval", help="An `lnfree eval` output folder or summary.json to put in the card's model-index (repeatable). (default: none)")] = None,
) -> None:
    """Verify an export and publish it with a model card (token from `hf auth login` or HF_TOKEN)."""
    from lnfree.forms.hub import push as run_push

    try:
        where = run_push(export_dir, repo_id, private=private, revision=revision, dry_run=dry_run,
                         dry_run_dir=dry_run_dir, force=force, eval_reports=eval_report or [])
    except (LnfreeError, OSError) as err:
        fail(str(err))
    typer.echo(f"{'dry run written to' if dry_run else 'pushed:'} {where}")


def _join_labels(args: list[str]) -> list[str]:
    """`--labels a b c` → `--labels a,b,c`: labels may follow `--labels` space- or comma-separated."""
    out, i = [], 0
    while i < len(args):
        out.append(args[i])
        i += 1
        if out[-1] in ("--labels", "-l"):
            end = i
            while end < len(args) and not args[end].startswith("-"):
                end += 1
            if end > i:
                out.append(",".join(args[i:end]))
            i = end
    return out


class _LabelsCommand(typer.core.TyperCommand):
    """A command whose `--labels` may be followed by several space-separated labels."""

    def parse_args(self, ctx, args):
        return super().parse_args(ctx, _join_labels(list(args)))


@app.command("eval", cls=_LabelsCommand)
def eval_(
    models: Annotated[list[str], typer.Argument(help=f"Models: a name ({MODEL_NAMES_HELP}), run/checkpoint/export folders, model folders or Hub ids.")],
    dataset: Annotated[str, typer.Option("--dataset", "-d", help="tiny, realtext, owt-val, pile, pile-filtered, a Hub dataset id or a local file/folder.")] = "tiny",
    labels: Annotated[Optional[list[str]], typer.Option("--labels", "-l", help="One label per model, space- or comma-separated, after the models. (default: from the model names)")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder: new or empty, else --overwrite.")] = Path("runs/eval"),
    overwrite: Annotated[bool, typer.Option(help="Write into a --out that holds files: an earlier evaluation there is replaced, nothing else.")] = False,
    n_sequences: Annotated[Optional[int], typer.Option(help="First N sequences. (default: the dataset preset's)", min=1)] = None,
    context: Annotated[Optional[int], typer.Option(help="Tokens per sequence. (default: the preset's, else the models' longest context up to 1024)", min=2)] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Sequences per forward pass. (default: up to 8, fewer where one batch's logits would pass 1 GB per model)", min=1)] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:1, …")] = "auto",
    dtype: Annotated[str, typer.Option(help="fp32, bf16 or fp16 (eps-trick files overflow fp16).")] = "fp32",
    form: Annotated[str, typer.Option(help="hf: lnfree's exact fixed-scale form; folded: LN-free weights folded; plain: the file as transformers loads it.")] = "hf",
    threshold: Annotated[float, typer.Option(help="List tokens whose CE (nats) exceeds this.")] = 50.0,
    max_outliers: Annotated[int, typer.Option(help="How many of them to list per model (all are counted).")] = 50,
    reference: Annotated[Optional[str], typer.Option(help="Label to compute Δ against. (default: 'vanilla', else the best model)")] = None,
    pairwise: Annotated[Optional[bool], typer.Option("--pairwise/--no-pairwise", help="JSD and paired ΔCE between models. (default: when they share a tokenizer)")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the bootstrap CIs.")] = 0,
    bootstrap: Annotated[int, typer.Option(help="Bootstrap resamples (over blocks of neighbouring sequences).", min=1)] = 1000,
    bootstrap_block: Annotated[Optional[int], typer.Option(help="Neighbouring sequences resampled together. (default: round(√N))", min=1)] = None,
    split: Annotated[Optional[str], typer.Option(help="Dataset split (Hub ids, save_to_disk folders). (default: the preset's, else train)")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Dataset revision (Hub ids). (default: the preset's, else the latest)")] = None,
    text_field: Annotated[str, typer.Option(help="Text column of a dataset without input_ids.")] = "text",
    cache_dir: Annotated[Optional[str], typer.Option(help="Token cache. (default: ~/.cache/lnfree/eval)")] = None,
    save_tokens: Annotated[bool, typer.Option("--save-tokens", help="Also write every per-token CE/entropy/JSD (tokens.npz). (default: off)")] = False,
    hellaswag: Annotated[bool, typer.Option("--hellaswag", help="Also run HellaSwag (needs `pip install lm-eval`). (default: off)")] = False,
    hellaswag_limit: Annotated[Optional[int], typer.Option(help="Only the first N HellaSwag items. (default: all)")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")] = True,
) -> None:
    """Per-token cross-entropy of one or more models on identical tokens, compared (docs/how-to/evaluate.md)."""
    from lnfree.evaluate import evaluate, markdown, write_report
    from lnfree.evaluate.output import check_output_folder
    from lnfree.evaluate.results import model_labels
    from lnfree.removal.train import quiet_libraries

    names = [x.strip() for item in labels or [] for x in item.split(",") if x.strip()] or None
    try:
        check_output_folder(out, model_labels(models, names), overwrite=overwrite, save_tokens=save_tokens)
        with quiet_libraries():
            report = evaluate(
                models, dataset, labels=names, form=form, dtype=dtype, device=device, batch_size=batch_size,
                n_sequences=n_sequences, context=context, split=split, revision=revision, text_field=text_field,
                cache_dir=cache_dir, progress=progress, benchmarks=["hellaswag"] if hellaswag else [],
                benchmark_limit=hellaswag_limit, threshold=threshold, max_outliers=max_outliers, reference=reference,
                pairwise=pairwise, seed=seed, n_resamples=bootstrap, bootstrap_block=bootstrap_block,
            )
    except (LnfreeError, OSError) as err:
        fail(str(err))
    write_report(report, out, save_tokens=save_tokens, overwrite=overwrite)
    typer.echo(markdown(report))
    typer.echo(f"peak memory: {report.settings['peak_memory_gb']:.2f} GB (this process's peak RSS)")
    typer.echo(f"written to {out}/ (comparison.md, summary.json, one JSON + CSV per model)")


app.command("analyze", cls=_LabelsCommand)(analyze)
app.command("stress", cls=_LabelsCommand)(stress)


@app.command()
def presets() -> None:
    """List the shipped presets."""
    from lnfree.removal.config import load_preset, preset_names

    for name in preset_names():
        typer.echo(f"{name:>12}: {load_preset(name).description}")


if __name__ == "__main__":
    app()
