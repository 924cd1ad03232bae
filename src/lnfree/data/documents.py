"""Fine-tuning data: documents → tokens with EOT between documents → fixed-length sequences.

Sources (``DataConfig.source``):
- ``tiny``: the synthetic corpus of the bundled tiny model (held-out text from its own seed);
- ``realtext``: Django's documentation, the corpus of the bundled realtext model, with that model's
  own train/held-out document split (``lnfree.data.realtext``; fetched with pip on first use); a run
  evaluates on the validation half of the held-out documents, the test half is for `lnfree eval`;
- a local ``.txt`` file (one document, or several split at ``document_separator``), a folder of
  ``.txt`` files (one document each), a ``.jsonl`` file (one document per line, in ``text_field``), a ``.parquet``
  file, or a folder written by ``datasets.Dataset.save_to_disk``;
- a pre-tokenised stream: a ``.npy`` array of token ids (EOT already in place, held-out tokens
  taken from the end), or any dataset with an ``input_ids`` column (rows concatenated as-is);
- any other string: a Hugging Face Hub dataset id (``revision``, ``split``).

Text is split into train/held-out documents with ``train_test_split(test_size=val_fraction,
seed=val_seed)`` (the nanoGPT split for OpenWebText), tokenised, joined with the EOT token
after every document (EOT stays a prediction target) and cached as flat ``uint16``/``uint32``
token files keyed by the tokenizer and the source. A source with a single document (one ``.txt``
file) is split by characters instead: its last ``val_fraction``, cut at a line break, is held out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lnfree.errors import LnfreeError
from lnfree.arch import architecture
from lnfree.data.config import DataConfig
from lnfree.data.realtext import CorpusError, train_and_heldout
from lnfree.data.tiny import FINETUNE_SEED, HELDOUT_SEED, generate_documents

CACHE_FORMAT = 3  # 3: realtext's held-out documents halved into validation and test
#: Fewer tokens per EOT than this on average is warned about (documents split too finely?).
FREQUENT_EOT = 100

log = logging.getLogger("lnfree")


class DataError(LnfreeError, ValueError):
    """A data source that cannot be read or does not fit the model."""


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's full definition (cache keys, same-tokenizer checks)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cache_root(config: DataConfig) -> Path:
    return Path(config.cache_dir or Path.home() / ".cache" / "lnfree" / "data").expanduser()


def _text_datasets(config: DataConfig, part: str = "validation"):
    """(train, held-out) `datasets.Dataset`s of documents, or of pre-tokenised rows; `part` chooses
    realtext's held-out half (`lnfree.data.realtext.corpus`: validation while training, test for the
    final evaluation). Other sources have one held-out split."""
    import datasets


    if config.source == "tiny":
        n = config.max_documents or 4000
        held_out = max(2, int(round(n * config.val_fraction)))
        return (
            datasets.Dataset.from_dict({"text": generate_documents(n, FINETUNE_SEED)}),
            datasets.Dataset.from_dict({"text": generate_documents(held_out, HELDOUT_SEED)}),
        )
    if config.source == "realtext":
        try:
            train, held_out = train_and_heldout(part=part)
        except CorpusError as err:
            raise DataError(str(err)) from err
        return (
            datasets.Dataset.from_dict({"text": train[: config.max_documents]}),
            datasets.Dataset.from_dict({"text": held_out}),
        )
    path = Path(config.source).expanduser()
    if path.exists():
        dataset = _local_dataset(path, config)
    elif config.source.startswith((".", "/", "~")) or path.suffix in {".txt", ".jsonl", ".json", ".parquet", ".npy"}:
        raise DataError(f"data source not found: {config.source}")
    else:
        try:
            dataset = datasets.load_dataset(config.source, revision=config.revision, split=config.split)
        except Exception as err:  # the Hub, the network or the id: say which source failed
            raise DataError(f"could not load dataset {config.source!r} (split {config.split!r}): {err}") from err
    if config.max_documents is not None:
        dataset = dataset.select(range(min(config.max_documents, len(dataset))))
    if len(dataset) == 1 and "input_ids" not in dataset.column_names and config.text_field in dataset.column_names:
        return _split_one_document(dataset[0][config.text_field], config)
    if len(dataset) < 2:
        raise DataError(f"data source {config.source!r} holds fewer than two documents")
    split = dataset.train_test_split(test_size=config.val_fraction, seed=config.val_seed, shuffle=True)
    return split["train"], split["test"]


def _split_one_document(text: str, config: DataConfig):
    """(train, held-out) parts of a single document: the last `val_fraction` of its characters."""
    import datasets

    cut = int(len(text) * (1 - config.val_fraction))
    line_break = text.rfind("\n", 0, cut)
    cut = line_break + 1 if line_break > 0 else cut
    if not text[:cut].strip() or not text[cut:].strip():
        raise DataError(f"data source {config.source!r} is too short to hold out {config.val_fraction:g} of it")
    column = config.text_field
    return datasets.Dataset.from_dict({column: [text[:cut]]}), datasets.Dataset.from_dict({column: [text[cut:]]})


def available_cores() -> int:
    """CPU cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _check_json_lines(path: Path) -> None:
    """A `DataError` naming the first line of a .jsonl file that is not a JSON object (lines count from 1)."""
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}, line {number}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}, line {number}: expected a JSON object per line, got {type(row).__name__}")


