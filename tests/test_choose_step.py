"""experiments/robust/choose_step.py: a run's end checkpoint chosen on validation CE, among bounded checkpoints only."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from conftest import experiment_script
from lnfree.evaluate import evaluate
from lnfree.forms.export import RunawayError
from lnfree.removal.train import run


def _script():
    return experiment_script("robust", "choose_step")


def _row(step: int, ce: float, over: int = 0, fixed: bool = True) -> dict:
    return {"step": step, "checkpoint": f"c/step_{step}", "ce": ce, "tokens_over_limit": over, "fully_ln_free": fixed}


def test_the_lowest_bounded_ce_is_chosen_and_an_unbounded_run_keeps_its_last_checkpoint():
    choose = _script().choose
    rows = [_row(1450, 3.30), _row(1500, 3.10, over=1), _row(1550, math.nan), _row(1551, 3.20)]
    assert choose(rows) == rows[3] | {"bounded": True}  # 1500 is lower but has a token above 30 nats
    assert choose(rows[:2]) == rows[0] | {"bounded": True}
    assert choose(rows[1:3]) == rows[2] | {"bounded": False}
    assert choose([_row(1500, 3.1), _row(1551, 3.1)])["step"] == 1551  # a tie: the later checkpoint
    # a removal's checkpoint with a norm still real is not an LN-free model, however low its CE
    partial = [_row(1300, 3.0, fixed=False), _row(1450, 3.3), _row(1551, 3.2)]
    assert choose(partial, removal=True)["step"] == 1551 and choose(partial)["step"] == 1300
    with pytest.raises(SystemExit, match="every norm fixed"):
        choose(partial[:1], removal=True)


def test_a_removal_whose_lowest_checkpoint_fails_the_export_probe_keeps_the_next_that_passes():
    script = _script()
    rows = [_row(1450, 3.2503), _row(1500, 3.2533), _row(1550, 3.2680), _row(1551, 3.2594), _row(1400, 3.0, over=2)]
    probed = []

    def refusal(checkpoint):  # the seed-1 removal's case: step 1450 runs away on '<eos>' x3 without BOS
        probed.append(checkpoint)
        return "the model runs away on 1 of 22 probe rows" if checkpoint == "c/step_1450" else None

    chosen = script.choose(rows, removal=True, refusal=refusal)
    assert chosen["step"] == 1500 and chosen["passes_probe"] and chosen["bounded"]
    assert probed == ["c/step_1450", "c/step_1500"]  # in CE order, only until one passes; 1400 is unbounded
    assert rows[0]["export_probe"].startswith("the model runs away") and rows[1]["export_probe"] == script.PASSES
    assert "export_probe" not in rows[2] and "export_probe" not in rows[4]
    nothing = script.choose([_row(1450, 3.25), _row(1500, 3.26)], removal=True, refusal=lambda c: "runs away")
    assert nothing["step"] == 1450 and nothing["passes_probe"] is False
    assert "cannot be exported" in script.table({"run": "r", "dataset": "d", "rule": script.RULE, "chosen_step": 1450,
                                                 "candidates": [nothing], "bounded": True, "passes_probe": False})
    control = script.choose([_row(1450, 3.25), _row(1500, 3.26)], refusal=refusal)  # a control is never probed
    assert control["step"] == 1450 and "passes_probe" not in control


def test_a_tiny_runs_checkpoints_are_evaluated_and_the_chosen_one_exported(run_config, tmp_path, monkeypatch):
    script = _script()
    finished = run(run_config(max_steps=12, save_every=3), progress=False)
    with pytest.raises(SystemExit, match="no complete checkpoint at or after step 13"):
        script.candidates(finished.output_dir, 13)
    out = tmp_path / "results" / "choice" / "ln_free"
    monkeypatch.setattr("sys.argv", ["choose_step.py", str(finished.output_dir), "--from-step", "3", "--dataset", "tiny",
                                     "--context", "32", "--n-sequences", "8", "--batch-size", "4", "--device", "cpu",
                                     "--out", str(out), "--export", str(tmp_path / "export")])
    script.main()
    choice = json.loads((out / "choice.json").read_text())
    rows = choice["candidates"]
    assert [r["step"] for r in rows] == [3, 6, 9, 12] and choice["dataset"] == "tiny"
    assert not rows[0]["fully_ln_free"] and rows[-1]["fully_ln_free"]  # step 3: some norms still real
    assert (out / "summary.json").is_file() and "**chosen**" in (out / "choice.md").read_text()  # lnfree eval's files too
    # the same numbers as a separate evaluation of one checkpoint alone
    alone = evaluate([rows[1]["checkpoint"]], "tiny", labels=["alone"], device="cpu", context=32, n_sequences=8,
                     batch_size=4).to_dict()["models"][0]["ce"]["mean"]
    assert rows[1]["ce"] == pytest.approx(alone, abs=1e-5)
    assert len({round(r["ce"], 4) for r in rows}) == 4  # the steps differ: a choice was made
    best = min((r for r in rows if r["fully_ln_free"]), key=lambda r: r["ce"])
    assert choice["bounded"] and (choice["chosen_step"], choice["chosen"]) == (best["step"], best["checkpoint"])
    assert choice["passes_probe"] and [r.get("export_probe") for r in rows if r["step"] == best["step"]] == ["passes"]
    assert "| passes | **chosen** |" in (out / "choice.md").read_text()
    assert choice["export"] == str(tmp_path / "export")
    record = json.loads((tmp_path / "export" / "lnfree_removal.json").read_text())
    assert record["fully_removed"] and record["checkpoint"] == choice["chosen"]
    from transformers import GPT2LMHeadModel

    plain = GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval()
    assert torch.isfinite(plain(input_ids=torch.arange(20)[None]).logits).all()
    # summary.json reads both arms' choices (here the same run twice)
    (out.parent / "vanilla").mkdir()
    (out.parent / "vanilla" / "choice.json").write_text((out / "choice.json").read_text())
    chosen = experiment_script("robust", "summary").choices(tmp_path / "results")
    assert chosen["ln_free"] == chosen["vanilla"] == {
        "step": best["step"], "checkpoint": best["checkpoint"], "bounded_on_validation": True, "dataset": "tiny",
        "passes_export_probe": True, "validation_ce": {str(r["step"]): r["ce"] for r in rows}}
    # where no bounded checkpoint passes the export's probe (here only step 12 has every norm fixed), the lowest is
    # kept, marked so, and an earlier choice's export is not left behind to be verified as this one's
    def runaway(*args, **kwargs):  # the export's probe measured: one row runs away
        raise RunawayError("the model runs away on 1 of 22 probe rows: special token '<eos>' three times")

    monkeypatch.setattr("lnfree.forms.export._probed", runaway)
    script.main()
    again = json.loads((out / "choice.json").read_text())
    assert again["chosen_step"] == best["step"] and again["passes_probe"] is False
    assert again["export_refused"].startswith("the model runs away") and not (tmp_path / "export").exists()
    assert again["candidates"][-1]["export_probe"] == again["export_refused"]


def _eval_table(folder: Path, label: str, ce) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    rows = "".join(f"{i},63,{c},0,0,0,0\n" for i, c in enumerate(ce))
    (folder / f"{label}.csv").write_text("sequence,scored_tokens,mean_ce,median_ce,max_ce,tokens_above_threshold,"
                                         "mean_entropy\n" + rows)
    return f"{folder}:{label}"


def test_a_step_better_on_every_document_is_chosen_on_either_part_and_its_gain_holds_on_the_other(tmp_path):
    transfer = experiment_script("robust", "selection_transfer")
    rng = torch.Generator().manual_seed(0)
    base = 3 + torch.rand(200, generator=rng)  # documents differ far more than the steps do
    noise = lambda: 0.01 * torch.randn(200, generator=rng)  # noqa: E731
    removal = transfer.arm([f"10={_eval_table(tmp_path / 'a', 's10', (base + 0.10 + noise()).tolist())}",
                            f"20={_eval_table(tmp_path / 'a', 's20', (base + 0.20 + noise()).tolist())}"])
    control = transfer.arm([f"10={_eval_table(tmp_path / 'b', 's10', (base + noise()).tolist())}",
                            f"20={_eval_table(tmp_path / 'b', 's20', (base + 0.01 + noise()).tolist())}"])
    result = transfer.transfer(removal, control, splits=50, block=10, seed=0)
    assert result["chosen_on_whole"] == {"removal": 10, "control": 10}
    assert result["picks_removal/control"] == {"10/10": 50}
    assert abs(result["held_out_gain"]["mean"] - 0.09) < 0.01  # end (20/20: +0.19) minus chosen (10/10: +0.10)
    assert abs(result["held_out_gap_chosen"]["mean"] - 0.10) < 0.01
    short = transfer.arm([f"10={_eval_table(tmp_path / 'c', 's10', base[:100].tolist())}"])
    with pytest.raises(SystemExit, match="different sequences"):
        transfer.transfer(short, control, splits=5, block=10, seed=0)


def test_paired_finite_compares_two_configs_gaps_on_the_same_sequences(tmp_path):
    compare = experiment_script("robust", "paired_finite")
    rng = torch.Generator().manual_seed(0)
    base = 3 + torch.rand(200, generator=rng)  # documents differ far more than the models do
    noise = lambda: 0.01 * torch.randn(200, generator=rng)  # noqa: E731
    tables = {"a_van": base + noise(), "a_free": base + 0.20 + noise(), "b_van": base + 0.05 + noise(),
              "b_free": base + 0.15 + noise()}
    specs = []
    for k, (name, ce) in enumerate(tables.items()):  # every file is ln_free.csv: the NAME= labels tell them apart
        folder, _ = _eval_table(tmp_path / str(k), "ln_free", ce.tolist()).rsplit(":", 1)
        specs.append(f"{name}={folder}/ln_free.csv")
    report = compare.compare(compare.read_tables(specs), [("a_van", "a_free"), ("b_van", "b_free")])
    row = next(line for line in report.splitlines() if line.startswith("| a_free − a_van | b_free − b_van |"))
    value, interval = row.split(" | ")[2:4]
    low, high = (float(x) for x in interval.strip("[] |").split(", "))
    assert abs(float(value) + 0.10) < 0.01 and low < -0.10 < high and high < 0  # b's gap +0.10, a's +0.20
    pooled = next(line for line in report.splitlines() if line.startswith("Mean of the 2 gaps"))
    value, low, high = (float(x) for x in re.findall(r"[+-]\d\.\d+", pooled.rsplit(": ", 1)[1]))
    assert abs(value - 0.15) < 0.01 and low < value < high and high - low < 0.02  # (0.20 + 0.10) / 2
    with pytest.raises(SystemExit, match="named 'ln_free'"):
        compare.read_tables([f"{tmp_path}/0/ln_free.csv", f"{tmp_path}/1/ln_free.csv"])
