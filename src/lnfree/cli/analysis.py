"""`lnfree analyze NAME --models A B C`: run one analysis, or all of them, and index the figures."""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from lnfree.errors import LnfreeError, UsageError
from lnfree.analysis.report import headline_tables, write_index_pages
from lnfree.cli.common import MODEL_NAMES_HELP, fail
from lnfree.removal.derived import clear_stale

#: Analysis name on the command line → module with a `run(models, out_dir, ...)` function.
ANALYSES = {
    "dla": "lnfree.analysis.dla",
    "patching": "lnfree.analysis.patching.run",
    "entropy-neurons": "lnfree.analysis.entropy_neurons.run",
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
    overwrite: bool = False,
) -> dict:
    """Run the named analyses on the same models and tokens; write `out/NAME/…` and an index.

    The index lists every analysis in `out`: one run earlier on the same models and settings stays
    beside the new ones. A folder holding anything else, or an analysis run again, needs
    `overwrite` (`lnfree.analysis.folder`). An analysis that cannot run on these models
    (:class:`NotApplicable`, e.g. IOI patching with a tokenizer that has no single-token names) is
    skipped with its reason in the index's ``skipped``; the others still run. Figures share one
    offline copy of plotly.js in `out`. Each analysis frees its bridges when done; the process's
    peak memory when each finished goes to ``timings.json`` (``peak_memory_gb``) beside its seconds.
    """
    from lnfree.analysis.common import (NotApplicable, analysis_progress, evaluation_tokens, load_models,  # fmt: skip
                                        quiet_libraries, release_bridges, shared_plotly_js)
    from lnfree.analysis.folder import check_folder, earlier_index, earlier_peaks, kept_analyses, remove_replaced
    from lnfree.data.documents import bos_token, tokenizer_fingerprint
    from lnfree.evaluate.results import model_labels, peak_memory_gb

    unknown = [n for n in names if n not in ANALYSES]
    if unknown:
        raise UsageError(f"unknown analysis {unknown[0]!r}; choose from {', '.join(ANALYSES)} or 'all'")
    if not sources:
        raise UsageError("give at least one model: --models A [B ...]")
    settings = {"data": data, "n_sequences": n_sequences, "length": length, "n_prompts": n_prompts, "seed": seed,
                "n_bootstrap": n_bootstrap}
    keep = check_folder(out, names, dict(zip(model_labels(sources, labels), map(str, sources))), settings,
                        overwrite=overwrite)
    with quiet_libraries(), shared_plotly_js(out):
        models = load_models(sources, labels, device=device)
        vocab = {m.label: m.loaded.model.config.vocab_size for m in models}
        if len(set(vocab.values())) > 1:
            raise UsageError(f"the models have different vocabularies {vocab}; analyses compare them on the same "
                             "tokens")
        if len({tokenizer_fingerprint(m.tokenizer) for m in models}) > 1:
            raise UsageError("the models' tokenizers differ; analyses compare models on the same tokens")
        tokens = None
        if NEEDS_TOKENS & set(names):
            tokens = evaluation_tokens(models[0].tokenizer, source=data, n_sequences=n_sequences, length=length,
                                       vocab_size=next(iter(vocab.values())), cache_dir=cache_dir,
                                       bos_token_id=bos_token(models[0].loaded.model, models[0].tokenizer))
        remove_replaced(out, keep)
        summaries, skipped, timings = kept_analyses(out, keep)
        peaks = earlier_peaks(out, keep)
        for name in names:
            started = time.perf_counter()
            kwargs = {"seed": seed, "n_bootstrap": n_bootstrap, **(
                {"tokens": tokens, **({"batch_size": batch_size} if name in BATCHED else {})}
                if name in NEEDS_TOKENS else {"n_prompts": n_prompts})}
            try:
                with analysis_progress(models, name, enabled=progress):
                    summary = importlib.import_module(ANALYSES[name]).run(models, out / name, **kwargs)
            except NotApplicable as err:
                skipped[name] = str(err)
                typer.secho(f"{name}: skipped: {err}", fg=typer.colors.YELLOW, err=True)
                continue
            finally:
                release_bridges(models)
            timings[name], peaks[name] = round(time.perf_counter() - started, 1), peak_memory_gb()
            summaries[name] = summary
            typer.echo(f"{name}: {len(summary.get('figures', []))} figures, {timings[name]} s, peak memory "
                       f"{peaks[name]:.2f} GB → {out / name}")
    earlier_tokens = (earlier_index(out) or {}).get("tokens") if keep else None
    index = {
        "models": {m.label: {"source": str(m.loaded.source), "repr": repr(m.loaded)} for m in models},
        "data": data if tokens is not None or earlier_tokens else None,
        "tokens": list(tokens.shape) if tokens is not None else earlier_tokens,
        "seed": seed,
        "settings": settings,
        "analyses": summaries,
        "skipped": skipped,
    }
    return _write_index(index, timings, peaks, out)


