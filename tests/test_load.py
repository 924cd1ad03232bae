"""`lnfree.load` and `lnfree verify`: every kind of checkpoint, loaded exactly."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import small_gpt2
from transformers import AutoTokenizer, GPT2LMHeadModel

from lnfree.fixedscale import surgery
from lnfree.forms.export import RECORD, write_export
from lnfree.forms.load import LoadedModel, LoadError, load
from lnfree.forms.verify import verify


@pytest.fixture
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def removed(tokenizer, n_layer=3):
    model = surgery.install(small_gpt2(n_layer=n_layer, vocab_size=len(tokenizer)))
    ids = torch.randint(0, len(tokenizer), (4, 32), generator=torch.Generator().manual_seed(1))
    surgery.initialise_sigmas(model, [ids])
    for name, state in surgery.scale_states(model).items():
        if name.endswith("ln_1v"):
            state.sigma.mul_(1.6)
        state.switch_to_fixed()
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.randint(0, 400, (3, 24), generator=torch.Generator().manual_seed(7))


def test_export_loads_exactly_with_its_sigmas(tokenizer, tmp_path):
    model = removed(tokenizer)
    write_export(model, tokenizer, tmp_path / "export", {})
    loaded = load(tmp_path / "export")
    assert loaded.stored_as == "lnfree export" and loaded.fully_ln_free
    assert "LN-free: 10/10 norms fixed-scale" in repr(loaded)
    for name, entry in surgery.removal_state(model).items():
        assert loaded.norms[name]["sigma"] == pytest.approx(entry["sigma"], rel=1e-6)
    reference = logits(model, IDS)
    assert (logits(loaded.hf(), IDS) - reference).abs().max() <= 1e-5
    assert (logits(loaded.folded(), IDS) - reference).abs().max() <= 1e-5


def test_published_format_with_config_eps_left_at_1e5_loads_exactly(tokenizer, tmp_path):
    model = removed(tokenizer)
    write_export(model, tokenizer, tmp_path / "pub", {})
    (tmp_path / "pub" / RECORD).unlink()  # published checkpoints carry no lnfree record
    config = json.loads((tmp_path / "pub" / "config.json").read_text())
    config["layer_norm_epsilon"] = 1e-5
    (tmp_path / "pub" / "config.json").write_text(json.dumps(config))
    naive = GPT2LMHeadModel.from_pretrained(tmp_path / "pub").eval()
    assert (logits(naive, IDS) - logits(model, IDS)).abs().max() > 1.0  # the trap
    loaded = load(tmp_path / "pub")
    assert loaded.stored_as == "eps-trick checkpoint" and loaded.fully_ln_free
    assert all(n["sigma"] is None for n in loaded.norms.values())  # σ is folded into the weights
    assert (logits(loaded.hf(), IDS) - logits(model, IDS)).abs().max() <= 1e-5
    report = verify(tmp_path / "pub", bridge=False)
    assert not report["ok"] and not report["checks"]["transformers.from_pretrained"]["ok"]
    assert report["checks"]["folded"]["ok"] and report["checks"]["dla_reconstruction"]["ok"]
    # checked on real text with BOS first, special and repeated tokens; the worst token is named with its text
    assert report["probe"]["real_text_rows"] == 1 and tokenizer.eos_token_id in report["probe"]["special_ids"]
    worst = report["checks"]["transformers.from_pretrained"]["worst_token"]
    assert worst["text"] == tokenizer.decode([worst["token_id"]]) and report["tokens"][0] > 4


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 0.05), (torch.float16, 0.01)])
def test_low_precision_loads_never_overflow(tokenizer, tmp_path, dtype, tolerance):
    model = removed(tokenizer)
    write_export(model, tokenizer, tmp_path / "export", {})
    loaded = load(tmp_path / "export", dtype=dtype)
    assert all(p.dtype == dtype and torch.isfinite(p).all() for p in loaded.model.parameters())
    exact = load(tmp_path / "export").norms
    for name, state in surgery.scale_states(loaded.model).items():  # σ is not rounded to `dtype`
        assert state.sigma.dtype == torch.float32 and float(state.sigma) == exact[name]["sigma"]
    out = logits(loaded.hf(), IDS).float()
    assert torch.isfinite(out).all()
    assert (out - logits(model, IDS)).abs().max() <= tolerance


def test_ordinary_gpt2_loads_with_real_norms(model_dir):
    loaded = load(model_dir)
    assert loaded.stored_as == "plain model" and not any(n["fixed"] for n in loaded.norms.values())
    assert "original norms" in repr(loaded)
    plain = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    assert torch.equal(logits(loaded.hf(), IDS), logits(plain, IDS))
    with pytest.raises(LoadError, match="only fixed-scale norms can be folded"):
        loaded.folded()


def test_folded_model_refuses_save_pretrained(tokenizer, tmp_path):
    write_export(removed(tokenizer), tokenizer, tmp_path / "export", {})
    folded = load(tmp_path / "export").folded()
    assert folded.lm_head.bias is not None and isinstance(folded.transformer.ln_f, torch.nn.Identity)
    with pytest.raises(TypeError, match="cannot be saved"):
        folded.save_pretrained(tmp_path / "folded")
    assert not (tmp_path / "folded").exists()


def test_verify_passes_a_good_export_and_fails_a_corrupted_one(tokenizer, tmp_path):
    write_export(removed(tokenizer), tokenizer, tmp_path / "export", {})
    good = verify(tmp_path / "export", bridge=False)
    assert good["ok"], good["checks"]
    assert good["checks"]["dla_reconstruction"]["max_abs_diff"] <= 1e-4
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    config["layer_norm_epsilon"] = 1e-5  # corrupt: the config no longer says eps 1e12
    (tmp_path / "export" / "config.json").write_text(json.dumps(config))
    bad = verify(tmp_path / "export", bridge=False)
    assert not bad["ok"] and "config eps" in bad["checks"]["transformers.from_pretrained"]["note"]


def test_checkpoints_at_every_stage_load_exactly_in_every_representation(run_config):
    from lnfree.removal.train import run

    result = run(run_config(max_steps=12, save_every=2), progress=False)
    checkpoints = result.output_dir / "checkpoints"
    ids = torch.randint(0, 400, (2, 20), generator=torch.Generator().manual_seed(3))
    stages = {
        "step_000002": (0, True),   # before any removal
        "step_000004": (2, True),   # every ln_2 fixed, ln_1 real
        "step_000006": (4, False),  # mid ln_1: Q/K fixed, V real — no single-input GPT-2 layout
        "step_000010": (6, True),   # everything but ln_f
        "step_000012": (7, True),   # after ln_f: LN-free
    }
    for name, (fixed, bridgeable) in stages.items():
        loaded = load(checkpoints / name)
        assert loaded.stored_as == "lnfree checkpoint"
        assert sum(n["fixed"] for n in loaded.norms.values()) == fixed, name
        reference = logits(loaded.hf(), ids)
        if bridgeable:
            bridge_logits = loaded.bridge()(ids)
            assert (bridge_logits - reference).abs().max() <= 1e-4, name
        else:
            with pytest.raises(LoadError, match="Q/K and V paths differ"):
                loaded.bridge()
        report = verify(checkpoints / name, bridge=bridgeable)
        assert report["ok"], (name, report["checks"])
    final = load(result.output_dir)  # a run folder means its latest checkpoint
    assert final.fully_ln_free and (logits(final.folded(), ids) - logits(final.hf(), ids)).abs().max() <= 1e-4


def test_lnfree_load_is_callable_from_the_package(tiny_ln_free_export):
    import lnfree

    loaded = lnfree.load(tiny_ln_free_export)
    assert isinstance(loaded, LoadedModel) and loaded.fully_ln_free
    assert lnfree.load("tiny").stored_as == "plain model"


def test_a_mixed_published_checkpoint_is_refused_not_guessed(tokenizer, tmp_path):
    folder = write_export(removed(tokenizer), tokenizer, tmp_path / "export", {})
    plain = GPT2LMHeadModel.from_pretrained(folder)
    plain.config.layer_norm_epsilon = 1e-5  # a published file whose config kept the small eps
    with torch.no_grad():
        plain.transformer.h[0].ln_2.weight.fill_(1.0)  # one norm not in the eps-trick format
    plain.save_pretrained(tmp_path / "mixed")
    tokenizer.save_pretrained(tmp_path / "mixed")
    with pytest.raises(LoadError, match="refusing to guess"):
        load(tmp_path / "mixed")


def test_a_folder_holding_lnfree_norms_is_recognised(tokenizer, tmp_path):
    from safetensors.torch import save_model

    model = removed(tokenizer)
    folder = tmp_path / "saved"
    model.config.save_pretrained(folder)  # what save_pretrained of an installed model wrote before it refused
    save_model(model, str(folder / "model.safetensors"))
    tokenizer.save_pretrained(folder)
    with pytest.raises(LoadError, match="saved by save_pretrained"):
        load(folder)


def test_sigma_measurement_starts_from_an_empty_accumulator(tokenizer):
    model = surgery.install(small_gpt2(vocab_size=len(tokenizer)))
    ids = torch.randint(0, len(tokenizer), (4, 32), generator=torch.Generator().manual_seed(1))
    surgery.initialise_sigmas(model, [ids])
    clean = {name: float(s.sigma) for name, s in surgery.scale_states(model).items()}
    model.train()
    with torch.no_grad():
        model(input_ids=ids * 0 + 3)  # a user's no-grad metric in train mode gathers nothing
    for state in surgery.scale_states(model).values():
        state.stats[0] += 1e6  # statistics left over from anything else
        state.stats[1] += 1
    surgery.initialise_sigmas(model, [ids])
    assert {name: float(s.sigma) for name, s in surgery.scale_states(model).items()} == pytest.approx(clean)