def _local_dataset(path: Path, config: DataConfig):
    import datasets

    try:
        if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "state.json").exists()):
            loaded = datasets.load_from_disk(str(path))
            return loaded[config.split] if isinstance(loaded, datasets.DatasetDict) else loaded
        if path.is_dir():
            files = sorted(path.glob("*.txt"))
            if not files:
                raise DataError(f"no .txt files in {path}")
            return datasets.Dataset.from_dict({"text": [f.read_text() for f in files]})
        if path.suffix == ".txt":
            text = path.read_text()
            docs = text.split(config.document_separator) if config.document_separator else [text]
            return datasets.Dataset.from_dict({config.text_field: [d.strip() for d in docs if d.strip()]})
        if path.suffix in {".jsonl", ".json"}:
            if path.suffix == ".jsonl":
                _check_json_lines(path)
            return datasets.load_dataset("json", data_files=str(path), split="train")
        if path.suffix == ".parquet":
            return datasets.load_dataset("parquet", data_files=str(path), split="train")
    except DataError:
        raise
    except Exception as err:
        raise DataError(f"could not read data source {path}: {err}") from err
    raise DataError(f"unsupported data file {path} (use .txt, .jsonl, .parquet, .npy or a dataset folder)")


def _own_temporary(path: Path) -> Path:
    """A new file beside `path` that only this call writes, to `os.replace` onto it when complete: two runs
    started side by side fill the same cache at once, and a temporary name they shared was renamed away
    under the second."""
    return path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")  # made with the user's umask


def _write_tokens(dataset, tokenizer, eot: int, config: DataConfig, out: Path, dtype) -> dict:
    """Tokenise `dataset` into the flat token file `out`; returns its token, document and EOT counts."""
    if "input_ids" in dataset.column_names:
        ids = dataset.map(lambda batch: {"n": [len(x) for x in batch["input_ids"]]}, batched=True, desc="counting")
    else:
        if config.text_field not in dataset.column_names:
            raise DataError(f"column {config.text_field!r} not in dataset (columns: {dataset.column_names})")

        def encode(batch):
            encoded = [tokenizer(t, verbose=False)["input_ids"] + [eot] for t in batch[config.text_field]]
            return {"input_ids": encoded, "n": [len(x) for x in encoded]}

        processes = min(config.num_proc, available_cores())
        ids = dataset.map(
            encode, batched=True, num_proc=processes if processes > 1 else None,
            remove_columns=dataset.column_names, desc="tokenising",
        )
    total = int(np.sum(ids["n"], dtype=np.int64))
    tmp = _own_temporary(out)
    stream = np.memmap(tmp, dtype=dtype, mode="w+", shape=(max(total, 1),))
    position = eots = 0
    for batch in ids.iter(batch_size=1024):
        flat = np.fromiter((t for row in batch["input_ids"] for t in row), dtype=np.int64)
        stream[position : position + len(flat)] = flat
        position += len(flat)
        eots += int(np.count_nonzero(flat == eot))
    stream.flush()
    del stream
    os.replace(tmp, out)
    rows_are_documents = "input_ids" not in dataset.column_names  # pre-tokenised rows are not documents
    return {"tokens": total, "documents": len(dataset) if rows_are_documents else None, "eot": eots}


@dataclass
class TokenData:
    """Train and held-out tokens cut into sequences of `context_length`."""

    train: np.ndarray  # (n_train, context) — a read-only memmap for cached streams
    held_out: np.ndarray  # (n_held_out, context)
    eot_token_id: int
    description: str
    stats: dict  # per split: tokens, documents and EOT tokens (documents None for a token stream)
    bos_token_id: int | None = None  # the token every sequence starts with, where the family reads one

    @property
    def context_length(self) -> int:
        return self.train.shape[1]

    def scored_tokens(self, n_sequences: int) -> int:
        """How many next-token predictions a held-out CE over `n_sequences` sequences averages."""
        return min(n_sequences, len(self.held_out)) * (self.context_length - 1)

    def eval_batch(self, n_sequences: int, spread: bool = False) -> torch.Tensor:
        """The first `n_sequences` held-out sequences, or with `spread` `n_sequences` evenly spaced over all of them
        from the first (`data.eval_spread`); a deterministic choice either way."""
        n = min(n_sequences, len(self.held_out))
        rows = np.arange(n) * len(self.held_out) // n if spread else np.arange(n)
        return torch.from_numpy(self.held_out[rows].astype(np.int64))


