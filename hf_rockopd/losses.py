"""Per-token divergences between a student and a teacher, and the chunked, token-weighted loss built on them.

Everything here is a pure function of tensors (and of the two output heads, called as modules): the trainer decides
which rows to project and with which weights, and this module turns that into numbers.

Conventions follow TRL's `GKDTrainer.generalized_jsd_loss` exactly (Agarwal et al., 2024, Eq. 1):

- `beta == 0`: forward KL, `KL(teacher ‖ student)`;
- `beta == 1`: reverse KL, `KL(student ‖ teacher)` (the rock-token paper's on-policy loss);
- `0 < beta < 1`: `beta · KL(teacher ‖ M) + (1 − beta) · KL(student ‖ M)` with `M = (1 − beta) · student + beta · teacher`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


__all__ = [
    "ChunkedDivergence",
    "chunked_divergence",
    "logit_grad_norm",
    "per_token_divergence",
    "per_token_entropy",
    "weighted_loss",
]


def _validate_beta(beta: float) -> float:
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}.")
    return beta


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
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


def _logit_grad_norm_from_log_probs(
    student_lp: torch.Tensor, teacher_lp: torch.Tensor, beta: float, temperature: float
) -> torch.Tensor:
    s = student_lp.exp()
    if beta == 0.0:
        # d KL(t‖s) / dz = s − t
        grad = s - teacher_lp.exp()
    else:
        if beta == 1.0:
            # d KL(s‖t) / ds_k = log(s_k / t_k) + 1 (the +1 vanishes through the softmax Jacobian)
            a = student_lp - teacher_lp
        else:
            # d JSD / ds_k = (1 − beta) · log(s_k / m_k): the teacher term's derivative cancels the rest.
            mixture_lp = _mixture_log_probs(student_lp, teacher_lp, beta)
            a = (1.0 - beta) * (student_lp - mixture_lp)
        a = a.masked_fill(s == 0, 0.0)
        # Softmax Jacobian: dL/dz_j = s_j (a_j − Σ_k s_k a_k).
        grad = s * (a - (s * a).sum(dim=-1, keepdim=True))
    return grad.norm(dim=-1) / temperature


def logit_grad_norm(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float = 1.0
) -> torch.Tensor:
    """L2 norm of `d per_token_divergence / d student_logits` per row, in closed form (no backward pass).

    This is the per-occurrence "logit-gradient norm" of the rock-token paper's gradient-geometry analysis: how hard a
    token pulls on the student under uniform weights.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.losses import logit_grad_norm, per_token_divergence
    >>> s = torch.randn(2, 8, requires_grad=True); t = torch.randn(2, 8)
    >>> per_token_divergence(s, t, beta=1.0).sum().backward()
    >>> torch.allclose(logit_grad_norm(s.detach(), t, beta=1.0), s.grad.norm(dim=-1), atol=1e-6)
    True
    ```
    """
    beta = _validate_beta(beta)
    return _logit_grad_norm_from_log_probs(
        _log_probs(student_logits, temperature), _log_probs(teacher_logits, temperature), beta, temperature
    )


@dataclass
class ChunkedDivergence:
    """Result of [`chunked_divergence`] for `N` projected rows.

    Attributes:
        divergence (`torch.Tensor`): `(N,)` float32, differentiable with respect to the student.
        student_entropy (`torch.Tensor`): `(N,)` float32, detached.
        teacher_entropy (`torch.Tensor`): `(N,)` float32, detached.
        logit_grad_norm (`torch.Tensor`): `(N,)` float32, detached; see [`logit_grad_norm`].
    """

    divergence: torch.Tensor
    student_entropy: torch.Tensor
    teacher_entropy: torch.Tensor
    logit_grad_norm: torch.Tensor


def chunked_divergence(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    student_head: Callable[[torch.Tensor], torch.Tensor],
    teacher_head: Callable[[torch.Tensor], torch.Tensor],
    beta: float,
    temperature: float = 1.0,
    chunk_size: int = 512,
) -> ChunkedDivergence:
    """Per-row divergence of hidden states projected through the two output heads, `chunk_size` rows at a time.

    Only `chunk_size × V` logits exist at any moment, in the forward and in the backward: each chunk's projection is
    recomputed in the backward pass (activation checkpointing per chunk) instead of keeping `(N, V)` temporaries
    alive. Heads are called as modules, so LoRA-wrapped or quantized output layers work unchanged.

    Args:
        student_hidden (`torch.Tensor`): `(N, H_s)` student last hidden states of the rows to score.
        teacher_hidden (`torch.Tensor`): `(N, H_t)` teacher last hidden states of the same rows.
        student_head, teacher_head (`Callable`): map `(n, H)` hidden states to `(n, V)` logits.
        beta (`float`): see [`per_token_divergence`].
        temperature (`float`, *optional*, defaults to `1.0`): divergence temperature.
        chunk_size (`int`, *optional*, defaults to `512`): rows projected at once.

    Returns:
        [`ChunkedDivergence`]

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.losses import chunked_divergence
    >>> head = torch.nn.Linear(4, 11, bias=False)
    >>> out = chunked_divergence(torch.randn(5, 4), torch.randn(5, 4), head, head, beta=1.0, chunk_size=2)
    >>> out.divergence.shape
    torch.Size([5])
    ```
    """
    if student_hidden.shape[0] != teacher_hidden.shape[0]:
        raise ValueError(
            f"student_hidden and teacher_hidden must have the same number of rows, got {student_hidden.shape[0]} "
            f"and {teacher_hidden.shape[0]}."
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    beta = _validate_beta(beta)
    n = student_hidden.shape[0]
    device = student_hidden.device
    if n == 0:
        empty = torch.zeros(0, device=device, dtype=torch.float32)
        return ChunkedDivergence(empty, empty, empty, empty)

    needs_grad = torch.is_grad_enabled() and student_hidden.requires_grad
    divergences, s_ent, t_ent, g_norm = [], [], [], []
    for start in range(0, n, chunk_size):
        h_s = student_hidden[start : start + chunk_size]
        h_t = teacher_hidden[start : start + chunk_size]
        stats: dict[str, torch.Tensor] = {}

        def chunk_fn(h_s: torch.Tensor, h_t: torch.Tensor, stats: dict = stats) -> torch.Tensor:
            student_lp = _log_probs(student_head(h_s), temperature)
            with torch.no_grad():
                teacher_lp = _log_probs(teacher_head(h_t), temperature)
            div = _divergence_from_log_probs(student_lp, teacher_lp, beta)
            # The statistics are gradient-free; compute them once (the forward), not again when the backward
            # recomputes this chunk.
            if not stats:
                with torch.no_grad():
                    s_det = student_lp.detach()
                    stats["s_ent"] = -(s_det.exp() * s_det.masked_fill(s_det == -math.inf, 0.0)).sum(-1)
                    stats["t_ent"] = -(teacher_lp.exp() * teacher_lp.masked_fill(teacher_lp == -math.inf, 0.0)).sum(
                        -1
                    )
                    stats["g_norm"] = _logit_grad_norm_from_log_probs(s_det, teacher_lp, beta, temperature)
            return div

        if needs_grad:
            div = checkpoint(chunk_fn, h_s, h_t, use_reentrant=False)
        else:
            div = chunk_fn(h_s, h_t)
        divergences.append(div)
        s_ent.append(stats["s_ent"])
        t_ent.append(stats["t_ent"])
        g_norm.append(stats["g_norm"])
    return ChunkedDivergence(
        divergence=torch.cat(divergences),
        student_entropy=torch.cat(s_ent),
        teacher_entropy=torch.cat(t_ent),
        logit_grad_norm=torch.cat(g_norm),
    )


def weighted_loss(
    divergence: torch.Tensor,
    weights: torch.Tensor,
    normalizer: torch.Tensor | float,
) -> torch.Tensor:
    """`Σ weights · divergence / normalizer`, the token-weighted OPD loss.

    Which normalizer to pass is the trainer's `rock_normalization` choice: the number of valid completion tokens
    (`"tokens"`, so down-weighting a token never raises the effective learning rate of the others — the defect of the
    paper's soft-weight ablation) or the sum of the weights (`"weights"`). A normalizer of 0 (no valid token) is
    treated as 1, so an empty batch gives exactly 0.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.losses import weighted_loss
    >>> float(weighted_loss(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 0.0]), normalizer=2))
    0.5
    ```
    """
    if divergence.shape != weights.shape:
        raise ValueError(f"divergence and weights must have the same shape, got {divergence.shape} and {weights.shape}.")
    if not torch.is_tensor(normalizer):
        normalizer = torch.tensor(float(normalizer), device=divergence.device)
    normalizer = normalizer.to(device=divergence.device, dtype=torch.float32)
    normalizer = torch.where(normalizer > 0, normalizer, torch.ones_like(normalizer))
    return (divergence * weights.to(divergence.dtype)).sum() / normalizer
