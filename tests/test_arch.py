"""Every supported family: install, schedule, export, load, fold, bridge and DLA on tiny random models."""

from __future__ import annotations

import copy

import pytest
import torch
from families import FAMILIES, tiny_family
from transformers import AutoModelForCausalLM, BertConfig, MambaConfig

import lnfree
from lnfree import surgery
from lnfree.analysis.dla import dla_and_direct_effect
from lnfree.arch import UnsupportedModel, architecture
from lnfree.export import write_export

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tokenizer():
    from lnfree.tiny import PRETRAIN_SEED, build_tokenizer, generate_documents

    return build_tokenizer(generate_documents(200, PRETRAIN_SEED))


def ids(vocab: int, seed: int = 1, shape=(3, 12)) -> torch.Tensor:
    return torch.randint(1, vocab, shape, generator=torch.Generator().manual_seed(seed))


def fully_fixed(model: torch.nn.Module, vocab: int) -> torch.nn.Module:
    """Measure σ, make every V path's σ differ from its Q/K path's, and fix every norm."""
    surgery.initialise_sigmas(model, [ids(vocab, seed=2, shape=(4, 16))])
    for name, state in surgery.scale_states(model).items():
        if name.endswith("ln_1v"):
            state.sigma.mul_(1.3)
        state.switch_to_fake()
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_installed_model_equals_the_original_until_switched_and_refuses_save_pretrained(family, tmp_path):
    base = tiny_family(family)
    model = surgery.install(copy.deepcopy(base))
    x = ids(64)
    assert torch.equal(model(input_ids=x).logits, base(input_ids=x).logits)
    slots = list(surgery.scale_states(model))
    arch = architecture(base)
    assert slots[-1] == "ln_f" and len(slots) == 3 * arch.n_layers + 1 + (2 * arch.n_layers if family == "qwen3" else 0)
    fully_fixed(model, 64)
    assert (model(input_ids=x).logits - base(input_ids=x).logits).abs().max() > 1e-3
    with pytest.raises(TypeError, match="write_export"):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_export_load_fold_and_bridge_reproduce_the_ln_free_model(family, tokenizer, tmp_path):
    vocab = len(tokenizer)
    model = fully_fixed(surgery.install(tiny_family(family, vocab_size=vocab)), vocab)
    x = ids(vocab)
    with torch.no_grad():
        reference = model(input_ids=x).logits
    folder = write_export(model, tokenizer, tmp_path / "export", {"note": "test"})

    plain = AutoModelForCausalLM.from_pretrained(folder).eval()  # a user who never heard of lnfree
    with torch.no_grad():
        assert (plain(input_ids=x).logits - reference).abs().max() <= TOLERANCE

    loaded = lnfree.load(folder)
    assert loaded.fully_ln_free and loaded.kind == "lnfree export" and loaded.arch.family == architecture(model).family
    for slot, entry in loaded.norms.items():
        assert entry["sigma"] == pytest.approx(float(surgery.scale_states(model)[slot].sigma), rel=1e-6)
    with torch.no_grad():
        assert (loaded.model(input_ids=x).logits - reference).abs().max() <= TOLERANCE
        folded = loaded.folded()
        assert (folded(input_ids=x).logits - reference).abs().max() <= TOLERANCE
    with pytest.raises(TypeError, match="cannot be saved"):
        folded.save_pretrained(tmp_path / "folded")
    bridge = loaded.bridge()
    with torch.no_grad():
        assert (bridge(x) - reference).abs().max() <= TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_dla_equals_direct_effect_on_the_ln_free_model_only(family, tokenizer, tmp_path):
    vocab = len(tokenizer)
    base = tiny_family(family, vocab_size=vocab)
    x = ids(vocab, shape=(2, 10))
    original = copy.deepcopy(base)
    folder_free = write_export(fully_fixed(surgery.install(base), vocab), tokenizer, tmp_path / "free", {})
    free = dla_and_direct_effect(lnfree.load(folder_free).bridge(), x)
    assert (free.dla - free.de).abs().max() <= 1e-5
    original_folder = tmp_path / "original"
    original.save_pretrained(original_folder)
    tokenizer.save_pretrained(original_folder)
    normed = dla_and_direct_effect(lnfree.load(original_folder).bridge(), x)
    assert (normed.dla - normed.de).abs().max() > 1e-3


def test_unsupported_architectures_get_one_error_naming_the_supported_families(tmp_path):
    for config in (BertConfig(), MambaConfig()):
        with pytest.raises(UnsupportedModel, match="supported families: gpt2 .*llama .*qwen3 .*gpt_neox"):
            architecture(config)
    folder = tmp_path / "bert"
    BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32).save_pretrained(folder)
    from lnfree.models import ModelError, load_base

    with pytest.raises(ModelError, match="supported families"):
        load_base(str(folder))


def test_qwen3_per_head_norms_are_their_own_stage_after_the_v_paths():
    from lnfree.schedule import derive_schedule

    arch = architecture(tiny_family("qwen3"))
    events = derive_schedule(arch.n_layers, stages=arch.stages).check(
        arch.n_layers, 500, slots=[s for site in arch.sites() for s in site.slots])
    kinds = [e.kind for e in events]
    assert kinds.index("q_norm") > max(i for i, k in enumerate(kinds) if k == "ln_1v")
    assert kinds[-1] == "ln_f"
    assert {e.slot for e in events} == {s for site in arch.sites() for s in site.slots}