def _write_index(index: dict, seconds: dict, peaks: dict, out: Path) -> dict:
    """Write index.json (analyses in `ANALYSES` order), timings.json (seconds and peak memory, GB) and the
    index pages; returns the index."""
    from lnfree.evaluate.results import TIMINGS, write_summary

    for key in ("analyses", "skipped"):
        index[key] = {n: index[key][n] for n in ANALYSES if n in index[key]}
    write_summary(index, out, "index")
    write_summary({"seconds": {n: seconds[n] for n in ANALYSES if n in seconds},
                   "peak_memory_gb": {n: peaks[n] for n in ANALYSES if n in peaks}}, out, TIMINGS)
    write_index_pages(index, out)
    clear_stale(out)
    return index


def analyze(
    name: Annotated[str, typer.Argument(help=f"One of {', '.join(ANALYSES)}, or 'all'.")],
    more_models: Annotated[Optional[list[str]], typer.Argument(help="Further models after --models A.", show_default=False)] = None,
    models: Annotated[Optional[list[str]], typer.Option("--models", "-m", help=f"Models (a name: {MODEL_NAMES_HELP}; folders, Hub ids): --models A B C.")] = None,
    labels: Annotated[Optional[str], typer.Option(help="One label per model, space- or comma-separated: original vanilla ln_free.")] = None,
    data: Annotated[str, typer.Option("--dataset", "--data", "-d", help="Token source for DLA, entropy neurons and residual norms: any `lnfree eval --dataset` (tiny, realtext, owt-val, pile, pile-filtered, a Hub id, a path).")] = "tiny",
    n_sequences: Annotated[int, typer.Option(help="Held-out sequences.", min=1)] = 32,
    length: Annotated[int, typer.Option(help="Tokens per sequence.", min=2)] = 64,
    n_prompts: Annotated[int, typer.Option(help="IOI prompts for patching.", min=1)] = 32,
    n_bootstrap: Annotated[int, typer.Option(help="Bootstrap resamples for CIs (0: none).", min=0)] = 1000,
    seed: Annotated[int, typer.Option(help="Seed of the prompts, the neuron choice and the bootstrap.")] = 0,
    batch_size: Annotated[int, typer.Option(help="Sequences per forward pass for DLA and residual norms (1 for GPT-2 XL DLA).", min=1)] = 8,
    device: Annotated[str, typer.Option(help="auto (CUDA if available), cpu, cuda, cuda:1, …")] = "auto",
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder: new, empty, or holding analyses of the same models and settings (the index lists them all).")] = Path("runs/analysis"),
    overwrite: Annotated[bool, typer.Option(help="Replace analyses already in --out (only files an analysis wrote) and write beside other files.")] = False,
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
                             batch_size=batch_size, device=device, progress=progress, overwrite=overwrite)  # fmt: skip
    except (LnfreeError, OSError) as err:
        fail(str(err))
    from lnfree.evaluate.results import peak_memory_gb

    tables = headline_tables(index)
    if tables:
        typer.echo("\n" + tables)
    typer.echo(f"peak memory: {peak_memory_gb():.2f} GB (this process's peak RSS; per analysis: {out / 'timings.json'})")
    typer.echo(f"index: {out / 'index.html'} ({out / 'index.md'})")
    if any(n in names for n in index["skipped"]):
        skipped = ", ".join(n for n in index["skipped"] if n in names)
        typer.secho(f"error: skipped {skipped} (these models cannot support it, reason above and in "
                    f"{out / 'index.md'}); ran {', '.join(index['analyses']) or 'nothing else'}",
                    fg=typer.colors.RED, err=True)  # fmt: skip
        raise typer.Exit(1)
