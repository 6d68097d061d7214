"""Per-token divergences between a student and a teacher, from full logits: the reference every chunked path must equal.

Conventions follow TRL's `GKDTrainer.generalized_jsd_loss` exactly (Agarwal et al., 2024, Eq. 1):

- `beta == 0`: forward KL, `KL(teacher ‖ student)`;
- `beta == 1`: reverse KL, `KL(student ‖ teacher)` (the rock-token paper's on-policy loss);
- `0 < beta < 1`: `beta · KL(teacher ‖ M) + (1 − beta) · KL(student ‖ M)`, `M = (1 − beta) · student + beta · teacher`.

These take `(N, V)` logits and let autograd differentiate them; they handle `-inf` logits (banned tokens) exactly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


__all__ = ["per_token_divergence", "per_token_entropy"]


def _validate_beta(beta: float) -> float:
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}.")
    return beta


def _validate_temperature(temperature: float) -> float:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    return float(temperature)


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    _validate_temperature(temperature)
    # float32 internally: bf16 log-softmax over 150k entries loses the small probabilities the KL is made of.
    logits = logits.float()
    if temperature != 1.0:
        # Skipped at 1: a full (rows, V) pass in the forward and again in the backward, for an exact no-op.
        logits = logits / temperature
    return F.log_softmax(logits, dim=-1)


def _kl_from_log_probs(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """`KL(p ‖ q)` per row. Entries with `p == 0` (e.g. `-inf` logits) contribute exactly 0, with a finite gradient.

    `F.kl_div` computes `0 · (−inf − x) = nan` there; masking the logs before the product keeps both the value and its
    gradient finite (a `torch.where` after the product would still back-propagate `0 · inf`).
    """
    p = log_p.exp()
    support = p > 0
    log_p = log_p.masked_fill(~support, 0.0)
    log_q = log_q.masked_fill(~support, 0.0)
    return (p * (log_p - log_q)).sum(dim=-1)


def _mixture_log_probs(student_lp: torch.Tensor, teacher_lp: torch.Tensor, beta: float) -> torch.Tensor:
    """`log((1 − beta) · s + beta · t)`. Where both are 0 (`-inf` logits in both models) the logsumexp backward would
    compute `exp(−inf − (−inf)) = nan`, so those entries are taken out of the logsumexp and set to `-inf` after."""
    neither = torch.isneginf(student_lp) & torch.isneginf(teacher_lp)
    parts = torch.stack(
        [
            (student_lp + math.log1p(-beta)).masked_fill(neither, 0.0),
            (teacher_lp + math.log(beta)).masked_fill(neither, 0.0),
        ]
    )
    return torch.logsumexp(parts, dim=0).masked_fill(neither, -math.inf)


def _divergence_from_log_probs(student_lp: torch.Tensor, teacher_lp: torch.Tensor, beta: float) -> torch.Tensor:
    if beta == 0.0:
        return _kl_from_log_probs(teacher_lp, student_lp)
    if beta == 1.0:
        return _kl_from_log_probs(student_lp, teacher_lp)
    mixture_lp = _mixture_log_probs(student_lp, teacher_lp, beta)
    return beta * _kl_from_log_probs(teacher_lp, mixture_lp) + (1.0 - beta) * _kl_from_log_probs(
        student_lp, mixture_lp
    )


def per_token_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Generalized Jensen–Shannon divergence per row, with TRL's `beta` convention.

    Args:
        student_logits (`torch.Tensor`): `(N, V)` student logits (any float dtype; computed in float32).
        teacher_logits (`torch.Tensor`): `(N, V)` teacher logits.
        beta (`float`): `0` forward KL `KL(teacher‖student)`, `1` reverse KL `KL(student‖teacher)`, in between the
            mixture form.
        temperature (`float`, *optional*, defaults to `1.0`): both logits are divided by it before the softmax.

    Returns:
        `torch.Tensor`: `(N,)` float32 divergences, differentiable with respect to both inputs.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.losses import per_token_divergence
    >>> s, t = torch.randn(3, 10), torch.randn(3, 10)
    >>> per_token_divergence(s, t, beta=1.0).shape
    torch.Size([3])
    >>> float(per_token_divergence(s, s, beta=0.5).abs().max()) < 1e-6
    True
    ```
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student_logits and teacher_logits must have the same shape, got {tuple(student_logits.shape)} and "
            f"{tuple(teacher_logits.shape)}. Student and teacher must share a vocabulary."
        )
    beta = _validate_beta(beta)
    return _divergence_from_log_probs(
        _log_probs(student_logits, temperature), _log_probs(teacher_logits, temperature), beta
    )


def per_token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Shannon entropy (nats) of `softmax(logits / temperature)` per row, float32, `(N, V) -> (N,)`.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.losses import per_token_entropy
    >>> round(float(per_token_entropy(torch.zeros(1, 4))), 4)  # log(4)
    1.3863
    ```
    """
    lp = _log_probs(logits, temperature)
    p = lp.exp()
    return -(p * lp.masked_fill(p == 0, 0.0)).sum(dim=-1)

