"""Process-level CPU settings of a run (`lnfree.removal.runtime`)."""

from __future__ import annotations

import json

import torch

from lnfree.removal.config import with_overrides
from lnfree.removal.runtime import denormals_flushed
from lnfree.removal.train import run

SUBNORMAL = 1e-39  # below fp32's smallest normal number, 1.18e-38


def kept(x: float) -> bool:
    return float(torch.tensor([x]) * torch.tensor([1.0])) != 0


def test_subnormals_are_flushed_within_and_kept_again_after():
    assert kept(SUBNORMAL)
    with denormals_flushed() as flushed:
        assert kept(SUBNORMAL) is not flushed  # a CPU that cannot flush says so
        assert kept(1e-37)  # normal numbers are untouched
    assert kept(SUBNORMAL)
    with denormals_flushed(False) as flushed:
        assert flushed is False and kept(SUBNORMAL)


def test_a_run_flushes_them_while_it_trains_and_logs_it(run_config):
    inside = []
    config = run_config(max_steps=12)
    original = torch.Tensor.backward

    def watched(self, *args, **kwargs):
        inside.append(kept(SUBNORMAL))
        return original(self, *args, **kwargs)

    torch.Tensor.backward = watched
    try:
        result = run(config, progress=False)
        kept_run = run(with_overrides(config, {"train.flush_denormals": False,
                                               "output_dir": str(config.output_dir) + "-kept"}), progress=False)
    finally:
        torch.Tensor.backward = original
    starts = [json.loads((r.output_dir / "log.jsonl").read_text().splitlines()[0]) for r in (result, kept_run)]
    flushed = starts[0]["flush_denormals"]
    assert starts[1]["flush_denormals"] is False
    assert inside and inside[: len(inside) // 2] == [not flushed] * (len(inside) // 2)
    assert inside[len(inside) // 2:] == [True] * (len(inside) - len(inside) // 2)
    assert kept(SUBNORMAL)  # switched off after the run
