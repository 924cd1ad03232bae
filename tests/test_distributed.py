"""Two CPU processes (gloo) must remove LayerNorm exactly as one process with the same global batch."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lnfree.fixedscale import surgery
from lnfree.removal.config import with_overrides
from lnfree.removal.train import run


def test_two_process_run_freezes_identical_sigma_on_every_rank(run_config, tmp_path):
    two_processes_match_one(run_config(max_steps=14, micro_batch_size=4), tmp_path)  # 8 sequences: 1 micro-step × 2 ranks


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_two_process_family_run_freezes_identical_sigma(family, tmp_path):
    two_processes_match_one(tiny_family_config(family, tmp_path), tmp_path)


def test_two_process_adaptive_distilled_gradual_run_decides_identically_on_every_rank(run_config, tmp_path):
    from test_strategies import strategies_config

    # delta 0 and a one-step window: each decision hinges on the noise of a single step's loss.
    adaptive = {"delta": 0.0, "min_gap": 1, "max_gap": 4, "window": 1}
    config = with_overrides(strategies_config(run_config, micro_batch_size=4), {"removal.adaptive": adaptive})
    result = run_two_processes(config, tmp_path)
    rank0, rank1 = result["events"]
    assert rank0 == rank1 and len(rank0) == 7
    assert torch.equal(*(torch.tensor(s) for s in result["sigmas"]))
    assert all(all(flag == 1.0 for flag in rank) for rank in result["fixed"])


@pytest.mark.parametrize("settings", [
    {"train.coverage": {"rows": 1, "ratio": 1.2, "start": 2, "max_grad_share": 0.3}},
    {"train.coverage": {"rows": 1, "ratio": 1.2, "start": 2, "max_grad_share": 0.3, "first_token_rows": 4}},
    {"train.stability_margin": {"factor": 4.0, "ratio": 1.5, "rows": 1, "start": 4}},
], ids=["coverage", "one-token rows", "margin"])
def test_two_process_capped_rows_take_the_same_step_on_every_rank(run_config, tmp_path, settings):
    # Each backs its own rows after the text's synchronised gradients, held apart meanwhile (HeldGradients);
    # the one-token rows and the margin read no logits, so DDP cannot see what they reach: every rank must still
    # end with the same weights, bit for bit.
    config = with_overrides(run_config(max_steps=14, micro_batch_size=4), {**settings, "train.distill_alpha": 0.5})
    rank0, rank1 = run_two_processes(config, tmp_path)["weights"]
    assert rank0 == rank1 and all(math.isfinite(w) for w in rank0)


def test_fsdp_run_freezes_the_single_process_sigma(run_config, tmp_path):
    # FSDP2 on two gloo processes: weights sharded, gathered inside each forward (the GPU users' --fsdp path).
    two_processes_match_one(run_config(max_steps=14, micro_batch_size=4), tmp_path, sharding="fsdp")


@pytest.mark.parametrize("settings", [
    {"train.coverage": {"rows": 1, "ratio": 1.2, "start": 2, "max_grad_share": 0.3}},
    {"train.coverage": {"rows": 1, "ratio": 1.2, "start": 2, "max_grad_share": 0.3, "first_token_rows": 4},
     "train.distill_alpha": 0.5},
    {"train.stability_margin": {"factor": 4.0, "ratio": 1.5, "rows": 1, "start": 4},
     "train.gradient_checkpointing": True},
], ids=["coverage rows, no teacher", "one-token rows", "margin, checkpointing"])
def test_fsdp_run_takes_the_steps_of_a_ddp_run(run_config, tmp_path, settings):
    # Rows whose loss reads inner activations only (no teacher's KL, the one-token rows, the margin): FSDP hangs
    # its gradient reduction on the module's outputs, DDP's run reduces them by hand. The same global batch must
    # end at the same weights (fp32: they differ by the reductions' rounding, about 1e-5 here).
    config = with_overrides(run_config(max_steps=14, micro_batch_size=4), settings)
    ddp, fsdp = (run_two_processes(config, tmp_path / kind, kind)["weights"][0] for kind in ("ddp", "fsdp"))
    torch.testing.assert_close(torch.tensor(fsdp), torch.tensor(ddp), rtol=1e-4, atol=1e-4)


def test_fsdp_gemma3_run_with_the_robust_recipes_terms_takes_the_steps_of_a_ddp_run(tmp_path):
    # The Gemma recipe's terms (experiments/robust/gemma3.toml) squeezed into a tiny run: the tails at the norms'
    # inputs and outputs, position 0's tail and its MLPs, the margin, spike skipping, coverage with replay, mining
    # and one-token rows, the training-time ceiling, position 0's own σ.
    config = tiny_family_config("gemma3", tmp_path)
    steps = config.train.max_steps
    stages = config.removal.schedule.model_dump(exclude_none=True)["stages"]
    stages[-1]["gap"] = 2  # ln_f, then position 0's own σ fades over 2 steps
    stages.append({"kind": "pos0_special", "blend_steps": 2})
    cov = {"rows": 1, "repeated_share": 0.5, "ratio": 2.0, "kl_weight": 0.5, "max_grad_share": 0.25}
    config = with_overrides(config, {
        "train.distill_alpha": 0.5, "train.scale_loss_weight": 0.1, "train.scale_loss_form": "log",
        "train.scale_tail": [{"ratio": 2.0, "start": 2}, {"ratio": 2.0, "start": 4, "measure": "output"}],
        "train.position0_tail": {"ratio": 8.0, "start": 6}, "train.position0_mlp": {"start": 8},
        "train.stability_margin": {"factor": 4.0, "ratio": 2.0, "rows": 1, "start": 4, "max_grad_share": 0.25},
        "train.skip_grad_norm": 1e5,
        "train.coverage": [{**cov, "start": 0}, {**cov, "rows": 2, "start": steps - 6, "replay_share": 1.0,
                                                 "no_bos_share": 0.5, "first_token_rows": 8, "first_text_share": 0.5,
                                                 "mine": {"part": 0, "of": 1, "random": True}}],
        "removal.special_pos0": True, "removal.schedule": {"stages": stages}, "removal.scale_ceiling": {"ratio": 8.0, "release_start": steps - 2, "release_steps": 1}})
    kinds = ("ddp", "fsdp", "fsdp-blocks")  # FSDP2 on the root alone, and on each block too
    runs = {kind: run_two_processes(config, tmp_path / kind, kind) for kind in kinds}
    logs = {kind: dist_log(tmp_path / kind) for kind in runs}
    events = {kind: [(r["event"], r["step"], r.get("slot")) for r in log if r.get("event", "end") not in ("start", "end")]
              for kind, log in logs.items()}
    assert events["fsdp"] == events["ddp"] == events["fsdp-blocks"] and ("mine", steps - 6, None) in events["ddp"]
    assert sum(event == "skip" for event, _, _ in events["ddp"]) >= 1  # a violent run: the reductions' rounding grows
    losses = {kind: torch.tensor([r["loss"] for r in log if "loss" in r]) for kind, log in logs.items()}
    ddp = torch.tensor(runs["ddp"]["weights"][0])
    for kind in kinds[1:]:
        torch.testing.assert_close(losses[kind], losses["ddp"], rtol=1e-2, atol=0)  # measured: within 2e-3
        fsdp = torch.tensor(runs[kind]["weights"][0])
        torch.testing.assert_close(fsdp, ddp, rtol=5e-3, atol=5e-3)  # measured: within 4e-4 of each tensor's sum


def test_fsdp_per_block_run_averages_the_norm_weights_gradients_read_after_the_forward(tmp_path):
    # The tail hinge measured at the norms' outputs reads each norm's weight after the forward, where FSDP with a
    # group per block has sharded it again: gathered there, its gradient must be averaged over the processes as
    # FSDP averages the rest (summed, the weights end 1.7× off; averaged, measured within 1.6e-4 of DDP's).
    config = with_overrides(tiny_family_config("gemma3", tmp_path), {
        "train.distill_alpha": 0.0, "train.vector_lr_scale": 100.0,  # the norm weights move enough to compare
        "train.scale_tail": [{"ratio": 1.2, "start": 0, "measure": "output", "weight": 10.0}]})
    ddp, fsdp = (torch.tensor(run_two_processes(config, tmp_path / kind, kind)["weights"][0])
                 for kind in ("ddp", "fsdp-blocks"))
    torch.testing.assert_close(fsdp, ddp, rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("settings", [
    {"train.neuron_gain": {"ratio": 1.5, "weight": 10.0, "start": 0, "project": True}},
    {"train.local_growth": {"factor": 3.0, "limit": 1.0, "tokens": 8, "weight": 10.0, "start": 2}},
], ids=["gain bound, projected", "local growth"])
def test_fsdp_per_block_run_of_the_weight_space_terms_takes_the_steps_of_a_ddp_run(tmp_path, settings):
    # Both read a block's MLP outside its forward: the gain bound its weights (and scales them after each step),
    # the growth hinge re-runs the MLP. Under a group per block FSDP has sharded them again by then.
    config = with_overrides(tiny_family_config("gemma3", tmp_path), {"train.distill_alpha": 0.0, **settings})
    kinds = ("ddp", "fsdp", "fsdp-blocks")
    ddp, *sharded = (torch.tensor(run_two_processes(config, tmp_path / kind, kind)["weights"][0]) for kind in kinds)
    for weights in sharded:
        torch.testing.assert_close(weights, ddp, rtol=2e-3, atol=1e-4)


def test_fsdp_bf16_run_follows_the_ddp_run(run_config, tmp_path):
    # Under bf16 autocast FSDP gathers fp32 weights into each forward, where DDP keeps a step's casts
    # (lnfree.removal.precision): the same casts, so the same losses but for the reductions' rounding, which bf16
    # carries into the weights (about 1e-2 of a tensor's sum after 14 steps): compared on the logged losses.
    config = with_overrides(run_config(max_steps=14, micro_batch_size=4), {"train.mixed_precision": "bf16"})
    logged = []
    for kind in ("ddp", "fsdp"):
        run_two_processes(config, tmp_path / kind, kind)
        logged.append(torch.tensor([[r["loss"], r["grad_norm"]] for r in dist_log(tmp_path / kind) if "loss" in r]))
    ddp, fsdp = logged
    assert len(ddp) == 14
    # measured: the losses at most 1.2e-4 apart (relative), the gradient norms 2.4e-3 on an AMD EPYC (avx512_bf16),
    # whose bf16 kernels round otherwise than the Intel Xeons' with AMX (where both stayed within 1e-3)
    torch.testing.assert_close(fsdp[:, 0], ddp[:, 0], rtol=1e-3, atol=0)
    torch.testing.assert_close(fsdp[:, 1], ddp[:, 1], rtol=1e-2, atol=0)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process's threads from /proc")
def test_two_process_remove_command_never_tears_down_with_gloo_threads_alive(run_config, tmp_path):
    config_file = tmp_path / "cli.json"
    config_file.write_text(run_config(max_steps=14, micro_batch_size=4).model_dump_json())
    out, reports = tmp_path / "cli-run", tmp_path / "teardown"
    reports.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(Path(__file__).with_name("dist_cli.py")), str(reports), "remove", "--config", str(config_file),
         "-o", str(out), "--no-control"],
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-20000:]
    assert (out / "summary.json").is_file() and (out / "export" / "config.json").is_file()
    # A process that reaches teardown with gloo's worker threads alive can abort there (exit -6).
    alive = {f.name: json.loads(f.read_text())["gloo_threads"] for f in reports.iterdir()}
    assert all(not threads for threads in alive.values()), alive


def tiny_family_config(family: str, tmp_path):
    """A quick removal of every slot of a tiny `family` model on the tiny corpus, 4 sequences a micro-step."""
    from test_arch import family_run_config

    from lnfree.data.tiny import PRETRAIN_SEED, build_tokenizer, generate_documents

    tokenizer = build_tokenizer(generate_documents(200, PRETRAIN_SEED))
    return family_run_config(family, tokenizer, tmp_path, micro_batch_size=4)


def run_two_processes(config, tmp_path, sharding: str = "ddp") -> dict:
    """Run `config` on two gloo processes, under DDP or FSDP2 (`sharding` "fsdp": the root module; "fsdp-blocks": each
    block too); what `dist_worker.py` gathered from both ranks."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config_file = tmp_path / "dist.json"
    config_file.write_text(with_overrides(config, {"output_dir": str(tmp_path / "dist-run")}).model_dump_json())
    result_file = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    worker = Path(__file__).with_name("dist_worker.py")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(worker), str(config_file), str(result_file), *([f"--{sharding}"] if sharding != "ddp" else [])],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-20000:]
    result = json.loads(result_file.read_text())
    assert result["world_size"] == 2 and result["backend"] == "gloo" and result["sharded"] == (sharding != "ddp")
    blocks = [name for name in result["groups"] if name.split(".")[-1].isdigit()]  # `transformer.h.0`, `model.layers.0`
    assert bool(blocks) == (sharding == "fsdp-blocks"), result["groups"]  # a group per block, or only the root's
    return result


