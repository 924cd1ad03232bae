"""End to end: `lnfree remove` on the bundled tiny model, as a user runs it (no vanilla control)."""

from __future__ import annotations

import json

import torch
from transformers import GPT2LMHeadModel
from typer.testing import CliRunner

from lnfree.fixedscale import surgery
from lnfree.cli import app
from lnfree.forms.export import load_checkpoint

MAX_CE_GAP = 0.15  # nats: LN-free held-out CE may exceed the original's by at most this


def test_tiny_removal_end_to_end(tmp_path):
    out = tmp_path / "tiny"
    result = CliRunner().invoke(app, ["remove", "-o", str(out), "--no-control",
                                      "--set", f"data.cache_dir={tmp_path / 'cache'}"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    ce = summary["held_out_ce"]
    print(f"tiny removal: original {ce['original']:.4f}, LN-free {ce['ln_free']:.4f}, "
          f"gap {ce['ln_free'] - ce['original']:+.4f} nats, {summary['seconds']} s")
    assert ce["ln_free"] - ce["original"] <= MAX_CE_GAP
    assert len(summary["removal_events"]) == 13 and "ln_f" in result.output

    model, tokenizer, _ = load_checkpoint(out / "checkpoints" / "step_000160")
    assert surgery.is_fully_removed(model)
    plain = GPT2LMHeadModel.from_pretrained(out / "export").eval()
    ids = tokenizer("When Mary and John went to the store , John gave a drink to", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert (plain(input_ids=ids).logits - model(input_ids=ids).logits).abs().max().item() <= 1e-4
    record = json.loads((out / "export" / "lnfree_removal.json").read_text())
    assert record["fully_removed"] and len(record["events"]) == 13
