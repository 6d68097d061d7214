"""The divergence against a teacher known only by its top-k log-probabilities: k categories plus one tail bin.

A served teacher (vLLM's `prompt_logprobs`), an offline cache or a truncated in-process teacher gives, per position,
the ids of its k most likely tokens and their log-probabilities. The vocabulary is then collapsed into k + 1
categories: each of those ids, and a tail bin holding the rest of the mass (teacher: `1 − Σ top-k`; student: the mass
its own full softmax puts outside those ids). `D_beta` is computed over these categories with the dense reference's
formulas (TRL's `beta` convention, see [`reference`](./reference.py)).

Two properties a user can rely on, both tested:

- at k = V (every id listed) it is the dense divergence, value and gradient;
- it is a coarse-graining of the dense distributions, so by the data-processing inequality (each of the three
  divergences is an f-divergence, or a sum of two KLs to a mixture that coarse-grains with them) it never exceeds
  the dense value, and it does not decrease as nested top-k sets grow.

Slots that carry no teacher entry (an id < 0, or a log-probability of `-inf`: fewer entries than k, padding) take
part in neither distribution. The student's logits and their gradient stay `(n, V)`: only the teacher is sparse.

Example:
```python
>>> import torch
>>> from hf_rockopd.losses import per_token_divergence
>>> from hf_rockopd.losses.sparse import sparse_divergence, topk_log_probs
>>> s, t = torch.randn(3, 10), torch.randn(3, 10)
>>> ids, lp = topk_log_probs(t, k=10)
>>> torch.allclose(sparse_divergence(s, ids, lp, beta=1.0), per_token_divergence(s, t, beta=1.0), atol=1e-6)
True
>>> ids, lp = topk_log_probs(t, k=2)
>>> bool((sparse_divergence(s, ids, lp, beta=1.0) <= per_token_divergence(s, t, beta=1.0) + 1e-6).all())
True
```
"""

from __future__ import annotations

import math

import torch

from .reference import _divergence_from_log_probs, _log_probs, _validate_beta


__all__ = ["pack_topk", "sparse_divergence", "tail_bin_log_probs", "topk_log_probs", "unpack_topk"]

# Ids travel packed beside the log-probabilities in one float32 tensor (see `pack_topk`); float32 holds every integer
# below 2**24 exactly, far above any tokenizer's vocabulary.
_MAX_PACKED_ID = 2**24

# The teacher's tail mass is `1 − Σ top-k` in float64; when the listed mass rounds to 1 while the student still puts
# mass outside the listed ids, a zero tail would make the reverse KL infinite. Floor it here (a tail of 1e-12 is
# "the teacher rules the rest out", which is what the rounding meant).
_TAIL_FLOOR = 1e-12


def topk_log_probs(logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` most likely ids of `softmax(logits / temperature)` and their log-probabilities, most likely first:
    what a served teacher returns, from in-process logits (for measurement and tests).

    Returns `(ids, log_probs)`, `(N, k)` int64 and float32.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.losses.sparse import topk_log_probs
    >>> ids, lp = topk_log_probs(torch.tensor([[0.0, 2.0, 1.0]]), k=2)
    >>> ids.tolist(), round(float(lp.exp().sum()), 3)
    ([[1, 2]], 0.91)
    ```
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}.")
    lp = _log_probs(logits, temperature)
    values, ids = lp.topk(min(int(k), lp.shape[-1]), dim=-1)
    return ids, values


