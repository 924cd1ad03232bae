"""The README's Python code blocks run as written."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def test_readme_python_blocks_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the blocks write runs/tiny/... relative to the working directory
    monkeypatch.setenv("HOME", str(tmp_path))  # and the token cache under ~/.cache/lnfree
    blocks = python_blocks()
    assert len(blocks) >= 2
    # The loading block reads runs/tiny/export, which the quick start's `lnfree remove` makes; here the
    # "Python API" block's own run (runs/tiny-api) stands in for it: run that block first.
    training, *others = sorted(blocks, key=lambda b: "lnfree.train import run" not in b)
    exec(compile(training, str(README), "exec"), {})
    assert (tmp_path / "runs" / "tiny-api" / "export" / "model.safetensors").is_file()
    assert (tmp_path / "runs" / "tiny-api" / "analysis" / "dla").is_dir()
    assert not (tmp_path / "runs" / "tiny").exists()  # the API example leaves the quick start's run alone
    shutil.copytree(tmp_path / "runs" / "tiny-api" / "export", tmp_path / "runs" / "tiny" / "export")
    for block in others:
        exec(compile(block, str(README), "exec"), {})
