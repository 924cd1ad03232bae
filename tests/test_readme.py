"""The README's Python code blocks run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def test_readme_python_blocks_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the blocks write runs/tiny/... relative to the working directory
    monkeypatch.setenv("HOME", str(tmp_path))  # and the token cache under ~/.cache/lnfree
    blocks = python_blocks()
    assert len(blocks) >= 2
    # The "Python API" block makes runs/tiny/export, which the loading block reads (after `lnfree
    # remove` in the README's own order): run the blocks that train first, then the rest in order.
    for block in sorted(blocks, key=lambda b: "lnfree.train import run" not in b):
        exec(compile(block, str(README), "exec"), {})
    assert (tmp_path / "runs" / "tiny" / "export" / "model.safetensors").is_file()
    assert (tmp_path / "runs" / "tiny" / "analysis" / "dla").is_dir()
