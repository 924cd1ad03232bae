"""Export an LN-free model as a plain `GPT2LMHeadModel` in the eps-trick format, and reload runs.

Eps-trick format (the one shared on the Hub): every fixed-scale norm becomes a LayerNorm with
eps = 1e12 and weight = w · 1e6 / σ, so LN(x) = (x − mean)/sqrt(var + 1e12) · w·1e6/σ, which in
fp32 equals (x − mean)/σ · w + b exactly while var < ~3·10⁴. `config.layer_norm_epsilon` is set
to 1e12 too, because some loaders (TransformerLens) read eps from the config. A block whose
Q/K and V paths froze different σ keeps ln_1 at σ_qk and folds σ_qk/σ_v into the V columns of
`c_attn` (weight and bias), which is exact.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_model
from transformers import AutoTokenizer, GPT2LMHeadModel

from lnfree import __version__, surgery
from lnfree.config import RunConfig
from lnfree.fakeln import ScaleState

EPS_TRICK_EPS = 1e12
EPS_TRICK_SCALE = 1e6
RECORD = "lnfree_removal.json"


class ExportError(ValueError):
    """A model or run that cannot be exported as asked."""


def _set_norm(ln: torch.nn.LayerNorm, weight: torch.Tensor, bias: torch.Tensor, state: ScaleState) -> None:
    if state.wants_context:
        raise ExportError("a special σ (position 0 / EOT) is still active; the eps-trick format cannot hold it")
    with torch.no_grad():
        if state.is_fake:
            ln.eps = EPS_TRICK_EPS
            ln.weight.copy_(weight.double() * EPS_TRICK_SCALE / state.sigma.double())
        else:
            ln.eps = state.eps
            ln.weight.copy_(weight)
        ln.bias.copy_(bias)


def to_eps_trick(model: GPT2LMHeadModel, *, allow_partial: bool = False) -> GPT2LMHeadModel:
    """A plain fp32 `GPT2LMHeadModel` computing what the installed `model` computes.

    Refuses a model with any real norm unless `allow_partial`. A partial export keeps the
    original eps in the config and lists its fixed-scale LayerNorms in
    `config.lnfree_fixed_scale_norms`: plain `from_pretrained` rebuilds every norm with the
    config's eps, so only a loader that reads that list (lnfree's) restores it exactly.
    """
    complete = surgery.is_fully_removed(model)
    if not complete and not allow_partial:
        real = [name for name, s in surgery.scale_states(model).items() if not s.is_fake]
        raise ExportError(f"{len(real)} norms are still real (e.g. {real[0]}); pass allow_partial to export anyway")
    config = copy.deepcopy(model.config)
    config.layer_norm_epsilon = EPS_TRICK_EPS if complete else model.config.layer_norm_epsilon
    plain = GPT2LMHeadModel(config).float().eval()
    wanted = plain.state_dict()
    missing, _ = plain.load_state_dict(
        {k: v.float() for k, v in model.state_dict().items() if k in wanted}, strict=False
    )
    if any(not k.endswith(("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "ln_f.weight", "ln_f.bias"))
           and k != "lm_head.weight" for k in missing):
        raise ExportError(f"weights missing from the model: {missing}")
    for block, plain_block in zip(model.transformer.h, plain.transformer.h):
        qkv = block.attn.c_attn
        if qkv.qk.is_fake != qkv.v.is_fake:
            raise ExportError("a block's ln_1 Q/K and V paths differ (one real, one fake); export after both")
        _set_norm(plain_block.ln_1, qkv.norm_weight, qkv.norm_bias, qkv.qk)
        if qkv.v.wants_context:
            raise ExportError("a special σ (EOT) is still active; the eps-trick format cannot hold it")
        if qkv.qk.is_fake:
            ratio = qkv.qk.sigma.double() / qkv.v.sigma.double()
            split = 2 * qkv.nx
            with torch.no_grad():
                w_v = qkv.weight[:, split:].double()
                attn = plain_block.attn.c_attn
                attn.weight[:, split:].copy_(w_v * ratio)
                attn.bias[split:].copy_(qkv.bias[split:].double() + (1 - ratio) * (qkv.norm_bias.double() @ w_v))
        _set_norm(plain_block.ln_2, block.ln_2.weight, block.ln_2.bias, block.ln_2.state)
    ln_f = model.transformer.ln_f
    _set_norm(plain.transformer.ln_f, ln_f.weight, ln_f.bias, ln_f.state)
    plain.tie_weights()
    if not complete:
        plain.config.lnfree_fixed_scale_norms = [
            name for name, m in plain.named_modules() if isinstance(m, torch.nn.LayerNorm) and m.eps == EPS_TRICK_EPS
        ]
    return plain


def write_export(
    model: GPT2LMHeadModel, tokenizer, out: str | Path, record: dict, *, allow_partial: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write the eps-trick model (safetensors), tokenizer and `lnfree_removal.json` to `out`.

    Written to a temporary folder first and moved into place, so a failure leaves nothing behind.
    The record holds a fingerprint (weights sha256, probe logits) that `lnfree verify` checks.
    """
    from lnfree.verify import export_fingerprint  # lnfree.verify imports this module

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} already exists and is not empty; pass overwrite to replace it")
    plain = to_eps_trick(model, allow_partial=allow_partial)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        full = {
            "lnfree_version": __version__,
            "format": "eps-trick",
            "eps": EPS_TRICK_EPS,
            "weight_scale": EPS_TRICK_SCALE,
            "fully_removed": surgery.is_fully_removed(model),
            "norms": surgery.removal_state(model),
            **record,
            "fingerprint": export_fingerprint(plain, tmp),
        }
        (tmp / RECORD).write_text(json.dumps(full, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def export_run(result, out: str | Path | None = None, *, held_out_ce: dict | None = None) -> Path:
    """Export a finished removal run (`lnfree.train.RunResult`) to `out` (default: its `export/` folder).

    The record holds the run config, the removal events and the held-out CE (by default the run's
    original and LN-free values; pass `held_out_ce` to add e.g. the vanilla control's).
    """
    from transformers import AutoTokenizer

    from lnfree.train import TOKENIZER

    out = Path(out) if out is not None else result.output_dir / "export"
    record = {
        "run_config": json.loads(result.config.model_dump_json()),
        "events": result.events,
        "held_out_ce": held_out_ce or {"original": result.held_out_ce_start, "ln_free": result.held_out_ce_end},
    }
    tokenizer = AutoTokenizer.from_pretrained(result.output_dir / TOKENIZER)
    return write_export(result.model, tokenizer, out, record, overwrite=True)


def load_checkpoint(checkpoint: str | Path) -> tuple[GPT2LMHeadModel, object, RunConfig]:
    """Rebuild the installed model of a training checkpoint: (model, tokenizer, run config)."""
    from transformers import GPT2Config

    from lnfree.train import RUN_CONFIG, TOKENIZER

    checkpoint = Path(checkpoint)
    run_dir = checkpoint.parent.parent
    weights = checkpoint / "model.safetensors"
    if not weights.is_file() or not (run_dir / RUN_CONFIG).is_file():
        raise ExportError(f"{checkpoint} is not an lnfree checkpoint (expected model.safetensors and ../../{RUN_CONFIG})")
    config = RunConfig.model_validate_json((run_dir / RUN_CONFIG).read_text())
    tokenizer = AutoTokenizer.from_pretrained(run_dir / TOKENIZER)
    model = GPT2LMHeadModel(GPT2Config.from_pretrained(checkpoint)).float()
    if config.removal.mode == "remove":
        surgery.install(model, special_pos0=config.removal.special_pos0, special_eot=config.removal.special_eot,
                        eot_token_id=tokenizer.eos_token_id)
    missing, unexpected = load_model(model, weights, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ExportError(f"{weights} does not match the model: missing {missing}, unexpected {unexpected}")
    return model.eval(), tokenizer, config
