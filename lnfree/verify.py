"""`lnfree verify`: check every representation of a checkpoint against lnfree's exact form.

The reference is the fixed-scale model of `lnfree.load` in fp32. Compared with it, on seeded
sample tokens: the checkpoint loaded by plain `transformers` exactly as saved (what a user who
has never heard of lnfree gets), the folded LN-free weights, the TransformerLens bridge, and the
direct-logit-attribution reconstruction (embeddings + every attention and MLP output, each read
through the unembedding, plus its bias, must sum to the logits; LN-free models only).

These checks only show that the representations agree with each other. An export also records a
fingerprint at export time (sha256 of its weight files, logits of a seeded probe batch), which
`check_fingerprint` compares with the files as they are now: that catches a damaged export.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from lnfree.arch import architecture
from lnfree.export import RECORD
from lnfree.load import LoadedModel, load
from lnfree.models import resolve_model_source

TOLERANCE = 1e-4


def sample_tokens(vocab_size: int, n_positions: int, n_sequences: int = 4, length: int = 32, seed: int = 0) -> torch.Tensor:
    """Seeded random token ids (n_sequences, min(length, n_positions))."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n_sequences, min(length, n_positions)), generator=generator)


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


def worst_token_relative_error(logits: torch.Tensor, reference: torch.Tensor) -> tuple[float, int]:
    """The largest per-token ‖logits − reference‖ / ‖reference‖ and the position where it occurs."""
    error = (logits.double() - reference.double()).norm(dim=-1) / reference.double().norm(dim=-1).clamp_min(1e-30)
    worst = int(error.argmax())
    return float(error.flatten()[worst]), worst % error.shape[-1]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def verify(source: str | Path, *, tolerance: float = TOLERANCE, seed: int = 0, bridge: bool = True) -> dict:
    """Run every check on `source`; returns a JSON-ready report with `ok` overall and per check."""
    loaded: LoadedModel = load(source)
    config = loaded.model.config
    ids = sample_tokens(config.vocab_size, loaded.arch.n_positions or 32, seed=seed)
    with torch.no_grad():
        reference = loaded.model(input_ids=ids).logits
    checks: dict[str, dict] = {}

    def record(name: str, value: float | None, note: str = "") -> None:
        checks[name] = {"max_abs_diff": value, "ok": value is not None and value <= tolerance, "note": note}

    path = Path(str(source))
    if loaded.kind != "lnfree checkpoint" and (path / "config.json").is_file():
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = plain(input_ids=ids).logits
        diff = _max_diff(logits, reference)
        note = "" if diff <= tolerance else (
            f"plain transformers loading disagrees (config eps {architecture(plain).eps:g}); "
            "loaders that read eps from the config get wrong logits: load with lnfree.load or fix the config")
        record("transformers.from_pretrained", diff, note)
        error, position = worst_token_relative_error(logits, reference)
        checks["transformers.from_pretrained"].update(worst_token_relative_error=error, worst_token_position=position)
    if loaded.fully_ln_free:
        folded = loaded.folded()
        logits, direct = dla_reconstruction(folded, ids)
        record("folded", _max_diff(logits, reference))
        record("dla_reconstruction", _max_diff(direct, logits))
    if bridge:
        try:
            tl = loaded.bridge()
            with torch.no_grad():
                record("transformer_lens_bridge", _max_diff(tl(ids), reference))
        except Exception as err:  # the bridge is one check among several: report, do not crash
            record("transformer_lens_bridge", None, f"{type(err).__name__}: {err}")
    fingerprint = check_fingerprint(source, loaded, tolerance)
    return {
        "source": str(source),
        "kind": loaded.kind,
        "repr": repr(loaded),
        "tolerance": tolerance,
        "tokens": list(ids.shape),
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


# --- Export fingerprint: detects files changed after export, which internal consistency cannot ---

PROBE_SEED = 1234
PROBE_SHAPE = (2, 16)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@torch.no_grad()
def probe_logits(model: nn.Module) -> dict[str, list]:
    """Summary of `model`'s fp32 logits on the seeded probe batch: per-position logsumexp and next-token logits."""
    ids = sample_tokens(model.config.vocab_size, architecture(model).n_positions or 32, *PROBE_SHAPE, seed=PROBE_SEED)
    logits = model(input_ids=ids).logits.double()
    return {
        "logsumexp": logits.logsumexp(-1).tolist(),
        "next_token_logits": logits[:, :-1].gather(-1, ids[:, 1:, None])[..., 0].tolist(),
    }


def export_fingerprint(model: nn.Module, folder: Path) -> dict:
    """What `lnfree verify` checks an export against: sha256 of its weight files and `probe_logits`."""
    return {
        "weights_sha256": {f.name: _sha256(f) for f in sorted(Path(folder).glob("*.safetensors"))},
        "probe": {"seed": PROBE_SEED, "shape": list(PROBE_SHAPE), **probe_logits(model)},
    }


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
        weights[name] = "missing" if path is None else ("match" if _sha256(path) == expected else "changed")
    recorded = fingerprint["probe"]
    now = probe_logits(loaded.model)
    diff = max(
        (torch.tensor(now[key], dtype=torch.float64) - torch.tensor(recorded[key], dtype=torch.float64)).abs().max().item()
        for key in ("logsumexp", "next_token_logits")
    )
    problems = [f"{name} {state}" for name, state in weights.items() if state != "match"]
    if diff > tolerance:
        problems.append(f"probe logits differ by {diff:.2e}")
    return {"checked": True, "ok": not problems, "weights": weights, "probe_max_abs_diff": diff,
            "note": "; ".join(problems) or "files and probe logits match the export"}
