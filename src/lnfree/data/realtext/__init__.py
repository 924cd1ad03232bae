"""The bundled real-text GPT-2 ('realtext'): its corpus, tokenizer and location on disk.

``REALTEXT_MODEL_DIR`` holds a 4-layer, 128-wide GPT-2 with LayerNorm, context 256, trained from
scratch on Django's documentation (see :mod:`lnfree.data.realtext.corpus` and
``experiments/realtext_pretrain/train_realtext.py``). Load it by the name ``realtext`` wherever
``tiny`` works, and fine-tune on its corpus with ``--data realtext``.
"""

from pathlib import Path

from lnfree.data.realtext.tokenizer import EOT_TOKEN, build_tokenizer

# The corpus names load lazily (PEP 562): `python -m lnfree.data.realtext.corpus` then runs a module that the
# package has not imported yet, and runpy has nothing to warn about.
_CORPUS_NAMES = ("HELDOUT_FRACTION", "SPLIT_SEED", "CorpusError", "fetch_command", "load_documents", "sdist_path",
                 "split_documents", "split_heldout", "train_and_heldout", "HELD_OUT_PARTS")

__all__ = ["REALTEXT_MODEL_DIR", "EOT_TOKEN", "build_tokenizer", *_CORPUS_NAMES]

#: Directory of the bundled real-text model (config, safetensors weights, tokenizer, training summary).
REALTEXT_MODEL_DIR: Path = Path(__file__).resolve().parents[2] / "assets" / "realtext-gpt2"


def __getattr__(name: str):
    if name in _CORPUS_NAMES:
        from lnfree.data.realtext import corpus

        return getattr(corpus, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