def dist_log(tmp_path) -> list[dict]:
    """The records of the log that `run_two_processes(config, tmp_path)` wrote."""
    return [json.loads(line) for line in (tmp_path / "dist-run" / "log.jsonl").read_text().splitlines()]


def two_processes_match_one(config, tmp_path, sharding: str = "ddp"):
    """Run `config` on two gloo processes and on one; every rank must freeze the single run's σ."""
    result = run_two_processes(config, tmp_path, sharding)
    rank0, rank1 = (torch.tensor(s) for s in result["sigmas"])
    assert torch.equal(rank0, rank1)
    assert all(all(flag == 1.0 for flag in rank) for rank in result["fixed"])

    single = run(config, progress=False)
    single_sigmas = torch.stack([s.sigmas() for s in surgery.scale_states(single.model).values()])
    torch.testing.assert_close(rank0, single_sigmas, rtol=1e-4, atol=0)
    assert result["held_out_ce_end"] == pytest.approx(single.held_out_ce_end, rel=1e-3)


def test_two_process_damped_run_damps_the_same_neurons_as_one(run_config, tmp_path):
    from test_massive import planted_tiny

    from lnfree.removal.losses.massive import NEURONS_FILE

    config = with_overrides(run_config(max_steps=22, micro_batch_size=4),  # 4 blocks: the last removal at 18
                            {"model": str(planted_tiny(tmp_path)), "removal.massive_neurons": {"steps": 4}})
    two_processes_match_one(config, tmp_path)  # σ on every rank equal to the single process's
    # Every rank measures process 0's micro-batches, so the measured values depend on the process count,
    # the chosen neurons do not.
    neurons = [[(n["layer"], n["index"]) for n in json.loads((Path(folder) / NEURONS_FILE).read_text())]
               for folder in (tmp_path / "dist-run", config.output_dir)]
    assert neurons == [[(1, 0)], [(1, 0)]]