def bos_token(model_or_config, tokenizer, rule: str = "family") -> int | None:
    """The token every sequence must start with, else None: by `rule` (`data.bos`), the tokenizer's BOS where
    the model's family reads one ("family"), or for every model ("always")."""
    if rule == "family" and not architecture(model_or_config).prepends_bos:
        return None
    if tokenizer.bos_token_id is None:
        why = "data.bos = 'always'" if rule == "always" else "this model's family reads one"
        raise DataError(f"sequences must start with a BOS token ({why}), but the tokenizer has none")
    return int(tokenizer.bos_token_id)


def prepend_bos(sequences: np.ndarray, bos_token_id: int) -> np.ndarray:
    """(n, c) sequences → (n, c + 1), each starting with `bos_token_id`."""
    first = np.full((len(sequences), 1), bos_token_id, dtype=sequences.dtype)
    return np.concatenate([first, np.asarray(sequences)], axis=1)


def _as_sequences(stream: np.ndarray, context: int, what: str, bos_token_id: int | None = None,
                  eot: int | None = None) -> np.ndarray:
    """The stream cut into (n, context) sequences; with a BOS token, context − 1 tokens after it (in memory),
    and no BOS inside a sequence (a tokenizer that starts each document with one: documents stay
    separated by EOT, and BOS, which carries the model's attention sink, is only ever at position 0)."""
    length = context if bos_token_id is None else context - 1
    if bos_token_id is not None and bos_token_id != eot:
        stream = np.asarray(stream)[np.asarray(stream) != bos_token_id]
    n = len(stream) // length
    if n < 1:
        raise DataError(f"the {what} data holds {len(stream)} tokens, fewer than one sequence of {context}")
    sequences = stream[: n * length].reshape(n, length)
    return sequences if bos_token_id is None else prepend_bos(sequences, bos_token_id)


def prepare_data(config: DataConfig, tokenizer, context_length: int, vocab_size: int,
                 bos_token_id: int | None = None, part: str = "validation") -> TokenData:
    """Load (from cache when possible) the train and held-out sequences for `config` (each starting with
    `bos_token_id` when given: `bos_token(model, tokenizer, config.bos)`).
    The held-out sequences are the validation split unless `part` is "test" (realtext only: the split a
    final evaluation reads, never a run)."""
    if part != "validation" and config.source != "realtext":
        raise DataError(f"only the realtext corpus has a separate {part} split; {config.source!r} has one held-out split")
    eot = tokenizer.eos_token_id
    if eot is None:
        raise DataError("the tokenizer has no eos (EOT) token to separate documents")
    if config.bos == "always" and bos_token_id is None:
        raise DataError("data.bos = 'always': pass its BOS token, bos_token(model, tokenizer, config.bos)")
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    if config.source.endswith(".npy"):
        path = Path(config.source).expanduser()
        if not path.is_file():
            raise DataError(f"data source not found: {config.source}")
        stream = np.load(path, mmap_mode="r")
        if stream.ndim != 1 or stream.max(initial=0) >= vocab_size:
            raise DataError(f"{path} must be a 1-D array of token ids below the vocabulary size {vocab_size}")
        cut = len(stream) - max(context_length, int(len(stream) * config.val_fraction))
        stats = {name: {"tokens": len(part), "documents": None, "eot": int(np.count_nonzero(part == eot))}
                 for name, part in (("train", stream[:cut]), ("held_out", stream[cut:]))}
        return _token_data(stream[:cut], stream[cut:], context_length, eot, f"{path} (pre-tokenised)", stats,
                           bos_token_id)
    key_fields = {
        "format": CACHE_FORMAT, "tokenizer": tokenizer_fingerprint(tokenizer), "eot": eot,
        **config.model_dump(include={"source", "document_separator", "revision", "split", "text_field",
                                     "val_fraction", "val_seed", "max_documents"}),
        "held_out": part,
    }
    if Path(config.source).expanduser().exists():
        stat = Path(config.source).expanduser().stat()
        key_fields["local"] = [str(Path(config.source).expanduser().resolve()), stat.st_size, stat.st_mtime_ns]
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:20]
    folder = _cache_root(config) / key
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        train_docs, held_out_docs = _text_datasets(config, part)
        folder.mkdir(parents=True, exist_ok=True)
        stats = {
            name: _write_tokens(docs, tokenizer, eot, config, folder / f"{name}.bin", dtype)
            for name, docs in (("train", train_docs), ("held_out", held_out_docs))
        }
        tmp = _own_temporary(meta_path)  # meta.json marks the folder complete: it appears whole or not at all
        tmp.write_text(json.dumps({"key": key_fields, "stats": stats, "dtype": np.dtype(dtype).name}, indent=1))
        os.replace(tmp, meta_path)
    meta = json.loads(meta_path.read_text())
    streams = {
        name: np.memmap(folder / f"{name}.bin", dtype=meta["dtype"], mode="r", shape=(max(s["tokens"], 1),))[: s["tokens"]]
        for name, s in meta["stats"].items()
    }
    if int(streams["train"].max(initial=0)) >= vocab_size:
        raise DataError(f"token ids reach {int(streams['train'].max())}, beyond the model's vocabulary ({vocab_size})")
    return _token_data(streams["train"], streams["held_out"], context_length, eot, config.source, meta["stats"],
                       bos_token_id)


