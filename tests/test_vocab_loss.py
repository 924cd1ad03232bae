"""`train.chunked_vocab_loss`: CE and the distillation KL chunk by chunk from the hidden states and the
head (`lnfree.removal.losses.vocab_loss`), the plain loss's value and gradients, wired into `Objective`."""

from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from conftest import small_gpt2
from families import tiny_family
from lnfree.fixedscale import surgery
from lnfree.arch import architecture
from lnfree.removal.config import TrainConfig, with_overrides
from lnfree.removal.losses.distill import kl_to_teacher
from lnfree.removal.losses.objective import TAILS, TERMS, Objective
from lnfree.removal.runtime import RECOMPILE_LIMIT
from lnfree.removal.train import run
from lnfree.removal.losses import vocab_loss as vocab_module
from lnfree.removal.losses.vocab_loss import IGNORE, HeadInput, compiles_vocab_terms, logits_loss, vocab_loss


def problem(dtype=torch.float32, seed=0, tokens=(3, 7), hidden=16, vocab=50):
    """Hidden states (leaf), a head weight (leaf), next-token labels and a teacher's (hidden, weight)."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(*tokens, hidden, generator=gen, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen, dtype=dtype) * 0.5).requires_grad_()
    ids = torch.randint(0, vocab, tokens, generator=gen)
    teacher = (torch.randn(*tokens, hidden, generator=gen, dtype=dtype),
               torch.randn(vocab, hidden, generator=gen, dtype=dtype) * 0.5)
    return h, w, F.pad(ids[:, 1:], (0, 1), value=IGNORE), teacher


def plain(h, w, labels, teacher, ce_weight, kl_weight, temperature):
    """The plain loss on full logits: transformers' CE (fp32 upcast) and `kl_to_teacher`."""
    logits = F.linear(h, w)
    ce = F.cross_entropy(logits.float().reshape(-1, w.shape[0]), labels.reshape(-1), ignore_index=IGNORE)
    kl = kl_to_teacher(logits, F.linear(*teacher), temperature)
    return ce_weight * ce + kl_weight * kl, ce, kl


def from_logits(h, w, labels, teacher, **kwargs):
    """`logits_loss` on the whole logits of `h` and `w` and the teacher's."""
    return logits_loss(F.linear(h, w), labels, F.linear(*teacher), **kwargs)


@pytest.mark.parametrize("fused", [vocab_loss, from_logits])  # from the hidden states and the head, or from logits
@pytest.mark.parametrize("chunk", [4, 1024])  # 21 tokens in 6 chunks, or in one
@pytest.mark.parametrize("ce_weight,kl_weight,temperature", [(0.5, 0.5, 1.0), (1.0, 0.0, 1.0), (0.3, 0.7, 2.0),
                                                             (0.0, 1.0, 1.0)])
def test_the_chunked_loss_and_its_gradients_are_the_plain_ones_in_fp32(fused, chunk, ce_weight, kl_weight,
                                                                       temperature):
    h, w, labels, teacher = problem()
    expected = plain(h, w, labels, teacher, ce_weight, kl_weight, temperature)
    grads = torch.autograd.grad(expected[0] * 0.25, (h, w))  # as `loss / accumulation` is backpropagated
    got = fused(h, w, labels, teacher, ce_weight=ce_weight, kl_weight=kl_weight, temperature=temperature,
                chunk=chunk)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not got[1].requires_grad and not got[2].requires_grad
    for a, b in zip(torch.autograd.grad(got[0] * 0.25, (h, w)), grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_under_bf16_autocast_it_multiplies_in_bf16_and_keeps_the_loss_in_fp32():
    h, w, labels, teacher = problem(seed=1)
    teacher = tuple(t.bfloat16() for t in teacher)  # a bf16 teacher
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = plain(h, w, labels, teacher, 0.5, 0.5, 1.0)
        grads = torch.autograd.grad(expected[0], (h, w))
        got = vocab_loss(h, w, labels, teacher, ce_weight=0.5, kl_weight=0.5, chunk=8)
    assert all(t.dtype == torch.float32 for t in got)
    for a, b in zip(got, expected):  # the same bf16 logits, then fp32: only the sums' order differs
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    new = torch.autograd.grad(got[0], (h, w))
    assert new[0].dtype == h.dtype and new[1].dtype == w.dtype
    for a, b in zip(new, grads):  # bf16 products of the gradient, rounded per chunk vs once
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_on_bf16_logits_the_gradient_is_bf16_and_a_teacher_alone_gives_the_kl():
    h, w, labels, teacher = problem(seed=2)
    logits = F.linear(h, w).bfloat16()
    target = F.linear(*teacher).bfloat16()
    loss, ce, kl = logits_loss(logits, labels, target, ce_weight=0.5, kl_weight=0.5, chunk=4)
    reference = 0.5 * F.cross_entropy(logits.float().reshape(-1, 50), labels.reshape(-1), ignore_index=IGNORE) \
        + 0.5 * kl_to_teacher(logits, target)
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    got, = torch.autograd.grad(loss, logits)
    expected_grad, = torch.autograd.grad(reference, logits)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected_grad)  # both rounded once to bf16 from fp32
    alone = logits_loss(logits, None, target, ce_weight=0.0, kl_weight=1.0)
    assert alone[1] == 0 and alone[2] == pytest.approx(kl_to_teacher(logits, target).item(), rel=1e-5)


