"""`lnfree stress MODEL...`: every model on the test split, repeated-token probes and a vocabulary sweep."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from lnfree.errors import LnfreeError

#: The files `lnfree stress` writes into its output folder (and each model's record in `STRESS_PARTS`/).
STRESS_FILES = ("stress.json", "stress.md")
STRESS_PARTS = "parts"


def _count(value: str, option: str) -> int | None:
    """'all' → None (every id), else a positive int."""
    if value == "all":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise typer.BadParameter(f"{option} takes a positive number or 'all', got {value!r}")
    return n


def stress(
    models: Annotated[list[str], typer.Argument(help="Models, the original first (its envelope is the growth reference): 'tiny', 'gemma3-270m', run/checkpoint/export folders, Hub ids.")],
    labels: Annotated[Optional[list[str]], typer.Option("--labels", "-l", help="One label per model, space- or comma-separated. (default: from the model names)")] = None,
    dataset: Annotated[str, typer.Option("--dataset", "-d", help="Whose test split to read whole: tiny, realtext (its test half), a local .txt/.jsonl file, a Hub id.")] = "tiny",
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder (stress.json, stress.md).")] = Path("runs/stress"),
    context: Annotated[int, typer.Option(help="Tokens per sequence, BOS included where the family reads one.", min=2)] = 128,
    n_sequences: Annotated[Optional[int], typer.Option(help="Only the first N test sequences. (default: all)", min=1)] = None,
    repeated: Annotated[str, typer.Option(help="Repeated-token probes: a number of ids spread over frequency ranks, or 'all'.")] = "512",
    vocab: Annotated[str, typer.Option(help="Vocabulary sweep: how many ids (a seeded sample), or 'all' (the final check).")] = "8192",
    batch_size: Annotated[int, typer.Option(help="Sequences per forward pass (lower it for large vocabularies).", min=1)] = 8,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:1, …")] = "auto",
    dtype: Annotated[str, typer.Option(help="fp32 or bf16 (an overflow check: fp32 unless you know why).")] = "fp32",
    form: Annotated[str, typer.Option(help="hf: lnfree's exact form; folded; plain: the file as transformers loads it.")] = "hf",
    seed: Annotated[int, typer.Option(help="Seed of the sweep's order and of ties among equally frequent ids.")] = 0,
    bos: Annotated[bool, typer.Option("--bos/--no-bos", help="Start every sequence with BOS where the family reads one; --no-bos: never (what users who tokenise without special tokens feed it).")] = True,
    overwrite: Annotated[bool, typer.Option(help="Replace an earlier stress report in --out.")] = False,
    resume: Annotated[bool, typer.Option(help="Reuse each model's record that an earlier run saved in OUT/parts with the same settings, inputs and weights (an interrupted sweep measures only the models left); replaces the report.")] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="A progress bar per model.")] = True,
    pending: Annotated[bool, typer.Option(help="With --resume: measure nothing, print the labels that have no reusable record in OUT/parts (one a line) and exit 0.")] = False,
) -> None:
    """Does each model stay bounded on a whole test split, repeated tokens and every vocabulary id? Exit 1 if any overflows."""
    from lnfree.evaluate.stress import markdown, run_stress
    from lnfree.removal.train import quiet_libraries

    names = [x.strip() for item in labels or [] for x in item.split(",") if x.strip()] or None
    if pending and not resume:
        typer.secho("error: --pending lists what --resume would measure; pass --resume too", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    written = [out / name for name in STRESS_FILES if (out / name).exists()]
    if written and not (overwrite or resume):
        typer.secho(f"error: {written[0]} exists; pass --overwrite to replace it, --resume to reuse its "
                    f"models' saved records, or another --out",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    try:
        with quiet_libraries():
            report = run_stress(models, dataset, labels=names, context=context, n_sequences=n_sequences,
                                repeated=_count(repeated, "--repeated"), vocab=_count(vocab, "--vocab"),
                                batch_size=batch_size, device=device, dtype=dtype, form=form, seed=seed,
                                progress=progress, with_bos=bos, parts=out / STRESS_PARTS, resume=resume,
                                pending_only=pending)
    except (LnfreeError, OSError) as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    if pending:
        for label in report.pending:
            typer.echo(label)
        return
    if report.reused:
        typer.echo(f"reused the records saved in {out / STRESS_PARTS} (same settings, inputs and weights): "
                   f"{', '.join(report.reused)}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "stress.json").write_text(json.dumps(report.to_dict(), indent=1, default=str))
    page = markdown(report)
    (out / "stress.md").write_text(page)
    typer.echo(page.split("\n## ")[0].rstrip())
    typer.echo(f"written to {out}/ ({', '.join(STRESS_FILES)})")
    badly = [f"{r.label} ({r.test_tokens_over_30_nats})" for r in report.records if r.test_tokens_over_30_nats]
    if badly:
        typer.echo(f"test tokens above 30 nats (not overflows): {', '.join(badly)}")
    broken = [r.label for r in report.records if r.overflow_total]
    if broken:
        typer.secho(f"overflow: {', '.join(broken)}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
