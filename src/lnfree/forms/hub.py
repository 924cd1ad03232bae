"""Publishing LN-free exports to the Hugging Face Hub with a model card.

`push` verifies the export (`lnfree.forms.verify`), assembles the exact folder to upload (the export,
a `README.md` model card written through `ModelCard`/`ModelCardData`, and the verify report),
then `create_repo` + `upload_folder`. The token is whatever huggingface_hub finds (login or
`HF_TOKEN`); lnfree never reads, prints or logs it.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import EvalResult, HfApi, ModelCard, ModelCardData

from lnfree.arch import architecture
from lnfree.errors import LnfreeError
from lnfree.forms.export import EPS_TRICK_EPS, RECORD
from lnfree.models.base import HUB_IDS
from lnfree.models.sources import hub_offline, looks_local
from lnfree.forms.verify import verify, write_report

CARD_TEMPLATE = """---
{{ card_data }}
---

# {{ model_name }}

A LayerNorm-free version of {% if base_link %}[{{ base_model }}]({{ base_link }}){% else %}`{{ base_model }}`{% endif %}: every norm's per-token
division was frozen to a fixed scale σ one norm at a time during fine-tuning
([lnfree](https://pypi.org/project/lnfree/), after Heimersheim 2024, arXiv 2409.13710, and
Baroni et al. 2025, arXiv 2507.02559). The model is a plain `{{ model_class }}` in the eps-trick
format: every norm has eps = {{ eps }} and weight = w·√eps/σ, so it computes (x − mean)/σ · w + b
(an RMSNorm: x/σ · w).

## How to load exactly

In fp32, sqrt(m + {{ eps }}) is exactly √eps while the norm input's variance (mean square for
RMSNorm) m is below {{ exact_below }}; the largest m measured at export was {{ peak }}, so the file
reproduces the LN-free model. The config's eps is {{ eps }} too, for loaders that read it there.

- **Plain transformers: fp32 only.** The √eps-scaled norm weights overflow fp16, and bf16 loses the
  exactness of the trick: never load this file in a lower precision with plain transformers.
- **Any dtype: lnfree.** `lnfree.load` reads every σ in fp32, removes the √eps factor and only then
  casts; it also gives the exactly LN-free folded weights and a TransformerLens bridge.
- `lnfree verify {{ repo_id }}` checks a download against the fingerprint recorded at export.
{% if bos %}- **Start every input with `{{ bos }}`.** The fine-tuning only ever showed BOS at position 0 (the
  attention sink): without it an LN-free model of this family can overflow where the original stays
  bounded (`lnfree stress --no-bos` measures it). The tokenizer and TransformerLens prepend it by default.
{% endif %}
```python
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("{{ repo_id }}", dtype=torch.float32)  # exact in fp32 only

import lnfree
loaded = lnfree.load("{{ repo_id }}", dtype=torch.bfloat16)  # any dtype: σ read in fp32, cast last
folded = loaded.folded()                     # exactly LN-free weights, identity norms (in memory)
bridge = loaded.bridge()                     # TransformerLens 4 TransformerBridge, exact
```

## Removal

{{ summary }}

| step | norm | σ |
|---|---|---|
{% for row in events %}| {{ row.step }} | {{ row.slot }} | {{ row.sigma }} |
{% endfor %}
## Verification (`lnfree verify`)