@pytest.fixture
def fresh_compile(monkeypatch):
    """The compiled chunk terms made anew for the test (none compiled yet, no earlier failure, no graphs cached)."""
    torch._dynamo.reset()
    monkeypatch.setattr(vocab_module._Compiled, "terms", None)
    monkeypatch.setattr(vocab_module._Compiled, "failed", False)
    return vocab_module._Compiled


@pytest.mark.parametrize("ce_weight,kl_weight,temperature,dtype", [(0.5, 0.5, 1.0, torch.bfloat16),
                                                                    (0.3, 0.7, 2.0, torch.float32),
                                                                    (0.0, 1.0, 1.0, torch.bfloat16)])
def test_the_compiled_terms_give_the_eager_values_and_gradients(fresh_compile, ce_weight, kl_weight, temperature,
                                                                dtype):
    h, w, labels, teacher = problem(seed=4, tokens=(4, 16), vocab=300)
    logits = F.linear(h, w).to(dtype).detach().requires_grad_()
    target = F.linear(*teacher).to(dtype)
    results = []
    for compiled in (False, True):
        got = logits_loss(logits, labels if ce_weight else None, target.clone(), ce_weight=ce_weight,
                          kl_weight=kl_weight, temperature=temperature, chunk=32, compiled=compiled)
        results.append((got, torch.autograd.grad(got[0] * 0.25, logits)[0]))
    assert fresh_compile.terms is not None and not fresh_compile.failed  # it compiled, and ran compiled
    (eager, eager_grad), (fused, fused_grad) = results
    for a, b in zip(fused, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fused_grad.dtype == dtype
    tolerance = {} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-6}  # fp32 sums rounded once to bf16
    torch.testing.assert_close(fused_grad, eager_grad, **tolerance)
    assert fused_grad.abs().sum() > 0


def test_the_compiled_terms_from_the_hidden_states_and_a_failed_compile_falls_back(fresh_compile, monkeypatch):
    h, w, labels, teacher = problem(seed=5, tokens=(2, 24), vocab=200)
    expected = vocab_loss(h, w, labels, teacher, ce_weight=0.5, kl_weight=0.5, chunk=16)
    expected_grads = torch.autograd.grad(expected[0], (h, w))
    got = vocab_loss(h, w, labels, teacher, ce_weight=0.5, kl_weight=0.5, chunk=16, compiled=True)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(got[0], (h, w)), expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)

    def broken(*args, **kwargs):  # what a machine without a working compiler gives at the first call
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(fresh_compile, "terms", broken)
    with pytest.warns(RuntimeWarning, match="eager kernels take over"):
        after = vocab_loss(h, w, labels, teacher, ce_weight=0.5, kl_weight=0.5, chunk=16, compiled=True)
    assert fresh_compile.failed
    torch.testing.assert_close(after[0], expected[0])


