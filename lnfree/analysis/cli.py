"""`lnfree analyze NAME --models A B C`: run one analysis, or all of them, and index the figures."""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from lnfree.analysis.report import write_index_pages
from lnfree.derived import clear_stale

#: Analysis name on the command line → module with a `run(models, out_dir, ...)` function.
ANALYSES = {
    "dla": "lnfree.analysis.dla",
    "patching": "lnfree.analysis.patching",
    "entropy-neurons": "lnfree.analysis.entropy_neurons",
    "residual": "lnfree.analysis.residual",
}
#: Analyses that read held-out token sequences (patching makes its own IOI prompts).
NEEDS_TOKENS = {"dla", "entropy-neurons", "residual"}
#: Analyses that take `batch_size` (sequences per forward pass).
BATCHED = {"dla", "residual"}


def run_analyses(
    names: list[str], sources: list[str], out: Path, *, labels: list[str] | None = None, data: str = "tiny",
    n_sequences: int = 32, length: int = 64, n_prompts: int = 32, seed: int = 0, n_bootstrap: int = 1000,
    batch_size: int = 8, device: str = "auto", cache_dir: str | None = None, progress: bool = True,
) -> dict:
    """Run the named analyses on the same models and tokens; write `out/NAME/…` and an index.

    An analysis that cannot run on these models (:class:`NotApplicable`, e.g. IOI patching with a
    tokenizer that has no single-token names) is skipped with its reason in the index's
    ``skipped``; the others still run. Figures share one offline copy of plotly.js in `out`.
    """
    from lnfree.analysis.common import (
        NotApplicable,
        analysis_progress,
        evaluation_tokens,
        load_models,
        quiet_libraries,  # fmt: skip
        shared_plotly_js,
    )
    from lnfree.data import bos_token, tokenizer_fingerprint
    from lnfree.results import TIMINGS, write_summary

    unknown = [n for n in names if n not in ANALYSES]
    if unknown:
        raise ValueError(f"unknown analysis {unknown[0]!r}; choose from {', '.join(ANALYSES)} or 'all'")
    if not sources:
        raise ValueError("give at least one model: --models A [B ...]")
    with quiet_libraries(), shared_plotly_js(out):
        models = load_models(sources, labels, device=device)
        vocab = {m.label: m.loaded.model.config.vocab_size for m in models}
        if len(set(vocab.values())) > 1:
            raise ValueError(f"the models have different vocabularies {vocab}; analyses compare them on the same "
                             "tokens")
        if len({tokenizer_fingerprint(m.tokenizer) for m in models}) > 1:
            raise ValueError("the models' tokenizers differ; analyses compare models on the same tokens")
        tokens = None
        if NEEDS_TOKENS & set(names):
            tokens = evaluation_tokens(models[0].tokenizer, source=data, n_sequences=n_sequences, length=length,
                                       vocab_size=next(iter(vocab.values())), cache_dir=cache_dir,
                                       bos_token_id=bos_token(models[0].loaded.model, models[0].tokenizer))
        summaries, skipped, timings = {}, {}, {}
        for name in names:
            started = time.perf_counter()
            module = importlib.import_module(ANALYSES[name])
            kwargs = {"seed": seed, "n_bootstrap": n_bootstrap}
            if name in NEEDS_TOKENS:
                kwargs["tokens"] = tokens
                if name in BATCHED:
                    kwargs["batch_size"] = batch_size
            else:
                kwargs["n_prompts"] = n_prompts
            try:
                with analysis_progress(models, name, enabled=progress):
                    summary = module.run(models, out / name, **kwargs)
            except NotApplicable as err:
                skipped[name] = str(err)
                typer.secho(f"{name}: skipped: {err}", fg=typer.colors.YELLOW, err=True)
                continue
            timings[name] = round(time.perf_counter() - started, 1)
            summaries[name] = summary
            typer.echo(f"{name}: {len(summary.get('figures', []))} figures, {timings[name]} s → {out / name}")
    index = {
        "models": {m.label: {"source": str(m.loaded.source), "repr": repr(m.loaded)} for m in models},
        "data": data if tokens is not None else None,
        "tokens": list(tokens.shape) if tokens is not None else None,
        "seed": seed,
        "analyses": summaries,
        "skipped": skipped,
    }
    write_summary(index, out, "index")
    write_summary({"seconds": timings}, out, TIMINGS)
    write_index_pages(index, out)
    clear_stale(out)
    return index


def analyze(
    name: Annotated[str, typer.Argument(help=f"One of {', '.join(ANALYSES)}, or 'all'.")],
    more_models: Annotated[Optional[list[str]], typer.Argument(help="Further models after --models A.", show_default=False)] = None,
    models: Annotated[Optional[list[str]], typer.Option("--models", "-m", help="Models (folders, Hub ids, 'tiny'): --models A B C.")] = None,
    labels: Annotated[Optional[str], typer.Option(help="One label per model, space- or comma-separated: original vanilla ln_free.")] = None,
    data: Annotated[str, typer.Option(help="Token source for DLA, entropy neurons and residual norms: any `lnfree eval --dataset` (tiny, owt-val, pile, pile-filtered, a Hub id, a path).")] = "tiny",
    n_sequences: Annotated[int, typer.Option(help="Held-out sequences.")] = 32,
    length: Annotated[int, typer.Option(help="Tokens per sequence.")] = 64,
    n_prompts: Annotated[int, typer.Option(help="IOI prompts for patching.")] = 32,
    n_bootstrap: Annotated[int, typer.Option(help="Bootstrap resamples for CIs.")] = 1000,
    seed: Annotated[int, typer.Option()] = 0,
    batch_size: Annotated[int, typer.Option(help="Sequences per forward pass for DLA and residual norms (1 for GPT-2 XL DLA).", min=1)] = 8,
    device: Annotated[str, typer.Option(help="auto (CUDA if available), cpu, cuda, cuda:1, …")] = "auto",
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder.")] = Path("runs/analysis"),
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="A progress bar per analysis.")] = True,
) -> None:
    """Run interpretability analyses (DLA vs DE, patching, entropy neurons, residual norms/sinks) on models.

    An analysis the models cannot support (e.g. IOI patching when the tokenizer has no single-token
    names) is skipped with its reason; the others run, and the exit status is then 1.
    """
    sources = list(models or []) + list(more_models or [])
    names = list(ANALYSES) if name == "all" else [name]
    label_list = [s.strip() for s in labels.split(",")] if labels else None
    try:
        index = run_analyses(names, sources, out, labels=label_list, data=data, n_sequences=n_sequences,
                             length=length, n_prompts=n_prompts, seed=seed, n_bootstrap=n_bootstrap,
                             batch_size=batch_size, device=device, progress=progress)  # fmt: skip
    except (ValueError, OSError) as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    typer.echo(f"index: {out / 'index.html'} ({out / 'index.md'})")
    if index["skipped"]:
        skipped = ", ".join(index["skipped"])
        typer.secho(f"error: skipped {skipped} (these models cannot support it, reason above and in "
                    f"{out / 'index.md'}); ran {', '.join(index['analyses']) or 'nothing else'}",
                    fg=typer.colors.RED, err=True)  # fmt: skip
        raise typer.Exit(1)
