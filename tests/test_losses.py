"""The divergence and the chunked loss: TRL parity, float64 references, closed-form gradients, memory."""

import math

import pytest
import torch
from trl.experimental.gkd import GKDTrainer

from hf_rockopd.losses import (
    chunked_divergence,
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
    """Bytes of every tensor autograd keeps for the backward pass while `fn` runs."""
    total = [0]

    def pack(t):
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
