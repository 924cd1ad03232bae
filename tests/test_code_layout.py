"""The package's import graph: every module imports what it needs at the top, so there are no hidden
import cycles; only the command line defers its imports (a command loads torch only when it runs)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lnfree

PACKAGE = Path(lnfree.__file__).parent
#: Files allowed to import lnfree modules inside functions, and why.
DEFERRED = {
    "cli/__init__.py": "the CLI imports a command's modules when it runs (`lnfree --help` stays fast)",
    "cli/analysis.py": "imported by the CLI at start-up: same reason",
    "cli/common.py": "imported by the CLI at start-up: same reason",
    "cli/stress.py": "imported by the CLI at start-up: same reason",
    "data/realtext/__init__.py": "the corpus module loads on first use, so `python -m lnfree.data.realtext.corpus` runs it once",
}


def deferred_imports(path: Path) -> list[str]:
    """`module:line` of each `lnfree` import inside a function of `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                names = ([inner.module or ""] if isinstance(inner, ast.ImportFrom) else
                         [a.name for a in inner.names] if isinstance(inner, ast.Import) else [])
                if any(name == "lnfree" or name.startswith("lnfree.") for name in names):
                    found.append(f"{path.relative_to(PACKAGE)}:{inner.lineno}")
    return found


def test_modules_import_lnfree_at_the_top_only_the_cli_defers():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if str(path.relative_to(PACKAGE)) not in DEFERRED
             for hit in deferred_imports(path)]
    assert found == [], f"imports inside functions (an import cycle or a slow import hidden?): {found}"
    assert deferred_imports(PACKAGE / "cli" / "__init__.py"), "the check finds deferred imports where there are some"



#: The size a reader can hold at once (issue 23's rule for the package).
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 80


def long_functions(path: Path) -> list[str]:
    """`file:function (lines)` of each function in `path` longer than MAX_FUNCTION_LINES."""
    return [f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1})"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_modules_and_functions_stay_readable(tmp_path):
    modules = sorted(PACKAGE.rglob("*.py"))
    too_long = [f"{p.relative_to(PACKAGE)} ({n})" for p in modules
                if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert too_long == [], f"modules over {MAX_MODULE_LINES} lines: {too_long}"
    functions = [hit for path in modules for hit in long_functions(path)]
    assert functions == [], f"functions over {MAX_FUNCTION_LINES} lines: {functions}"
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def f():\n{body}")
    assert long_functions(tmp_path / "long.py") == [f"long.py:f ({MAX_FUNCTION_LINES + 1})"], "the check sees a long one"


#: The package reads as the pipeline (issue 39): a few files at the top, the rest in stage packages.
MAX_TOP_LEVEL_FILES = 8


def test_the_top_of_the_package_stays_short():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_FILES, f"{len(top)} modules directly under lnfree/ (a stage package's?): {top}"


def shared_prefixes(folder: Path) -> dict[str, list[str]]:
    """`prefix: modules` for each `prefix_` that two or more sibling modules of `folder` share."""
    by_prefix: dict[str, list[str]] = {}
    for path in sorted(folder.glob("*.py")):
        if "_" in path.stem.strip("_"):
            by_prefix.setdefault(path.stem.split("_")[0], []).append(path.name)
    return {prefix: names for prefix, names in by_prefix.items() if len(names) > 1}


def test_no_sibling_modules_share_a_concept_prefix(tmp_path):
    folders = [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").exists())]
    shared = {str(f.relative_to(PACKAGE.parent)): hit for f in folders if (hit := shared_prefixes(f))}
    assert shared == {}, f"sibling modules named after one concept (make it a package): {shared}"
    for name in ("patching_methods.py", "patching_output.py", "position0_mlp.py"):
        (tmp_path / name).write_text("")
    assert shared_prefixes(tmp_path) == {"patching": ["patching_methods.py", "patching_output.py"]}, "the check sees one"


def test_the_layers_contract_holds():
    """`lint-imports` (import-linter, the contract in pyproject.toml): a stage never imports a later one."""
    root = PACKAGE.parent.parent
    if not (root / "pyproject.toml").exists():
        pytest.skip("lnfree is installed, not a checkout: no pyproject.toml with the contract")
    lint = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(lint).exists():
        pytest.fail("import-linter is not installed (pip install -e '.[dev]')")
    done = subprocess.run([lint, "--no-cache"], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout and "KEPT" in done.stdout
