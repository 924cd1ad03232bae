"""A run's generated coverage rows (`train.coverage`) and the repeated-id sweep that feeds their replay.

`coverage_rows` gives the training loop, per (step, micro-step, setting on), this process's rows
(`lnfree.removal.losses.coverage.coverage_ids`) with the ids to replay; `mine_if_due` runs a setting's
sweep (`lnfree.removal.mining`) once, when it starts, and keeps what it finds in the run folder.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch import nn

from lnfree.data.documents import TokenData, bos_token
from lnfree.fixedscale.ceiling import set_ceiling
from lnfree.removal.config import RunConfig
from lnfree.removal.layout import MINED
from lnfree.removal.losses.coverage import coverage_ids, first_token_counts, first_token_ids
from lnfree.removal.losses.massive import pieces, tail_at
from lnfree.removal.mining import MinedIds, mine
from lnfree.removal.resolve import RunError


def coverage_rows(config: RunConfig, rank: int, context: int, model: nn.Module, tokenizer):
    """((step, micro-step, the settings on) → this rank's generated rows of `train.coverage`, or None when it
    is off; the ids mined so far)."""
    coverage, mined = config.train.coverage, MinedIds(Path(config.output_dir) / MINED)
    if coverage is None:
        return None, mined
    bos, vocab = bos_token(model, tokenizer, config.data.bos), model.config.vocab_size
    outside = [i for p in pieces(coverage) for i in p.replay or () if not 0 <= i < vocab]
    if outside:
        raise RunError(f"train.coverage.replay: ids outside the vocabulary of {vocab:,}: {outside[:5]}")
    def rows(step: int, micro: int, cov, first: bool = False, text=None, replayed: bool | None = None):
        """first: the one-token rows (text: theirs), only the replayed ones (`replayed` True), or all but them (False)."""
        if first:
            replay = mined.replay(cov)
            ids = first_token_ids(cov, step, micro, rank, vocab_size=vocab, seed=config.train.seed, text=text,
                                  replay=replay)
            if replayed is None:
                return ids
            drawn, count = first_token_counts(cov, text=text is not None, replaying=bool(replay))
            return ids[drawn:drawn + count] if replayed else torch.cat([ids[:drawn], ids[drawn + count:]])
        return coverage_ids(cov, step, micro, rank, context=context, vocab_size=vocab, bos=bos,
                            seed=config.train.seed, replay=mined.replay(cov))
    return rows, mined


def mine_if_due(config: RunConfig, accelerator: Accelerator, data: TokenData, mined: MinedIds, log, bare: nn.Module,
                step: int, ceiling_now: float | None, *, bf16: bool) -> None:
    """Run the repeated-id sweep of the coverage setting on at `step` if it mines and has not yet
    (`lnfree.removal.mining`): on the model as it will be exported (no scale ceiling), its share on each
    process, against the envelope of the held-out sequences; record the ids in the run folder."""
    coverage = tail_at(config.train.coverage, step)
    if coverage is None or coverage.mine is None or coverage.start in mined.found:
        return
    if config.removal.mode == "vanilla":  # every norm real: nothing runs away, an hour's sweep would find nothing
        mined.add(coverage.start, [], write=accelerator.is_main_process)
        log({"event": "mine", "step": step, "skipped": "vanilla: every norm is real"})
        return
    started = time.process_time()
    guarded = ceiling_now is not None and not math.isinf(ceiling_now)
    if guarded:
        set_ceiling(bare, math.inf)
    text = data.eval_batch(config.data.eval_sequences)
    found = mine(bare, coverage.mine, text, bos=data.bos_token_id, seed=config.train.seed,
                 rank=accelerator.process_index, world=accelerator.num_processes, bf16=bf16)
    if guarded:
        set_ceiling(bare, ceiling_now)
    gather = gather_object if accelerator.num_processes > 1 else list
    ids, random = list(dict.fromkeys(gather(found.ids))), gather(found.random)
    mined.add(coverage.start, ids, write=accelerator.is_main_process)
    log({"event": "mine", "step": step, "part": coverage.mine.part, "of": coverage.mine.of,
         "swept": found.swept * accelerator.num_processes, "overflow": len(ids),
         **({"random_rows_overflow": len(random)} if coverage.mine.random else {}),
         **({"alone_overflow": len(gather(found.alone))} if coverage.mine.alone else {}),
         "cpu_seconds": round(time.process_time() - started, 1)})