def pack_topk(ids: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """`(..., k)` ids and log-probabilities as one `(..., 2, k)` float32 tensor, so that the rows of a batch can be
    selected and chunked like hidden states (`packed[mask]`, `packed[rows]`). Padding ids (< 0) become -1.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.losses.sparse import pack_topk, unpack_topk
    >>> packed = pack_topk(torch.tensor([[5, 2]]), torch.tensor([[-0.1, -2.5]]))
    >>> packed.shape, unpack_topk(packed)[0].tolist()
    (torch.Size([1, 2, 2]), [[5, 2]])
    ```
    """
    if ids.shape != log_probs.shape:
        raise ValueError(f"ids and log_probs must have the same shape, got {tuple(ids.shape)} and {tuple(log_probs.shape)}.")
    if ids.numel() and int(ids.max()) >= _MAX_PACKED_ID:
        raise ValueError(f"token id {int(ids.max())} is too large to pack (ids must be < {_MAX_PACKED_ID}).")
    return torch.stack([ids.clamp(min=-1).float(), log_probs.float()], dim=-2)


def unpack_topk(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The `(ids, log_probs)` of a [`pack_topk`] tensor: `(..., k)` int64 and float32."""
    return packed[..., 0, :].long(), packed[..., 1, :]


def tail_bin_log_probs(
    student_log_probs: torch.Tensor, ids: torch.Tensor, teacher_log_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both distributions collapsed onto the teacher's listed ids plus a tail bin: `(log Q, log P)`, each `(N, k + 1)`.

    `student_log_probs` is the student's full `(N, V)` log-softmax (differentiable through it), `ids` and
    `teacher_log_probs` the teacher's `(N, k)` entries. Unused slots (id < 0 or log-probability `-inf`) are `-inf` in
    both. When the listed ids cover the whole vocabulary, the tail is empty (`-inf`) in both.
    """
    valid = (ids >= 0) & torch.isfinite(teacher_log_probs)
    safe_ids = ids.clamp(min=0)
    student_listed = student_log_probs.gather(-1, safe_ids).masked_fill(~valid, -math.inf)
    # A sum rather than a boolean scatter: padding slots point at id 0 and must not mark it as listed.
    covered = torch.zeros_like(student_log_probs).scatter_add_(-1, safe_ids, valid.to(student_log_probs.dtype)) > 0
    student_tail = torch.logsumexp(student_log_probs.masked_fill(covered, -math.inf), dim=-1, keepdim=True)
    # float32 at least; a float64 teacher stays float64 (and the result with it): the tail's precision is the listed
    # values' (see `_TAIL_FLOOR` and docs/teacher.md on float32 wire values).
    dtype = torch.promote_types(teacher_log_probs.dtype, torch.float32)
    teacher = teacher_log_probs.to(dtype).masked_fill(~valid, -math.inf)
    # log(1 − exp(lse)) through expm1 in float64: `1 − Σ exp` loses the tail's digits when the listed mass is near 1.
    listed = torch.logsumexp(teacher.double(), dim=-1, keepdim=True)
    teacher_tail = (-torch.expm1(listed)).clamp(min=_TAIL_FLOOR).log().to(dtype)
    complete = torch.isneginf(student_tail)  # every id listed: there is no tail on either side
    teacher_tail = teacher_tail.masked_fill(complete, -math.inf)
    log_q = torch.cat([student_listed, student_tail], dim=-1)
    return log_q.to(torch.promote_types(log_q.dtype, dtype)), torch.cat([teacher, teacher_tail], dim=-1)


def sparse_divergence(
    student_logits: torch.Tensor,
    ids: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Generalized JSD per row between the student's `(N, V)` logits and a top-k teacher, over the k listed ids plus
    a tail bin (see the module docstring). Differentiable with respect to `student_logits` by autograd: the reference
    the chunked sparse loss is tested against.

    `teacher_log_probs` are taken as given (at the loss temperature already); `temperature` divides the student's
    logits only.

    Example: see the module docstring.
    """
    if ids.shape != teacher_log_probs.shape or ids.shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(
            f"ids {tuple(ids.shape)} and teacher_log_probs {tuple(teacher_log_probs.shape)} must be (N, k) for "
            f"student_logits {tuple(student_logits.shape)}."
        )
    beta = _validate_beta(beta)
    log_q, log_p = tail_bin_log_probs(_log_probs(student_logits, temperature), ids, teacher_log_probs)
    return _divergence_from_log_probs(log_q, log_p, beta)


def sparse_chunk_terms(
    student_logits: torch.Tensor, packed: torch.Tensor, beta: float, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(divergence, student entropy, teacher entropy, logit-gradient norm, d divergence / d logits)` of one chunk
    against packed top-k targets, as the chunked loss needs them. The teacher's entropy is that of its k + 1
    categories (a lower bound of its full entropy); the student's is exact.

    The gradient is autograd's through the `(n, V)` log-softmax of the chunk: a few passes over it, each chunk on its
    own, so no `(N, V)` tensor outlives its chunk.
    """
    ids, teacher_lp = unpack_topk(packed)
    with torch.enable_grad():
        z = student_logits.detach().float().requires_grad_(True)
        ls = _log_probs(z, temperature)
        log_q, log_p = tail_bin_log_probs(ls, ids, teacher_lp)
        div = _divergence_from_log_probs(log_q, log_p, beta)
        (grad,) = torch.autograd.grad(div.sum(), z)
    ls = ls.detach()

    def entropy(lp: torch.Tensor) -> torch.Tensor:
        return -(lp.exp() * lp.masked_fill(torch.isneginf(lp), 0.0)).sum(-1)

    return div.detach(), entropy(ls), entropy(log_p), torch.linalg.vector_norm(grad, dim=-1), grad
