"""The fine-tuning run: exact resume, the vanilla control, and clear errors before any output."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from transformers import BertConfig

from lnfree.fixedscale import surgery
from lnfree.removal.config import TrainConfig, with_overrides
from lnfree.data.documents import DataError
from lnfree.removal.derived import STALE_MARKER
from lnfree.forms.export import load_checkpoint
from lnfree.forms.load import load
from lnfree.models.base import ModelError
from lnfree.removal.losses import objective as objective_module
from lnfree.removal.layout import latest_checkpoint
from lnfree.removal.precision import cpu_description
from lnfree.removal.train import RunError, TrainingDiverged, micro_batches, run


def records(path, after_resume=False):
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    if after_resume:
        lines = lines[max(i for i, r in enumerate(lines) if r.get("event") == "resume") + 1 :]
    return {r["step"]: r for r in lines if "loss" in r}


def test_resume_from_mid_removal_checkpoint_is_exact(run_config, tmp_path):
    config = run_config(save_every=5)
    full = run(config, progress=False)
    assert [c.name for c in sorted((full.output_dir / "checkpoints").iterdir())] == [
        "step_000005", "step_000010", "step_000015", "step_000016"]
    # Mid-removal at step 5: both ln_2 and block 0's ln_1 Q/K are fixed, the rest real.
    state = json.loads((full.output_dir / "checkpoints/step_000005/trainer_state.json").read_text())["removal_state"]
    assert [name for name, s in state.items() if s["fixed"]] == ["blocks.0.ln_1qk", "blocks.0.ln_2", "blocks.1.ln_2"]

    moved = tmp_path / "moved"
    shutil.copytree(full.output_dir, moved)
    for later in ("step_000010", "step_000015", "step_000016"):
        shutil.rmtree(moved / "checkpoints" / later)
    resumed = run(with_overrides(config, {"output_dir": str(moved)}), resume=True, progress=False)

    original, continued = records(full.output_dir / "log.jsonl"), records(moved / "log.jsonl", after_resume=True)
    assert sorted(continued) == list(range(6, 17))
    for step in continued:
        assert continued[step]["loss"] == pytest.approx(original[step]["loss"], rel=1e-6, abs=1e-7), step
    assert surgery.removal_state(resumed.model) == surgery.removal_state(full.model)
    assert resumed.held_out_ce_end == pytest.approx(full.held_out_ce_end, rel=1e-6)
    assert surgery.is_fully_removed(full.model)


def test_a_diverging_run_stops_with_its_step_and_never_saves_the_non_finite_state(run_config, monkeypatch):
    calls = {"n": 0}
    real = objective_module.auxiliary_loss

    def aux_that_overflows_at_step_4(*args, **kwargs):  # one call per step (no gradient accumulation here)
        calls["n"] += 1
        value = real(*args, **kwargs)
        return value * float("inf") if calls["n"] == 4 else value

    monkeypatch.setattr(objective_module, "auxiliary_loss", aux_that_overflows_at_step_4)
    config = run_config(save_every=2, log_every=5, micro_batch_size=8)
    with pytest.raises(TrainingDiverged, match=r"not finite at step 4 \(not finite: loss, aux, grad_norm\), just after "
                       r"removing .*latest checkpoint is step_000002"):
        run(config, progress=False)
    saved = sorted(p.name for p in (Path(config.output_dir) / "checkpoints").iterdir())
    assert saved == ["step_000002"]


def test_checkpoint_reloads_with_its_removal_state(run_config):
    result = run(run_config(max_steps=12), progress=False)
    model, tokenizer, config = load_checkpoint(latest_checkpoint(result.output_dir))
    assert surgery.removal_state(model) == surgery.removal_state(result.model)
    ids = torch.randint(0, len(tokenizer), (2, 20))
    result.model.eval()
    torch.testing.assert_close(model(input_ids=ids).logits, result.model(input_ids=ids).logits)


def test_ema_does_not_move_during_evaluation_passes(run_config):
    """Evaluating every step must leave σ exactly as a run without evaluation."""
    plain = run(run_config(max_steps=12), progress=False)
    evaluated = run(with_overrides(run_config(max_steps=12, eval_every=1), {"output_dir": str(plain.output_dir) + "-eval"}),
                    progress=False)
    assert surgery.removal_state(plain.model) == surgery.removal_state(evaluated.model)


def test_vanilla_control_removes_nothing_and_sees_the_same_first_loss(run_config):
    removal = run(run_config(max_steps=12), progress=False)
    control = run(with_overrides(run_config(max_steps=12), {"removal.mode": "vanilla", "output_dir": str(removal.output_dir) + "-v"}),
                  progress=False)
    assert not surgery.is_installed(control.model) and control.events == []
    loaded = load(control.output_dir)  # a vanilla run folder loads with every norm real
    assert loaded.stored_as == "lnfree checkpoint" and not any(n["fixed"] for n in loaded.norms.values())
    ids = torch.randint(0, control.model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(loaded.model(input_ids=ids).logits, control.model.eval()(input_ids=ids).logits, atol=1e-5)
    first = lambda r: records(r.output_dir / "log.jsonl")[1]["loss"]  # noqa: E731
    assert first(control) == pytest.approx(first(removal), rel=1e-6)  # nothing removed before step 2


def test_refuses_bad_inputs_before_writing_anything(run_config, tmp_path):
    bert = tmp_path / "bert"
    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(bert)
    config = run_config()
    with pytest.raises(ModelError, match="does not support bert models; supported families"):
        run(with_overrides(config, {"model": str(bert)}), progress=False)
    with pytest.raises(DataError, match="not found"):
        run(with_overrides(config, {"data.source": str(tmp_path / "missing.jsonl")}), progress=False)
    with pytest.raises(RunError, match="tokens_per_step"):
        run(with_overrides(config, {"train.tokens_per_step": 1000}), progress=False)
    with pytest.raises(ValueError, match="run ends after"):
        run(with_overrides(config, {"train.max_steps": 5}), progress=False)
    assert not (tmp_path / "run").exists()


def test_refuses_tokenizer_that_does_not_fit_the_model(model_dir, tmp_path):
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(model_dir)
    model.resize_token_embeddings(10)
    model.save_pretrained(tmp_path / "small-vocab")
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "small-vocab")
    shutil.copy(model_dir / "tokenizer_config.json", tmp_path / "small-vocab")
    from lnfree.models.base import load_base

    with pytest.raises(ModelError, match="tokens but the model's vocabulary is 10"):
        load_base(str(tmp_path / "small-vocab"))


def test_output_dir_holding_another_run_is_an_error(run_config):
    first = run(run_config(max_steps=12), progress=False)
    with pytest.raises(RunError, match="this same run; continue it with resume=True"):
        run(run_config(max_steps=12), progress=False)
    with pytest.raises(RunError, match=r"a different run; choose another output_dir \(CLI: -o DIR\)") as error:
        run(run_config(max_steps=13), progress=False)
    assert "resume" not in str(error.value)
    with pytest.raises(RunError, match="different config"):
        run(run_config(max_steps=13), resume=True, progress=False)
    assert (first.output_dir / "checkpoints" / "step_000012").exists()
    (first.output_dir / "eval").mkdir()
    (first.output_dir / "eval" / "summary.json").write_text("{}")
    read_run = {"models": [{"label": "ln_free", "source": str(first.output_dir / "checkpoints" / "step_000012")}]}
    (first.output_dir / "analysis").mkdir()
    (first.output_dir / "analysis" / "index.json").write_text(json.dumps(read_run))
    run(run_config(max_steps=13), overwrite=True, progress=False)
    assert (first.output_dir / "eval" / "summary.json").read_text() == "{}"  # not the run's to delete
    assert not (first.output_dir / "eval" / STALE_MARKER).exists()  # it read no model of the run
    assert "replaced" in (first.output_dir / "analysis" / STALE_MARKER).read_text()  # it did: marked stale
    assert [c.name for c in (first.output_dir / "checkpoints").iterdir()] == ["step_000013"]


def test_micro_batch_is_chosen_when_unset_and_only_a_contradiction_is_an_error():
    assert micro_batches(TrainConfig(tokens_per_step=4096, max_micro_batch_size=32), 256, 1) == (16, 1)
    assert micro_batches(TrainConfig(tokens_per_step=96 * 256, max_micro_batch_size=32), 256, 1) == (32, 3)
    assert micro_batches(TrainConfig(tokens_per_step=12 * 256, max_micro_batch_size=8), 256, 1) == (6, 2)
    assert micro_batches(TrainConfig(tokens_per_step=12 * 256, max_micro_batch_size=8), 256, 2) == (6, 1)
    with pytest.raises(RunError, match="micro_batch_size × processes × context = 32 × 1 × 256"):
        micro_batches(TrainConfig(tokens_per_step=4096, micro_batch_size=32), 256, 1)
    with pytest.raises(RunError, match="multiple of processes × context = 1 × 256"):
        micro_batches(TrainConfig(tokens_per_step=1000), 256, 1)


def test_a_save_killed_midway_is_ignored_resume_continues_and_a_finished_run_is_left_alone(
    run_config, monkeypatch, caplog
):
    from accelerate import Accelerator

    config = run_config(save_every=5)
    out = Path(config.output_dir)
    save_state = Accelerator.save_state

    def killed_during_step_10(self, output_dir=None, **kwargs):
        save_state(self, output_dir, **kwargs)
        if "step_000010" in str(output_dir):
            raise KeyboardInterrupt  # after the weights and optimiser, before the trainer state

    monkeypatch.setattr(Accelerator, "save_state", killed_during_step_10)
    with pytest.raises(KeyboardInterrupt):
        run(config, progress=False)
    monkeypatch.undo()
    assert latest_checkpoint(out).name == "step_000005"
    stored = json.loads((out / "run_config.json").read_text())
    del stored["train"]["steady_allocator"]  # written by an lnfree without that field: resumes at its default
    (out / "run_config.json").write_text(json.dumps(stored))
    legacy = out / "checkpoints" / "step_000008"  # an older lnfree's half-written folder: no optimizer.bin
    legacy.mkdir()
    shutil.copy(out / "checkpoints" / "step_000005" / "model.safetensors", legacy)

    with caplog.at_level("INFO", logger="lnfree"):
        resumed = run(config, resume=True, progress=False)
    ignored = [r.getMessage() for r in caplog.records if "ignoring the incomplete checkpoint" in r.getMessage()]
    assert len(ignored) == 2 and "step_000008" in ignored[0] and "step_000010" in ignored[1]
    assert any(r.getMessage().endswith("step_000005") for r in caplog.records)
    assert [c.name for c in sorted((out / "checkpoints").glob("step_*")) if c != legacy] == [
        "step_000005", "step_000010", "step_000015", "step_000016"]

    lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == list(range(1, 17))  # nothing repeated
    start = next(r for r in lines if r.get("event") == "start")  # what the run computed on, for its CPU hours
    assert start["precision"] == "no" and start["cpu"] == cpu_description()
    removals = [(r["step"], r["slot"]) for r in lines if r.get("event") == "remove"]
    assert len(removals) == len(set(removals)) == len(resumed.events) == 7
    assert resumed.events == [r for r in lines if r.get("event") == "remove"]
    seconds = [r["seconds"] for r in lines if "loss" in r]
    assert seconds == sorted(seconds) and resumed.seconds >= seconds[-1]  # one clock over the whole run
    cpu = [r["cpu_seconds"] for r in lines if "loss" in r]  # process CPU time, carried over the resume too
    assert cpu == sorted(cpu) and cpu[-1] > 0

    files = lambda: {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}  # noqa: E731
    before = files()
    again = run(config, resume=True, progress=False)  # a finished run: nothing to do, nothing changed
    assert again.already_finished and not resumed.already_finished
    assert again.events == resumed.events and again.held_out_ce_end == resumed.held_out_ce_end
    assert again.seconds == resumed.seconds and files() == before


def test_a_disk_without_room_for_the_next_checkpoint_stops_the_run_with_a_clear_error(run_config, monkeypatch):
    from lnfree.removal import checkpointing

    config = run_config(save_every=5)
    out = Path(config.output_dir)
    real = shutil.disk_usage
    full = lambda path: real(path)._replace(free=1000)  # noqa: E731  (the first checkpoint took more)
    calls = []
    monkeypatch.setattr(checkpointing.shutil, "disk_usage", lambda path: calls.append(path) or full(path))
    with pytest.raises(RunError, match=r"no room for checkpoint step_000010: 0.00 GB free .* resume with --resume"):
        run(config, progress=False)
    assert calls and latest_checkpoint(out).name == "step_000005"
    assert not list((out / "checkpoints").glob(".partial-*"))  # nothing half-written
    monkeypatch.undo()
    assert run(config, resume=True, progress=False).output_dir == out


def test_a_resumed_run_keeps_what_auto_chose_at_its_start_and_records_the_machine_it_goes_on(run_config):
    config = run_config(save_every=5)  # mixed_precision "auto": fp32 on a CPU without train.auto_cpu_bf16
    out = run(config, progress=False).output_dir
    log = out / "log.jsonl"

    def resume_last_step(started_in: str) -> dict:
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        next(r for r in lines if r.get("event") == "start")["precision"] = started_in  # as on another machine
        log.write_text("".join(f"{json.dumps(r)}\n" for r in lines))
        shutil.rmtree(out / "checkpoints" / "step_000016")
        run(config, resume=True, progress=False)
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        return next(r for r in reversed(lines) if r.get("event") == "resume")

    for started_in in ("no", "bf16"):  # "auto" chooses once: a resume on another machine computes the same
        resumed = resume_last_step(started_in)
        assert resumed == {"event": "resume", "step": 15, "checkpoint": str(out / "checkpoints" / "step_000015"),
                           "precision": started_in, "cpu": cpu_description()}


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_frozen_embeddings_stay_as_they_were_while_the_rest_trains(run_config, precision):
    from transformers import GPT2LMHeadModel

    from lnfree.removal.frozen_head import FrozenHead

    config = with_overrides(run_config(max_steps=6, learning_rate=1e-3, eval_every=0),
                            {"train.freeze_embeddings": True, "removal.mode": "vanilla",
                             "train.mixed_precision": precision})
    result = run(config, progress=False)
    before = GPT2LMHeadModel.from_pretrained(config.model)
    torch.testing.assert_close(result.model.transformer.wte.weight, before.transformer.wte.weight, rtol=0, atol=0)
    assert not torch.equal(result.model.transformer.h[0].mlp.c_fc.weight, before.transformer.h[0].mlp.c_fc.weight)
    # the head multiplies by one kept copy of the frozen tied weight (lnfree.removal.frozen_head), still tied
    head = result.model.lm_head
    assert isinstance(head, FrozenHead) and head.weight is result.model.transformer.wte.weight
    assert all(math.isfinite(r["loss"]) for r in records(result.output_dir / "log.jsonl").values())


def test_adamw_is_fused_by_default_and_a_resumed_run_keeps_the_implementation_it_started_with(run_config, tmp_path):
    def fused(run_dir, step):
        state = torch.load(run_dir / "checkpoints" / f"step_{step:06d}" / "optimizer.bin", weights_only=False)
        return {group["fused"] for group in state["param_groups"]}

    config = with_overrides(run_config(max_steps=6, save_every=3, eval_every=0), {"removal.mode": "vanilla"})
    assert TrainConfig().fused_optimizer
    default = run(config, progress=False)
    assert fused(default.output_dir, 3) == {True}
    loop_config = with_overrides(config, {"train.fused_optimizer": False, "output_dir": str(tmp_path / "loop")})
    loop = run(loop_config, progress=False)
    assert fused(loop.output_dir, 3) == {None}
    # the same maths: the two implementations round differently, nothing more
    a, b = records(default.output_dir / "log.jsonl"), records(loop.output_dir / "log.jsonl")
    assert [a[s]["loss"] for s in sorted(a)] == pytest.approx([b[s]["loss"] for s in sorted(b)], rel=1e-4)

    moved = tmp_path / "moved"
    shutil.copytree(loop.output_dir, moved)
    shutil.rmtree(moved / "checkpoints" / "step_000006")
    stored = json.loads((moved / "run_config.json").read_text())
    del stored["train"]["fused_optimizer"]  # as a run folder written before the setting existed
    (moved / "run_config.json").write_text(json.dumps(stored))
    run(with_overrides(config, {"output_dir": str(moved)}), resume=True, progress=False)  # config: fused
    assert fused(moved, 6) == {None}
    continued = records(moved / "log.jsonl", after_resume=True)
    assert [continued[s]["loss"] for s in (4, 5, 6)] == [b[s]["loss"] for s in (4, 5, 6)]


def test_steps_whose_gradient_norm_exceeds_the_limit_move_no_weight_and_are_logged(run_config, tmp_path):
    from transformers import GPT2LMHeadModel

    config = with_overrides(run_config(max_steps=4, learning_rate=1e-3, eval_every=0),
                            {"removal.mode": "vanilla", "train.skip_grad_norm": 1e-12})
    result = run(config, progress=False)
    before = GPT2LMHeadModel.from_pretrained(config.model)
    torch.testing.assert_close(result.model.transformer.h[0].mlp.c_fc.weight, before.transformer.h[0].mlp.c_fc.weight,
                               rtol=0, atol=0)
    log = [json.loads(line) for line in (result.output_dir / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r.get("event") == "skip"] == [1, 2, 3, 4]
    loose = run(with_overrides(config, {"train.skip_grad_norm": 1e12, "output_dir": str(tmp_path / "loose")}),
                progress=False)
    assert not torch.equal(loose.model.transformer.h[0].mlp.c_fc.weight, before.transformer.h[0].mlp.c_fc.weight)
    assert '"skip"' not in (loose.output_dir / "log.jsonl").read_text()


def test_only_the_newest_checkpoints_are_kept_when_asked(run_config, tmp_path):
    config = with_overrides(run_config(max_steps=8, save_every=2, eval_every=0),
                            {"removal.mode": "vanilla", "train.keep_checkpoints": 2})
    result = run(config, progress=False)
    kept = sorted(p.name for p in (result.output_dir / "checkpoints").iterdir())
    assert kept == ["step_000006", "step_000008"]
    everything = run(with_overrides(config, {"train.keep_checkpoints": None, "output_dir": str(tmp_path / "all")}),
                     progress=False)
    assert len(list((everything.output_dir / "checkpoints").iterdir())) == 4


def test_checkpoints_at_the_kept_steps_are_saved_and_never_pruned_and_a_run_may_resume_asking_for_them(
        run_config, tmp_path):
    config = with_overrides(run_config(max_steps=12, save_every=4, eval_every=0),
                            {"removal.mode": "vanilla", "train.keep_checkpoints": 1, "train.keep_steps": [3, 4]})
    result = run(config, progress=False)
    kept = sorted(p.name for p in (result.output_dir / "checkpoints").iterdir())
    assert kept == ["step_000003", "step_000004", "step_000012"]  # 3 off the cadence; 8 pruned, 4 kept
    plain = with_overrides(config, {"train.keep_steps": [], "train.keep_checkpoints": None,
                                    "output_dir": str(tmp_path / "plain")})
    first = run(plain, progress=False)
    shutil.rmtree(first.output_dir / "checkpoints" / "step_000012")  # as if stopped after step 8
    resumed = run(with_overrides(plain, {"train.keep_steps": [10], "train.keep_checkpoints": 1}), resume=True,
                  progress=False)
    kept = sorted(p.name for p in (resumed.output_dir / "checkpoints").iterdir())
    assert kept == ["step_000010", "step_000012"]
    for name, value in result.model.state_dict().items():  # bookkeeping changes nothing of what is trained
        torch.testing.assert_close(resumed.model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_run_resumes_with_another_eval_and_save_cadence_but_not_another_recipe(run_config):
    config = run_config(max_steps=12, save_every=6)
    first = run(config, progress=False)
    out = first.output_dir
    shutil.rmtree(out / "checkpoints" / "step_000012")
    with pytest.raises(RunError, match="different config"):
        run(with_overrides(config, {"train.seed": 7}), resume=True, progress=False)
    resumed = run(with_overrides(config, {"train.eval_every": 3, "train.save_every": 3}), resume=True, progress=False)
    assert json.loads((out / "run_config.json").read_text())["train"]["eval_every"] == 3  # the new cadence, recorded
    evals = [r["step"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if r.get("event") == "eval"]
    assert evals == [9]  # after step 6, every 3 steps (the last step's CE is the run's end record)
    assert (out / "checkpoints" / "step_000009").is_dir()
    for name, value in first.model.state_dict().items():  # bookkeeping changes nothing of what is trained
        torch.testing.assert_close(resumed.model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_resumed_run_may_amend_its_future_but_never_its_past(run_config, tmp_path):
    config = run_config(save_every=5)  # ln_2 at steps 2–3, ln_1qk 4–5, ln_1v 6 and 8, ln_f 10; 16 steps
    first = run(config, progress=False)
    out = first.output_dir
    for later in ("step_000010", "step_000015", "step_000016"):
        shutil.rmtree(out / "checkpoints" / later)
    stages = json.loads(config.removal.schedule.model_dump_json())["stages"]
    slower = [*stages[:2], {**stages[2], "gap": 4}, stages[3]]  # ln_1v at steps 6 and 10, ln_f at 14
    amended = with_overrides(config, {"removal.schedule.stages": slower, "train.max_steps": 20,
                                      "train.cosine_steps": 16, "train.scale_tail": {"ratio": 2.0, "start": 5},
                                      "train.learning_rate_restart": {"start": 15, "learning_rate": 5e-4,
                                                                      "min_learning_rate": 1e-4}})

    for change, why in (({"train.seed": 7}, "train.seed changed"),
                        ({"train.cosine_steps": None}, "the learning rate before step 5"),
                        ({"train.scale_tail.start": 3}, "the scale_tail loss before step 5"),
                        ({"train.learning_rate_restart.start": 4}, "the learning rate before step 5"),
                        ({"removal.schedule.stages": [{**stages[0], "gap": 2}, *slower[1:]]},
                         r"the removals before step 5 \(blocks.0.ln_1qk, blocks.1.ln_2\)")):
        with pytest.raises(RunError, match=why):
            run(with_overrides(amended, change), resume=True, progress=False)
    resumed = run(amended, resume=True, progress=False)
    lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert {"event": "amend", "step": 5, "changed": ["removal.schedule.stages", "train.cosine_steps",
                                                     "train.learning_rate_restart", "train.max_steps",
                                                     "train.scale_tail"]} in lines
    lr = {r["step"]: r["lr"] for r in lines if "lr" in r}  # a record's step counts the steps done: its lr is step − 1's
    assert lr[15] < 2e-4 and lr[16] == 5e-4 and 1e-4 < lr[17] < 5e-4  # the restart at (0-based) step 15
    assert [r["step"] for r in lines if r.get("event") == "remove"] == [2, 3, 4, 5, 6, 10, 14]
    assert json.loads((out / "run_config.json").read_text())["train"]["max_steps"] == 20

    planned = run(with_overrides(amended, {"output_dir": str(tmp_path / "planned")}), progress=False)
    assert surgery.removal_state(resumed.model) == surgery.removal_state(planned.model)
    for name, value in planned.model.state_dict().items():  # the amended run is the run planned so from step 0
        torch.testing.assert_close(resumed.model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
