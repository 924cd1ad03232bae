"""Outputs derived from a run (evaluations, analyses), and marking them stale when the run is replaced.

`lnfree eval` writes `summary.json` and `lnfree analyze` writes `index.json`, each listing the models it
read under `models` with their `source`. When `lnfree remove --overwrite` replaces a run, every such
folder inside the run folder that read one of the run's models (the run, its export, control or a
checkpoint) would describe a model that no longer exists: it gets a `STALE.md` marker saying so
(nothing of the user's is deleted). The next evaluation or analysis written there removes the marker.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

STALE_MARKER = "STALE.md"
#: The file an evaluation (`summary.json`) or analysis (`index.json`) folder lists its models in.
REPORT_FILES = ("summary.json", "index.json")


def _sources(report: Path) -> list[str]:
    try:
        models = json.loads(report.read_text()).get("models")
    except (ValueError, AttributeError, OSError):
        return []
    entries = models.values() if isinstance(models, dict) else models if isinstance(models, list) else []
    return [str(e["source"]) for e in entries if isinstance(e, dict) and e.get("source")]


def _inside(source: str, root: Path) -> bool:
    path = Path(source).expanduser()
    return path.exists() and path.resolve().is_relative_to(root)


def mark_derived_outputs(run_dir: str | Path, skip: tuple[str, ...] = ()) -> list[Path]:
    """Put `STALE_MARKER` into every evaluation or analysis folder under `run_dir` (except the top-level
    names in `skip`, the run's own outputs) that read a model inside `run_dir`; returns those folders."""
    run_dir = Path(run_dir)
    root = run_dir.resolve()
    marked = []
    for name in REPORT_FILES:
        for report in sorted(run_dir.rglob(name)):
            folder = report.parent
            relative = folder.relative_to(run_dir).parts
            if not relative or relative[0] in skip or folder in marked:
                continue
            read = [s for s in _sources(report) if _inside(s, root)]
            if read:
                when = datetime.datetime.now().isoformat(timespec="seconds")
                (folder / STALE_MARKER).write_text(
                    f"# Stale\n\nThis folder describes {', '.join(f'`{s}`' for s in read)}, which `lnfree remove "
                    f"--overwrite` replaced on {when}. Its numbers are not those of the model now in `{run_dir}`; "
                    "run the evaluation or analysis again (it removes this file).\n")
                marked.append(folder)
    return marked


def clear_stale(folder: str | Path) -> None:
    """Remove `folder`'s stale marker (a new report is being written there)."""
    (Path(folder) / STALE_MARKER).unlink(missing_ok=True)
