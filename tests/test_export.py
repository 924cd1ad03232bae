"""Eps-trick export: a plain GPT2LMHeadModel that reproduces the LN-free model."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from conftest import small_gpt2
from transformers import AutoTokenizer, GPT2LMHeadModel

from lnfree.fixedscale import surgery
from lnfree.forms.export import RECORD, ExportError, probe_refusal, to_eps_trick, write_export


def removed_model(seed=0, distinct_v_sigma=True):
    model = surgery.install(small_gpt2(n_layer=3, seed=seed))
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(seed))
    surgery.initialise_sigmas(model, [ids])
    for name, state in surgery.scale_states(model).items():
        if distinct_v_sigma and name.endswith("ln_1v"):
            state.sigma.mul_(1.9)  # Q/K and V froze different σ
        state.switch_to_fixed()
    return model


@pytest.fixture
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def test_export_reloads_as_plain_gpt2_with_matching_logits(tmp_path, tokenizer):
    model = removed_model()
    write_export(model, tokenizer, tmp_path / "export", {"note": "test"})
    plain = GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval()
    assert type(plain.transformer.ln_f) is torch.nn.LayerNorm
    assert plain.config.layer_norm_epsilon == 1e12
    assert all(m.eps == 1e12 for m in plain.modules() if isinstance(m, torch.nn.LayerNorm))
    ids = torch.randint(0, 64, (3, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        error = (plain(input_ids=ids).logits - model(input_ids=ids).logits).abs().max().item()
    assert error <= 1e-4
    record = json.loads((tmp_path / "export" / RECORD).read_text())
    assert record["fully_removed"] and record["note"] == "test"
    assert record["norms"]["blocks.2.ln_1v"]["sigma"] == pytest.approx(float(surgery.scale_states(model)["blocks.2.ln_1v"].sigma))
    assert (tmp_path / "export" / "model.safetensors").exists()


def test_export_without_the_v_ratio_fold_would_be_wrong():
    """Guards the σ_qk/σ_v fold: exporting ln_1 at σ_qk alone must not match."""
    model = removed_model()
    plain = to_eps_trick(model)
    ids = torch.randint(0, 64, (2, 16))
    exact = (plain(input_ids=ids).logits - model(input_ids=ids).logits).abs().max()
    naive = to_eps_trick(removed_model(distinct_v_sigma=False))
    assert exact < 1e-4
    assert (naive(input_ids=ids).logits - model(input_ids=ids).logits).abs().max() > 1e-2


def test_partial_export_is_refused_unless_asked(tmp_path, tokenizer):
    model = surgery.install(small_gpt2())
    surgery.scale_states(model)["blocks.0.ln_2"].switch_to_fixed()
    with pytest.raises(ExportError, match="still real"):
        write_export(model, tokenizer, tmp_path / "out", {})
    assert not (tmp_path / "out").exists()
    write_export(model, tokenizer, tmp_path / "out", {}, allow_partial=True)
    plain = GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    assert plain.config.layer_norm_epsilon == 1e-5
    assert plain.config.lnfree_fixed_scale_norms == ["transformer.h.0.ln_2"]
    for name in plain.config.lnfree_fixed_scale_norms:  # what a loader must do for a partial export
        plain.get_submodule(name).eps = 1e12
    ids = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(plain(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_export_refuses_active_special_sigma_and_occupied_folders(tmp_path, tokenizer):
    model = surgery.install(small_gpt2(), special_pos0=True)
    for state in surgery.scale_states(model).values():
        state.switch_to_fixed()
    with pytest.raises(ExportError):
        write_export(model, tokenizer, tmp_path / "a", {}, allow_partial=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("keep")
    with pytest.raises(ExportError, match="not empty"):
        write_export(removed_model(), tokenizer, tmp_path / "b", {})
    assert (tmp_path / "b" / "x").read_text() == "keep"


def test_an_eps_beyond_fp32_is_refused_not_written():
    from lnfree.forms.export import MAX_EPS, ExportError, choose_eps

    assert choose_eps(None) == 1e12 and choose_eps(1e6) > 1e12
    assert choose_eps(1e20) <= MAX_EPS
    with pytest.raises(ExportError, match="cannot be exported in the plain format"):
        choose_eps(7e30)  # would need eps 1e39: inf in fp32


def massive_bos_llama():
    """The reproduction of issue 24: a tiny Llama (vocab 5000, eos 0, BOS 1) whose BOS row is 1000× larger,
    σ measured on ids that never contain BOS, every norm fixed."""
    from families import tiny_family

    model = tiny_family("llama", vocab_size=5000, eos_token_id=0)
    model.config.bos_token_id = 1
    with torch.no_grad():
        model.model.embed_tokens.weight[1] *= 1000
    surgery.install(model)
    surgery.initialise_sigmas(model, [torch.randint(2, 5000, (4, 32), generator=torch.Generator().manual_seed(0))])
    for state in surgery.scale_states(model).values():
        state.switch_to_fixed()
    return model


def relative_error(plain, model, ids):
    with torch.no_grad():
        got, want = plain(input_ids=ids).logits.double(), model(input_ids=ids).logits.double()
    return float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max())


def test_the_default_probe_holds_bos_and_the_export_is_measured_exact_on_it(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    model = massive_bos_llama()
    folder = write_export(model, tokenizer, tmp_path / "export", {})  # no probe: the default one
    choice = json.loads((folder / RECORD).read_text())["eps_choice"]
    assert choice["peak_norm_input"] > 1e5  # BOS was in the probe (random ids alone peak near 1e-3)
    assert choice["worst_relative_error"] <= 1e-4 and choice["worst_token"]["position"] >= 0
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    starts_with_bos = torch.randint(2, 5000, (2, 16), generator=torch.Generator().manual_seed(3))
    starts_with_bos[:, 0] = 1
    assert relative_error(plain, model, starts_with_bos) <= 1e-4


def test_the_export_raises_eps_until_its_measured_error_is_within_tolerance(tmp_path, tokenizer, monkeypatch):
    import lnfree.forms.export as export

    model = massive_bos_llama()
    monkeypatch.setattr(export, "choose_eps", lambda peak: 1e12)  # as if the peak had been missed
    folder = write_export(model, tokenizer, tmp_path / "export", {})
    record = json.loads((folder / RECORD).read_text())
    assert record["eps"] > 1e12 and record["eps_choice"]["worst_relative_error"] <= 1e-4
    monkeypatch.setattr(export, "MAX_EPS", 1e12)  # and when no eps is allowed that is exact: refused, nothing written
    with pytest.raises(ExportError, match="cannot be exported in the plain format"):
        write_export(model, tokenizer, tmp_path / "refused", {})
    assert not (tmp_path / "refused").exists() and not list(tmp_path.glob(".refused-*"))


def test_probe_rows_the_model_itself_runs_away_on_are_refused_or_left_out_and_listed(tmp_path, tokenizer):
    """An LN-free gated model can overflow on rare tokens far out of distribution (Gemma 3 270M does):
    the export refuses it, naming the kinds of input, unless asked; then no representation can match
    that, so those probe rows are reported, not compared, and verify fails `bounded`; real text is
    never forgiven."""
    from families import tiny_family

    from lnfree.forms.export import RUNAWAY_PEAK
    from lnfree.removal.losses.probe import probe_batch
    from lnfree.forms.verify import verify

    model = tiny_family("mistral", vocab_size=600, eos_token_id=0)  # an untied head: one row's logits stay finite
    model.config.bos_token_id = 1
    surgery.install(model)
    surgery.initialise_sigmas(model, [torch.randint(2, 500, (4, 32), generator=torch.Generator().manual_seed(0))])
    for state in surgery.scale_states(model).values():
        state.switch_to_fixed()
    text = torch.randint(2, 500, (2, 32), generator=torch.Generator().manual_seed(1))
    planted = int(probe_batch(model.config, tokenizer, text_ids=text)[-1, 10])  # a token of the last (random) row
    text[text == planted] = 2
    ids = probe_batch(model.config, tokenizer, text_ids=text)  # the probe the export builds
    assert probe_refusal(model, tokenizer, text) is None
    with torch.no_grad():
        model.model.embed_tokens.weight[planted] *= 1e18  # its residual stream far beyond any fp32 eps
    assert re.search(r"runs away on \d+ of \d+ probe rows: .*random ids", probe_refusal(model, tokenizer, text))
    with pytest.raises(ExportError, match=r"runs away on \d+ of \d+ probe rows: .*random ids.*--allow-runaway"):
        write_export(model, tokenizer, tmp_path / "export", {}, probe=text)
    folder = write_export(model, tokenizer, tmp_path / "export", {}, probe=text, allow_runaway=True)
    record = json.loads((folder / RECORD).read_text())
    runaway = record["eps_choice"]["runaway_rows"]
    rows = [r for r in range(len(ids)) if planted in ids[r].tolist()]
    assert [r["row"] for r in runaway] == rows
    assert all(r["kind"] != "real text" and "random ids" in r["kind"] for r in runaway)
    assert all(r["peak_norm_input"] == "overflow" or r["peak_norm_input"] > RUNAWAY_PEAK for r in runaway)
    assert record["eps_choice"]["probe_tokens"][0] == len(ids) - len(rows)
    assert record["eps_choice"]["worst_relative_error"] <= 1e-4
    assert record["eps_choice"]["worst_token"]["row"] not in rows  # a row of the whole probe
    report = verify(folder, bridge=False)
    assert not report["ok"] and not report["checks"]["bounded"]["ok"]
    assert all(check["ok"] for name, check in report["checks"].items() if name != "bounded"), report["checks"]
    json.loads((folder / RECORD).read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    text[0, 5] = planted
    with pytest.raises(ExportError, match="on real held-out text"):
        write_export(model, tokenizer, tmp_path / "refused", {}, probe=text, allow_runaway=True)


def test_comparing_logits_counts_a_non_finite_logit_as_an_infinite_difference():
    from lnfree.removal.losses.probe import compare_logits
    from lnfree.forms.verify import within

    ids = torch.zeros(2, 3, dtype=torch.long)
    const = lambda value: (lambda x: torch.full((2, 3, 5), value))  # noqa: E731
    assert within(compare_logits(const(1.0), const(1.0), ids), 1e-4)
    for got, want in ((float("nan"), 1.0), (1.0, float("inf")), (float("nan"), float("nan"))):
        measured = compare_logits(const(got), const(want), ids)
        assert measured["max_abs_diff"] == measured["max_scaled_diff"] == math.inf and not within(measured, 1e-4)
    large = compare_logits(const(100.005), const(100.0), ids)  # fp32 rounds relative to a logit's size
    assert large["max_abs_diff"] > 1e-4 and within(large, 1e-4) and not within(large, 1e-5)


def test_comparing_logits_holds_a_bounded_number_of_them_and_still_finds_the_worst_token(monkeypatch):
    from lnfree.removal.losses import probe

    ids = torch.arange(12 * 4).reshape(12, 4)  # 12 rows of 4 tokens, 10 logits each: 40 logits a row
    table = torch.randn(ids.numel(), 10, generator=torch.Generator().manual_seed(0))
    seen = []

    def reference(x):
        seen.append(len(x))
        return table[x]

    def model(x):
        logits = table[x].clone()
        logits[x == 9 * 4 + 2] += 0.5  # row 9, position 2
        return logits

    monkeypatch.setattr(probe, "COMPARE_LOGITS", 100)  # at most two rows' logits
    measured = probe.compare_logits(model, reference, ids)
    assert measured["worst_token"] == (9, 2) and measured["max_abs_diff"] == pytest.approx(0.5)
    assert max(seen) == 2 and sum(seen) == 12
    seen.clear()
    monkeypatch.setattr(probe, "COMPARE_LOGITS", 10**6)
    assert probe.compare_logits(model, reference, ids)["worst_token"] == (9, 2) and max(seen) == 8


def test_probe_rows_without_bos_say_so_for_a_family_that_reads_one(tokenizer):
    from families import tiny_family

    from lnfree.removal.losses.probe import _bos, probe_rows

    for family, reads_bos in (("gpt2", False), ("gemma3", True)):
        config = tiny_family(family, vocab_size=600, eos_token_id=0).config
        rows, kinds = probe_rows(config, tokenizer)
        bos = _bos(config, tokenizer)
        assert bos is not None and any(row[0] == bos for row in rows.tolist())
        for row, kind in zip(rows.tolist(), kinds):
            assert ("no BOS first" in kind) == (reads_bos and row[0] != bos), (family, kind)
