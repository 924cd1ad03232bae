"""`lnfree verify`: check every representation of a checkpoint against lnfree's exact form.

The reference is the fixed-scale model of `lnfree.load` in fp32. Compared with it, on a probe of
real text, BOS, special and repeated tokens and seeded random ids (`lnfree.removal.losses.probe`): the checkpoint
loaded by plain `transformers` exactly as saved (what a user who has never heard of lnfree gets), the folded LN-free weights, the TransformerLens bridge, and the
direct-logit-attribution reconstruction (embeddings + every attention and MLP output, each read
through the unembedding, plus its bias, must sum to the logits; LN-free models only).

These checks only show that the representations agree with each other. An export also records a
fingerprint at export time (sha256 of its weight files, logits of a seeded probe batch), which
`check_fingerprint` compares with the files as they are now: that catches a damaged export.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from lnfree.arch import architecture
from lnfree.forms.export import RECORD, describe_rows, norm_input_peaks, runaway_rows, runaway_summary
from lnfree.files import file_sha256
from lnfree.forms.load import LoadedModel, load
from lnfree.models.base import resolve_model_source
from lnfree.removal.losses.probe import (
    compare_logits, describe_token, logits_fn, probe_logits, probe_rows, special_ids, text_ids,
)

TOLERANCE = 1e-4
PROBE_LENGTH = 64  # tokens per probe row (at most the model's context)


@torch.no_grad()
def dla_reconstruction(folded: nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, Σ direct contributions + unembedding bias) of a folded LN-free model of any family."""
    arch = architecture(folded)
    outputs: list[torch.Tensor] = []
    handles = [
        folded.get_submodule(name).register_forward_hook(
            lambda m, a, out: outputs.append(out[0] if isinstance(out, tuple) else out))
        for name in arch.output_modules()
    ]
    try:
        logits = folded(input_ids=input_ids).logits
    finally:
        for handle in handles:
            handle.remove()
    components = [folded.get_submodule(arch.token_embedding)(input_ids), *outputs]
    if arch.position_embedding is not None:
        positions = torch.arange(input_ids.shape[1])
        components.append(folded.get_submodule(arch.position_embedding)(positions)[None])
    head = folded.get_output_embeddings()
    direct = sum(component @ head.weight.T for component in components)
    return logits, direct + head.bias if head.bias is not None else direct


def within(measured: dict | None, tolerance: float) -> bool:
    """A comparison passes when every logit is within `tolerance` × max(1, its token's logit scale, the
    largest |logit| of that token): absolute for logits up to 1, relative to the token's logits above,
    as fp32 rounds (Gemma 3's large logits round past 1e-4 absolute; a TransformerLens bridge of a
    model with real norms folds and centres its weights, which rounds a near-zero logit like its
    neighbours)."""
    return measured is not None and measured["max_scaled_diff"] <= tolerance


