"""The bundled realtext model: loads by name, round-trips text, and its summary is reproducible."""

from __future__ import annotations

import json

import pytest
import torch

from lnfree.removal.config import load_preset
from lnfree.data.documents import prepare_data
from lnfree.models.base import load_base
from lnfree.data.realtext import REALTEXT_MODEL_DIR, CorpusError, load_documents, sdist_path, split_documents
from lnfree.data.realtext.corpus import SDIST_NAME, split_heldout
from lnfree.data.tiny import encode_documents

SUMMARY = json.loads((REALTEXT_MODEL_DIR / "training_summary.json").read_text())


@pytest.fixture(scope="module")
def base():
    return load_base("realtext")


@pytest.fixture(scope="module")
def documents():
    sdist_path(download=False)  # fetched at setup (`python -m lnfree.data.realtext.corpus`), never during tests
    return load_documents()


def test_loads_by_name_as_a_small_gpt2_with_layernorm(base):
    model, tokenizer = base
    c = model.config
    assert (c.n_layer, c.n_embd, c.n_positions, c.vocab_size) == (4, 128, 256, len(tokenizer))
    assert 2000 <= c.vocab_size <= 8192 and c.layer_norm_epsilon == 1e-5
    assert type(model.transformer.ln_f) is torch.nn.LayerNorm
    assert tokenizer.eos_token_id == c.eos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")


def test_tokenizer_round_trips_any_text_and_compresses_english(base):
    _, tokenizer = base
    text = "Django's ORM — naïve `QuerySet`s,\ttabs,  double spaces\n\n中文 and 🙂; <|endoftext|>-free."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    prose = "The view function returns an HTTP response object, which Django sends to the browser."
    assert len(tokenizer(prose)["input_ids"]) < len(prose) / 3


def test_summary_split_and_heldout_ce_are_reproducible(base, documents):
    model, tokenizer = base
    train, heldout = split_documents(list(documents))
    assert heldout == SUMMARY["data"]["heldout_documents"] and not set(train) & set(heldout)
    stream = encode_documents(tokenizer, [documents[n] for n in heldout])
    assert len(stream) == SUMMARY["heldout_tokens"]
    ids = torch.tensor(stream[: 16 * 256]).view(16, 256)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)
    # fp32 means of 255 terms: machines differ by ~1e-6, a wrong model or text by far more.
    assert ce.tolist() == pytest.approx(SUMMARY["heldout_ce_first_16_chunks"], abs=1e-4)
    assert SUMMARY["heldout_ce"] < SUMMARY["log_vocab"] - 3  # far below the uniform guess (log vocab)


def _halves(documents):
    """The train names and the held-out halves (validation, test), each a list of names."""
    train, heldout = split_documents(list(documents))
    return train, *split_heldout({n: len(documents[n]) for n in heldout})


def test_heldout_documents_halve_into_validation_and_test_of_about_equal_text(documents):
    train, validation, test = _halves(documents)
    _, heldout = split_documents(list(documents))
    assert sorted(validation + test) == heldout and not set(validation) & set(test) and not set(train) & set(heldout)
    sizes = [sum(len(documents[n]) for n in part) for part in (validation, test)]
    assert abs(sizes[0] - sizes[1]) < 0.05 * sum(sizes)  # balanced although one document is 22% of the text


def test_data_source_realtext_trains_on_its_split_and_evaluates_on_validation(base, documents, tmp_path):
    _, tokenizer = base
    config = load_preset("realtext").data.model_copy(update={"max_documents": 10, "cache_dir": str(tmp_path)})
    data = prepare_data(config, tokenizer, 256, len(tokenizer))
    train, validation, test = _halves(documents)
    expected = encode_documents(tokenizer, [documents[n] for n in validation])
    assert data.held_out.reshape(-1).tolist() == expected[: data.held_out.size]
    first_train = encode_documents(tokenizer, [documents[n] for n in train[:10]])  # max_documents=10
    assert data.train.reshape(-1).tolist() == first_train[: data.train.size]
    tested = prepare_data(config, tokenizer, 256, len(tokenizer), part="test")
    assert tested.held_out.reshape(-1).tolist() == encode_documents(tokenizer, [documents[n] for n in test])[
        : tested.held_out.size]
    with pytest.raises(ValueError, match="only the realtext corpus"):
        prepare_data(load_preset("tiny").data, tokenizer, 256, len(tokenizer), part="test")


@pytest.mark.parametrize("name, part", [("realtext", "test"), ("realtext-val", "validation")])
def test_eval_dataset_realtext_reads_the_test_half_and_realtext_val_the_validation_half(base, documents, tmp_path,
                                                                                      name, part):
    from lnfree.analysis.common import evaluation_tokens
    from lnfree.evaluate import load_sequences, resolve_dataset

    _, tokenizer = base
    tokens = evaluation_tokens(tokenizer, source=name, n_sequences=4, length=256, cache_dir=str(tmp_path))
    names = dict(zip(("validation", "test"), _halves(documents)[1:]))[part]
    stream = encode_documents(tokenizer, [documents[n] for n in names])
    assert tokens.reshape(-1).tolist() == stream[: 4 * 256]
    every = load_sequences(resolve_dataset(name), tokenizer, context=256, n_sequences=None, vocab_size=len(tokenizer),
                           cache_dir=str(tmp_path))
    assert len(every) == len(stream) // 256  # the whole half by default


def test_a_missing_or_altered_corpus_names_the_fix(tmp_path):
    with pytest.raises(CorpusError, match=r"pip download --no-deps --no-binary :all: django==5\.2\.8 -d"):
        sdist_path(tmp_path, download=False)
    (tmp_path / SDIST_NAME).write_bytes(b"not the sdist")
    with pytest.raises(CorpusError, match="sha256"):
        sdist_path(tmp_path)


def test_fetching_the_corpus_as_a_module_prints_no_runpy_warning():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "lnfree.data.realtext.corpus"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "RuntimeWarning" not in done.stderr, done.stderr
