"""`lnfree verify` against the fingerprint recorded at export: a damaged export is caught."""

from __future__ import annotations

import json

import torch
from conftest import small_gpt2
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from lnfree.fixedscale import surgery
from lnfree.forms.export import RECORD, write_export
from lnfree.forms.verify import verify


def export(model_dir, out):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = surgery.install(small_gpt2(n_layer=2, vocab_size=len(tokenizer)))
    surgery.initialise_sigmas(model, [torch.randint(0, len(tokenizer), (4, 32), generator=torch.Generator().manual_seed(1))])
    for state in surgery.scale_states(model).values():
        state.switch_to_fixed()
    return write_export(model, tokenizer, out, {})


def test_verify_fails_an_export_whose_final_norm_weight_was_reset(model_dir, tmp_path):
    folder = export(model_dir, tmp_path / "export")
    good = verify(folder, bridge=False)
    assert good["ok"] and good["fingerprint"]["checked"], good["fingerprint"]
    assert good["fingerprint"]["weights"] == {"model.safetensors": "match"}

    weights = load_file(folder / "model.safetensors")
    weights["transformer.ln_f.weight"] = torch.ones_like(weights["transformer.ln_f.weight"])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    bad = verify(folder, bridge=False)
    # Every representation is read from the same damaged file, so they still agree with each other:
    assert all(check["ok"] for check in bad["checks"].values())
    assert not bad["ok"] and not bad["fingerprint"]["ok"]
    assert bad["fingerprint"]["weights"] == {"model.safetensors": "changed"}
    assert bad["fingerprint"]["probe_max_abs_diff"] > 1e-2  # far beyond the 1e-4 tolerance


def test_probe_logits_catch_a_change_the_weight_hash_cannot(model_dir, tmp_path):
    """A config edit leaves the safetensors intact; the probe logits still move."""
    folder = export(model_dir, tmp_path / "export")
    config = json.loads((folder / "config.json").read_text())
    config["n_head"] = 2  # same weights, different attention
    (folder / "config.json").write_text(json.dumps(config))
    report = verify(folder, bridge=False)
    assert report["fingerprint"]["weights"] == {"model.safetensors": "match"}
    assert not report["fingerprint"]["ok"] and "probe logits differ" in report["fingerprint"]["note"]


def test_a_checkpoint_without_a_fingerprint_says_only_consistency_was_checked(model_dir, tmp_path):
    folder = export(model_dir, tmp_path / "export")
    record = json.loads((folder / RECORD).read_text())
    del record["fingerprint"]  # as an export written before fingerprints, or a published checkpoint
    (folder / RECORD).write_text(json.dumps(record))
    report = verify(folder, bridge=False)
    assert report["ok"] and not report["fingerprint"]["checked"]
    assert "only internal consistency was checked" in report["fingerprint"]["note"]
