"""Every supported family: install, schedule, export, load, fold, bridge and DLA on tiny random models."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from families import FAMILIES, tiny_family
from transformers import AutoModelForCausalLM, BertConfig, MambaConfig

import lnfree
from lnfree.fixedscale import surgery
from lnfree.analysis.dla import dla_and_direct_effect
from lnfree.arch import UnsupportedModel, architecture
from lnfree.forms.export import write_export

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tokenizer():
    from lnfree.data.tiny import PRETRAIN_SEED, build_tokenizer, generate_documents

    return build_tokenizer(generate_documents(200, PRETRAIN_SEED))


def ids(vocab: int, seed: int = 1, shape=(3, 12)) -> torch.Tensor:
    return torch.randint(1, vocab, shape, generator=torch.Generator().manual_seed(seed))


def fully_fixed(model: torch.nn.Module, vocab: int) -> torch.nn.Module:
    """Measure σ, make every V path's σ differ from its Q/K path's, and fix every norm."""
    surgery.initialise_sigmas(model, [ids(vocab, seed=2, shape=(4, 16))])
    for name, state in surgery.scale_states(model).items():
        if name.endswith("ln_1v"):
            state.sigma.mul_(1.3)
        state.switch_to_fixed()
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_every_module_path_the_adapter_names_exists_in_the_model(family):
    model = tiny_family(family)
    arch = architecture(model)
    paths = [arch.final_norm, arch.unembedding, arch.token_embedding, arch.layers]
    paths += [arch.position_embedding] if arch.position_embedding else []
    for layer in range(arch.n_layers):
        paths += [arch.block(layer, name) for name in (arch.attention, arch.attn_out, arch.mlp, *arch.mlp_in, arch.mlp_out)]
    paths += [site.module for site in arch.sites()]
    paths += [consumer.path for site in arch.sites() for consumer in site.consumers]
    for path in paths:
        model.get_submodule(path)  # AttributeError names a path the family does not have
    writers = [model.get_submodule(arch.block(0, name)) for name in (arch.attn_out, arch.mlp_out)]
    assert all(w.weight.shape[-1 if arch.conv1d else 0] == arch.hidden for w in writers)


@pytest.mark.parametrize("family", FAMILIES)
def test_installed_model_equals_the_original_until_switched_and_refuses_save_pretrained(family, tmp_path):
    base = tiny_family(family)
    model = surgery.install(copy.deepcopy(base))
    x = ids(64)
    assert torch.equal(model(input_ids=x).logits, base(input_ids=x).logits)
    slots = list(surgery.scale_states(model))
    arch = architecture(base)
    assert slots[-1] == "ln_f" and len(slots) == {"qwen3": 5, "gemma3": 7, "olmo2": 4}.get(family, 3) * arch.n_layers + 1
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
    fingerprint = json.loads((folder / "lnfree_removal.json").read_text())["fingerprint"]["probe"]
    # BOS first in the fingerprint's probe for the families that always read one (Gemma 3), none else
    assert fingerprint.get("bos") == (model.config.bos_token_id if architecture(model).prepends_bos else None)

    plain = AutoModelForCausalLM.from_pretrained(folder).eval()  # a user who never heard of lnfree
    with torch.no_grad():
        assert (plain(input_ids=x).logits - reference).abs().max() <= TOLERANCE

    loaded = lnfree.load(folder)
    assert loaded.fully_ln_free and loaded.stored_as == "lnfree export" and loaded.arch.family == architecture(model).family
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
    assert (free.dla - free.de).abs().max() <= 1e-5 and free.dla.abs().max() > 1e-3
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
    from lnfree.models.base import ModelError, load_base

    with pytest.raises(ModelError, match="supported families"):
        load_base(str(folder))


def test_qwen3_per_head_norms_are_their_own_stage_after_the_v_paths():
    from lnfree.removal.schedule import derive_schedule

    arch = architecture(tiny_family("qwen3"))
    events = derive_schedule(arch.n_layers, stages=arch.stages).check(
        arch.n_layers, 500, slots=[s for site in arch.sites() for s in site.slots])
    kinds = [e.kind for e in events]
    assert kinds.index("q_norm") > max(i for i, k in enumerate(kinds) if k == "ln_1v")
    assert kinds[-1] == "ln_f"
    assert {e.slot for e in events} == {s for site in arch.sites() for s in site.slots}


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_per_head_norms_get_a_position0_sigma_in_their_own_layout(family):
    """Gemma 3 normalises q/k as (batch, heads, positions, d), Qwen3 as (batch, positions, heads, d): each
    per-head norm's position-0 σ is the mean scale of position 0's heads, and only position 0 divides by it."""
    model = surgery.install(tiny_family(family), special_pos0=True, per_head_pos0=True)
    sites = [site for site in architecture(model).sites() if site.per_head]
    inputs, outputs = {}, {}

    def keep(name):
        def hook(module, args, out):
            inputs[name], outputs[name] = args[0], out
        return hook

    for site in sites:
        model.get_submodule(site.module).register_forward_hook(keep(site.module))
    ids = torch.randint(1, 64, (3, 7))  # 7 positions: unlike the batch and any head count
    surgery.initialise_sigmas(model, [ids])
    for site in sites:
        x = inputs[site.module].float()
        scale = (x.pow(2).mean(-1) + model.get_submodule(site.module).state.eps).sqrt()
        positions = scale.movedim(list(scale.shape).index(7), -1)  # (batch, heads, positions)
        state = model.get_submodule(site.module).state
        assert state.heads_axis == site.heads_axis and state.has_pos0
        torch.testing.assert_close(state.sigma_pos0, positions[..., 0].mean(), rtol=1e-4, atol=0)
        torch.testing.assert_close(state.sigma, positions[..., 1:].mean(), rtol=1e-4, atol=0)
    for state in surgery.scale_states(model).values():
        state.switch_to_fixed()
    with torch.no_grad():
        model(input_ids=ids)
        before = {name: out.clone() for name, out in outputs.items()}
        for site in sites:
            model.get_submodule(site.module).state.sigma_pos0.mul_(2.0)
        model(input_ids=ids)
    for site in sites[:1]:  # the first block's q_norm: its input does not depend on any σ_pos0 of its own block
        ratio = (outputs[site.module] / before[site.module]).movedim(list(scale.shape).index(7), -2)
        torch.testing.assert_close(ratio[..., 0, :], torch.full_like(ratio[..., 0, :], 0.5), rtol=1e-4, atol=1e-5)


def test_gemma3_output_norms_fold_into_their_producers_and_go_last_and_softcapping_is_refused():
    from lnfree.removal.schedule import derive_schedule

    model = tiny_family("gemma3")
    arch = architecture(model)
    post = [site for site in arch.sites() if site.on_output]
    assert [(s.stage, s.consumers[0].path.rsplit(".", 2)[-2:]) for s in post[:2]] == [
        ("post_attn", ["self_attn", "o_proj"]), ("post_mlp", ["mlp", "down_proj"])]
    kinds = [e.kind for e in derive_schedule(arch.n_layers, stages=arch.stages).events(arch.n_layers)]
    assert min(i for i, k in enumerate(kinds) if k.startswith("post_")) > max(
        i for i, k in enumerate(kinds) if k in ("ln_2", "ln_1qk", "ln_1v", "q_norm", "k_norm"))
    config = copy.deepcopy(model.config)
    config.final_logit_softcapping = 30.0
    with pytest.raises(UnsupportedModel, match="final_logit_softcapping"):
        architecture(config)


@pytest.mark.parametrize("family", ["llama", "qwen3", "neox-sequential", "gemma3", "olmo2"])
def test_every_analysis_runs_on_the_family_through_the_cli(family, tokenizer, tmp_path):
    import json

    from typer.testing import CliRunner

    from lnfree.cli import app

    vocab = len(tokenizer)
    base = tiny_family(family, vocab_size=vocab, eos_token_id=tokenizer.eos_token_id)
    original = tmp_path / "original"
    copy.deepcopy(base).save_pretrained(original)
    tokenizer.save_pretrained(original)
    free = write_export(fully_fixed(surgery.install(base), vocab), tokenizer, tmp_path / "free", {})
    out = tmp_path / "analysis"
    result = CliRunner().invoke(app, [
        "analyze", "all", "--models", str(original), str(free), "--labels", "original", "ln_free",
        "--n-sequences", "4", "--length", "16", "--n-prompts", "8", "--n-bootstrap", "10", "--device", "cpu",
        "--out", str(out)])
    assert result.exit_code == 0, result.output
    index = json.loads((out / "index.json").read_text())
    assert set(index["analyses"]) == {"dla", "patching", "entropy-neurons", "residual"}
    dla = index["analyses"]["dla"]["models"]
    assert dla["ln_free"]["heads"]["nmae"] < 1e-5 < dla["original"]["heads"]["nmae"]


def family_run_config(family, tokenizer, tmp_path, **train):
    """A quick run on the tiny corpus that removes every slot of a tiny `family` model."""
    from conftest import quick_run_config

    from lnfree.removal.config import with_overrides

    folder = tmp_path / f"{family}-model"
    model = tiny_family(family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    first, *rest = architecture(model).stages
    stages = [{"kind": first, "start": 2, "gap": 1}] + [{"kind": kind, "gap": 1} for kind in rest]
    stages += [{"kind": "ln_f", "gap": 0}]
    config = quick_run_config(tmp_path / "run", folder, tmp_path / "cache", max_steps=len(stages) * 2 + 8, **train)
    return with_overrides(config, {"removal.schedule": {"stages": stages}})


@pytest.mark.parametrize("family", ["llama", "qwen3", "neox-parallel", "gemma3", "olmo2"])
def test_full_removal_run_removes_every_slot_resumes_exactly_and_exports(family, tokenizer, tmp_path):
    import json
    import shutil

    from lnfree.removal.config import with_overrides
    from lnfree.forms.export import export_run
    from lnfree.removal.train import run

    config = family_run_config(family, tokenizer, tmp_path, save_every=4)
    full = run(config, progress=False)
    assert surgery.is_fully_removed(full.model)
    state = json.loads((full.output_dir / "checkpoints/step_000004/trainer_state.json").read_text())["removal_state"]
    assert 0 < sum(s["fixed"] for s in state.values()) < len(state)  # mid-removal

    moved = tmp_path / "moved"
    shutil.copytree(full.output_dir, moved)
    for later in sorted((moved / "checkpoints").iterdir())[1:]:
        shutil.rmtree(later)
    resumed = run(with_overrides(config, {"output_dir": str(moved)}), resume=True, progress=False)
    assert surgery.removal_state(resumed.model) == surgery.removal_state(full.model)
    assert resumed.held_out_ce_end == pytest.approx(full.held_out_ce_end, rel=1e-6)

    folder = export_run(full)
    x = ids(len(tokenizer))
    full.model.eval()
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        assert (plain(input_ids=x).logits - full.model(input_ids=x).logits).abs().max() <= TOLERANCE


def test_position0_sigmas_at_the_per_head_norms_fade_with_the_others_and_the_export_is_exact(tokenizer, tmp_path):
    from lnfree.removal.config import with_overrides
    from lnfree.forms.export import export_run
    from lnfree.removal.train import run

    config = family_run_config("gemma3", tokenizer, tmp_path, save_every=4)
    stages = [*config.removal.schedule.model_dump()["stages"], {"kind": "pos0_special", "gap": 0, "blend_steps": 3}]
    config = with_overrides(config, {"removal.special_pos0": True, "removal.special_pos0_per_head": True,
                                     "removal.schedule": {"stages": stages},
                                     "train.max_steps": config.train.max_steps + 4})
    full = run(config, progress=False)
    state = json.loads((full.output_dir / "checkpoints/step_000004/trainer_state.json").read_text())["removal_state"]
    assert state["blocks.0.k_norm"]["pos0_active"] and state["blocks.0.q_norm"]["sigma_pos0"] > 0
    assert surgery.is_fully_removed(full.model)
    x = ids(len(tokenizer))
    full.model.eval()
    plain = AutoModelForCausalLM.from_pretrained(export_run(full)).eval()
    with torch.no_grad():
        assert (plain(input_ids=x).logits - full.model(input_ids=x).logits).abs().max() <= TOLERANCE
    with pytest.raises(ValueError, match="special_pos0_per_head needs removal.special_pos0"):
        with_overrides(config, {"removal.special_pos0": False})


@pytest.mark.parametrize("preset, family, depth", [
    ("smollm2-135m", "llama", 30), ("pythia-160m", "neox-parallel", 12), ("qwen3-0.6b", "qwen3", 28),
    ("llama-3.2-1b", "llama", 16),
])
def test_family_presets_remove_every_slot_of_their_model_within_the_run(preset, family, depth):
    from lnfree.removal.config import load_preset

    config = load_preset(preset)
    model_config = tiny_family(family).config
    model_config.num_hidden_layers = depth
    arch = architecture(model_config)
    slots = {s for site in arch.sites() for s in site.slots}
    events = config.removal.schedule.check(depth, config.train.max_steps, slots=slots)
    assert {e.slot for e in events} == slots


def test_export_chooses_eps_from_massive_activations_and_stays_exact(tokenizer, tmp_path):
    import json

    from lnfree.forms.export import choose_eps, to_eps_trick

    vocab = len(tokenizer)
    model = tiny_family("llama", vocab_size=vocab)
    with torch.no_grad():  # a massive activation, as Llama-family models carry at sink tokens
        model.model.embed_tokens.weight[5] *= 2e4
    x = ids(vocab)
    x[:, 3] = 5
    fully_fixed(surgery.install(model), vocab)
    with torch.no_grad():
        reference = model(input_ids=x).logits
    folder = write_export(model, tokenizer, tmp_path / "export", {}, probe=x)
    record = json.loads((folder / "lnfree_removal.json").read_text())
    peak = record["eps_choice"]["peak_norm_input"]
    assert peak > 1e5 and record["eps"] == choose_eps(peak) > 1e12
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    relative = lambda logits: ((logits - reference).norm(dim=-1) / reference.norm(dim=-1)).max()  # noqa: E731
    with torch.no_grad():
        # fp32 rounding through logits of ~1e12 leaves ~1e-5 (the two forms round in different orders)
        assert relative(plain(input_ids=x).logits) <= 1e-4
        naive = to_eps_trick(model, eps=1e12)  # the published eps is not enough here: relative error ~1
        assert relative(naive(input_ids=x).logits) > 1e-2
    for name, param in plain.named_parameters():
        assert torch.isfinite(param).all() and torch.isfinite(param.bfloat16()).all(), name


@pytest.mark.parametrize("family", FAMILIES)
def test_folding_a_few_columns_at_a_time_gives_the_same_weights(family, monkeypatch):
    """`fold` reads each column before it writes it, a block of columns at a time (no copy of a whole
    vocabulary-sized head): blocks of 3 columns give the weights one block gives, bit for bit, and the
    installed model is left as it was."""
    import lnfree.forms.fold as fold_module

    model = fully_fixed(surgery.install(tiny_family(family, vocab_size=50)), 50)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    whole = fold_module.fold(model).state_dict()
    monkeypatch.setattr(fold_module, "FOLD_CHUNK", 3)
    blocks = fold_module.fold(model).state_dict()
    assert set(blocks) == set(whole)
    for name, value in whole.items():
        assert torch.equal(blocks[name], value), name
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
