"""Word-level tokenizer for the bundled tiny GPT-2.

One token per word (each character name is exactly one token), punctuation isolated into its own
token, plus two special tokens:

* ``<|endoftext|>`` (id 0): end-of-text, used as ``eos_token`` and ``bos_token`` as in GPT-2. It is
  appended after every document when documents are packed into a training stream.
* ``<|unk|>`` (id 1): any word not seen when the vocabulary was built.

The vocabulary is deterministic: special tokens first, then every word of the corpus sorted by
decreasing frequency, ties broken alphabetically. Decoding joins words with spaces and re-attaches
``. , ! ?`` to the previous word, which reproduces the corpus text exactly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["EOT_TOKEN", "UNK_TOKEN", "build_tokenizer", "encode_documents"]

EOT_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<|unk|>"
MODEL_MAX_LENGTH = 128


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    # Split on whitespace, then isolate every punctuation character ("store," -> "store", ",").
    return pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated")]
    )


def build_tokenizer(documents: list[str]) -> PreTrainedTokenizerFast:
    """Build the word-level tokenizer whose vocabulary is every word occurring in ``documents``."""
    pre = _pre_tokenizer()
    # Count whitespace-separated pieces first (fast), then split each distinct piece with the real
    # pre-tokenizer (which isolates punctuation) and accumulate the word counts.
    piece_counts: Counter[str] = Counter()
    for doc in documents:
        piece_counts.update(doc.split())
    counts: Counter[str] = Counter()
    for piece, n in piece_counts.items():
        for word, _ in pre.pre_tokenize_str(piece):
            counts[word] += n
    for special in (EOT_TOKEN, UNK_TOKEN):
        counts.pop(special, None)
    words = sorted(counts, key=lambda w: (-counts[w], w))
    vocab = {EOT_TOKEN: 0, UNK_TOKEN: 1}
    for word in words:
        vocab[word] = len(vocab)

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre
    # WordPiece decoding joins tokens with spaces; cleanup re-attaches punctuation.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.add_special_tokens([EOT_TOKEN, UNK_TOKEN])

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOT_TOKEN,
        bos_token=EOT_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )


def encode_documents(tokenizer: PreTrainedTokenizerFast, documents: Iterable[str]) -> list[int]:
    """Encode ``documents`` into one token stream with the EOT token after every document."""
    eot = tokenizer.eos_token_id
    stream: list[int] = []
    for ids in tokenizer(list(documents), add_special_tokens=False, verbose=False)["input_ids"]:
        stream.extend(ids)
        stream.append(eot)
    return stream
