"""Publishing: the dry-run folder, the model card, and the Hub calls (network calls replaced)."""

from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from transformers import AutoTokenizer

from lnfree.fixedscale import surgery
from lnfree.forms.export import write_export
from lnfree.forms.export import RECORD
from lnfree.forms.hub import PushError, build_card, push
from lnfree.forms.verify import verify


@pytest.fixture
def export(tmp_path, model_dir):
    from conftest import small_gpt2

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = surgery.install(small_gpt2(n_layer=2, vocab_size=len(tokenizer)))
    surgery.initialise_sigmas(model, [torch.randint(0, len(tokenizer), (2, 16))])
    events = []
    for step, (name, state) in enumerate(surgery.scale_states(model).items()):
        state.switch_to_fixed()
        events.append({"step": step, "slot": name, "sigma": float(state.sigma)})
    record = {"run_config": {"model": "tiny", "data": {"source": "tiny"}, "train": {"max_steps": 9}},
              "events": events, "held_out_ce": {"original": 1.5, "ln_free": 1.49, "vanilla": 1.48}}
    return write_export(model, tokenizer, tmp_path / "export", record)


class RecordingApi(HfApi):
    """HfApi with every network call replaced by a recorder."""

    def __init__(self, existing_files=(), branch_exists=True):
        super().__init__(token=False)
        self.calls = []
        self.existing_files = list(existing_files)
        self.branch_exists = branch_exists

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def revision_exists(self, repo_id, revision, **kwargs):
        self.calls.append(("revision_exists", repo_id, revision))
        return self.branch_exists

    def create_branch(self, repo_id, **kwargs):
        self.calls.append(("create_branch", repo_id, kwargs))

    def list_repo_files(self, repo_id, **kwargs):
        self.calls.append(("list_repo_files", repo_id, kwargs))
        return [".gitattributes", *self.existing_files]

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs["repo_id"], kwargs))
        self.uploaded = sorted(p.name for p in kwargs["folder_path"].iterdir())
        return "https://huggingface.co/user/tiny-lnfree/commit/abc"


def test_dry_run_folder_passes_verify_and_its_card_round_trips(export, tmp_path):
    folder = push(export, "user/tiny-lnfree", dry_run=True, dry_run_dir=tmp_path / "upload")
    assert verify(folder)["ok"]
    card = ModelCard.load(tmp_path / "upload" / "README.md")
    assert "layernorm-free" in card.data.tags and card.data.pipeline_tag == "text-generation"
    assert card.data.license == "mit"
    assert card.data.eval_results[0].metric_value == pytest.approx(1.49)
    assert "AutoModelForCausalLM.from_pretrained(\"user/tiny-lnfree\", dtype=torch.float32)" in card.text
    assert "plain `GPT2LMHeadModel` in the eps-trick" in card.text and "eps = 1e+12" in card.text
    assert card.data.base_model is None and "base_model_relation" not in card.data.to_dict()
    assert "blocks.1.ln_1v" in card.text and "dla_reconstruction" in card.text
    assert json.loads((tmp_path / "upload" / "verify.json").read_text())["ok"]


def test_push_creates_repo_and_uploads_the_verified_folder(export):
    api = RecordingApi()
    url = push(export, "user/tiny-lnfree", private=True, api=api)
    names = [c[0] for c in api.calls]
    assert names == ["create_repo", "list_repo_files", "upload_folder"]
    assert api.calls[0][2] == {"private": True, "repo_type": "model", "exist_ok": True}
    assert api.calls[2][2]["revision"] is None and "README.md" in api.uploaded and "model.safetensors" in api.uploaded
    assert url.endswith("/commit/abc")


def test_push_refuses_to_overwrite_a_branch_without_force(export):
    with pytest.raises(PushError, match="--force"):
        push(export, "user/tiny-lnfree", api=RecordingApi(existing_files=["model.safetensors"]))
    api = RecordingApi(existing_files=["model.safetensors"])
    push(export, "user/tiny-lnfree", force=True, api=api)
    assert api.calls[-1][0] == "upload_folder"