def test_auto_compiles_the_vocabulary_terms_on_a_cpu_with_a_large_vocabulary():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert compiles_vocab_terms("auto", cpu, 262_144) and not compiles_vocab_terms("auto", cpu, 50_257)
    assert not compiles_vocab_terms("auto", gpu, 262_144)
    assert compiles_vocab_terms(True, gpu, 64) and not compiles_vocab_terms(False, cpu, 262_144)


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_still_do():
    h, w, labels, teacher = problem()
    w.requires_grad_(False)
    loss, _, _ = vocab_loss(h, w, labels, teacher, ce_weight=0.5, kl_weight=0.5, chunk=4)
    loss.backward()
    assert w.grad is None and h.grad is not None and h.grad.abs().sum() > 0
    with torch.no_grad():  # nothing to differentiate: no gradient is taken
        assert not vocab_loss(h, w.requires_grad_(), labels, chunk=4)[0].requires_grad


def test_the_head_computes_no_logits_while_skipping_and_heads_it_cannot_copy_are_refused():
    model = small_gpt2()
    head = HeadInput(model, architecture(model))
    ids = torch.randint(0, 64, (2, 9))
    with head.skipping():
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, 9, 0)
    torch.testing.assert_close(F.linear(head.value, head.weight), model(input_ids=ids).logits)
    sharded = object.__new__(type("Sharded", (FSDPModule,), {}))  # what FSDP2's fully_shard makes of a module
    with pytest.raises(ValueError, match="FSDP"), head.skipping(sharded):
        pass
    capped = tiny_family("gemma3")
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        HeadInput(capped, architecture(capped))


def objective_pair(freeze: bool, alpha: float = 0.5, temperature: float = 1.0, autocast=contextlib.nullcontext):
    """(student, the same loss plain, chunked): a tiny GPT-2 (tied head) with lnfree norms and its teacher."""
    student = surgery.install(small_gpt2(n_layer=2))
    teacher = small_gpt2(n_layer=2, seed=1).requires_grad_(False)
    student.train()
    if freeze:
        student.get_submodule(architecture(student).token_embedding).weight.requires_grad_(False)
    train = TrainConfig(distill_alpha=alpha, distill_temperature=temperature, scale_loss_weight=0.1,
                        coverage={"rows": 2, "ratio": 1.2, "kl_weight": 0.5})
    objectives = [Objective(student, train.model_copy(update={"chunked_vocab_loss": chunk}), architecture(student),
                            teacher, 0, autocast) for chunk in (None, 5)]
    return student, *objectives


def step(student, objective, text, rows):
    """The terms of one micro-step (text and coverage rows) and every parameter's gradient."""
    student.zero_grad(set_to_none=True)
    loss, terms = objective(student, text, (None,) * len(TAILS))
    loss.backward()
    cov_loss, cov_terms = objective.coverage(student, rows, objective.train.coverage)
    cov_loss.backward()
    grads = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
    return torch.cat([terms, cov_terms]), grads


