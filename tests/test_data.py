"""Data: packing with EOT between documents, the sources, the cache and step-indexed batches."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from lnfree.removal.config import DataConfig
from lnfree.data.documents import DataError, DeviceBatches, StepBatches, bos_token, prepare_data


@pytest.fixture
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


DOCS = ["Mary went to the park .", "John gave a ball to Mary .", "the dog ran home .", "Mary and John went home ."] * 10


def config(source, tmp_path, **kw):
    return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), val_fraction=0.1, **kw)


def test_documents_are_joined_with_eot_and_eot_stays_a_target(tokenizer, tmp_path):
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS))
    data = prepare_data(config(tmp_path / "docs.jsonl", tmp_path), tokenizer, 8, len(tokenizer))
    eot = tokenizer.eos_token_id
    stream = np.concatenate([data.train.reshape(-1), data.held_out.reshape(-1)])
    assert (stream == eot).sum() >= 30
    # Every document is followed by EOT: the token after each EOT starts a known document.
    starts = {tokenizer(d)["input_ids"][0] for d in DOCS}
    flat = data.train.reshape(-1)
    assert all(flat[i + 1] in starts for i in np.flatnonzero(flat[:-1] == eot))
    # Held-out CE scores every next token, EOT included (no label masking).
    import contextlib

    from conftest import small_gpt2

    from lnfree.removal.train import held_out_ce

    model = small_gpt2(vocab_size=len(tokenizer))
    ids = data.eval_batch(2)
    logits = model(input_ids=ids).logits[:, :-1]
    manual = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    assert (ids[:, 1:] == eot).any()
    assert held_out_ce(model, data, 2, 2, contextlib.nullcontext).item() == pytest.approx(manual.item(), rel=1e-6)
    # data.eval_spread: as many sequences, evenly spaced over the held-out ones from the first
    n = len(data.held_out)
    spread = data.eval_batch(2, spread=True)
    middle = torch.from_numpy(data.held_out[n // 2].astype(np.int64))
    assert n > 2 and torch.equal(spread[0], ids[0]) and torch.equal(spread[1], middle)
    assert torch.equal(data.eval_batch(n + 5, spread=True), data.eval_batch(n + 5))  # all of them either way
    spread_ce = held_out_ce(model, data, 2, 2, contextlib.nullcontext, spread=True).item()
    logits = model(input_ids=spread).logits[:, :-1]
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), spread[:, 1:].flatten())
    assert spread_ce == pytest.approx(expected.item(), rel=1e-6)


def test_txt_folder_txt_file_parquet_and_npy_sources(tokenizer, tmp_path):
    (tmp_path / "folder").mkdir()
    for i, d in enumerate(DOCS):
        (tmp_path / "folder" / f"{i:03}.txt").write_text(d)
    (tmp_path / "one.txt").write_text("\n\n".join(DOCS))
    import datasets

    datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(tmp_path / "docs.parquet"))
    counts = set()
    for source in ("folder", "one.txt", "docs.parquet"):
        separator = {"document_separator": "\n\n"} if source == "one.txt" else {}
        data = prepare_data(config(tmp_path / source, tmp_path, **separator), tokenizer, 8, len(tokenizer))
        counts.add(data.train.size + data.held_out.size)
    assert len(counts) == 1  # the same documents, the same token count
    stream = np.arange(1000, dtype=np.uint16) % 50
    np.save(tmp_path / "tokens.npy", stream)
    data = prepare_data(config(tmp_path / "tokens.npy", tmp_path), tokenizer, 10, len(tokenizer))
    assert np.array_equal(data.train.reshape(-1), stream[: data.train.size])
    assert data.held_out.shape[1] == 10


def test_a_txt_file_is_one_document_unless_a_separator_is_given(tokenizer, tmp_path):
    (tmp_path / "work.txt").write_text("\n\n".join(DOCS * 5))
    data = prepare_data(config(tmp_path / "work.txt", tmp_path), tokenizer, 8, len(tokenizer))
    assert data.stats["train"]["documents"] == data.stats["held_out"]["documents"] == 1
    assert data.stats["train"]["eot"] == data.stats["held_out"]["eot"] == 1
    assert (data.train == tokenizer.eos_token_id).sum() <= 1  # only where the held-out part was cut off
    assert data.stats["held_out"]["tokens"] == pytest.approx(0.1 * (data.stats["train"]["tokens"] + data.stats["held_out"]["tokens"]), rel=0.2)
    split = prepare_data(config(tmp_path / "work.txt", tmp_path, document_separator="\n\n"), tokenizer, 8, len(tokenizer))
    assert split.stats["train"]["documents"] + split.stats["held_out"]["documents"] == len(DOCS) * 5
    assert "180 documents" in split.description and "EOT" in split.description


def test_frequent_eot_is_warned_about(tokenizer, tmp_path, caplog):
    (tmp_path / "short.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS))
    (tmp_path / "long.jsonl").write_text("\n".join(json.dumps({"text": " ".join(DOCS[i:i + 20])}) for i in range(20)))
    with caplog.at_level("INFO", logger="lnfree"):
        prepare_data(config(tmp_path / "long.jsonl", tmp_path), tokenizer, 8, len(tokenizer))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert any("18 documents" in r.getMessage() for r in caplog.records)  # documents and EOT are logged
    with caplog.at_level("INFO", logger="lnfree"):
        prepare_data(config(tmp_path / "short.jsonl", tmp_path), tokenizer, 8, len(tokenizer))
    assert any(r.levelname == "WARNING" and "an EOT every 7 tokens" in r.getMessage() for r in caplog.records)


def test_tokenising_processes_are_capped_by_the_available_cores(tokenizer, tmp_path, monkeypatch):
    import datasets

    seen = []
    original = datasets.Dataset.map
    monkeypatch.setattr(datasets.Dataset, "map", lambda self, *a, **kw: seen.append(kw.get("num_proc")) or original(self, *a, **kw))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS))
    prepare_data(config(tmp_path / "docs.jsonl", tmp_path, num_proc=8), tokenizer, 8, len(tokenizer))
    assert seen and all(n is None for n in seen)


def test_missing_or_bad_sources_are_clear_errors(tokenizer, tmp_path):
    with pytest.raises(DataError, match="not found"):
        prepare_data(config(tmp_path / "nope.jsonl", tmp_path), tokenizer, 8, len(tokenizer))
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n{"body": "y"}\n{"body": "z"}\n')
    with pytest.raises(DataError, match="column 'text'"):
        prepare_data(config(tmp_path / "bad.jsonl", tmp_path), tokenizer, 8, len(tokenizer))
    np.save(tmp_path / "big.npy", np.full(100, 10_000, dtype=np.int64))
    with pytest.raises(DataError, match="below the vocabulary"):
        prepare_data(config(tmp_path / "big.npy", tmp_path), tokenizer, 8, len(tokenizer))


def test_cache_is_reused_and_keyed_by_source(tokenizer, tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS))
    first = prepare_data(config(tmp_path / "a.jsonl", tmp_path), tokenizer, 8, len(tokenizer))
    folders = list((tmp_path / "cache").iterdir())
    again = prepare_data(config(tmp_path / "a.jsonl", tmp_path), tokenizer, 8, len(tokenizer))
    assert list((tmp_path / "cache").iterdir()) == folders and np.array_equal(first.train, again.train)
    prepare_data(config(tmp_path / "a.jsonl", tmp_path, val_seed=1), tokenizer, 8, len(tokenizer))
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_two_runs_filling_one_cache_at_once_both_finish(tokenizer, tmp_path, monkeypatch):
    # A removal and its control started side by side tokenise the same cache folder at once. Replayed here in one
    # process: the second preparation runs to its end just before the first moves its token file into place.
    import lnfree.data.documents as documents

    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS))
    replace, calls = documents.os.replace, []

    def interleaved(source, target):
        calls.append(target)
        if len(calls) == 1:
            inner = prepare_data(config(tmp_path / "a.jsonl", tmp_path), tokenizer, 8, len(tokenizer))
            assert inner.train.size
        replace(source, target)

    monkeypatch.setattr(documents.os, "replace", interleaved)
    first = prepare_data(config(tmp_path / "a.jsonl", tmp_path), tokenizer, 8, len(tokenizer))
    monkeypatch.undo()
    assert len(calls) == 6  # train, held-out and meta of each preparation
    again = prepare_data(config(tmp_path / "a.jsonl", tmp_path), tokenizer, 8, len(tokenizer))
    assert np.array_equal(first.train, again.train) and np.array_equal(first.held_out, again.held_out)
    (folder,) = (tmp_path / "cache").iterdir()
    assert sorted(p.name for p in folder.iterdir()) == ["held_out.bin", "meta.json", "train.bin"]


def test_step_batches_are_a_pure_function_of_the_step_and_split_over_ranks():
    sequences = np.arange(40 * 4).reshape(40, 4)
    one = StepBatches(sequences, micro_batch_size=2, accumulation=4, world_size=1, seed=3)
    two = StepBatches(sequences, micro_batch_size=2, accumulation=2, world_size=2, seed=3)
    for step in (0, 4, 7):  # step 5+ crosses into a second, reshuffled epoch
        seen_one = torch.cat([one.get(step, m, 0) for m in range(4)])
        seen_two = torch.cat([two.get(step, m, r) for m in range(2) for r in range(2)])
        assert sorted(seen_one[:, 0].tolist()) == sorted(seen_two[:, 0].tolist())
        assert len(set(seen_one[:, 0].tolist())) == 8
    assert torch.equal(one.get(6, 1, 0), StepBatches(sequences, 2, 4, 1, seed=3).get(6, 1, 0))
    epoch0 = torch.cat([one.get(s, m, 0) for s in range(5) for m in range(4)])[:, 0]
    assert sorted(epoch0.tolist()) == list(range(0, 160, 4))  # every sequence once per epoch


def test_device_batches_equal_step_batches_in_order_and_after_a_jump():
    sequences = np.arange(40 * 5).reshape(40, 5)
    batches = StepBatches(sequences, micro_batch_size=2, accumulation=3, world_size=2, seed=1)
    loader = DeviceBatches(batches, rank=1, device=torch.device("cpu"))
    keys = [(0, 0), (0, 1), (0, 2), (1, 0), (7, 2), (8, 0), (3, 1)]  # in order, then a resume-like jump
    for step, micro in keys:
        assert torch.equal(loader.get(step, micro), batches.get(step, micro, 1))


def test_a_family_that_needs_bos_gets_it_first_in_every_sequence_of_training_and_evaluation(tokenizer, tmp_path):
    from families import tiny_family

    from lnfree.data.documents import bos_token
    from lnfree.evaluate import load_sequences, resolve_dataset

    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS))
    plain = prepare_data(config(tmp_path / "docs.jsonl", tmp_path), tokenizer, 8, len(tokenizer))
    assert bos_token(tiny_family("llama"), tokenizer) is None
    bos = bos_token(tiny_family("gemma3"), tokenizer)
    assert bos == tokenizer.bos_token_id
    data = prepare_data(config(tmp_path / "docs.jsonl", tmp_path), tokenizer, 8, len(tokenizer), bos)
    assert data.train.shape[1] == 8 and (data.train[:, 0] == bos).all() and (data.held_out[:, 0] == bos).all()
    stream = plain.train.reshape(-1)
    assert np.array_equal(data.train[:, 1:].reshape(-1), stream[: data.train.shape[0] * 7])  # 7 tokens after BOS
    assert "after BOS" in data.description
    ids = load_sequences(resolve_dataset(str(tmp_path / "docs.jsonl")), tokenizer, context=8, n_sequences=3,
                         vocab_size=len(tokenizer), bos_token_id=bos)
    assert ids.shape == (3, 8) and (ids[:, 0] == bos).all()
    unprefixed = load_sequences(resolve_dataset(str(tmp_path / "docs.jsonl")), tokenizer, context=7, n_sequences=3,
                                vocab_size=len(tokenizer))
    assert np.array_equal(ids[:, 1:], unprefixed)


def test_data_bos_always_starts_every_sequence_with_the_tokenizers_bos_for_a_family_that_reads_none(tokenizer,
                                                                                                   tmp_path):
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS))
    family = prepare_data(config(tmp_path / "docs.jsonl", tmp_path), tokenizer, 8, len(tokenizer))  # none for GPT-2
    rule = config(tmp_path / "docs.jsonl", tmp_path, bos="always")
    with pytest.raises(DataError, match="bos_token"):  # the rule is resolved by bos_token, once for every caller
        prepare_data(rule, tokenizer, 8, len(tokenizer))
    bos = bos_token(None, tokenizer, rule.bos)
    always = prepare_data(rule, tokenizer, 8, len(tokenizer), bos)
    assert bos == tokenizer.bos_token_id
    assert not (family.train[:, 0] == bos).all()
    assert always.train.shape[1] == 8 and (always.train[:, 0] == bos).all() and (always.held_out[:, 0] == bos).all()
    # the same as the BOS a family that reads one gets
    given = prepare_data(config(tmp_path / "docs.jsonl", tmp_path), tokenizer, 8, len(tokenizer), bos)
    assert np.array_equal(always.train, given.train) and np.array_equal(always.held_out, given.held_out)


def test_a_bos_token_that_documents_carry_is_only_ever_at_position_0(tokenizer, tmp_path):
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS))
    plain = prepare_data(config(tmp_path / "docs.jsonl", tmp_path), tokenizer, 8, len(tokenizer))
    marker = int(tokenizer("Mary")["input_ids"][0])  # stands in for a BOS each document starts with
    assert (plain.train == marker).any()
    data = prepare_data(config(tmp_path / "docs.jsonl", tmp_path), tokenizer, 8, len(tokenizer), marker)
    assert (data.train[:, 0] == marker).all() and not (data.train[:, 1:] == marker).any()
    stream = plain.train.reshape(-1)  # the stream, cut at a multiple of 8
    kept, after = stream[stream != marker], data.train[:, 1:].reshape(-1)
    n = min(len(kept), len(after))
    assert n > 100 and np.array_equal(after[:n], kept[:n])


def test_a_malformed_jsonl_line_is_named_by_its_line_number(tokenizer, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n\n{"text": \n')
    with pytest.raises(DataError, match=r"bad.jsonl, line 3: not valid JSON"):
        prepare_data(config(tmp_path / "bad.jsonl", tmp_path), tokenizer, 8, len(tokenizer))
