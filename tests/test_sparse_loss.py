"""The tail-bin divergence against a top-k teacher: the dense loss at k = V, a lower bound growing with k below it."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_rockopd.losses import (
    chunked_divergence,
    chunked_weighted_loss,
    pack_topk,
    per_token_divergence,
    sparse_divergence,
    topk_log_probs,
)
from hf_rockopd.losses.sparse import tail_bin_log_probs


BETAS = [0.0, 0.5, 1.0]


def _rows(n=7, hidden=6, vocab=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(n, hidden, generator=g)
    h_t = torch.randn(n, hidden, generator=g)
    student = torch.nn.Linear(hidden, vocab, bias=False)
    teacher = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        student.weight.copy_(torch.randn(vocab, hidden, generator=g))
        teacher.weight.copy_(torch.randn(vocab, hidden, generator=g) * 2)
    return h_s, h_t, student, teacher


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_full_vocabulary_equals_dense_loss_and_gradients(beta, temperature):
    h_s, h_t, student, teacher = _rows()
    weights = torch.tensor([1.0, 0.0, 2.0, 0.5, 1.0, 0.0, 3.0])  # frozen rows among them
    vocab = student.out_features

    def run(sparse: bool):
        student.zero_grad()
        h = h_s.clone().requires_grad_(True)
        if sparse:
            with torch.no_grad():
                ids, lp = topk_log_probs(teacher(h_t), vocab, temperature)
            loss, scores = chunked_weighted_loss(
                h, pack_topk(ids, lp), student, None, weights, 5.0, beta=beta, temperature=temperature, chunk_size=3
            )
        else:
            loss, scores = chunked_weighted_loss(
                h, h_t, student, teacher, weights, 5.0, beta=beta, temperature=temperature, chunk_size=3
            )
        loss.backward()
        return loss.detach(), h.grad.clone(), student.weight.grad.clone(), scores

    dense, sparse = run(False), run(True)
    torch.testing.assert_close(sparse[0], dense[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sparse[1], dense[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sparse[2], dense[2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sparse[3].divergence, dense[3].divergence, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sparse[3].teacher_entropy, dense[3].teacher_entropy, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", BETAS)
def test_row_divergence_path_matches_the_autograd_reference(beta):
    """`chunked_divergence` (weights decided after the divergence) against autograd through `sparse_divergence`."""
    h_s, h_t, student, teacher = _rows(seed=3)
    with torch.no_grad():
        ids, lp = topk_log_probs(teacher(h_t), 4)
    h1 = h_s.clone().requires_grad_(True)
    out = chunked_divergence(h1, pack_topk(ids, lp), student, None, beta=beta, chunk_size=2)
    (out.divergence * torch.arange(7.0)).sum().backward()
    h2 = h_s.clone().requires_grad_(True)
    ref = sparse_divergence(student(h2), ids, lp, beta=beta)
    (ref * torch.arange(7.0)).sum().backward()
    torch.testing.assert_close(out.divergence, ref.detach(), rtol=1e-5, atol=1e-6)
    # Same formulas; the weight multiplies before autograd there and after the per-row gradient here (float32).
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-4, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    beta=st.sampled_from(BETAS),
    vocab=st.integers(2, 40),
    scale=st.floats(0.1, 8.0),
)
def test_lower_bound_that_grows_with_k(seed, beta, vocab, scale):
    """Coarse-graining never increases an f-divergence: below the dense value, and non-decreasing over nested top-k.

    The teacher's log-probabilities are float64 here: its tail is `1 − Σ` of the listed values, and float32 rounding
    of those (what a server sends) moves a tiny tail by a relative 1e-2, which a reverse KL shows (next test)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(4, vocab, generator=g, dtype=torch.float64) * scale
    t = torch.randn(4, vocab, generator=g, dtype=torch.float64) * scale
    dense = per_token_divergence(s.float(), t.float(), beta=beta).double()
    teacher_lp = torch.log_softmax(t, dim=-1)
    previous = torch.zeros_like(dense)
    for k in range(1, vocab + 1):
        lp, ids = teacher_lp.topk(k, dim=-1)
        value = sparse_divergence(s.float(), ids, lp, beta=beta)
        assert torch.isfinite(value).all()
        tol = 1e-5 * (1 + dense.abs())
        assert (value <= dense + tol).all(), (k, value, dense)
        assert (value >= previous - tol).all(), (k, value, previous)
        previous = value
    torch.testing.assert_close(previous, dense, rtol=1e-4, atol=1e-5)


def test_padding_slots_take_no_part():
    """-inf log-probabilities and negative ids (fewer entries than k, as a server pads) change nothing."""
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(3, 9, generator=g), torch.randn(3, 9, generator=g)
    ids, lp = topk_log_probs(t, 3)
    padded_ids = torch.cat([ids, torch.tensor([[0, -1]] * 3)], dim=1)
    padded_lp = torch.cat([lp, torch.full((3, 2), -math.inf)], dim=1)
    for beta in BETAS:
        torch.testing.assert_close(
            sparse_divergence(s, padded_ids, padded_lp, beta=beta), sparse_divergence(s, ids, lp, beta=beta)
        )


def test_tail_bins_sum_to_one():
    g = torch.Generator().manual_seed(2)
    s, t = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g)
    ids, lp = topk_log_probs(t, 4)
    log_q, log_p = tail_bin_log_probs(torch.log_softmax(s, -1), ids, lp)
    torch.testing.assert_close(log_q.exp().sum(-1), torch.ones(5))
    torch.testing.assert_close(log_p.exp().sum(-1), torch.ones(5))


def test_peaked_teacher_keeps_reverse_kl_finite():
    """A teacher whose listed mass rounds to 1 still gives a finite reverse KL (the tail is floored, not zero)."""
    t = torch.full((1, 50), -60.0)
    t[0, 3] = 60.0
    s = torch.zeros(1, 50)
    ids, lp = topk_log_probs(t, 1)
    value = sparse_divergence(s, ids, lp, beta=1.0)
    assert torch.isfinite(value).all() and value.item() > 0


def test_float32_teacher_tail_precision():
    """What float32 wire values cost: a teacher token of probability 7e-6 left alone in the tail, where the student
    puts 0.22, moves the reverse KL by 0.04 % (the tail's own relative error, about 0.7 %, times its share)."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(4, 8, generator=g, dtype=torch.float64).float() * 1.96875
    t = torch.randn(4, 8, generator=g, dtype=torch.float64).float() * 1.96875
    ids, lp = topk_log_probs(t, 7)
    dense = per_token_divergence(s, t, beta=1.0)
    error = (sparse_divergence(s, ids, lp, beta=1.0) - dense).abs() / dense
    assert float(error.max()) < 1e-3
