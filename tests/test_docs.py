"""The documentation: the site builds with no broken link or reference, and its Python code blocks
(the README's and every docs page's) run as written."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks() -> list[tuple[Path, str]]:
    return [(page, block) for page in PAGES
            for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)]


def test_the_site_builds_strictly(tmp_path):
    result = subprocess.run(  # the notebooks not run (tests/test_notebooks.py runs them): seconds, not a minute
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
        capture_output=True, text=True, env=dict(os.environ, NO_MKDOCS_2_WARNING="1", LNFREE_DOCS_EXECUTE="false"))
    assert result.returncode == 0, result.stdout + result.stderr
    site = tmp_path / "site"
    assert (site / "notebooks" / "01_quickstart" / "index.html").is_file()  # notebooks rendered as pages
    assert "stylesheets/extra.css" in (site / "getting-started" / "index.html").read_text()
    assert "write_export" in (site / "reference" / "api" / "index.html").read_text()  # docstrings rendered
    assert (site / "experiments" / "results" / "gemma3-270m" / "index.html").is_file()  # results pages


def test_readme_stays_short_and_holds_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "pip install -q -e . && lnfree remove" in readme and "python -m pytest" in readme


def test_python_blocks_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the blocks write runs/... relative to the working directory
    monkeypatch.setenv("HOME", str(tmp_path))  # and the token cache under ~/.cache/lnfree
    blocks = python_blocks()
    assert len(blocks) >= 3
    # The loading blocks read runs/tiny/export, which the quick start's `lnfree remove` makes; here the
    # Python API page's own run (runs/tiny-api) stands in for it: run that block first.
    training = [b for b in blocks if "lnfree.removal.train import run" in b[1]]
    assert len(training) == 1
    others = [b for b in blocks if b not in training]
    exec(compile(training[0][1], str(training[0][0]), "exec"), {})
    assert (tmp_path / "runs" / "tiny-api" / "export" / "model.safetensors").is_file()
    assert (tmp_path / "runs" / "tiny-api" / "analysis" / "dla").is_dir()
    assert not (tmp_path / "runs" / "tiny").exists()  # the API example leaves the quick start's run alone
    shutil.copytree(tmp_path / "runs" / "tiny-api" / "export", tmp_path / "runs" / "tiny" / "export")
    for page, block in others:
        exec(compile(block, str(page), "exec"), {})


def test_the_site_wraps_long_code_lines_runs_the_offline_notebook_and_stays_out_of_git():
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!ENV", lambda loader, node: loader.construct_sequence(node)[-1])  # its default
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader)
    css = "".join((ROOT / "docs" / path).read_text() for path in config["extra_css"])
    assert re.search(r"\.md-typeset pre > code[^{]*\{[^}]*white-space: pre-wrap", css)  # not clipped at the edge
    jupyter = next(p["mkdocs-jupyter"] for p in config["plugins"] if isinstance(p, dict) and "mkdocs-jupyter" in p)
    assert jupyter["execute"] is True and jupyter["allow_errors"] is False
    offline = {"notebooks/01_quickstart.ipynb"}  # needs neither the Hub, a GPU nor the models' wheels
    assert set(jupyter["execute_ignore"]) == {str(p.relative_to(ROOT)) for p in (ROOT / "notebooks").glob("*.ipynb")} - offline
    assert "/site/" in (ROOT / ".gitignore").read_text().split()  # `mkdocs build` writes site/ (79 MB)