@pytest.mark.parametrize("freeze,temperature", [(False, 1.0), (True, 2.0)])
def test_the_objective_with_the_chunked_loss_gives_the_plain_terms_and_gradients(freeze, temperature):
    student, plain_objective, chunked = objective_pair(freeze, temperature=temperature)
    gen = torch.Generator().manual_seed(3)
    text, rows = torch.randint(0, 64, (2, 12), generator=gen), torch.randint(0, 64, (2, 12), generator=gen)
    snapshot = copy.deepcopy(student.state_dict())
    expected, expected_grads = step(student, plain_objective, text, rows)
    student.load_state_dict(snapshot)
    got, grads = step(student, chunked, text, rows)
    term = {name: got[i] for i, name in enumerate(TERMS)}  # the text's terms
    assert term["kl"] > 0 and got[len(TERMS) + TERMS.index("cov_kl")] > 0
    weighted = 0.5 * term["ce"] + 0.5 * term["kl"] + 0.1 * term["aux"] + 0.1 * term["scale"]
    torch.testing.assert_close(term["loss"], weighted)
    cov = {name: got[len(TERMS) + i] for i, name in enumerate(TERMS)}  # the coverage rows' terms
    cov_loss, cov_kl, cov_tail = cov["loss"], cov["cov_kl"], cov["cov_tail"]
    torch.testing.assert_close(cov_loss, 0.5 * cov_kl + cov_tail)  # the coverage's kl_weight and weight
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    assert ("transformer.wte.weight" in grads) is not freeze
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_run_with_the_chunked_or_compiled_loss_logs_the_plain_runs_losses(run_config, tmp_path, monkeypatch):
    # Dynamo's default limit, whatever ran before. Its own patch, not monkeypatch: pytest undoes a module
    # attribute missing from its __dict__ by deleting it, which hides the option from the tests after this one.
    with torch._dynamo.config.patch(recompile_limit=8):
        monkeypatch.setattr(vocab_module._Compiled, "terms", None)  # compiled afresh in this process
        config = with_overrides(run_config(max_steps=4, distill_alpha=0.5, eval_every=0), {"removal.schedule": {
            "stages": [{"kind": kind, "start": 1, "gap": 0} for kind in ("ln_2", "ln_1qk", "ln_1v", "ln_f")]}})
        logs = []
        for chunk, compiled, out in ((None, False, "plain"), (64, False, "chunked"), (None, True, "compiled")):
            overrides = {"train.chunked_vocab_loss": chunk, "train.compile_vocab_loss": compiled,
                         "output_dir": str(tmp_path / out)}
            result = run(with_overrides(config, overrides), progress=False)
            logs.append([json.loads(line) for line in (result.output_dir / "log.jsonl").read_text().splitlines()
                         if '"loss"' in line])
        assert len(logs[0]) == 4
        assert torch._dynamo.config.recompile_limit == RECOMPILE_LIMIT  # each set of terms may keep its own graph
    for other in logs[1:]:
        for a, b in zip(logs[0], other):
            for term in ("loss", "ce", "kl", "aux", "grad_norm"):
                assert b[term] == pytest.approx(a[term], rel=1e-4, abs=1e-6), (a["step"], term)


def test_the_coverage_hinge_reads_position_0_only_in_rows_without_bos_where_asked():
    student, objective, _ = objective_pair(False)
    gen = torch.Generator().manual_seed(5)
    text, rows = torch.randint(0, 64, (2, 12), generator=gen), torch.randint(1, 64, (2, 12), generator=gen)
    rows[:, 0] = 0  # both rows "BOS-led" when the family's BOS is id 0
    with torch.no_grad():
        student.get_submodule(architecture(student).token_embedding).weight[0] *= 50  # a first token far too large
    objective(student, text, (None,) * len(TAILS))  # the text's typical scales
    hinge = TERMS.index("cov_tail")
    cov = objective.train.coverage
    flagged = cov.model_copy(update={"no_bos_position0": True})
    with torch.no_grad():
        off = objective.coverage(student, rows, cov, bos=0)[1][hinge]
        on_with_bos = objective.coverage(student, rows, flagged, bos=0)[1][hinge]
        on_without_bos = objective.coverage(student, rows, flagged, bos=63)[1][hinge]
    assert on_with_bos == off
    assert on_without_bos > off + 1


def test_one_token_rows_are_hinged_at_their_only_token():
    student, objective, _ = objective_pair(False)
    gen = torch.Generator().manual_seed(6)
    text = torch.randint(0, 64, (2, 12), generator=gen)
    objective(student, text, (None,) * len(TAILS))
    cov = objective.train.coverage.model_copy(update={"first_token_rows": 4})
    rows = torch.tensor([[1], [2], [3], [4]])
    hinge = TERMS.index("first_tail")
    widths = []
    student.get_submodule(architecture(student).unembedding).register_forward_hook(
        lambda module, args, out: widths.append(out.shape[-1]))
    with torch.no_grad():
        clean = objective.first_tokens(student, rows, cov)[1][hinge]
        student.get_submodule(architecture(student).token_embedding).weight[3] *= 50
        loss, terms = objective.first_tokens(student, rows, cov)
    assert widths == [0, 0]  # nothing reads the rows' logits: the head computes none
    assert terms[hinge] > clean + 1 and loss == cov.weight * terms[hinge]
    assert terms[TERMS.index("cov_tail")] == 0 and terms[TERMS.index("cov_kl")] == 0
