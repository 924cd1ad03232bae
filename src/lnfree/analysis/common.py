"""Shared pieces of the analyses: models by label, evaluation tokens, progress, figures (labels, CIs,
tables and summaries: `lnfree.evaluate.results`)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lnfree.errors import LnfreeError
from lnfree.evaluate import EvalError, load_sequences, resolve_dataset, resolve_device
from lnfree.forms.load import LoadedModel, load
from lnfree.evaluate.results import model_labels


#: Logits (fp32 values) one forward pass of an analysis may hold: 2**26, 256 MB, i.e. 256 positions of
#: Gemma 3's 262,144-token vocabulary or 1,335 of GPT-2's. Analyses run as many sequences per pass as
#: fit (`logit_rows`), never fewer than one.
LOGITS_BUDGET = 2**26


def logit_rows(n_pos: int, vocab: int, largest: int) -> int:
    """Sequences of ``n_pos`` positions per forward pass: at most ``largest``, and no more than keep their
    logits within `LOGITS_BUDGET` (at least 1)."""
    return max(1, min(int(largest), LOGITS_BUDGET // max(1, int(n_pos) * int(vocab))))


class NotApplicable(LnfreeError, ValueError):
    """An analysis cannot run on a model (e.g. its tokenizer cannot express the task): `analyze all` skips it."""


@dataclass
class AnalysisModel:
    """A loaded model under a short label ("original", "vanilla", "ln_free"), with its bridge cached.

    While ``on_forward`` is set (see :func:`analysis_progress`), every forward pass of the model
    or its bridge calls it with the label.
    """

    label: str
    loaded: LoadedModel
    _bridge: Any = field(default=None, repr=False)
    on_forward: Callable[[str], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _report_forwards(self.loaded.model, self)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def ln_free(self) -> bool:
        return self.loaded.fully_ln_free

    def bridge(self):
        """The model's TransformerLens bridge (built once, until :meth:`release_bridge`): exact LN-free or
        folded LN."""
        if self._bridge is None:
            self._bridge = self.loaded.bridge()
            _report_forwards(self._bridge, self)
        return self._bridge

    def release_bridge(self) -> None:
        """Drop the cached bridge (a copy of the model's weights, an untied unembedding often beside them)
        and collect it: an analysis done with a model frees its bridge before the next model's is built."""
        self._bridge = None
        gc.collect()


@contextlib.contextmanager
def bridge_of(model: AnalysisModel) -> Iterator[Any]:
    """``model``'s bridge for one analysis step, released afterwards unless it was built before (a
    caller's cached bridge stays): run one model at a time, one bridge is alive at a time."""
    cached = model._bridge is not None
    try:
        yield model.bridge()
    finally:
        if not cached:
            model.release_bridge()


def release_bridges(models: Sequence[AnalysisModel]) -> None:
    """Free every model's cached bridge (and collect): between analyses, nothing of the last one stays."""
    for model in models:
        model.release_bridge()


def _report_forwards(network: torch.nn.Module, model: AnalysisModel) -> None:
    """Call ``model.on_forward`` after each forward pass of ``network`` (hooked at its input embedding)."""
    embedding = network.get_input_embeddings() if hasattr(network, "get_input_embeddings") else network.embed

    def hook(module, args, output) -> None:
        # Copies of the network (a bridge deep-copies its model) carry this hook too: count only the original.
        if module is embedding and model.on_forward is not None:
            model.on_forward(model.label)

    embedding.register_forward_hook(hook)


@contextlib.contextmanager
def analysis_progress(models: Sequence[AnalysisModel], name: str, *, enabled: bool = True) -> Iterator[Any]:
    """A progress bar for one analysis, counted in models (its total from the start): the model running
    now and its forward passes.

    An analysis runs the same passes for every model, one model after the other, so once the first
    model is done each later pass advances the bar by 1 / (the first model's count), and tqdm shows
    the ETA from then on.
    """
    from tqdm.auto import tqdm

    bar = tqdm(desc=name, total=len(models), disable=not enabled, leave=False, dynamic_ncols=True,
               bar_format="{l_bar}{bar}| [{elapsed}<{remaining}{postfix}]")
    passes: dict[str, int] = {}

    def tick(label: str) -> None:
        passes[label] = passes.get(label, 0) + 1
        order = list(passes)
        per_model = passes[order[0]] if len(order) > 1 else None
        done = len(order) - 1 + (min(passes[label] / per_model, 1.0) if per_model else 0.0)
        bar.update(done - bar.n)
        count = f"pass {passes[label]}" + (f"/{per_model}" if per_model else "")
        # shown at once when a model starts (whatever tqdm's refresh interval), else at tqdm's pace
        bar.set_postfix_str(f"model {len(order)}/{len(models)} ({label}), {count}", refresh=passes[label] == 1)

    for model in models:
        model.on_forward = tick
    try:
        yield bar
    finally:
        for model in models:
            model.on_forward = None
        bar.close()


#: Loggers of the libraries under the analyses (their INFO/WARNING messages are not ours).
LIBRARY_LOGGERS = ("transformers", "transformer_lens", "huggingface_hub", "accelerate", "torch")


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Silence other libraries' weight-loading bars, log messages and warnings; lnfree's own warnings still show."""
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )
    from transformers.utils import logging as hf_logging

    hf_bars, hub_bars_off = hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    levels = {name: logging.getLogger(name).level for name in LIBRARY_LOGGERS}
    hf_verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    disable_progress_bars()
    hf_logging.set_verbosity_error()
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore")
            warnings.filterwarnings("default", module=r"lnfree(\.|$)")
            yield
    finally:
        hf_logging.set_verbosity(hf_verbosity)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        if hf_bars:
            hf_logging.enable_progress_bar()
        if not hub_bars_off:
            enable_progress_bars()


def load_models(
    sources: Sequence[str], labels: Sequence[str] | None = None, *, device: str = "cpu",
) -> list[AnalysisModel]:
    """Load every source with `lnfree.load` (fp32, on `device`); labels default to the sources' folder names."""
    labels = model_labels(sources, labels)
    target = resolve_device(device)
    models = []
    for label, source in zip(labels, sources):
        loaded = load(source)
        loaded.model.to(target)
        models.append(AnalysisModel(label, loaded))
    return models


def evaluation_tokens(
    tokenizer, *, source: str = "tiny", n_sequences: int = 32, length: int = 64, vocab_size: int | None = None,
    cache_dir: str | None = None, bos_token_id: int | None = None,
) -> torch.Tensor:
    """The first `n_sequences` sequences of `length` tokens of a dataset (deterministic), as `lnfree eval` reads it.

    `source` is anything `lnfree eval --dataset` takes: "tiny" (the bundled model's held-out
    synthetic text), "owt-val", "pile", "pile-filtered", a Hub dataset id (streamed) or a local path.
    """
    try:
        sequences = load_sequences(resolve_dataset(source), tokenizer, context=length, n_sequences=n_sequences,
                                   vocab_size=vocab_size or len(tokenizer), cache_dir=cache_dir,
                                   bos_token_id=bos_token_id)
    except EvalError as err:  # worded for `lnfree eval`, whose --context is --length here
        raise EvalError(str(err).replace("--context", "--length")) from None
    return torch.from_numpy(sequences)


#: The folder holding the one plotly.js copy that figures load (None: each figure's own folder).
_PLOTLY_JS_DIR: ContextVar[Path | None] = ContextVar("plotly_js_dir", default=None)


@contextlib.contextmanager
def shared_plotly_js(folder: str | Path) -> Iterator[None]:
    """Figures written in this block load plotly.js from one copy in ``folder`` (e.g. the analyses' root)."""
    token = _PLOTLY_JS_DIR.set(Path(folder))
    try:
        yield
    finally:
        _PLOTLY_JS_DIR.reset(token)


def _local_plotly_js(out_dir: Path) -> str:
    """Write plotly.min.js (once, beside the figures) and return its path relative to ``out_dir``.

    A CDN link leaves figures blank on an offline machine; inlining the 4.8 MB library in every
    figure would make each one that large.
    """
    from plotly.offline import get_plotlyjs

    folder = _PLOTLY_JS_DIR.get() or out_dir
    folder.mkdir(parents=True, exist_ok=True)
    script, source = folder / "plotly.min.js", get_plotlyjs().encode()
    if not script.exists() or script.stat().st_size != len(source):  # absent, or another plotly version's
        script.write_bytes(source)
    return Path(os.path.relpath(script, out_dir)).as_posix()


def write_figure(figure, out_dir: str | Path, name: str) -> list[Path]:
    """Write a plotly figure as HTML (always; opens offline) and PNG (when a static exporter such as kaleido works)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    html = out_dir / f"{name}.html"
    # A fixed element id (not plotly's random one): the same figure gives the same file, and the
    # report (`lnfree.analysis.report`) can inline it beside the others.
    figure.write_html(html, include_plotlyjs=_local_plotly_js(out_dir), div_id=f"{out_dir.name}-{name}")
    written = [html]
    try:
        figure.write_image(out_dir / f"{name}.png")
        written.append(out_dir / f"{name}.png")
    except Exception:  # no static exporter (kaleido + a browser) on this machine: HTML only
        pass
    return written