def verify(source: str | Path, *, tolerance: float = TOLERANCE, seed: int = 0, bridge: bool = True) -> dict:
    """Run every check on `source`; returns a JSON-ready report with `ok` overall and per check.

    Every check runs on the same probe (`lnfree.removal.losses.probe.probe_batch`): a real-text row (BOS first when
    the tokenizer has one), seeded random rows, and rows that start with BOS, each special token and
    repeated tokens, where real models put their largest activations. Each check reports the largest
    |Δlogit| and the worst token (its relative error, place and text), and passes `within` the tolerance.
    Rows on which the model itself runs away (`lnfree.forms.export.runaway_rows`: an LN-free gated model on
    rare or repeated tokens) are left out of the comparisons and listed with their kind of input, and
    fail the check `bounded`; a real-text row that runs away also fails the check `real_text`.
    """
    loaded: LoadedModel = load(source)
    config = loaded.model.config
    tokenizer = loaded.tokenizer
    n_positions = loaded.arch.n_positions
    real = text_ids(tokenizer, length=min(PROBE_LENGTH, n_positions or PROBE_LENGTH)) if tokenizer is not None else None
    ids, kinds = probe_rows(config, tokenizer, text_ids=real, length=PROBE_LENGTH, n_positions=n_positions, seed=seed)
    reference = logits_fn(loaded.model)
    checks: dict[str, dict] = {}
    # Rows the model itself runs away on (an LN-free gated model on random tokens) cannot be compared.
    peaks = norm_input_peaks(loaded.model, ids)
    runaway = runaway_rows(peaks)
    runaway_described = describe_rows(ids, runaway, peaks, tokenizer, kinds)
    text_rows = 0 if real is None else 1
    if runaway[:text_rows].any() or runaway.all():
        where = "the real-text row" if runaway[:text_rows].any() else "every probe row"
        checks["real_text"] = {"max_abs_diff": None, "ok": False,
                               "note": f"the model runs away on {where}: no representation is comparable there"}
    if runaway_described:  # a model that overflows on some input is broken there, whatever its forms agree on
        checks["bounded"] = {"max_abs_diff": None, "ok": False, "note": runaway_summary(runaway_described, len(ids))}
    kept = (~runaway).nonzero().flatten()
    ids = ids[kept] if len(kept) else ids

    def record(name: str, measured: dict | None, note: str = "") -> None:
        value = None if measured is None else measured["max_abs_diff"]
        checks[name] = {"max_abs_diff": value, "ok": within(measured, tolerance), "note": note}
        if measured is not None:
            worst = describe_token(ids, measured["worst_token"], tokenizer)
            worst["row"] = int(kept[worst["row"]]) if len(kept) else worst["row"]  # a row of the whole probe
            checks[name].update(max_scaled_diff=measured["max_scaled_diff"],
                                worst_token_relative_error=measured["worst_token_relative_error"], worst_token=worst)

    path = Path(str(source))
    if loaded.stored_as != "lnfree checkpoint" and (path / "config.json").is_file():
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        measured = compare_logits(plain, reference, ids)
        note = "" if within(measured, tolerance) else (
            f"plain transformers loading disagrees (config eps {architecture(plain).eps:g}); "
            "loaders that read eps from the config get wrong logits: load with lnfree.load or fix the config")
        record("transformers.from_pretrained", measured, note)
    if loaded.fully_ln_free:
        folded = loaded.folded()
        record("folded", compare_logits(folded, reference, ids))
        record("dla_reconstruction", compare_logits(lambda x: dla_reconstruction(folded, x)[1], logits_fn(folded), ids))
    if bridge:
        try:
            tl = loaded.bridge()
            record("transformer_lens_bridge", compare_logits(lambda x: tl(x).cpu(), reference, ids))
        except Exception as err:  # the bridge is one check among several: report, do not crash
            record("transformer_lens_bridge", None, f"{type(err).__name__}: {err}")
    fingerprint = check_fingerprint(source, loaded, tolerance)
    return {
        "source": str(source),
        "kind": loaded.stored_as,  # the JSON key of earlier records
        "repr": repr(loaded),
        "tolerance": tolerance,
        "tokens": list(ids.shape),
        "probe": {"real_text_rows": text_rows, "special_ids": special_ids(config, tokenizer),
                  "runaway_rows": runaway_described},
        "seed": seed,
        "norms": loaded.norms,
        "checks": checks,
        "fingerprint": fingerprint,
        "ok": all(c["ok"] for c in checks.values()) and fingerprint["ok"],
    }


def write_report(report: dict, out: str | Path) -> Path:
    """Write a verify report as JSON."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return out


# --- Export fingerprint (`lnfree.removal.losses.probe.export_fingerprint`): detects files changed after export, which
# internal consistency cannot ---


def _source_file(source: str, name: str) -> Path | None:
    """A file of a local folder, bundled model or Hub repo; None when absent or not fetchable."""
    location = Path(resolve_model_source(source))
    if location.exists():
        return location / name if (location / name).is_file() else None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(source, name))
    except Exception:  # absent from the repo, or no network: reported as "no record"
        return None


def _max_abs_diff(now: list, recorded: list) -> float:
    """Largest |now − recorded|, where the same non-finite value on both sides (a model that overflows on
    the probe, as recorded) counts as equal and a non-finite value on one side only as infinite."""
    a, b = (torch.tensor(x, dtype=torch.float64) for x in (now, recorded))
    same = (a == b) | (a.isnan() & b.isnan())
    return torch.where(same, 0.0, (a - b).abs().nan_to_num(nan=float("inf"))).max().item()


def check_fingerprint(source: str | Path, loaded: LoadedModel, tolerance: float = TOLERANCE) -> dict:
    """Compare `source`'s files and probe logits with the fingerprint recorded at export.

    Without a recorded fingerprint (published checkpoints, older exports) nothing is compared and
    the note says that only internal consistency was checked.
    """
    record_path = _source_file(str(source), RECORD)
    fingerprint = json.loads(record_path.read_text()).get("fingerprint") if record_path else None
    if not fingerprint:
        return {"checked": False, "ok": True, "weights": {}, "probe_max_abs_diff": None,
                "note": f"no export fingerprint ({RECORD}): only internal consistency was checked"}
    weights = {}
    for name, expected in fingerprint["weights_sha256"].items():
        path = _source_file(str(source), name)
        weights[name] = "missing" if path is None else ("match" if file_sha256(path) == expected else "changed")
    recorded = fingerprint["probe"]
    now = probe_logits(loaded.model, recorded.get("bos"))  # exports before 2026-11-26 recorded none
    diff = max(_max_abs_diff(now[key], recorded[key]) for key in ("logsumexp", "next_token_logits"))
    problems = [f"{name} {state}" for name, state in weights.items() if state != "match"]
    if diff > tolerance:
        problems.append(f"probe logits differ by {diff:.2e}")
    return {"checked": True, "ok": not problems, "weights": weights, "probe_max_abs_diff": diff,
            "note": "; ".join(problems) or "files and probe logits match the export"}
