"""The notebooks in notebooks/: committed without outputs, and executed end to end on the tiny model.

Each notebook's first code cell is tagged `parameters` (papermill's convention). The tests insert a
cell right after it that overrides the parameters (small sizes, outputs under tmp_path, the tiny
model instead of GPT-2 for 02), then run the notebook with nbclient in a fresh kernel of this
interpreter (a kernel spec written to a temporary folder, so no user-level `python3` spec can point
elsewhere). Nothing is downloaded: the kernel runs with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import time
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
QUICKSTART = NOTEBOOKS / "01_quickstart.ipynb"
CIRCUITS = NOTEBOOKS / "02_gpt2_circuits.ipynb"
MODERN = NOTEBOOKS / "03_modern_models.ipynb"
TIMEOUT = 600  # seconds per cell; a whole notebook takes about a minute on two CPU cores


def _parameters_index(nb) -> int:
    tagged = [i for i, cell in enumerate(nb.cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, f"expected exactly one cell tagged 'parameters', found {len(tagged)}"
    return tagged[0]


def _with_parameters(nb, **values):
    """The notebook with a cell assigning `values` inserted after the `parameters` cell."""
    source = "\n".join(f"{name} = {value!r}" for name, value in values.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(_parameters_index(nb) + 1, cell)
    return nb


def _parameter_names(nb) -> set[str]:
    tree = ast.parse(nb.cells[_parameters_index(nb)].source)
    return {target.id for node in tree.body if isinstance(node, ast.Assign) for target in node.targets}


@pytest.fixture(scope="module")
def kernel_manager(tmp_path_factory):
    """Makes kernel managers that start `python -m ipykernel_launcher` with this very interpreter."""
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    kernels = tmp_path_factory.mktemp("kernels")
    write_kernel_spec(kernels / "lnfree-test", overrides={"display_name": "lnfree tests"})
    spec = json.loads((kernels / "lnfree-test" / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable

    def make():
        specs = KernelSpecManager(kernel_dirs=[str(kernels)])
        return AsyncKernelManager(kernel_name="lnfree-test", kernel_spec_manager=specs)

    return make


def execute(nb, cwd: Path, kernel_manager, name: str) -> tuple[object, float]:
    """Execute `nb` in a fresh kernel (working directory `cwd`, kept there as `name` for inspection)."""
    from nbclient import NotebookClient

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TQDM_DISABLE="1", PYDEVD_DISABLE_FILE_VALIDATION="1")
    client = NotebookClient(nb, km=kernel_manager(), timeout=TIMEOUT, resources={"metadata": {"path": str(cwd)}})
    started = time.perf_counter()
    try:
        client.execute(env=env)
    finally:
        nbformat.write(nb, cwd / name)
    return nb, time.perf_counter() - started


def text_output(nb) -> str:
    """Every stream and text/plain, text/markdown output of the executed notebook, joined."""
    parts = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                parts.append(output.text)
            elif "data" in output:
                parts += [output.data[kind] for kind in ("text/plain", "text/markdown") if kind in output.data]
    return "\n".join(parts)


def plotly_figures(nb) -> int:
    return sum("application/vnd.plotly.v1+json" in output.get("data", {})
               for cell in nb.cells for output in cell.get("outputs", []))


@pytest.mark.parametrize("path", [QUICKSTART, CIRCUITS, MODERN], ids=lambda p: p.name)
def test_committed_notebook_is_clean(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: a committed cell has outputs:\n{cell.source[:200]}"
            assert cell.execution_count is None, f"{path.name}: a committed cell has an execution count"
    first_code = next(i for i, cell in enumerate(nb.cells) if cell.cell_type == "code")
    assert _parameters_index(nb) == first_code, "the parameters cell must be the first code cell"


def test_quickstart_notebook_runs_on_the_tiny_model(tmp_path, kernel_manager):
    nb = nbformat.read(QUICKSTART, as_version=4)
    # Smaller than the notebook's defaults (32 steps still leave 11 after the last removal at step 20).
    overrides = dict(OUT=str(tmp_path / "quickstart"), CACHE_DIR=str(tmp_path / "cache"), MAX_STEPS=32,
                     CONTROL=True, N_SEQUENCES=8, LENGTH=64, N_PROMPTS=8, N_BOOTSTRAP=100, ONLINE=False)
    assert set(overrides) <= _parameter_names(nb)
    nb, seconds = execute(_with_parameters(nb, **overrides), tmp_path, kernel_manager, QUICKSTART.name)
    print(f"01_quickstart.ipynb: {seconds:.0f} s")

    out = tmp_path / "quickstart"
    text = text_output(nb)
    assert "verify: ok" in text
    assert "LN-free: DLA == DE" in text
    assert (out / "export" / "model.safetensors").is_file() and (out / "export" / "lnfree_removal.json").is_file()
    assert (out / "control" / "run_config.json").is_file()
    assert (out / "eval" / "comparison.md").is_file()
    comparison = (out / "eval" / "comparison.md").read_text()
    assert all(f"| {label} |" in comparison for label in ("original", "vanilla", "ln_free"))
    for table in ("dla_components", "residual_norms", "patching_agreement", "entropy_neuron_ablations"):
        assert (out / "analysis" / f"{table}.csv").is_file(), table
    figures = {p.stem for p in (out / "figures").glob("*.html")}
    assert {"training_curve", "dla_nmae_heads", "residual_norms", "attention_to_first", "patching_resid_pre",
            "patching_scatter", "entropy_candidates", "entropy_ablations"} <= figures
    assert plotly_figures(nb) >= len(figures)
    assert "max |Δlogits|" in text and (out / "published_like" / "config.json").is_file()


def test_gpt2_circuits_notebook_runs_on_the_tiny_model(tmp_path, kernel_manager, tiny_ln_free_export):
    nb = nbformat.read(CIRCUITS, as_version=4)
    # GPT-2 small -> the tiny model; its LN-free export -> the conftest fixture (σ measured, no
    # fine-tuning); the vanilla control -> the tiny model again, a stand-in that exercises three models.
    overrides = dict(ORIGINAL="tiny", LN_FREE=str(tiny_ln_free_export), VANILLA="tiny", DATA="tiny",
                     N_SEQUENCES=8, LENGTH=64, N_EVAL_SEQUENCES=16, EVAL_CONTEXT=64, N_PROMPTS=8,
                     N_BOOTSTRAP=100, DEVICE="cpu", OUT=str(tmp_path / "circuits"), CACHE_DIR=str(tmp_path / "cache"))
    assert set(overrides) <= _parameter_names(nb)
    nb, seconds = execute(_with_parameters(nb, **overrides), tmp_path, kernel_manager, CIRCUITS.name)
    print(f"02_gpt2_circuits.ipynb: {seconds:.0f} s")

    out = tmp_path / "circuits"
    text = text_output(nb)
    assert "LN-free: DLA == DE" in text
    assert (out / "eval" / "comparison.md").is_file()
    for table in ("dla_components", "dla_global", "residual_norms", "attention_sinks", "patching_agreement",
                  "entropy_neuron_ablations", "summary"):
        assert (out / "analysis" / f"{table}.csv").is_file(), table
    assert plotly_figures(nb) >= 8


def test_modern_models_notebook_runs_on_tiny_stand_ins(tmp_path, kernel_manager):
    import copy

    from families import tiny_family
    from test_arch import fully_fixed
    from transformers import AutoTokenizer

    from lnfree.fixedscale import surgery
    from lnfree.forms.export import write_export
    from lnfree.data.tiny import TINY_MODEL_DIR

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    sources = {}
    for label, family in (("llama stand-in", "llama"), ("gemma3 stand-in", "gemma3")):
        model = tiny_family(family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
        model.save_pretrained(tmp_path / family)
        tokenizer.save_pretrained(tmp_path / family)
        sources[label] = str(tmp_path / family)
    free = fully_fixed(surgery.install(copy.deepcopy(model)), len(tokenizer))
    write_export(free, tokenizer, tmp_path / "gemma3-free", {"note": "test stand-in: σ measured, no fine-tuning"})
    nb = nbformat.read(MODERN, as_version=4)
    overrides = dict(MODELS=sources, LN_FREE={"gemma3 LN-free": str(tmp_path / "gemma3-free")}, DATA="tiny",
                     N_SEQUENCES=4, LENGTH=32, CACHE_DIR=str(tmp_path / "cache"))
    assert set(overrides) <= _parameter_names(nb)
    nb, seconds = execute(_with_parameters(nb, **overrides), tmp_path, kernel_manager, MODERN.name)
    print(f"03_modern_models.ipynb: {seconds:.0f} s")
    text = text_output(nb)
    assert "gemma3 stand-in: gemma3_text, 2 blocks, BOS first" in text and "llama stand-in: llama, 2 blocks, no BOS" in text
    assert "gemma3 LN-free: LN-free: DLA == DE" in text
    assert "position 0's largest channels" in text and "head mean > 0.3" in text
