"""The divergence and the chunked loss: TRL parity, float64 references, closed-form gradients, memory."""

import math
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from trl.experimental.gkd import GKDTrainer

from hf_rockopd.losses import (
    chunked_divergence,
    chunked_weighted_loss,
    logit_grad_norm,
    per_token_divergence,
    per_token_entropy,
    weighted_loss,
)


def reference_jsd(student_logits, teacher_logits, beta, temperature=1.0):
    """Generalized JSD in float64 written from the definition (Agarwal et al. 2024, Eq. 1), TRL's beta convention."""
    s = torch.softmax(student_logits.double() / temperature, -1)
    t = torch.softmax(teacher_logits.double() / temperature, -1)

    def kl(p, q):
        return torch.where(p > 0, p * (p.log() - q.log()), torch.zeros_like(p)).sum(-1)

    if beta == 0:
        return kl(t, s)
    if beta == 1:
        return kl(s, t)
    m = (1 - beta) * s + beta * t
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_matches_float64_reference(beta, temperature):
    torch.manual_seed(0)
    s, t = torch.randn(7, 33) * 3, torch.randn(7, 33) * 3
    ours = per_token_divergence(s, t, beta, temperature)
    assert ours.dtype == torch.float32 and ours.shape == (7,)
    torch.testing.assert_close(ours.double(), reference_jsd(s, t, beta, temperature), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_matches_trl_generalized_jsd(beta):
    torch.manual_seed(1)
    s, t = torch.randn(2, 5, 40), torch.randn(2, 5, 40)
    trl_per_token = GKDTrainer.generalized_jsd_loss(s, t, beta=beta, reduction="none").sum(-1)
    ours = per_token_divergence(s.reshape(-1, 40), t.reshape(-1, 40), beta).reshape(2, 5)
    torch.testing.assert_close(ours, trl_per_token, rtol=1e-5, atol=1e-6)
    labels = torch.tensor([[-100, 3, 4, 5, -100], [-100, -100, 1, 2, 3]])
    trl_mean = GKDTrainer.generalized_jsd_loss(s, t, labels=labels, beta=beta)  # mean over labelled rows
    mask = labels != -100
    torch.testing.assert_close(ours[mask].sum() / mask.sum(), trl_mean, rtol=1e-5, atol=1e-6)


def test_identical_distributions_give_zero():
    x = torch.randn(4, 50)
    for beta in (0.0, 0.5, 1.0):
        assert per_token_divergence(x, x.clone(), beta).abs().max() < 1e-6


def test_minus_inf_logits_are_finite_with_finite_gradients():
    s = torch.randn(3, 6)
    t = torch.randn(3, 6)
    s[:, 0] = -math.inf
    t[:, 0] = -math.inf  # a token banned in both: contributes nothing
    s.requires_grad_(True)
    for beta in (0.0, 0.5, 1.0):
        div = per_token_divergence(s, t, beta)
        assert torch.isfinite(div).all()
        (grad,) = torch.autograd.grad(div.sum(), s)
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(
            div.double(), reference_jsd(s.detach()[:, 1:], t[:, 1:], beta), rtol=1e-5, atol=1e-6
        )


def test_shape_mismatch_and_bad_beta_are_clear_errors():
    with pytest.raises(ValueError, match="same shape"):
        per_token_divergence(torch.randn(2, 5), torch.randn(2, 6), 1.0)
    with pytest.raises(ValueError, match="beta must be in"):
        per_token_divergence(torch.randn(2, 5), torch.randn(2, 5), 1.5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        per_token_divergence(torch.randn(2, 5), torch.randn(2, 5), 1.0, temperature=0.0)


def test_bf16_inputs_are_computed_in_float32():
    torch.manual_seed(2)
    s, t = torch.randn(4, 64), torch.randn(4, 64)
    ours = per_token_divergence(s.bfloat16(), t.bfloat16(), 1.0)
    assert ours.dtype == torch.float32
    reference = reference_jsd(s.bfloat16().float(), t.bfloat16().float(), 1.0)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-6)


def test_entropy():
    torch.testing.assert_close(per_token_entropy(torch.zeros(2, 8)), torch.full((2,), math.log(8)))
    x = torch.tensor([[0.0, -math.inf, 0.0]])
    torch.testing.assert_close(per_token_entropy(x), torch.tensor([math.log(2)]))


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_logit_grad_norm_matches_autograd(beta, temperature):
    torch.manual_seed(3)
    s = (torch.randn(6, 20) * 2).requires_grad_(True)
    t = torch.randn(6, 20) * 2
    (grad,) = torch.autograd.grad(per_token_divergence(s, t, beta, temperature).sum(), s)
    torch.testing.assert_close(logit_grad_norm(s.detach(), t, beta, temperature), grad.norm(dim=-1), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_chunked_equals_full_projection_values_and_gradients(beta, chunk_size):
    torch.manual_seed(4)
    n, h, v = 10, 8, 37
    s_head = torch.nn.Linear(h, v, bias=True)
    t_head = torch.nn.Linear(h + 4, v, bias=False)  # the teacher may be wider than the student
    hs = torch.randn(n, h, requires_grad=True)
    ht = torch.randn(n, h + 4)
    weights = torch.rand(n)

    out = chunked_divergence(hs, ht, s_head, t_head, beta, temperature=1.3, chunk_size=chunk_size)
    (out.divergence * weights).sum().backward()
    got = (hs.grad.clone(), s_head.weight.grad.clone(), s_head.bias.grad.clone())
    hs.grad = None
    s_head.zero_grad()

    assert t_head.weight.grad is None  # the teacher is never trained
    full = per_token_divergence(s_head(hs), t_head(ht).detach(), beta, temperature=1.3)
    (full * weights).sum().backward()
    torch.testing.assert_close(out.divergence, full.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(got, (hs.grad, s_head.weight.grad, s_head.bias.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    with torch.no_grad():
        s_lp, t_lp = s_head(hs), t_head(ht)
        torch.testing.assert_close(out.student_entropy, per_token_entropy(s_lp / 1.3))
        torch.testing.assert_close(out.teacher_entropy, per_token_entropy(t_lp / 1.3))
        torch.testing.assert_close(out.logit_grad_norm, logit_grad_norm(s_lp, t_lp, beta, 1.3), rtol=1e-5, atol=1e-6)


def _saved_bytes(fn):
    """Bytes of every tensor autograd keeps for the backward pass while `fn` runs (parameters are references, not
    activations, and are not counted)."""
    total = [0]

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total[0], out


def test_chunked_loss_keeps_no_vocab_sized_activations():
    torch.manual_seed(5)
    n, h, v, chunk = 256, 16, 4096, 32
    s_head = torch.nn.Linear(h, v, bias=False)
    t_head = torch.nn.Linear(h, v, bias=False)
    hs = torch.randn(n, h, requires_grad=True)
    ht = torch.randn(n, h)

    chunked, out = _saved_bytes(lambda: chunked_divergence(hs, ht, s_head, t_head, 1.0, chunk_size=chunk))
    full, _ = _saved_bytes(lambda: per_token_divergence(s_head(hs), t_head(ht), 1.0))
    # Full logits keep several (N, V) float32 tensors alive; the chunked path keeps only its (N, H) inputs.
    assert full >= 2 * n * v * 4
    assert chunked <= 4 * n * h * 4 + n * 64
    out.divergence.sum().backward()  # and the backward still works
    assert torch.isfinite(hs.grad).all()


def test_chunked_empty_rows_and_bad_chunk():
    head = torch.nn.Linear(4, 9)
    out = chunked_divergence(torch.zeros(0, 4), torch.zeros(0, 4), head, head, 1.0)
    assert out.divergence.shape == (0,)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        chunked_divergence(torch.zeros(2, 4), torch.zeros(2, 4), head, head, 1.0, chunk_size=0)
    with pytest.raises(ValueError, match="same number of rows"):
        chunked_divergence(torch.zeros(2, 4), torch.zeros(3, 4), head, head, 1.0)


def test_weighted_loss_normalizers():
    div = torch.tensor([1.0, 2.0, 4.0])
    w = torch.tensor([1.0, 0.5, 0.0])
    assert float(weighted_loss(div, w, normalizer=3)) == pytest.approx(2.0 / 3)
    assert float(weighted_loss(div, w, normalizer=w.sum())) == pytest.approx(2.0 / 1.5)
    # An empty batch (normalizer 0) is exactly 0, not NaN.
    assert float(weighted_loss(torch.zeros(0), torch.zeros(0), normalizer=0)) == 0.0
    with pytest.raises(ValueError, match="same shape"):
        weighted_loss(div, w[:2], 1)


# ------------------------------------------------------------------ fused loss and closed-form backward passes ----
def _reference_loss(hs, ht, s_head, t_head, weights, normalizer, beta, temperature):
    full = per_token_divergence(s_head(hs), t_head(ht).detach(), beta, temperature)
    return weighted_loss(full, weights, normalizer), full.detach()


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 1.3])
@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_fused_weighted_loss_equals_full_projection(beta, temperature, chunk_size):
    torch.manual_seed(6)
    n, h, v = 10, 8, 37
    s_head = torch.nn.Linear(h, v, bias=True)
    t_head = torch.nn.Linear(h + 4, v, bias=False).requires_grad_(False)
    hs = (torch.randn(n, h) * 2).requires_grad_(True)
    ht = torch.randn(n, h + 4) * 2
    weights = torch.rand(n) * (torch.rand(n) > 0.3)
    tensors = (hs, s_head.weight, s_head.bias)

    loss, scores = chunked_weighted_loss(hs, ht, s_head, t_head, weights, 7.0, beta, temperature, chunk_size)
    got = _grads(loss, tensors)
    ref, full = _reference_loss(hs, ht, s_head, t_head, weights, 7.0, beta, temperature)
    want = _grads(ref, tensors)

    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(scores.divergence, full, rtol=1e-5, atol=1e-6)
    assert not scores.divergence.requires_grad
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        z_s, z_t = s_head(hs), t_head(ht)
        torch.testing.assert_close(scores.student_entropy, per_token_entropy(z_s / temperature))
        torch.testing.assert_close(scores.teacher_entropy, per_token_entropy(z_t / temperature))
        torch.testing.assert_close(scores.logit_grad_norm, logit_grad_norm(z_s, z_t, beta, temperature), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_closed_form_paths_find_the_tensors_a_head_trains(fused):
    """A closure head with logit post-processing, a frozen base weight and trainable low-rank factors (LoRA's
    shape), and a tied embedding that also receives gradient from elsewhere in the graph."""
    torch.manual_seed(7)
    n, h, v, r = 9, 6, 23, 2
    embedding = torch.nn.Embedding(v, h)
    base = torch.randn(v, h)
    lora_a = (torch.randn(r, h) * 0.1).requires_grad_(True)
    lora_b = (torch.randn(v, r) * 0.1).requires_grad_(True)

    def head(x):  # trains lora_a, lora_b and the tied embedding weight, not `base`
        return 5.0 * torch.tanh((x @ (base + embedding.weight).T + x @ lora_a.T @ lora_b.T) / 5.0)

    t_head = torch.nn.Linear(h, v, bias=False).requires_grad_(False)
    ids = torch.randint(0, v, (n,))
    ht = torch.randn(n, h)
    weights = torch.rand(n)
    tensors = (lora_a, lora_b, embedding.weight)

    def total(loss_fn):
        hs = embedding(ids) * 2.0  # the student's hidden states themselves depend on the embedding
        return loss_fn(hs) + 0.1 * hs.square().sum()

    if fused:
        ours = total(lambda hs: chunked_weighted_loss(hs, ht, head, t_head, weights, 4.0, 0.5, chunk_size=4)[0])
    else:
        ours = total(lambda hs: weighted_loss(chunked_divergence(hs, ht, head, t_head, 0.5, chunk_size=4).divergence, weights, 4.0))
    got = _grads(ours, tensors)
    want = _grads(total(lambda hs: _reference_loss(hs, ht, head, t_head, weights, 4.0, 0.5, 1.0)[0]), tensors)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_frozen_head_row_divergence_scales_stored_gradients(beta):
    """With no trainable head, `chunked_divergence` forms each row's hidden-state gradient in the forward pass; the
    backward must weight it by the upstream gradient of each row (here non-uniform and of mixed sign)."""
    torch.manual_seed(8)
    n, h, v = 11, 5, 19
    s_head = torch.nn.Linear(h, v).requires_grad_(False)
    t_head = torch.nn.Linear(h, v).requires_grad_(False)
    hs = torch.randn(n, h, requires_grad=True)
    ht = torch.randn(n, h)
    upstream = torch.randn(n)
    out = chunked_divergence(hs, ht, s_head, t_head, beta, chunk_size=4)
    (got,) = torch.autograd.grad((out.divergence * upstream).sum() + out.divergence[0] ** 2, hs)
    full = per_token_divergence(s_head(hs), t_head(ht), beta)
    (want,) = torch.autograd.grad((full * upstream).sum() + full[0] ** 2, hs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_fused_minus_inf_logits_take_the_masked_path(beta):
    torch.manual_seed(9)
    n, h, v = 6, 4, 13
    s_head, t_head = torch.nn.Linear(h, v), torch.nn.Linear(h, v).requires_grad_(False)
    with torch.no_grad():
        s_head.bias[3] = -math.inf  # a token banned in both models: contributes exactly 0
        t_head.bias[3] = -math.inf
    hs = torch.randn(n, h, requires_grad=True)
    ht = torch.randn(n, h)
    weights = torch.ones(n)
    loss, scores = chunked_weighted_loss(hs, ht, s_head, t_head, weights, n, beta, chunk_size=4)
    got = _grads(loss, (hs, s_head.weight))
    ref, full = _reference_loss(hs, ht, s_head, t_head, weights, n, beta, 1.0)
    want = _grads(ref, (hs, s_head.weight))
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in got)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(scores.divergence, full, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(scores.student_entropy).all() and torch.isfinite(scores.teacher_entropy).all()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_fused_bf16_matches_autograd_on_the_same_bf16_logits():
    torch.manual_seed(10)
    n, h, v = 8, 16, 64
    s_head = torch.nn.Linear(h, v, bias=False).bfloat16()
    t_head = torch.nn.Linear(h, v, bias=False).bfloat16().requires_grad_(False)
    hs = torch.randn(n, h, dtype=torch.bfloat16, requires_grad=True)
    ht = torch.randn(n, h, dtype=torch.bfloat16)
    loss, _ = chunked_weighted_loss(hs, ht, s_head, t_head, torch.ones(n), n, 1.0, chunk_size=3)
    got = _grads(loss, (hs, s_head.weight))
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.bfloat16
    ref, _ = _reference_loss(hs, ht, s_head, t_head, torch.ones(n), n, 1.0, 1.0)
    want = _grads(ref, (hs, s_head.weight))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, want):
        # bf16 keeps 8 bits of mantissa: the two paths round the (n, V) gradient at different points.
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_compilable_closed_forms_equal_the_eager_ones(beta, temperature):
    """`_terms_math`, the pure function CUDA compiles, computes what the eager in-place formulas compute."""
    from hf_rockopd.losses.closed_form import _chunk_terms, _terms_math

    torch.manual_seed(12)
    z_s, z_t = torch.randn(6, 301) * 3, torch.randn(6, 301) * 3
    eager = _chunk_terms(z_s.clone(), z_t.clone(), beta, temperature)
    pure = _terms_math(z_s, z_t, beta, temperature)
    for name, got in zip(("divergence", "student_entropy", "teacher_entropy", "logit_grad_norm", "grad"), pure):
        torch.testing.assert_close(got, getattr(eager, name), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_loss_through_the_compiled_branch_matches_and_falls_back_on_minus_inf(beta, monkeypatch):
    """The branch CUDA takes (pure closed forms, then the finiteness check), run here with the uncompiled function:
    same loss and gradients as the reference, and a chunk with -inf logits is redone by the masked formulas from the
    logits the pure function left intact."""
    from hf_rockopd.losses import closed_form as losses

    monkeypatch.setenv("HF_ROCKOPD_COMPILE_LOSS", "1")  # the default, whatever the environment running the tests says
    monkeypatch.setattr(losses, "_compiled_terms", losses._terms_math)
    torch.manual_seed(13)
    n, h, v = 9, 6, 29
    s_head, t_head = torch.nn.Linear(h, v), torch.nn.Linear(h, v).requires_grad_(False)
    with torch.no_grad():
        s_head.bias[5] = t_head.bias[5] = -math.inf
    hs = torch.randn(n, h, requires_grad=True)
    ht = torch.randn(n, h)
    weights = torch.rand(n)
    for head_bias in (True, False):
        if not head_bias:  # a chunk of finite logits only
            with torch.no_grad():
                s_head.bias[5] = t_head.bias[5] = 0.0
        loss, _ = chunked_weighted_loss(hs, ht, s_head, t_head, weights, n, beta, chunk_size=4)
        ref, _ = _reference_loss(hs, ht, s_head, t_head, weights, n, beta, 1.0)
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-7)
        for a, b in zip(_grads(loss, (hs, s_head.weight)), _grads(ref, (hs, s_head.weight))):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the float32-output half-precision products are CUDA's")
@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_cuda_bf16_loss_projects_with_float32_logits_and_is_closer_to_float64_than_bf16_logits(
    beta, compiled, monkeypatch
):
    """On CUDA a bare bf16 head writes float32 logits and its gradient is accumulated in float32 from bf16 operands
    (TRL's kernels do the same). Against float64 on the same bf16 inputs that must be more accurate than autograd on
    bf16 logits (what full-logit GKD computes), for both paths, with bf16 gradients of the parameters' dtype."""
    from hf_rockopd.losses.fused import _logits

    monkeypatch.setenv("HF_ROCKOPD_COMPILE_LOSS", "1" if compiled else "0")
    torch.manual_seed(11)
    n, h, h_t, v = 96, 64, 128, 4096
    s_head = torch.nn.Linear(h, v, bias=False, device="cuda", dtype=torch.bfloat16)
    t_head = torch.nn.Linear(h_t, v, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        s_head.weight.normal_(0, 3 / math.sqrt(h))
        t_head.weight.normal_(0, 3 / math.sqrt(h_t))
    hs = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ht = torch.randn(n, h_t, device="cuda", dtype=torch.bfloat16)
    weights = (torch.rand(n, device="cuda") > 0.3).float()
    tensors = (hs, s_head.weight)
    assert _logits(s_head, hs.detach()).dtype == torch.float32

    def exact():
        w64 = s_head.weight.detach().double().requires_grad_(True)
        h64 = hs.detach().double().requires_grad_(True)
        full = per_token_divergence(h64 @ w64.T, ht.double() @ t_head.weight.double().T, beta)
        loss = weighted_loss(full, weights.double(), float(n))
        return loss, _grads(loss, (h64, w64))

    def rel(a, b):
        return float((a.detach().double() - b).norm() / b.norm())

    loss64, grads64 = exact()
    fused, _ = chunked_weighted_loss(hs, ht, s_head, t_head, weights, float(n), beta, chunk_size=32)
    row = weighted_loss(chunked_divergence(hs, ht, s_head, t_head, beta, chunk_size=32).divergence, weights, float(n))
    bf16_logits, _ = _reference_loss(hs, ht, s_head, t_head, weights, float(n), beta, 1.0)
    errors = {}
    for name, loss in (("fused", fused), ("row", row), ("bf16_logits", bf16_logits)):
        grads = _grads(loss, tensors)
        assert all(g.dtype == torch.bfloat16 for g in grads)
        errors[name] = (rel(loss.detach(), loss64), *(rel(g, g64) for g, g64 in zip(grads, grads64)))
    for name in ("fused", "row"):
        assert errors[name][0] < 1e-4, errors  # float32 logits: only the bf16 inputs' products are rounded
        assert errors[name][0] < errors["bf16_logits"][0], errors
        assert max(errors[name][1:]) < 1e-2, errors  # bf16 gradients: 8 bits of mantissa


def test_fused_loss_edges_and_errors():
    head = torch.nn.Linear(4, 9)
    hs = torch.randn(3, 4, requires_grad=True)
    loss, scores = chunked_weighted_loss(hs[:0], torch.zeros(0, 4), head, head, torch.zeros(0), 0, 1.0)
    assert float(loss.detach()) == 0.0 and scores.divergence.shape == (0,)
    loss, _ = chunked_weighted_loss(hs, torch.randn(3, 4), head, head, torch.zeros(3), 0, 1.0)
    assert float(loss.detach()) == 0.0  # all weights 0, normalizer 0 -> 1: exactly 0 with zero gradients
    loss.backward()
    assert hs.grad.abs().max() == 0
    with pytest.raises(RuntimeError, match="already back-propagated"):
        loss.backward()
    with torch.no_grad():
        loss, scores = chunked_weighted_loss(hs, torch.randn(3, 4), head, head, torch.ones(3), 3, 0.5)
    assert loss.grad_fn is None and scores.divergence.shape == (3,)
    with pytest.raises(ValueError, match=r"one entry per row, shape \(3,\), got \(2,\)"):
        chunked_weighted_loss(hs, torch.randn(3, 4), head, head, torch.ones(2), 3, 1.0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        chunked_weighted_loss(hs, torch.randn(3, 4), head, head, torch.ones(3), 3, 1.0, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        chunked_weighted_loss(hs, torch.randn(3, 4), head, head, torch.ones(3), 3, 1.0, chunk_size=0)


# --------------------------------------------------------------------- hand-written gradient of a bare Linear head ----
class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors that ops allocate while the mode is active (views and in-place results share their
    input's storage and are not counted; a tensor is counted until it is garbage collected)."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0

    def _free(self, nbytes):
        self.now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                nbytes = t.untyped_storage().nbytes()
                self.now += nbytes
                self.peak = max(self.peak, self.now)
                weakref.finalize(t, self._free, nbytes)
        return out


@pytest.mark.parametrize("fused", [True, False])
def test_bare_linear_head_gradient_lives_in_one_buffer(fused):
    """Through autograd every chunk allocates its own (V, H) head gradient before adding it to the total, so the peak
    holds two; a bare nn.Linear head is differentiated in place into one (the Qwen3-head benchmark case, where the
    head is 1.16 GiB in float32)."""
    torch.manual_seed(11)
    n, h, v, chunk = 64, 256, 4096, 8
    s_head = torch.nn.Linear(h, v, bias=False)
    t_head = torch.nn.Linear(h, v, bias=False).requires_grad_(False)
    hs = torch.randn(n, h, requires_grad=True)
    ht = torch.randn(n, h)
    head_bytes, chunk_bytes = v * h * 4, chunk * v * 4
    peaks, grads = {}, {}
    for name, head in [("linear", s_head), ("closure", lambda x: s_head(x))]:
        s_head.weight.grad = hs.grad = None
        with _LiveBytes() as live:
            if fused:
                loss, _ = chunked_weighted_loss(hs, ht, head, t_head, torch.ones(n), n, 1.0, chunk_size=chunk)
            else:
                loss = chunked_divergence(hs, ht, head, t_head, 1.0, chunk_size=chunk).divergence.mean()
            loss.backward()
        peaks[name], grads[name] = live.peak, (hs.grad, s_head.weight.grad)
    assert peaks["linear"] <= head_bytes + 12 * chunk_bytes
    assert peaks["closure"] >= 2 * head_bytes
    for a, b in zip(*grads.values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("train_bias", [True, False])
def test_bare_linear_head_with_bias_accumulates_into_existing_grads(train_bias):
    """The in-place path adds to gradients already there (gradient accumulation) and trains a bias only when it
    requires grad."""
    torch.manual_seed(12)
    n, h, v = 7, 5, 17
    s_head = torch.nn.Linear(h, v)
    s_head.bias.requires_grad_(train_bias)
    t_head = torch.nn.Linear(h, v).requires_grad_(False)
    hs = torch.randn(n, h, requires_grad=True)
    ht = torch.randn(n, h)
    weights = torch.rand(n)
    tensors = [hs, s_head.weight] + ([s_head.bias] if train_bias else [])
    for t in tensors:
        t.grad = torch.full_like(t, 0.5)
    loss, _ = chunked_weighted_loss(hs, ht, s_head, t_head, weights, 3.0, 0.5, chunk_size=3)
    loss.backward()
    ref, _ = _reference_loss(hs, ht, s_head, t_head, weights, 3.0, 0.5, 1.0)
    for got, want in zip([t.grad for t in tensors], _grads(ref, tensors)):
        torch.testing.assert_close(got, want + 0.5, rtol=1e-5, atol=1e-7)
    assert train_bias or s_head.bias.grad is None


def test_linear_head_with_a_forward_hook_keeps_the_hook():
    """A hook may change the logits, so a hooked Linear is differentiated through autograd, hook included."""
    torch.manual_seed(13)
    n, h, v = 6, 4, 11
    s_head = torch.nn.Linear(h, v, bias=False)
    s_head.register_forward_hook(lambda module, args, out: 2.0 * out)
    t_head = torch.nn.Linear(h, v, bias=False).requires_grad_(False)
    hs = torch.randn(n, h, requires_grad=True)
    ht = torch.randn(n, h)
    loss, scores = chunked_weighted_loss(hs, ht, s_head, t_head, torch.ones(n), n, 1.0, chunk_size=4)
    ref, full = _reference_loss(hs, ht, s_head, t_head, torch.ones(n), n, 1.0, 1.0)
    torch.testing.assert_close(scores.divergence, full, rtol=1e-5, atol=1e-6)
    for a, b in zip(_grads(loss, (hs, s_head.weight)), _grads(ref, (hs, s_head.weight))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "env, compile, expected", [("1", None, True), ("0", None, False), ("0", True, True), ("1", False, False)]
)
def test_compilation_is_a_per_call_choice(env, compile, expected, monkeypatch):
    """`compile=` decides for one call; without it the environment is read at the call (no module switch to flip)."""
    from hf_rockopd.losses import closed_form

    calls = []

    def spy(*args):
        calls.append(args)
        return closed_form._terms_math(*args)

    monkeypatch.setenv("HF_ROCKOPD_COMPILE_LOSS", env)
    monkeypatch.setattr(closed_form, "_compiled_terms", spy)
    torch.manual_seed(14)
    head = torch.nn.Linear(4, 13)
    hs, ht, weights = torch.randn(5, 4, requires_grad=True), torch.randn(5, 4), torch.rand(5)
    loss, _ = chunked_weighted_loss(hs, ht, head, head, weights, 5, 0.5, chunk_size=2, compile=compile)
    row = chunked_divergence(hs, ht, head, head, 0.5, chunk_size=2, compile=compile).divergence
    norm = logit_grad_norm(head(hs).detach(), head(ht).detach(), 0.5, compile=compile)
    assert bool(calls) is expected
    ref, _ = _reference_loss(hs, ht, head, head, weights, 5, 0.5, 1.0)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weighted_loss(row, weights, 5), ref, rtol=1e-5, atol=1e-7)
    assert norm.shape == (5,)
