"""`lnfree stress`: an original shows zero overflow; a planted runaway is caught, whichever probe finds it."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from lnfree.cli import app
from lnfree.evaluate.stress import (OVERFLOW_RATIO, Pass, culprit, envelope, frequency_ranks, measure, overflow_ratio,
                                   repeated_probe_ids, repeated_sequences, run_stress, sweep_sequences)

runner = CliRunner()
FAST = {"context": 32, "n_sequences": 24, "repeated": 64, "vocab": None}


def planted(export, tmp_path, token: int, factor: float):
    """A copy of an LN-free export whose embedding row `token` is `factor`× larger (a planted outlier)."""
    folder = tmp_path / f"planted-{token}-{factor:g}"
    shutil.copytree(export, folder)
    weights = next(folder.glob("*.safetensors"))
    tensors = load_file(weights)
    tensors["transformer.wte.weight"][token] *= factor
    save_file(tensors, weights, metadata={"format": "pt"})
    (folder / "fingerprint.json").unlink(missing_ok=True)
    return folder


def rare_token(test_ids: torch.Tensor, vocab_size: int) -> int:
    """An id that never occurs in `test_ids` (the test split stays clean, the sweep holds it)."""
    return int(np.flatnonzero(np.bincount(test_ids.reshape(-1).numpy(), minlength=vocab_size) == 0)[-1])


def test_sweep_covers_every_id_and_probes_span_the_frequency_ranks():
    sweep = sweep_sequences(100, 16, bos=7, n_ids=None, seed=0)
    assert (sweep[:, 0] == 7).all() and set(sweep[:, 1:].reshape(-1).tolist()) == set(range(100))
    counts = np.zeros(100, dtype=int)
    counts[:10] = np.arange(10, 0, -1) * 5  # ids 0–9 seen, 0 most often; ids 10–99 never
    ranks = frequency_ranks(counts)
    assert ranks[:10].tolist() == list(range(10)) and sorted(ranks[10:].tolist()) == list(range(10, 100))
    picked = repeated_probe_ids(counts, 12)
    assert picked[0] == 0 and len(picked) == 12 and any(p >= 10 for p in picked)  # the rarest included
    assert len(repeated_probe_ids(counts, None)) == 100


def test_the_original_shows_zero_overflow_and_its_ln_free_form_is_measured_against_it(tiny_ln_free_export):
    report = run_stress(["tiny", str(tiny_ln_free_export)], "tiny", labels=["original", "ln_free"], **FAST)
    original, ln_free = report.records
    assert original.overflow_total == 0 and original.vocab_covered == original.vocab_size
    assert original.repeated_probes == 64 and original.test_tokens == 24 * 31
    assert original.max_growth_vs_first is None and ln_free.max_growth_vs_first > 0
    assert len(ln_free.growth_vs_first) == 5  # 4 block inputs and the final norm's input


def test_a_token_above_30_nats_is_counted_on_its_own_not_as_an_overflow():
    original = run_stress(["tiny"], "tiny", labels=["original"], **FAST).records[0]
    badly = dataclasses.replace(original, test_tokens_over_30_nats=1)
    assert badly.overflow_total == original.overflow_total == 0
    assert dataclasses.replace(original, test_overflow_tokens=2, repeated_overflow=1).overflow_total == 3


def test_a_planted_outlier_embedding_is_caught_by_the_sweep_not_the_test_split(tiny_ln_free_export, tmp_path):
    clean = run_stress([str(tiny_ln_free_export)], "tiny", **FAST)
    from transformers import AutoTokenizer

    from lnfree.evaluate import load_sequences, resolve_dataset

    tokenizer = AutoTokenizer.from_pretrained(tiny_ln_free_export)
    test_ids = torch.from_numpy(load_sequences(resolve_dataset("tiny"), tokenizer, context=32, n_sequences=24,
                                               vocab_size=len(tokenizer)))
    token = rare_token(test_ids, len(tokenizer))  # absent from the test split: only the probes can find it
    bad = planted(tiny_ln_free_export, tmp_path, token, 100.0)
    record = run_stress([str(bad)], "tiny", **FAST).records[0]
    assert clean.records[0].vocab_overflow == 0 and record.test_overflow_tokens == 0
    assert record.vocab_overflow >= 1 and record.vocab_overflow_sequences >= 1
    assert record.worst[0]["token_id"] == token and record.worst[0]["part"] in ("vocab", "repeated")


def test_the_command_writes_its_report_exits_1_on_overflow_and_refuses_to_overwrite(tiny_ln_free_export, tmp_path):
    args = ["--dataset", "tiny", "--context", "32", "--n-sequences", "8", "--repeated", "16", "--vocab", "all",
            "--no-progress"]
    out = tmp_path / "ok"
    result = runner.invoke(app, ["stress", "tiny", "--labels", "original", "--out", str(out), *args])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "stress.json").read_text())
    assert saved["models"]["original"]["overflow_total"] == 0 and (out / "stress.md").exists()
    again = runner.invoke(app, ["stress", "tiny", "--out", str(out), *args])
    assert again.exit_code == 2 and "--overwrite" in again.output
    resumed = runner.invoke(app, ["stress", "tiny", "--labels", "original", "--out", str(out), "--resume", *args])
    assert resumed.exit_code == 0 and "reused the records saved in" in resumed.output  # nothing measured again
    assert json.loads((out / "stress.json").read_text()) == saved and (out / "parts" / "original.json").exists()
    # --pending measures nothing and prints the labels --resume would measure, one a line (what run.sh reads)
    pending = runner.invoke(app, ["stress", "tiny", "tiny", "--labels", "original", "other", "--out", str(out),
                                  "--resume", "--pending", *args])
    assert pending.exit_code == 0 and pending.stdout == "other\n", pending.output
    assert json.loads((out / "stress.json").read_text()) == saved and not (out / "parts" / "other.json").exists()
    unresumed = runner.invoke(app, ["stress", "tiny", "--out", str(out), "--pending", *args])
    assert unresumed.exit_code == 2 and "pass --resume too" in unresumed.output
    broken = planted(tiny_ln_free_export, tmp_path, 5, 1e36)  # overflows fp32 on the way through
    result = runner.invoke(app, ["stress", str(broken), "--out", str(tmp_path / "bad"), *args])
    assert result.exit_code == 1
    record = next(iter(json.loads((tmp_path / "bad" / "stress.json").read_text())["models"].values()))
    assert record["vocab_nonfinite_tokens"] >= 1 and record["worst"][0]["times_typical"] == "non-finite logit"


@pytest.mark.parametrize("value", ["0", "-3", "some"])
def test_probe_counts_must_be_positive_or_all(value):
    result = runner.invoke(app, ["stress", "tiny", "--vocab", value])
    assert result.exit_code == 2 and "--vocab" in result.output


def test_a_residual_whose_norm_overflows_is_outside_the_envelope_even_when_its_logits_are_finite():
    # A partial removal: fixed norms blow a token's residual past fp32's norm, real norms above divide it back.
    n, length = 3, 5
    norms = torch.ones(4, n, length)
    norms[:, 1] = 2.0  # the largest sane sequence
    norms[2, 2, 3] = float("inf")  # sequence 2, position 3: its norm at layer 2 overflows, its logits stay finite
    run = Pass(torch.zeros(n, length, dtype=torch.long), norms, torch.ones(n, length, dtype=torch.bool),
               torch.ones(n, length - 1))
    limits = envelope(run)
    assert limits.tolist() == [2.0] * 4  # from the sane sequences only, not inf
    worst, layer = overflow_ratio(run, limits)
    assert worst[2, 3] > OVERFLOW_RATIO and layer[2, 3] == 2 and (worst[:2] <= 1).all()


def test_the_culprit_is_the_token_that_leaves_the_envelope_at_the_earliest_layer():
    limits = torch.ones(5)
    norms = torch.ones(5, 6)  # layers × positions
    norms[2, 3] = 50.0  # position 3 runs away at layer 2 ...
    norms[3, 3:] = 500.0  # ... reaches the tokens after it at layer 3 ...
    norms[4, :] = float("inf")  # ... and at layer 4 a non-finite value reaches every position, 0 included
    assert culprit(norms, limits) == 3
    norms[2, 1] = 20.0  # two positions leave the envelope at the same layer: the first
    assert culprit(norms, limits) == 1
    assert culprit(torch.ones(5, 6), limits) is None


def test_the_repeated_sweep_reads_what_stress_reads_and_finds_a_planted_id(tiny_ln_free_export, tmp_path):
    from lnfree.data.documents import bos_token
    from lnfree.evaluate import load_models
    from lnfree.removal.mining import repeated_sweep

    limits = torch.tensor(run_stress([str(tiny_ln_free_export)], "tiny", **FAST).records[0].envelope)
    token = 40
    swept = {}
    for name, folder in (("clean", tiny_ln_free_export), ("planted", planted(tiny_ln_free_export, tmp_path, token, 100.0))):
        model = load_models([str(folder)])[0]
        ids, bos = torch.arange(model.vocab_size), bos_token(model.module, model.tokenizer)
        swept[name] = repeated_sweep(model.module, ids, limits, bos=bos, context=8, batch_size=64)
        run = measure(model.module, repeated_sequences(ids.numpy(), 8, bos), batch_size=64)  # with the head
        torch.testing.assert_close(swept[name], overflow_ratio(run, limits)[0].amax(dim=1), rtol=1e-5, atol=1e-6)
    assert (swept["clean"] < OVERFLOW_RATIO).all()
    assert swept["planted"][token] > OVERFLOW_RATIO and (swept["planted"] > OVERFLOW_RATIO).sum() == 1


def test_mining_writes_the_overflowing_ids_that_coverage_replays(tiny_ln_free_export, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from lnfree.removal.losses.coverage import Coverage

    report = run_stress([str(tiny_ln_free_export)], "tiny", **FAST)
    (tmp_path / "stress.json").write_text(json.dumps(report.to_dict(), default=str))
    bad = planted(tiny_ln_free_export, tmp_path, 40, 100.0)
    script = Path(__file__).parents[1] / "experiments" / "robust" / "mine_repeated.py"
    mined = {}
    for part in ("0,1", "2,3"):
        out = tmp_path / f"part{part[0]}.json"
        subprocess.run([sys.executable, str(script), str(bad), "--envelope", str(tmp_path / "stress.json"),
                        "--part", part, "--of", "4", "--fp32", "--out", str(out)], check=True, capture_output=True)
        mined[part] = json.loads(out.read_text())
    assert mined["0,1"]["swept"] + mined["2,3"]["swept"] == report.records[0].vocab_size
    found = [m["overflow"] for m in mined.values()]
    assert sorted(found[0] + found[1]) == [40]
    first = tmp_path / ("part0.json" if found[0] else "part2.json")
    assert Coverage(replay=str(first)).replay == [40]
    again = tmp_path / "again.json"
    subprocess.run([sys.executable, str(script), str(tiny_ln_free_export), "--envelope", str(tmp_path / "stress.json"),
                    "--ids-from", str(first), "--out", str(again)], check=True, capture_output=True)
    assert json.loads(again.read_text())["swept"] == 1 and json.loads(again.read_text())["overflow"] == []  # clean



class _Tokenizer:
    bos_token_id = 0

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_without_bos_no_probe_row_starts_with_it():
    from families import tiny_family

    from lnfree.evaluate.stress import markdown, stress_models

    model = tiny_family("gemma3")  # a family that reads BOS (id 0 here)
    test_ids = torch.randint(1, 64, (4, 16))
    counts = np.bincount(test_ids.reshape(-1).numpy(), minlength=64)
    pages = {}
    for with_bos in (True, False):
        report = stress_models([("m", "m", model)], _Tokenizer(), test_ids, counts, context=16, repeated=8, vocab=32,
                               with_bos=with_bos, settings={"dataset": "random", "with_bos": with_bos})
        assert report.settings["bos"] == (0 if with_bos else None)
        worst = report.records[0].worst
        starts = {w["before"].split(" ")[0] for w in worst if w["part"] != "test" and w["position"] > 0 and w["before"]}
        assert ("0" in starts) == with_bos or not starts
        pages[with_bos] = markdown(report).splitlines()[0]
    assert "no BOS" in pages[False] and "no BOS" not in pages[True]


def test_a_resumed_stress_reuses_only_the_records_whose_settings_inputs_and_weights_match(tiny_ln_free_export,
                                                                                        tmp_path, monkeypatch):
    import lnfree.evaluate.stress as stress

    parts = tmp_path / "parts"
    copy = planted(tiny_ln_free_export, tmp_path, 5, 1.0)  # the same weights in a folder of its own
    sources, labels = ["tiny", str(copy)], ["original", "ln_free"]
    first = run_stress(sources, "tiny", labels=labels, parts=parts, **FAST)
    assert sorted(p.name for p in parts.iterdir()) == ["ln_free.json", "original.json"]
    measured = []
    real = stress.stress_model
    monkeypatch.setattr(stress, "stress_model", lambda label, *a, **k: measured.append(label) or real(label, *a, **k))
    again = run_stress(sources, "tiny", labels=labels, parts=parts, resume=True, **FAST)
    assert measured == [] and again.reused == labels and again.to_dict() == first.to_dict()  # growth vs the first recomputed from the parts
    listed = run_stress(sources, "tiny", labels=labels, parts=parts, resume=True, pending_only=True, **FAST)
    assert (listed.pending, listed.reused, listed.records, measured) == ([], labels, [], [])
    weights = next(copy.glob("*.safetensors"))
    tensors = load_file(weights)
    tensors["transformer.wte.weight"][5] *= 100.0
    save_file(tensors, weights, metadata={"format": "pt"})  # other weights, same label and folder: measured again
    listed = run_stress(sources, "tiny", labels=labels, parts=parts, resume=True, pending_only=True, **FAST)
    assert (listed.pending, listed.reused, measured) == (["ln_free"], ["original"], [])
    run_stress(sources, "tiny", labels=labels, parts=parts, resume=True, **FAST)
    assert measured == ["ln_free"]
    run_stress(sources, "tiny", labels=labels, parts=parts, resume=True, **{**FAST, "repeated": 32})
    assert measured == ["ln_free", "original", "ln_free"]  # other settings (inputs): nothing reused
    run_stress(sources, "tiny", labels=labels, parts=parts, **{**FAST, "repeated": 32})  # no resume: measured
    assert measured[3:] == ["original", "ln_free"]
