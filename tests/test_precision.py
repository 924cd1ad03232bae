"""What `auto` precision means on a CPU (`lnfree.removal.precision`), and a bf16-autocast step's loss on a CPU."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import GPT2LMHeadModel

from lnfree.removal import precision

from lnfree.fixedscale import surgery
from lnfree.arch import architecture
from lnfree.removal.config import RunConfig, TrainConfig, with_overrides
from lnfree.removal.losses.distill import teacher_dtype
from lnfree.removal.losses.objective import TAILS, TERMS, Objective
from lnfree.removal.preparation import autocast_factory
from lnfree.data.tiny import TINY_MODEL_DIR

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_native_bf16_is_read_from_the_cpus_flags(tmp_path):
    detect = precision.cpu_has_native_bf16.__wrapped__
    cpus = (("zen4", "fpu avx512f avx512_bf16 avx512_vnni", True), ("sapphire", "avx512f amx_bf16 amx_tile", True),
            ("skylake", "fpu avx512f avx512bw avx512_vnni", False))
    for name, flags, native in cpus:
        (tmp_path / name).write_text(f"processor\t: 0\nflags\t\t: {flags}\nbugs\t\t: amx_bf16 (only the flags line counts)\n")
        assert detect(tmp_path / name) is native, name
    assert detect(tmp_path / "absent") is False  # not Linux: no /proc/cpuinfo


def test_the_cpu_is_described_by_its_model_name_and_bf16_flags(tmp_path):
    describe = precision.cpu_description.__wrapped__
    (tmp_path / "xeon").write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\n"
                                   "flags\t\t: fpu avx512f amx_tile amx_bf16 avx512_bf16\n")
    (tmp_path / "old").write_text("model name\t: AMD EPYC 7B12\nflags\t\t: fpu avx2\n")
    assert describe(tmp_path / "xeon") == "Intel(R) Xeon(R) Processor (amx_bf16, avx512_bf16)"
    assert describe(tmp_path / "old") == "AMD EPYC 7B12 (no native bf16)"
    assert describe(tmp_path / "absent") == "unknown"


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bf16_on_a_cpu_only_when_the_run_opts_in_and_the_cpu_has_native_bf16(monkeypatch, native):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    for opt_in in (False, True):
        config = RunConfig(train={"auto_cpu_bf16": opt_in})
        bf16 = opt_in and native
        assert autocast_factory(config, CPU)[1] == ("bf16" if bf16 else "no")
        assert teacher_dtype("auto", CPU, opt_in) == (torch.bfloat16 if bf16 else torch.float32)
        for choice, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):  # explicit choices stand
            assert teacher_dtype(choice, CPU, opt_in) == dtype
        assert autocast_factory(RunConfig(train={"mixed_precision": "no", "auto_cpu_bf16": opt_in}), CPU)[1] == "no"
        assert autocast_factory(RunConfig(train={"mixed_precision": "bf16"}), CPU)[1] == "bf16"


def test_a_gpu_is_unchanged(monkeypatch):
    for supported in (True, False):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: supported)
        for opt_in in (False, True):
            assert precision.auto_bf16(CUDA, opt_in) is supported
            assert teacher_dtype("auto", CUDA, opt_in) == (torch.bfloat16 if supported else torch.float32)
            config = RunConfig(train={"auto_cpu_bf16": opt_in})
            assert autocast_factory(config, CUDA)[1] == ("bf16" if supported else "no")


class SoftmaxInputs(TorchFunctionMode):
    """Records the dtype of every input to a softmax-family function called inside it."""

    FUNCTIONS = (F.log_softmax, F.softmax, torch.softmax, F.cross_entropy, F.nll_loss, F.kl_div, torch.logsumexp)

    def __init__(self):
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FUNCTIONS:
            self.dtypes.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


def terms_of(autocast, chunk=None, teacher_dtype=torch.float32) -> torch.Tensor:
    """The `TERMS` of one micro-step of the bundled tiny model with every norm fixed (σ measured), distilled
    from the original (in `teacher_dtype`) with the scale loss, under `autocast`."""
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    student = surgery.install(GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR))
    surgery.initialise_sigmas(student, [ids])
    for state in surgery.scale_states(student).values():
        state.switch_to_fixed()
    teacher = GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR).eval().requires_grad_(False).to(teacher_dtype)
    train = TrainConfig(distill_alpha=0.5, scale_loss_weight=0.1, chunked_vocab_loss=chunk)
    objective = Objective(student.train(), train, architecture(student), teacher, 0, autocast)
    with SoftmaxInputs() as seen:
        loss, terms = objective(student, ids, (None,) * len(TAILS))
    assert seen.dtypes == {torch.float32}, "CE and KL take fp32 logits"
    loss.backward()
    return terms


@pytest.mark.parametrize("chunk", [None, 32])
def test_a_bf16_autocast_step_gives_the_fp32_loss_within_bf16_precision(chunk):
    fp32 = terms_of(contextlib.nullcontext, chunk)
    bf16 = terms_of(lambda: torch.autocast("cpu", dtype=torch.bfloat16), chunk, torch.bfloat16)
    names = ("loss", "ce", "aux", "kl", "scale")
    assert all(fp32[TERMS.index(n)] > 0 for n in names)
    for name in names:
        value = bf16[TERMS.index(name)]
        assert value != fp32[TERMS.index(name)], f"{name}: bf16 did not run"
        assert value.bfloat16().float() != value, f"{name} has bf16's 8 bits only: it was computed in bf16, not fp32"
    # bf16 rounds each product's output to 8 bits, 2⁻⁸ relative at most, errors that partly average out over
    # the tokens and the vocabulary (measured: ≤ 1e-3 here): every term within one such rounding of fp32's.
    for name in names:
        i = TERMS.index(name)
        assert bf16[i].item() == pytest.approx(fp32[i].item(), rel=2**-8), name


def test_the_modern_presets_and_a_model_without_one_freeze_the_embedding_and_let_auto_choose_bf16_on_a_cpu():
    from lnfree.cli.common import base_config
    from lnfree.removal.config import load_preset, preset_names

    modern = {"smollm2-135m", "qwen3-0.6b", "llama-3.2-1b", "pythia-160m"}
    assert modern <= set(preset_names())
    for name in preset_names():  # the tiny, realtext and GPT-2 presets compute alike on every CPU
        train = load_preset(name).train
        assert train.auto_cpu_bf16 is train.freeze_embeddings is (name in modern), name
    generic = base_config(None, None, "some-org/a-model-without-a-preset").train
    assert generic.auto_cpu_bf16 and generic.freeze_embeddings
    tiny = base_config(None, None, None).train  # the bundled tiny model
    assert not tiny.auto_cpu_bf16 and not tiny.freeze_embeddings


def test_attention_runs_in_fp32_under_a_cpus_bf16_autocast_only_at_short_contexts_and_small_heads():
    assert precision.attention_in_fp32(CPU, "bf16", 64, 64)
    assert precision.attention_in_fp32(CPU, "bf16", precision.FP32_ATTENTION_MAX_CONTEXT, 128)
    assert not precision.attention_in_fp32(CPU, "bf16", precision.FP32_ATTENTION_MAX_CONTEXT + 1, 64)
    assert not precision.attention_in_fp32(CPU, "bf16", 64, 256)  # Gemma 3: bf16's kernel is as fast
    assert not precision.attention_in_fp32(CPU, "no", 64, 64)
    assert not precision.attention_in_fp32(CUDA, "bf16", 64, 64)


class AttentionCalls(TorchFunctionMode):
    """Records the query's dtype and whether autocast was on at each scaled-dot-product attention call."""

    def __init__(self):
        super().__init__()
        self.calls: set[tuple[torch.dtype, bool]] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.calls.add((args[0].dtype, torch.is_autocast_enabled("cpu")))
        return func(*args, **(kwargs or {}))