def test_push_to_a_new_branch_creates_it(export):
    api = RecordingApi(branch_exists=False)
    push(export, "user/tiny-lnfree", revision="step-300", api=api)
    assert ("create_branch", "user/tiny-lnfree", {"branch": "step-300", "repo_type": "model"}) in api.calls
    assert api.calls[-1][2]["revision"] == "step-300"


def test_push_refuses_an_export_that_fails_verify(export):
    config = json.loads((export / "config.json").read_text())
    config["layer_norm_epsilon"] = 1e-5
    (export / "config.json").write_text(json.dumps(config))
    api = RecordingApi()
    with pytest.raises(PushError, match="fails lnfree verify"):
        push(export, "user/tiny-lnfree", api=api)
    assert api.calls == []


def test_eval_reports_become_model_index_results(export, tmp_path):
    from lnfree.evaluate import evaluate, write_report

    report = evaluate([str(export)], "tiny", labels=["ln_free"], n_sequences=4, context=32, n_resamples=10,
                      cache_dir=str(tmp_path / "cache"))
    write_report(report, tmp_path / "eval")
    folder = push(export, "user/tiny-lnfree", dry_run=True, dry_run_dir=tmp_path / "upload", eval_reports=[tmp_path / "eval"])
    card = ModelCard.load(tmp_path / "upload" / "README.md")
    assert folder == str(tmp_path / "upload")
    mean = json.loads((tmp_path / "eval" / "summary.json").read_text())["models"][0]["ce"]["mean"]
    by_name = {r.metric_name: r for r in card.data.eval_results}
    assert by_name["mean cross-entropy (nats)"].metric_value == pytest.approx(mean, abs=1e-4)
    assert by_name["mean cross-entropy (nats)"].dataset_name == "tiny"
    with pytest.raises(PushError, match="cannot read the eval report"):
        push(export, "user/tiny-lnfree", dry_run=True, dry_run_dir=tmp_path / "u2", eval_reports=[tmp_path / "missing.json"])


def test_card_of_a_fine_tune_names_the_relation_and_its_load_snippet_runs_exactly(export):
    record = json.loads((export / RECORD).read_text())
    record["run_config"]["model"] = "openai-community/gpt2"
    (export / RECORD).write_text(json.dumps(record))
    card = build_card(export, str(export), verify(export, bridge=False))
    assert card.data.base_model == "openai-community/gpt2" and card.data.base_model_relation == "finetune"
    section = card.text.split("## How to load exactly")[1].split("## Removal")[0]
    assert "fp32 only" in section and "Any dtype" in section
    namespace: dict = {}
    exec(section.split("```python")[1].split("```")[0], namespace)  # the snippet, on the local export
    ids = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = namespace["model"](input_ids=ids).logits
        reference = namespace["lnfree"].load(export).model(input_ids=ids).logits
    assert (plain - reference).abs().max() <= 1e-4
    assert namespace["loaded"].model.dtype == torch.bfloat16


def test_bundled_models_are_mit_licensed_and_not_named_as_hub_base_models():
    from lnfree.forms.hub import base_license

    assert base_license("tiny") == base_license("realtext") == "mit"


def test_the_card_links_the_base_model_only_when_it_is_a_hub_id(export, tmp_path):
    record = json.loads((export / RECORD).read_text())
    checks = verify(export, bridge=False)  # once: the card's links come from the record, not from the checks
    for model, linked in (("openai-community/gpt2", True), (str(tmp_path), False), ("tiny", False)):
        record["run_config"]["model"] = model
        (export / RECORD).write_text(json.dumps(record))
        text = build_card(export, "user/x", checks).text
        assert ("https://huggingface.co/" + model in text) == linked, model
        assert f"A LayerNorm-free version of {'[' if linked else '`'}{model}" in text


def test_the_card_asks_for_bos_only_where_the_family_reads_one(export, tmp_path):
    from families import tiny_family
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from lnfree.forms.hub import _bos_text

    assert _bos_text(export) is None
    assert "Start every input with" not in build_card(export, "user/x", verify(export, bridge=False)).text
    folder = tmp_path / "gemma"
    tiny_family("gemma3").config.save_pretrained(folder)
    vocab = {"<pad>": 0, "<bos>": 1, "a": 2}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")),
                            bos_token="<bos>").save_pretrained(folder)
    assert _bos_text(folder) == "<bos>"
