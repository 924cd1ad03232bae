"""The output folder of `lnfree analyze`: what an earlier analysis there wrote, whether new analyses
may join it, and what --overwrite replaces.

One folder holds the analyses of one set of models under one set of settings, and its index lists
every analysis in it: `analyze dla` then `analyze residual` into one folder give one index of both.
Anything else needs `overwrite`, which replaces only what earlier analyses wrote (their
`NAME/` files and the index); a file of the same name that no analysis wrote is never replaced.
"""

from __future__ import annotations

import json
from pathlib import Path

from lnfree.errors import UsageError
from lnfree.removal.derived import STALE_MARKER
from lnfree.evaluate.results import TIMINGS

#: The files an analysis folder's index consists of (beside one `NAME/` folder per analysis).
INDEX_FILES = ("index.json", "index.md", "index.html", f"{TIMINGS}.json", "plotly.min.js")


def earlier_index(out: Path) -> dict | None:
    """The index an earlier `lnfree analyze` wrote in `out`, or None."""
    try:
        index = json.loads((Path(out) / "index.json").read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(index, dict) and isinstance(index.get("analyses"), dict) and isinstance(index.get("models"), dict)
    return index if ok else None


def _sources(index: dict) -> dict[str, str]:
    return {label: str(info.get("source")) for label, info in index["models"].items()}


def _mismatch(index: dict, sources: dict[str, str], settings: dict) -> str | None:
    """What differs between an earlier index and the analyses asked for now (None: they can share the folder)."""
    if _sources(index) != sources:
        return f"other models ({', '.join(f'{k}: {v}' for k, v in _sources(index).items())})"
    differ = [k for k, v in settings.items() if index.get("settings", {}).get(k) != v]
    return f"other settings ({', '.join(differ)})" if differ else None


def check_folder(out: Path, names: list[str], sources: dict[str, str], settings: dict, *, overwrite: bool) -> list[str]:
    """Raise `ValueError` unless `out` may take the analyses `names` of these models (label → source)
    under these settings; returns the earlier analyses that stay in the index beside them."""
    out = Path(out)
    if not out.exists():
        return []
    if not out.is_dir():
        raise UsageError(f"{out} is a file, not a folder; choose another folder (CLI: --out)")
    index = earlier_index(out)
    written = {*(index or {}).get("analyses", {}), *(index or {}).get("skipped", {})} if index else set()
    ours = (set(INDEX_FILES) if index else set()) | written | {STALE_MARKER}
    entries = {p.name for p in out.iterdir()}
    foreign = sorted(entries & (set(INDEX_FILES) | set(names)) - ours)
    if foreign:
        raise UsageError(f"{out / foreign[0]} was not written by lnfree analyze and would be replaced; choose "
                         "another folder (CLI: --out)")
    mismatch = _mismatch(index, sources, settings) if index else None
    repeated = [n for n in names if n in written]
    if not overwrite:
        if entries - ours:
            raise UsageError(f"{out} holds files no analysis wrote ({', '.join(sorted(entries - ours)[:3])}); write "
                             "beside them with overwrite=True (CLI: --overwrite), or choose another folder (CLI: --out)")
        if mismatch or repeated:
            what = f"analyses of {mismatch}" if mismatch else f"the {', '.join(repeated)} analysis"
            raise UsageError(f"{out} already holds {what}; replace it with overwrite=True (CLI: --overwrite), or "
                             "choose another folder (CLI: --out)")
    return [] if mismatch or index is None else sorted(written - set(names))


def remove_replaced(out: Path, keep: list[str]) -> None:
    """Remove the files of the earlier analyses in `out` that are not kept (those --overwrite replaces):
    the ones their summaries list, by name, inside their own `NAME/` folder, and nothing else."""
    index = earlier_index(out)
    for name, summary in (index or {}).get("analyses", {}).items():
        if name in keep:
            continue
        folder = Path(out) / name
        listed = [*summary.get("figures", []), *summary.get("tables", []), summary.get("summary_path")]
        for file in {Path(p).name for p in listed if p} | {"summary.json", f"{TIMINGS}.json", f"{name}_summary.json"}:
            (folder / file).unlink(missing_ok=True)


def _earlier_timings(out: Path, key: str, keep: list[str]) -> dict:
    """One entry of the earlier timings.json in `out` ("seconds", "peak_memory_gb"), for the analyses kept."""
    try:
        values = json.loads((Path(out) / f"{TIMINGS}.json").read_text()).get(key, {})
    except (OSError, ValueError, AttributeError):
        values = {}
    return {k: v for k, v in values.items() if k in keep}


def earlier_peaks(out: Path, keep: list[str]) -> dict:
    """The peak memory (GB) the earlier analyses that stay recorded in timings.json."""
    return _earlier_timings(out, "peak_memory_gb", keep)


def kept_analyses(out: Path, keep: list[str]) -> tuple[dict, dict, dict]:
    """(summaries, skipped, seconds) of the earlier analyses that stay, their paths inside `out`."""
    index = earlier_index(out) or {"analyses": {}, "skipped": {}}
    seconds = _earlier_timings(out, "seconds", keep)
    summaries = {}
    for name in [n for n in keep if n in index["analyses"]]:
        summary = dict(index["analyses"][name])
        for kind in ("figures", "tables"):  # as written from another working directory: rebased on `out`
            summary[kind] = [str(Path(out) / name / Path(p).name) for p in summary.get(kind, [])]
        summaries[name] = summary
    skipped = {k: v for k, v in index.get("skipped", {}).items() if k in keep}
    return summaries, skipped, seconds
