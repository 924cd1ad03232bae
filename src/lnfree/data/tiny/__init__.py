"""The bundled tiny pretrained GPT-2: its corpus generator, tokenizer and location on disk.

``TINY_MODEL_DIR`` holds a 4-layer, 128-wide GPT-2 trained from scratch on the synthetic corpus of
:mod:`lnfree.data.tiny.corpus` (words from :mod:`lnfree.data.tiny.words`; see ``experiments/tiny_pretrain/train_tiny.py``). Load it offline with
``GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR)`` and ``AutoTokenizer.from_pretrained(TINY_MODEL_DIR)``.
"""

from pathlib import Path

from lnfree.data.tiny.corpus import generate_documents
from lnfree.data.tiny.tokenizer import EOT_TOKEN, UNK_TOKEN, build_tokenizer, encode_documents
from lnfree.data.tiny.words import NAMES, OBJECTS, PLACES

__all__ = [
    "TINY_MODEL_DIR",
    "PRETRAIN_SEED",
    "FINETUNE_SEED",
    "HELDOUT_SEED",
    "NAMES",
    "PLACES",
    "OBJECTS",
    "EOT_TOKEN",
    "UNK_TOKEN",
    "generate_documents",
    "build_tokenizer",
    "encode_documents",
]

#: Directory of the bundled tiny model (config, safetensors weights, tokenizer, training summary).
TINY_MODEL_DIR: Path = Path(__file__).resolve().parents[2] / "assets" / "tiny-gpt2"

#: Seed of the document stream used to pre-train the tiny model (and build its tokenizer).
PRETRAIN_SEED = 0
#: Seed of the document stream used for LayerNorm-removal fine-tuning.
FINETUNE_SEED = 1
#: Seed of the held-out evaluation document stream.
HELDOUT_SEED = 2
