"""MkDocs hook: the repository's results, benchmarks and notebooks become part of the site.

`experiments/`, `benchmarks/results/` and `notebooks/` live beside `docs/`; their READMEs, tables,
figures and notebooks are added to the site at their repository paths (so `experiments/results/
gemma3-270m/README.md` is the page `experiments/results/gemma3-270m/`), and their own relative links
keep working and are checked like every other link under `mkdocs build --strict`.
"""

from __future__ import annotations

import os
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
# The notebooks executed at build time (mkdocs.yml) show their plotly figures as HTML with plotly.js
# inlined once per page, offline (a kernel without a front end would only emit plotly's own MIME type,
# which the site cannot draw); the kernel inherits this environment. No require.js on the page: with it,
# plotly.js would register as an AMD module instead of `window.Plotly`, which the figures call.
os.environ.setdefault("PLOTLY_RENDERER", "notebook")
#: Repository folders mounted into the site, and the files of theirs that are left out.
MOUNTED = ("experiments", "benchmarks/results", "notebooks")
SKIPPED_SUFFIXES = {".pyc", ".py", ".sh", ".toml"}


@event_priority(100)  # before the plugins (mkdocs-jupyter turns the notebooks into pages in its on_files)
def on_files(files, config):
    for folder in MOUNTED:
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or path.suffix in SKIPPED_SUFFIXES or "__pycache__" in path.parts:
                continue
            uri = path.relative_to(ROOT).as_posix()
            files.append(File(uri, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files