| check | max abs Δ logits |
|---|---|
{% for name, check in checks.items() %}| {{ name }} | {{ check }} |
{% endfor %}
Run configuration: see `lnfree_removal.json` in this repository.
"""


#: lnfree's own models and corpora, which are not on the Hub.
BUNDLED = ("tiny", "realtext")


class PushError(LnfreeError, ValueError):
    """An export that cannot be pushed as asked."""


def is_hub_id(name: str) -> bool:
    """True for a Hub model id (not a bundled model's name, not a local folder)."""
    return name not in BUNDLED and not Path(name).expanduser().exists() and not looks_local(name)


def base_license(base_model: str) -> str | None:
    """The license of the base model: 'mit' for lnfree's bundled models, else from its card."""
    if base_model in BUNDLED:
        return "mit"
    local = Path(base_model) / "README.md"
    try:
        card = ModelCard.load(local) if local.is_file() else ModelCard.load(base_model)
        return card.data.license
    except Exception:  # no card, or no network: the card then says nothing about the license
        return None


def _evaluated_entry(summary: dict, export_dir: Path) -> dict | None:
    """This export's entry in an `lnfree eval` summary: by path, else the only fully LN-free model."""
    entries = summary.get("models", [])
    for entry in entries:
        if Path(str(entry.get("source", ""))).expanduser().resolve() == export_dir.resolve():
            return entry
    ln_free = [e for e in entries if e.get("fully_ln_free")]
    return ln_free[0] if len(ln_free) == 1 else None


def eval_report_results(eval_reports: list[Path], export_dir: Path) -> list[EvalResult]:
    """`model-index` results (mean and median CE) from `lnfree eval` summary.json files."""
    results = []
    for path in eval_reports:
        path = path / "summary.json" if path.is_dir() else path
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise PushError(f"cannot read the eval report {path}: {err}") from err
        entry = _evaluated_entry(summary, export_dir)
        if entry is None:
            raise PushError(f"{path} holds no result for {export_dir} (nor exactly one LN-free model)")
        dataset = summary["dataset"]
        split = f"first {dataset['sequences']} x {dataset['context']} tokens"
        for metric, name in (("mean", "mean cross-entropy (nats)"), ("median", "median per-token cross-entropy (nats)")):
            results.append(EvalResult(
                task_type="text-generation", dataset_type=dataset["source"], dataset_name=dataset["name"],
                dataset_split=split, metric_type="cross_entropy", metric_name=name,
                metric_value=round(entry["ce"][metric], 4)))
    return results


def build_card(export_dir: Path, repo_id: str, report: dict, eval_reports: list[Path] = ()) -> ModelCard:
    """The model card of an export: metadata, schedule and σ table, eval results, load snippets.

    Eval results: the run's held-out CE from the export record, plus every `lnfree eval` report given.
    """
    record = json.loads((export_dir / RECORD).read_text())
    run = record.get("run_config", {})
    base_model = HUB_IDS.get(run.get("model", "unknown"), run.get("model", "unknown"))
    model_config = json.loads((export_dir / "config.json").read_text())
    eps = float(record.get("eps", EPS_TRICK_EPS))
    peak = (record.get("eps_choice") or {}).get("peak_norm_input")
    data_source = run.get("data", {}).get("source", "unknown")
    eval_results = eval_report_results([Path(p) for p in eval_reports], export_dir)
    for name, value in (record.get("held_out_ce") or {}).items():
        if name == "ln_free":
            eval_results.append(EvalResult(
                task_type="text-generation", dataset_type=data_source, dataset_name=f"{data_source} (held-out)",
                dataset_split="held-out", metric_type="cross_entropy", metric_name="held-out cross-entropy (nats)",
                metric_value=round(value, 4)))
    card_data = ModelCardData(
        base_model=None if base_model in BUNDLED else base_model,
        base_model_relation=None if base_model in BUNDLED else "finetune",
        datasets=None if data_source in BUNDLED or Path(data_source).exists() else [data_source],
        license=base_license(base_model),
        pipeline_tag="text-generation",
        library_name="transformers",
        tags=["layernorm-free", "lnfree", model_config.get("model_type", "gpt2"), "interpretability"],
        model_name=repo_id.split("/")[-1],
        eval_results=eval_results or None,
    )
    events = [{"step": e["step"], "slot": e["slot"], "sigma": f"{e['sigma']:.6g}" if "sigma" in e else "—"}
              for e in record.get("events", [])]
    if not events:
        events = [{"step": "—", "slot": name, "sigma": f"{n['sigma']:.6g}"} for name, n in record.get("norms", {}).items()]
    checks = {name: "n/a" if c["max_abs_diff"] is None else f"{c['max_abs_diff']:.2e}" for name, c in report["checks"].items()}
    ce = record.get("held_out_ce") or {}
    summary = (f"Fine-tuned for {run.get('train', {}).get('max_steps', '?')} steps on `{data_source}`. "
               + (" Held-out cross-entropy (nats): " + ", ".join(f"{k} {v:.4f}" for k, v in ce.items()) + "." if ce else ""))
    return ModelCard.from_template(
        card_data, template_str=CARD_TEMPLATE, model_name=card_data.model_name, repo_id=repo_id,
        base_model=base_model, base_link=f"https://huggingface.co/{base_model}" if is_hub_id(base_model) else None,
        events=events, checks=checks,
        summary=summary, model_class=(model_config.get("architectures") or ["a transformers model"])[0],
        eps=f"{eps:.0e}", exact_below=f"{2.0 ** (math.floor(math.log2(eps)) - 24):.3g}",
        peak="not recorded" if peak is None else f"{peak:.3g}",
        bos=_bos_text(export_dir),
    )


def _bos_text(export_dir: Path) -> str | None:
    """The BOS token every input must start with, for a family that reads one (else None)."""
    from transformers import AutoConfig, AutoTokenizer

    if not architecture(AutoConfig.from_pretrained(export_dir)).prepends_bos:
        return None
    return AutoTokenizer.from_pretrained(export_dir).bos_token


def prepare_folder(export_dir: str | Path, repo_id: str, out: str | Path, eval_reports: list[Path] = ()) -> Path:
    """Verify `export_dir` and write the exact folder that would be uploaded to `out`."""
    export_dir, out = Path(export_dir), Path(out)
    if not (export_dir / RECORD).is_file():
        raise PushError(f"{export_dir} is not an lnfree export (no {RECORD}); create one with `lnfree export`")
    report = verify(export_dir)
    if not report["ok"]:
        failed = [name for name, c in report["checks"].items() if not c["ok"]]
        raise PushError(f"{export_dir} fails lnfree verify ({', '.join(failed)}); refusing to push it")
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(export_dir, out, ignore=shutil.ignore_patterns(".*"))
    build_card(export_dir, repo_id, report, eval_reports).save(out / "README.md")
    write_report(report, out / "verify.json")
    return out


def check_hub_access(api: HfApi) -> None:
    """Raise `PushError` (one line: what to do) unless there is a token and the Hub answers to it.

    Checked before anything is verified or uploaded, so that a push without credentials or network
    fails at once instead of deep inside `create_repo`.
    """
    from huggingface_hub import get_token
    from huggingface_hub.errors import HfHubHTTPError

    token = api.token if isinstance(api.token, str) else get_token()
    if not token:
        raise PushError("no Hugging Face token: log in with `hf auth login` (or set HF_TOKEN to a write token); "
                        "--dry-run writes the folder without one")
    if hub_offline():
        raise PushError("the Hugging Face Hub is switched off (HF_HUB_OFFLINE is set): unset it to push, or use --dry-run")
    try:
        api.whoami(token=token)
    except HfHubHTTPError as err:
        status = getattr(err.response, "status_code", None)
        raise PushError(f"the Hugging Face Hub refused the token (HTTP {status}): log in again with `hf auth login` "
                        "or set HF_TOKEN to a valid write token") from None
    except Exception as err:  # no network, DNS, proxy: say so in one line instead of a traceback
        raise PushError(f"cannot reach the Hugging Face Hub at {api.endpoint} ({type(err).__name__}): check the "
                        "network (or HF_ENDPOINT), or use --dry-run") from None


def push(
    export_dir: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    dry_run: bool = False,
    dry_run_dir: str | Path | None = None,
    force: bool = False,
    eval_reports: list[Path] = (),
    api: HfApi | None = None,
) -> str:
    """Publish an export; returns the commit URL, or the dry-run folder's path.

    Refuses an export that fails `verify`, and an existing repo branch that already holds files
    unless `force`; without `api`, first checks the token and that the Hub answers (`check_hub_access`).
    """
    if dry_run:
        folder = Path(dry_run_dir or f"{Path(export_dir).as_posix().rstrip('/')}-hub")
        return str(prepare_folder(export_dir, repo_id, folder, eval_reports))
    if api is None:
        api = HfApi()
        check_hub_access(api)
    with tempfile.TemporaryDirectory() as tmp:
        folder = prepare_folder(export_dir, repo_id, Path(tmp) / "upload", eval_reports)
        api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
        branch = revision or "main"
        if revision and not api.revision_exists(repo_id, revision, repo_type="model"):
            api.create_branch(repo_id, branch=revision, repo_type="model")
        else:
            existing = [f for f in api.list_repo_files(repo_id, revision=branch, repo_type="model") if f != ".gitattributes"]
            if existing and not force:
                raise PushError(f"{repo_id}@{branch} already holds {len(existing)} files; pass --force to overwrite them")
        commit = api.upload_folder(
            repo_id=repo_id, folder_path=folder, revision=revision, repo_type="model",
            commit_message="Upload LN-free model (lnfree)",
        )
    return str(getattr(commit, "commit_url", commit))
