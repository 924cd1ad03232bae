"""Tests of the bundled tiny GPT-2: corpus generator, tokenizer and the pretrained assets."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lnfree.data.tiny import (
    FINETUNE_SEED,
    HELDOUT_SEED,
    NAMES,
    OBJECTS,
    PLACES,
    PRETRAIN_SEED,
    TINY_MODEL_DIR,
    build_tokenizer,
    encode_documents,
    generate_documents,
)

EOT = "<|endoftext|>"
REPO = Path(__file__).resolve().parents[1]

# Measured on the bundled model: 1.628 nats on the first 20 HELDOUT_SEED documents (1.658 on 500;
# log vocab = 6.32).
HELDOUT_CE_THRESHOLD = 1.75

_NAME = "|".join(NAMES)
# "When A and B went to the P, B gave a X to A." (any motion/give verb, optional adjective).
IOI_WHEN = re.compile(
    rf"When ({_NAME}) and ({_NAME}) \w+ to the \w+, ({_NAME}) \w+ (?:a|an) (?:\w+ )?\w+ to ({_NAME})\."
)
# "Then, A and B went to the P. B gave a X to A."
IOI_THEN = re.compile(
    rf"Then, ({_NAME}) and ({_NAME}) \w+ to the \w+\. ({_NAME}) \w+ (?:a|an) (?:\w+ )?\w+ to "
    rf"({_NAME})\."
)
# Induction spans: (said once, repeated later verbatim).
SPAN_PATTERNS = (
    (r"down a secret code, ([\w ]+)\.", r"the code again, {}\."),
    (r"The song (?:goes|went) ([\w ]+)\.", r"(?:sings|sang) it again, {}\."),
    (r"\w+ the magic words, ([\w ]+)\.", r"Later, \w+ (?:says|said) the magic words, {}\."),
    (r"(?:has|had) a list, ([\w ]+)\.", r"(?:remembers|remembered) the list, {}\."),
)


def _digest(docs: list[str]) -> str:
    return hashlib.sha256("\n".join(docs).encode()).hexdigest()


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return generate_documents(300, PRETRAIN_SEED)


@pytest.fixture(scope="module")
def bundled():
    from transformers import AutoTokenizer, GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR, local_files_only=True)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR, local_files_only=True)
    return model, tokenizer


# ------------------------------------------------------------------------------------------------
# Corpus
# ------------------------------------------------------------------------------------------------


def test_generator_is_deterministic_and_seed_dependent():
    a = generate_documents(30, 7)
    assert a == generate_documents(30, 7)
    assert a != generate_documents(30, 8)
    assert generate_documents(10, 7) == a[:10]  # prefix-stable
    assert generate_documents(0, 7) == []
    seeds = {PRETRAIN_SEED, FINETUNE_SEED, HELDOUT_SEED}
    assert len(seeds) == 3
    streams = [generate_documents(5, s) for s in sorted(seeds)]
    assert streams[0] != streams[1] != streams[2] != streams[0]


def test_generator_independent_of_hash_seed():
    code = (
        "import hashlib; from lnfree.data.tiny.corpus import generate_documents; "
        "print(hashlib.sha256('\\n'.join(generate_documents(40, 3)).encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == _digest(generate_documents(40, 3))


def test_pretraining_corpus_unchanged():
    """The bundled model was trained on this exact stream; changing the generator invalidates it."""
    summary = json.loads((TINY_MODEL_DIR / "training_summary.json").read_text())
    assert summary["corpus_digest_first_100_docs"] == _digest(
        generate_documents(100, PRETRAIN_SEED)
    )


def test_document_shape_and_vocabulary(docs):
    n_words = [len(re.findall(r"\w+", d)) for d in docs]
    assert min(n_words) >= 50 and max(n_words) <= 300
    assert 100 <= sum(n_words) / len(n_words) <= 200
    assert all("\n" not in d and "  " not in d for d in docs)
    words = {w for d in docs for w in re.findall(r"\w+|[^\w\s]", d)}
    assert set(re.findall(r"[^\w\s]", " ".join(docs))) <= {".", ",", "!", "?"}
    assert len(words) <= 1500
    assert set(NAMES) <= words and set(PLACES) <= words and set(OBJECTS) <= words


def test_word_lists():
    assert len(NAMES) == len(set(NAMES)) == 40
    assert len(PLACES) == len(set(PLACES)) == 20
    assert len(OBJECTS) == len(set(OBJECTS)) == 30
    for lst in (NAMES, PLACES, OBJECTS):
        assert isinstance(lst, tuple) and all(re.fullmatch(r"[A-Za-z]+", w) for w in lst)
    assert not set(w.lower() for w in NAMES) & (set(PLACES) | set(OBJECTS))


def test_ioi_sentences_occur_in_both_orders(docs):
    text = " ".join(docs)
    orders = {"ABBA": 0, "BABA": 0}
    for pattern in (IOI_WHEN, IOI_THEN):
        matches = pattern.findall(text)
        assert len(matches) >= 50
        for a, b, subj, io in matches:
            assert a != b and {subj, io} == {a, b}
            orders["ABBA" if subj == b else "BABA"] += 1
    assert min(orders.values()) >= 0.35 * sum(orders.values())


def test_repeated_spans_for_induction(docs):
    n_docs_with_repeat = 0
    for doc in docs:
        found = False
        for first, second in SPAN_PATTERNS:
            m = re.search(first, doc)  # the earliest match is a first occurrence
            if m is None:
                continue
            span = m.group(1)
            assert 3 <= len(span.split()) <= 10
            if not re.search(second.format(re.escape(span)), doc[m.end() :]):
                pytest.fail(f"span {span!r} never repeated in: {doc}")
            found = True
        n_docs_with_repeat += found
    assert n_docs_with_repeat >= 0.3 * len(docs)
    # Unframed repeats: "The parrot said, X Y Z X Y Z!"
    chants = re.findall(r"The parrot (?:says|said), ([\w ]+)!", " ".join(docs))
    assert len(chants) >= 10
    for chant in chants:
        words = chant.split()
        assert any(
            len(words) == k * n and words == words[:n] * k for k in (2, 3) for n in range(3, 11)
        ), chant


# ------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------


def test_build_tokenizer_deterministic_sorted_and_round_trips(docs):
    tok = build_tokenizer(docs[:100])
    again = build_tokenizer(docs[:100])
    assert tok.get_vocab() == again.get_vocab()
    vocab = tok.convert_ids_to_tokens(list(range(len(tok))))
    assert vocab[:2] == [EOT, "<|unk|>"]
    counts: dict[str, int] = {}
    for d in docs[:100]:
        for w in re.findall(r"\w+|[^\w\s]", d):
            counts[w] = counts.get(w, 0) + 1
    assert vocab[2:] == sorted(counts, key=lambda w: (-counts[w], w))
    assert tok.eos_token == EOT and tok.eos_token_id == 0
    for d in docs[:20]:
        ids = tok(d)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == d
    assert tok("Mary met Zebulon.")["input_ids"][2] == tok.unk_token_id
    stream = encode_documents(tok, docs[:3])
    assert stream.count(tok.eos_token_id) == 3 and stream[-1] == tok.eos_token_id


def test_bundled_tokenizer_names_and_eot(bundled):
    model, tok = bundled
    assert tok.eos_token == EOT and tok.bos_token == EOT
    eot_id = tok.convert_tokens_to_ids(EOT)
    assert tok.eos_token_id == eot_id == model.config.eos_token_id == model.config.bos_token_id
    assert tok(EOT, add_special_tokens=False)["input_ids"] == [eot_id]
    assert len(tok) == model.config.vocab_size
    for name in NAMES:
        assert len(tok(name, add_special_tokens=False)["input_ids"]) == 1, name
        assert len(tok(" " + name, add_special_tokens=False)["input_ids"]) == 1, name
        ids = tok(f"Then, Mary gave it to {name}.", add_special_tokens=False)["input_ids"]
        assert tok.convert_ids_to_tokens(ids[-2]) == name
    for word in PLACES + OBJECTS:
        assert len(tok(word, add_special_tokens=False)["input_ids"]) == 1, word
    held = generate_documents(50, HELDOUT_SEED)
    assert tok.unk_token_id not in encode_documents(tok, held)


# ------------------------------------------------------------------------------------------------
# Bundled model
# ------------------------------------------------------------------------------------------------


def test_bundled_assets_present_and_small():
    names = {p.name for p in TINY_MODEL_DIR.iterdir()}
    assert {"model.safetensors", "config.json", "training_summary.json"} <= names
    assert "tokenizer.json" in names
    total = sum(p.stat().st_size for p in TINY_MODEL_DIR.rglob("*") if p.is_file())
    assert total < 10 * 2**20


def test_bundled_model_is_the_one_the_training_script_builds(bundled):
    spec = importlib.util.spec_from_file_location("train_tiny", REPO / "experiments" / "tiny_pretrain" / "train_tiny.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model, tokenizer = bundled
    built = script.model_config(tokenizer).to_diff_dict()
    bundled_config = model.config.to_dict()
    differing = {k: (v, bundled_config.get(k)) for k, v in built.items()
                 if k not in ("transformers_version", "architectures", "dtype") and bundled_config.get(k) != v}
    assert differing == {}, f"the bundled config differs from experiments/tiny_pretrain/train_tiny.py: {differing}"
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()


@torch.no_grad()
def test_bundled_model_heldout_ce(bundled):
    model, tok = bundled
    stream = encode_documents(tok, generate_documents(20, HELDOUT_SEED))
    ctx = model.config.n_positions
    total, count = 0.0, 0
    for i in range(0, len(stream), ctx):
        ids = torch.tensor([stream[i : i + ctx]])
        if ids.shape[1] < 2:
            continue
        logits = model(input_ids=ids).logits[0, :-1]
        total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    ce = total / count
    assert ce < HELDOUT_CE_THRESHOLD
    assert ce < 0.35 * math.log(len(tok))


@torch.no_grad()
def test_bundled_model_does_ioi(bundled):
    """On fresh IOI prompts, the indirect object usually beats the repeated subject.

    Measured on the bundled model with this exact prompt set: accuracy 0.875, mean logit
    difference 3.4 (the "When" template is easier than the "Then" one).
    """
    import random

    model, tok = bundled
    rng = random.Random(0)
    templates = (
        "Then, {a} and {b} went to the {p}. {s} gave a {o} to",
        "When {a} and {b} went to the {p}, {s} gave a {o} to",
    )
    diffs = []
    for template in templates:
        for _ in range(40):
            a, b = rng.sample(NAMES, 2)
            place, obj = rng.choice(PLACES), rng.choice(OBJECTS)
            subj, io = (b, a) if rng.random() < 0.5 else (a, b)
            prompt = template.format(a=a, b=b, p=place, s=subj, o=obj)
            ids = tok(prompt, return_tensors="pt")["input_ids"]
            logits = model(input_ids=ids).logits[0, -1]
            io_id, s_id = tok.convert_tokens_to_ids([io, subj])
            diffs.append((logits[io_id] - logits[s_id]).item())
    accuracy = sum(d > 0 for d in diffs) / len(diffs)
    assert accuracy >= 0.75
    assert sum(diffs) / len(diffs) > 2.0


@torch.no_grad()
def test_bundled_model_does_induction(bundled):
    """The second occurrence of a repeated random span is far more predictable than the first."""
    model, tok = bundled
    first, second = [], []
    for doc in generate_documents(60, HELDOUT_SEED):
        m = re.search(r"the magic words, ([\w ]+)\.|a list, ([\w ]+)\.|secret code, ([\w ]+)\.", doc)
        if m is None:
            continue
        span = tok(m.group(m.lastindex), add_special_tokens=False)["input_ids"]
        ids = tok(doc, add_special_tokens=False)["input_ids"][: model.config.n_positions]
        starts = [i for i in range(1, len(ids) - len(span) + 1) if ids[i : i + len(span)] == span]
        if len(starts) < 2:
            continue
        logprobs = model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
        for start, out in ((starts[0], first), (starts[-1], second)):
            out += [-logprobs[start + i - 1, span[i]].item() for i in range(1, len(span))]
    assert len(first) >= 50
    # Measured: 5.9 nats on the first occurrence, 0.3 on the repeat.
    assert sum(second) / len(second) < 1.0 < 4.0 < sum(first) / len(first)


@torch.no_grad()
def test_bundled_model_residual_norm_varies_across_tokens(bundled):
    """Like real GPT-2, the scale LayerNorm divides by is not constant across tokens.

    Measured per-token std of the block inputs: coefficient of variation 0.14 / 0.18 / 0.29 for
    blocks 1-3, and position 0 is about 1.6x the median in blocks 1 and 2.
    """
    model, tok = bundled
    stream = encode_documents(tok, generate_documents(3, HELDOUT_SEED))
    ids = torch.tensor([stream[: model.config.n_positions]])
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    for layer in range(1, model.config.n_layer):
        x = hidden[layer][0]  # input of block `layer`
        std = (x - x.mean(-1, keepdim=True)).pow(2).mean(-1).sqrt()
        assert (std.std() / std.mean()).item() > 0.08, layer
        if layer <= 2:
            assert std[0] > 1.3 * std.median(), layer
