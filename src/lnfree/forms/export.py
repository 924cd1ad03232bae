"""Export an LN-free model as a plain transformers model in the eps-trick format, and reload runs.

Eps-trick format (the one shared on the Hub for GPT-2): every fixed-scale norm becomes a real norm
with a huge eps E and weight w·√E/σ, so LN(x) = (x − mean)/sqrt(var + E) · w·√E/σ (RMSNorm alike,
without centring), which in fp32 equals (x − mean)/σ · w + b exactly while var + E rounds to E,
i.e. while the input's variance (mean square for RMSNorm) m stays below half an ulp of E
(E·2⁻²⁴). E is chosen per export from the largest m measured at any norm input (position 0 and
EOT included) with a safety factor `EPS_SAFETY`; GPT-2 keeps E = 10¹² (weights ×10⁶, the
published format) wherever that is exact. The config's eps field is set to E too, because plain
`from_pretrained` and TransformerLens read eps from the config. An attention-input norm whose Q/K
and V paths froze different σ keeps σ_qk and folds σ_qk/σ_v into the V columns of its consumers
(weight and bias), which is exact. Probe rows on which the LN-free model itself runs away (a norm
input beyond what any fp32 eps can hold, through gated MLPs) are left out of the eps choice and the
check and listed in the record with the kind of input each row is (random ids, BOS and a repeated
token, a special token, ...); such a model is broken on those inputs, so the export is refused unless
`allow_runaway` (CLI: `--allow-runaway`), and real text that runs away is always refused.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_model
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lnfree import __version__

from lnfree.errors import LnfreeError
from lnfree.fixedscale import surgery
from lnfree.arch import architecture
from lnfree.arch.base import in_out, set_norm_eps, v_mask
from lnfree.fixedscale.functional import second_moment
from lnfree.fixedscale.state import ScaleState
from lnfree.removal.config import RunConfig
from lnfree.removal.layout import EXPORT, RUN_CONFIG, TOKENIZER
from lnfree.removal.losses.massive import NEURONS_FILE
from lnfree.removal.losses.probe import RELATIVE_TOLERANCE, compare_logits, describe_token, export_fingerprint, probe_rows

EPS_TRICK_EPS = 1e12
EPS_SAFETY = 2.0  # the largest measured m times this must stay below E·2⁻²⁴
RECORD = "lnfree_removal.json"
logger = logging.getLogger("lnfree")


class ExportError(LnfreeError, ValueError):
    """A model or run that cannot be exported as asked."""


class RunawayError(ExportError):
    """The model overflows on some probe rows (not real text): refused unless `allow_runaway`."""


#: The largest eps an export writes: the config's eps and mean(x²) + eps must be finite in fp32 (largest 3.4e38).
MAX_EPS = 1e38
#: A norm input beyond this variance (mean square) is beyond any fp32 eps-trick export (exact needs eps above
#: 1e38): a probe row that reaches it is one the LN-free model itself runs away on.
RUNAWAY_PEAK = 2.0 ** (math.floor(math.log2(MAX_EPS)) - 24) / EPS_SAFETY


def choose_eps(peak: float | None) -> float:
    """The smallest power of ten ≥ 10¹² for which `peak` (the largest norm-input variance or mean
    square measured) times `EPS_SAFETY` is below half an ulp of eps in fp32, so the trick is exact."""
    eps = EPS_TRICK_EPS
    while peak is not None and peak * EPS_SAFETY > 2.0 ** (math.floor(math.log2(eps)) - 24):
        eps *= 10
        if eps > MAX_EPS:
            raise ExportError(
                f"a norm input reaches a variance (mean square) of {peak:.3g}: an exact eps-trick export would need "
                f"eps above {MAX_EPS:g}, beyond fp32; such a model cannot be exported "
                "in the plain format (lnfree.load and the installed model stay exact)"
            )
    return eps


def eps_trick_error(peak: float, eps: float) -> float:
    """Worst relative error of an eps-trick norm whose input has variance (mean square) `peak`."""
    exact = peak < 2.0 ** (math.floor(math.log2(eps)) - 24)
    return 0.0 if exact else 1.0 - 1.0 / math.sqrt(1.0 + peak / eps)


@torch.no_grad()
def norm_input_peaks(model: nn.Module, ids: torch.Tensor, batch_size: int = 4) -> dict[str, torch.Tensor]:
    """Per slot and row of `ids`, the largest per-token variance (LayerNorm) or mean square (RMSNorm)
    of the norm's input, every position included (the eps-trick's worst case); fp64, on the CPU."""
    arch = architecture(model)
    peaks: dict[str, list[torch.Tensor]] = {}
    handles = []
    for slots, module in surgery.norm_input_modules(model):
        def hook(mod, args, slots=slots):
            m = second_moment(args[0].detach().double(), arch.norm_kind).nan_to_num(nan=math.inf)
            for slot in slots:
                peaks.setdefault(slot, []).append(m.reshape(m.shape[0], -1).amax(1).cpu())  # per row
        handles.append(module.register_forward_pre_hook(hook))
    was_training = model.training
    model.eval()
    try:
        for input_ids in ids.split(batch_size):
            model(input_ids=input_ids.to(next(model.parameters()).device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return {slot: torch.cat(rows) for slot, rows in peaks.items()}


def runaway_rows(peaks: dict[str, torch.Tensor]) -> torch.Tensor:
    """Which rows (bool) reach a norm input no eps-trick export can hold (`RUNAWAY_PEAK`): inputs
    on which the LN-free model itself runs away (a gated MLP's answer grows quadratically with its
    input, so a token far out of distribution can grow block after block until fp32 overflows)."""
    return torch.stack(list(peaks.values())).amax(0) > RUNAWAY_PEAK


def describe_rows(ids: torch.Tensor, rows: torch.Tensor, peaks: dict[str, torch.Tensor], tokenizer=None,
                  kinds: list[str] | None = None) -> list[dict]:
    """JSON-ready: each row of `rows` (bool) with what kind of input it is (`lnfree.removal.losses.probe.probe_rows`), its
    first tokens and its largest norm input."""
    out = []
    for row in rows.nonzero().flatten().tolist():
        start = ids[row, :3].tolist()
        peak = float(max(p[row] for p in peaks.values()))
        entry = {"row": row, **({"kind": kinds[row]} if kinds is not None else {}), "first_tokens": start,
                 "peak_norm_input": peak if math.isfinite(peak) else "overflow"}
        if tokenizer is not None:
            entry["first_text"] = [tokenizer.decode([t]) for t in start]
        out.append(entry)
    return out


BLENDING = "a norm is part-way through a gradual removal; export once its blend has ended"


def _set_norm(norm: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, state: ScaleState, eps: float,
              offset: float = 0.0) -> None:
    """Write an installed norm (effective `weight`) into the plain `norm`, which multiplies by offset + its weight."""
    if state.wants_context:
        raise ExportError("a special σ (position 0 / EOT) is still active; the eps-trick format cannot hold it")
    if state.is_blending:
        raise ExportError(BLENDING)
    with torch.no_grad():
        if state.is_fixed:
            set_norm_eps(norm, eps)
            norm.weight.copy_(weight.double() * math.sqrt(eps) / state.sigma.double() - offset)
        else:
            set_norm_eps(norm, state.eps)
            norm.weight.copy_(weight.double() - offset)
        if bias is not None:
            norm.bias.copy_(bias)


@torch.no_grad()
def _fold_v_ratio(plain: nn.Module, site, split, arch) -> None:
    """Keep ln_1 at σ_qk and fold σ_qk/σ_v into the V columns of its consumers (exact)."""
    ratio = split.qk.sigma.double() / split.v.sigma.double()
    for consumer in site.consumers:
        proj = plain.get_submodule(consumer.path)
        scale_v_columns(proj, in_out(proj.weight, arch.conv1d), consumer.v_columns, ratio, split.bias)


def scale_v_columns(proj: nn.Module, weight: torch.Tensor, v_columns, ratio, norm_bias: torch.Tensor | None) -> None:
    """Multiply the V columns of a consumer of a split norm by `ratio` (`weight`: its (in, out) view) and
    move (1 − ratio)·(norm bias @ W_V) into its bias, in fp64: what an export does with σ_qk/σ_v, so the
    V path may divide by σ_qk; `lnfree.forms.load` undoes it with 1/ratio."""
    columns = v_mask(v_columns, weight.shape[1]).to(weight.device)
    if not columns.any():
        return
    w_v = weight[:, columns].double()
    if norm_bias is not None:
        if proj.bias is None:
            raise ExportError("a consumer without a bias cannot absorb the V-path σ ratio")
        proj.bias[columns] += ((1 - ratio) * (norm_bias.double() @ w_v)).to(proj.bias.dtype)
    weight[:, columns] = (w_v * ratio).to(weight.dtype)


def to_eps_trick(model: nn.Module, *, eps: float = EPS_TRICK_EPS, allow_partial: bool = False) -> nn.Module:
    """A plain fp32 transformers model computing what the installed `model` computes.

    Refuses a model with any real norm unless `allow_partial`. A partial export keeps the
    original eps in the config and lists its fixed-scale norms in `config.lnfree_fixed_scale_norms`:
    plain `from_pretrained` rebuilds every norm with the config's eps, so only a loader that reads
    that list (lnfree's) restores it exactly.
    """
    arch = architecture(model)
    complete = surgery.is_fully_removed(model)
    if not complete and not allow_partial:
        real = [name for name, s in surgery.scale_states(model).items() if not s.is_fixed]
        raise ExportError(f"{len(real)} norms are still real (e.g. {real[0]}); pass allow_partial=True "
                          "(CLI: --allow-partial) to export anyway")
    config = copy.deepcopy(model.config)
    if complete:
        arch.set_eps(config, eps)
        config.lnfree_original_eps = arch.eps
    plain = surgery.original_class(model)(config).float().eval()
    wanted = plain.state_dict()
    missing, _ = plain.load_state_dict({k: v.float() for k, v in model.state_dict().items() if k in wanted}, strict=False)
    tied = set(getattr(plain, "_tied_weights_keys", None) or {})
    if [k for k in missing if k not in tied]:
        raise ExportError(f"weights missing from the model: {missing}")
    fixed_names = []
    for site in arch.sites():
        installed = model.get_submodule(site.module)
        norm = plain.get_submodule(site.module)
        state = installed.qk if site.split else installed.state
        if site.split:
            if installed.qk.is_fixed != installed.v.is_fixed:
                raise ExportError(f"{site.module}: the Q/K and V paths differ (one real, one fixed); export after both")
            if installed.v.wants_context:
                raise ExportError("a special σ (EOT) is still active; the eps-trick format cannot hold it")
            if installed.v.is_blending:
                raise ExportError(BLENDING)
        _set_norm(norm, installed.weight, installed.bias, state, eps, arch.norm_weight_offset)
        if site.split and state.is_fixed:
            _fold_v_ratio(plain, site, installed, arch)
        if state.is_fixed:
            fixed_names.append(site.module)
    if arch.tied:
        plain.tie_weights()
    if not complete:
        plain.config.lnfree_fixed_scale_norms = fixed_names
        plain.config.lnfree_fixed_scale_eps = eps
    return plain


def write_export(
    model: nn.Module, tokenizer, out: str | Path, record: dict, *, allow_partial: bool = False,
    overwrite: bool = False, probe: torch.Tensor | None = None, allow_runaway: bool = False,
) -> Path:
    """Write the eps-trick model (safetensors), tokenizer and `lnfree_removal.json` to `out`.

    The eps is chosen from the largest norm-input variance measured on a probe (`lnfree.removal.losses.probe`:
    `probe`, i.e. real held-out ids when the run has them, plus rows with BOS, every special token,
    repeated tokens and random ids). A complete export is then reloaded by plain `transformers` and
    its logits measured against the installed model on that probe; eps is raised tenfold until the
    worst token's relative error is within `RELATIVE_TOLERANCE`, else the export is refused. The
    record holds the measured error and its token. Written to a temporary folder first and moved
    into place, so a failure leaves nothing behind. The record also holds a fingerprint (weights
    sha256, probe logits) that `lnfree verify` checks.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} already exists and is not empty; pass overwrite=True (CLI: --overwrite) to replace it")
    ids, rows, runaway, kept = _probed(model, tokenizer, probe, allow_runaway)
    peaks = {slot: float(value.max()) for slot, value in rows.items()}
    peak = max(peaks.values())
    eps = choose_eps(peak)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # not tempfile.mkdtemp: its 0700 would stay on the export
    try:
        plain, eps, measured = _write_checked(model, tmp, ids, eps, allow_partial)
        tokenizer.save_pretrained(tmp)
        full = {
            "lnfree_version": __version__,
            "format": "eps-trick",
            "eps": eps,
            "weight_scale": math.sqrt(eps),
            "eps_choice": {"peak_norm_input": peak, "safety": EPS_SAFETY, "probe_tokens": list(ids.shape),
                           "real_text_rows": 0 if probe is None else len(probe), "runaway_rows": runaway,
                           "bound_relative_error": eps_trick_error(peak, eps), "peak_by_slot": peaks,
                           **_measured_record(measured, ids, tokenizer, kept)},
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


def probe_refusal(model: nn.Module, tokenizer, probe: torch.Tensor | None = None) -> str | None:
    """Why `write_export` would refuse `model` on its probe rows (some row runs away), or None where it would not."""
    try:
        _probed(model, tokenizer, probe, allow_runaway=False)
    except ExportError as err:
        return str(err)
    return None


def _probed(model: nn.Module, tokenizer, probe: torch.Tensor | None, allow_runaway: bool):
    """The export's probe rows measured: `_without_runaway_rows` of their norm-input peaks."""
    ids, kinds = probe_rows(model.config, tokenizer, text_ids=probe, n_positions=architecture(model).n_positions)
    return _without_runaway_rows(ids, norm_input_peaks(model, ids), kinds, tokenizer, allow_runaway)


def runaway_summary(described: list[dict], total: int) -> str:
    """One line: how many probe rows run away, and which kinds of input they are."""
    kinds = [r.get("kind", "?") + f" ({', '.join(map(repr, r['first_text']))}…)" if "first_text" in r else r.get("kind", "?")
             for r in described]
    return f"the model runs away on {len(described)} of {total} probe rows: {'; '.join(kinds)}"


def _without_runaway_rows(ids: torch.Tensor, rows: dict[str, torch.Tensor], kinds: list[str], tokenizer,
                          allow_runaway: bool = False):
    """The probe without the rows the model itself runs away on (those are reported, not compared: no
    representation can match an overflow); refuses when real text runs away, and when anything does
    unless `allow_runaway`."""
    runaway = runaway_rows(rows)
    described = describe_rows(ids, runaway, rows, tokenizer, kinds)
    text = torch.tensor([kind == "real text" for kind in kinds])
    if (runaway & text).any() or runaway.all():
        where = "real held-out text" if (runaway & text).any() else "every probe row"
        raise ExportError(
            f"a norm input reaches a variance (mean square) above {RUNAWAY_PEAK:.3g} on {where}: an exact eps-trick "
            f"export would need eps above {MAX_EPS:g}, beyond fp32; such a model cannot be exported in the plain "
            "format (lnfree.load and the installed model stay exact)")
    if described:
        message = runaway_summary(described, len(ids))
        if not allow_runaway:
            raise RunawayError(f"{message}. A model that overflows on such input is broken there (`lnfree stress` "
                              "measures how often); pass --allow-runaway (allow_runaway=True) to export it anyway")
        logger.warning("%s (not compared)", message)
    return ids[~runaway], {slot: value[~runaway] for slot, value in rows.items()}, described, (~runaway).nonzero()[:, 0]


def _write_checked(model: nn.Module, folder: Path, ids: torch.Tensor, eps: float, allow_partial: bool):
    """Save the eps-trick model to `folder`, reload it with plain transformers and measure it on `ids`
    (complete exports only), raising eps tenfold while the worst token is beyond tolerance.
    Returns (plain model, eps, measurement or None)."""
    was_training = model.training
    model.eval()
    try:
        while True:
            plain = to_eps_trick(model, eps=eps, allow_partial=allow_partial)
            plain.save_pretrained(folder, safe_serialization=True)
            if not surgery.is_fully_removed(model):  # plain transformers rebuilds every norm with one eps
                return plain, eps, None
            reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            measured = compare_logits(reloaded.to(next(model.parameters()).device), model, ids)
            if measured["worst_token_relative_error"] <= RELATIVE_TOLERANCE:
                return plain, eps, measured
            if eps * 10 > MAX_EPS:
                raise ExportError(
                    f"the exported model's logits differ from the installed model's by "
                    f"{measured['worst_token_relative_error']:.2e} (relative, worst token of the probe) even with "
                    f"eps {eps:g}: it cannot be exported in the plain format (lnfree.load and the installed model "
                    "stay exact)")
            eps *= 10
    finally:
        model.train(was_training)


def _measured_record(measured: dict | None, ids: torch.Tensor, tokenizer, kept: torch.Tensor) -> dict:
    if measured is None:
        return {"worst_relative_error": None,
                "measured": "not measured: a partial export is exact only through lnfree.load"}
    return {"worst_relative_error": measured["worst_token_relative_error"],
            "max_abs_diff": measured["max_abs_diff"], "tolerance": RELATIVE_TOLERANCE,
            "worst_token": {**(worst := describe_token(ids, measured["worst_token"], tokenizer)),
                            "row": int(kept[worst["row"]])},  # a row of the whole probe, as in runaway_rows
            "measured": "plain transformers from_pretrained of the export against the installed model, on the probe"}


def export_run(result, out: str | Path | None = None, *, held_out_ce: dict | None = None,
               allow_runaway: bool = False) -> Path:
    """Export a finished removal run (`lnfree.removal.train.RunResult`) to `out` (default: its `export/` folder);
    `allow_runaway` as in `write_export`.

    The record holds the run config, the removal events and the held-out CE (by default the run's
    original and LN-free values; pass `held_out_ce` to add e.g. the vanilla control's).
    """
    out = Path(out) if out is not None else result.output_dir / EXPORT
    neurons = result.output_dir / NEURONS_FILE  # the MLP neurons the run damped out (lnfree.removal.losses.massive)
    record = {
        "run_config": json.loads(result.config.model_dump_json()),
        "events": result.events,
        **({"massive_neurons": json.loads(neurons.read_text())} if neurons.is_file() else {}),
        "held_out_ce": held_out_ce or {"original": result.held_out_ce_start, "ln_free": result.held_out_ce_end},
    }
    tokenizer = AutoTokenizer.from_pretrained(result.output_dir / TOKENIZER)
    return write_export(result.model, tokenizer, out, record, overwrite=True, probe=getattr(result, "probe", None),
                        allow_runaway=allow_runaway)


def load_checkpoint(checkpoint: str | Path) -> tuple[nn.Module, object, RunConfig]:
    """Rebuild the installed model of a training checkpoint: (model, tokenizer, run config)."""
    checkpoint = Path(checkpoint)
    run_dir = checkpoint.parent.parent
    weights = checkpoint / "model.safetensors"
    if not weights.is_file() or not (run_dir / RUN_CONFIG).is_file():
        raise ExportError(f"{checkpoint} is not an lnfree checkpoint (expected model.safetensors and ../../{RUN_CONFIG})")
    config = RunConfig.model_validate_json((run_dir / RUN_CONFIG).read_text())
    tokenizer = AutoTokenizer.from_pretrained(run_dir / TOKENIZER)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint)).float()
    if config.removal.mode == "remove":
        removal = config.removal
        surgery.install(model, special_pos0=removal.special_pos0, per_head_pos0=removal.special_pos0_per_head,
                        pos0_span=removal.special_pos0_span, special_eot=removal.special_eot,
                        eot_token_id=tokenizer.eos_token_id)
    missing, unexpected = load_model(model, weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    if unexpected or [k for k in missing if k not in tied]:
        raise ExportError(f"{weights} does not match the model: missing {missing}, unexpected {unexpected}")
    return model.eval(), tokenizer, config