def test_fp32_attention_computes_attention_in_fp32_with_autocast_off_and_keeps_the_bf16_result():
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    reference = GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR).eval()
    switched = GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR).eval()
    precision.use_fp32_attention(switched, None)
    with torch.no_grad():
        fp32 = reference(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with AttentionCalls() as plain:
                bf16 = reference(ids).logits.float()
            with AttentionCalls() as mixed:
                out = switched(ids).logits.float()
    assert plain.calls == {(torch.bfloat16, True)}
    assert mixed.calls == {(torch.float32, False)}
    # the rest of the model still runs in bf16: the logits differ from fp32's by bf16's rounding, as the plain
    # bf16 model's do, and from the plain bf16 model's by no more than that
    error = (bf16 - fp32).abs().max()
    assert error > 0 and (out - fp32).abs().max() > 0
    assert (out - bf16).abs().max() <= 2 * error
    assert reference.config._attn_implementation == "sdpa"
    assert precision.FP32_ATTENTION not in switched.config.to_json_string()  # exports name no custom kernel


@pytest.mark.parametrize("limit, on", [(64, True), (32, True), (64, False)])
def test_a_cpu_bf16_run_uses_fp32_attention_at_short_contexts_only_and_unless_told_not_to(run_config, monkeypatch,
                                                                                           limit, on):
    from lnfree.removal.train import run

    monkeypatch.setattr(precision, "FP32_ATTENTION_MAX_CONTEXT", limit)  # the tiny model's contexts are 64 tokens
    config = run_config(mixed_precision="bf16", distill_alpha=0.5, max_steps=2, save_every=0, cpu_fp32_attention=on)
    result = run(with_overrides(config, {"removal.mode": "vanilla"}), progress=False)
    assert result.model.config._attn_implementation == (precision.FP32_ATTENTION if on and limit >= 64 else "sdpa")


def _casts_and_grads(kept: bool) -> tuple[int, torch.Tensor]:
    """Three forwards, each in its own autocast region with its own backward (as a step's text, coverage rows and
    margin are), within `casts_kept` or not: autocast's weight casts counted, the first weight's gradient."""
    from torch.profiler import profile

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    x = torch.randn(4, 16)
    with profile() as prof, precision.casts_kept(kept):
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
    casts = sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")
    return casts, model[0].weight.grad


def test_a_steps_weight_casts_are_kept_across_its_autocast_regions_with_the_same_gradients():
    casts, grad = _casts_and_grads(kept=False)
    kept_casts, kept_grad = _casts_and_grads(kept=True)
    assert torch.equal(kept_grad, grad)
    assert kept_casts == casts - 8  # 2 weights and 2 biases cast once instead of three times


def test_a_forward_without_gradient_first_leaves_the_later_forwards_their_gradients():
    # the stability margin's clean pass runs without gradient; a cast kept from it would carry none
    model, x = torch.nn.Linear(8, 8), torch.randn(2, 8)
    with precision.casts_kept():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).float().sum().backward()
    assert model.weight.grad is not None and model.weight.grad.abs().sum() > 0
