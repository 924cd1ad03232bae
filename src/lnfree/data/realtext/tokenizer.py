"""Byte-level BPE tokenizer of the 'realtext' model (GPT-2 style, trained on its train documents)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

__all__ = ["EOT_TOKEN", "build_tokenizer"]

EOT_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 256


def build_tokenizer(documents: list[str], vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of ``vocab_size`` tokens (EOT is id 0) on ``documents``.

    Byte-level: every string encodes and decodes back exactly, with no unknown token.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOT_TOKEN,
        bos_token=EOT_TOKEN,
        unk_token=EOT_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