def _token_data(train: np.ndarray, held_out: np.ndarray, context: int, eot: int, source: str, stats: dict,
                bos_token_id: int | None = None) -> TokenData:
    """Cut both streams into sequences, describe them and warn when EOT is unusually frequent."""
    parts = []
    for name, s in stats.items():
        documents = "" if s["documents"] is None else f"{s['documents']:,} documents, "
        parts.append(f"{name.replace('_', '-')}: {documents}{s['tokens']:,} tokens, {s['eot']:,} EOT")
    description = f"{source} ({'; '.join(parts)})"
    log.info("data: %s", description)
    eots = stats["train"]["eot"]
    if eots and stats["train"]["tokens"] / eots < FREQUENT_EOT:
        log.warning(
            "the training data has an EOT every %.0f tokens on average; if its documents are longer, they were "
            "split too finely (a .txt file is one document unless data.document_separator is set)",
            stats["train"]["tokens"] / eots,
        )
    if bos_token_id is not None:
        description += f", each sequence {context - 1} tokens after BOS"
    return TokenData(_as_sequences(train, context, "train", bos_token_id, eot),
                     _as_sequences(held_out, context, "held-out", bos_token_id, eot), eot, description, stats,
                     bos_token_id)


class StepBatches:
    """Micro-batches indexed by (optimiser step, micro-step, rank): a pure function of the step.

    Sequences are visited in a seeded random order that is reshuffled every epoch. Each step
    consumes `sequences_per_step` sequences split over ranks and micro-steps, so a resumed run
    (or a different number of ranks with the same global batch) sees the same data per step.
    """

    def __init__(self, sequences: np.ndarray, micro_batch_size: int, accumulation: int, world_size: int, seed: int):
        self.sequences = sequences
        self.micro_batch_size = micro_batch_size
        self.accumulation = accumulation
        self.world_size = world_size
        self.seed = seed
        self._orders: dict[int, np.ndarray] = {}

    @property
    def sequences_per_step(self) -> int:
        return self.micro_batch_size * self.accumulation * self.world_size

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.sequences))}
        return self._orders[epoch]

    def get(self, step: int, micro_step: int, rank: int) -> torch.Tensor:
        """Input ids (micro_batch_size, context) for this rank's `micro_step` of `step`."""
        first = step * self.sequences_per_step + (micro_step * self.world_size + rank) * self.micro_batch_size
        n = len(self.sequences)
        rows = [self._order((first + j) // n)[(first + j) % n] for j in range(self.micro_batch_size)]
        # Sorted rows read a memory-mapped stream in order; the order inside a batch is irrelevant.
        return torch.from_numpy(self.sequences[np.sort(rows)].astype(np.int64))


class DeviceBatches:
    """`StepBatches` of one rank delivered on `device`, the next micro-batch's copy issued ahead.

    On a GPU the ids go through pinned host memory with a non-blocking copy, so fetching a
    micro-batch never synchronises the stream; the copy of the following one is started as
    soon as one is handed out. Batches are still a pure function of (step, micro-step).
    """

    def __init__(self, batches: StepBatches, rank: int, device: torch.device):
        self.batches = batches
        self.rank = rank
        self.device = torch.device(device)
        self._ahead: tuple[tuple[int, int], torch.Tensor] | None = None

    def _copy(self, step: int, micro_step: int) -> torch.Tensor:
        ids = self.batches.get(step, micro_step, self.rank)
        if self.device.type == "cuda":
            return ids.pin_memory().to(self.device, non_blocking=True)
        return ids.to(self.device)

    def get(self, step: int, micro_step: int) -> torch.Tensor:
        """Input ids of `micro_step` of `step` on the device; starts copying the micro-batch after it."""
        key = (step, micro_step)
        ids = self._ahead[1] if self._ahead is not None and self._ahead[0] == key else self._copy(*key)
        following = (step, micro_step + 1) if micro_step + 1 < self.batches.accumulation else (step + 1, 0)
        self._ahead = (following, self._copy(*following))
        return ids
