"""The closed-form terms of one chunk of logits: divergence, both entropies, and the divergence's gradient with respect
to the student logits, written out instead of back-propagated through the softmaxes.

[`fused`](./fused.py) projects hidden states chunk by chunk and hands each chunk's logits here. On CUDA the pure
formulas ([`_terms_math`]) are compiled with `torch.compile` unless the caller asks otherwise (`compile=False`, or
`HF_ROCKOPD_COMPILE_LOSS=0` in the environment, read at each call); on the CPU the eager, in-place formulas run.
"""

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.utils import logging

from .reference import _divergence_from_log_probs, _log_probs, _validate_beta, _validate_temperature


logger = logging.get_logger(__name__)


__all__ = ["ChunkedDivergence", "logit_grad_norm"]


def logit_grad_norm(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
    *,
    compile: bool | None = None,
) -> torch.Tensor:
    """L2 norm of `d per_token_divergence / d student_logits` per row, in closed form (no backward pass).

    This is the per-occurrence "logit-gradient norm" of the rock-token paper's gradient-geometry analysis: how hard a
    token pulls on the student under uniform weights. `compile`: use the `torch.compile`d formulas on CUDA (`None`:
    unless `HF_ROCKOPD_COMPILE_LOSS=0`); the CPU always runs the eager ones.

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
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student_logits and teacher_logits must have the same shape, got {tuple(student_logits.shape)} and "
            f"{tuple(teacher_logits.shape)}."
        )
    beta = _validate_beta(beta)
    _validate_temperature(temperature)
    terms = _chunk_terms(
        student_logits.detach(), teacher_logits.detach(), beta, temperature, compile=_compile_requested(compile)
    )
    return terms.logit_grad_norm


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


def _dot_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`Σ_k a[i, k] · b[i, k]` per row, a few rows at a time: `vecdot` materializes the `(n, V)` product, which would
    be the chunk's largest buffer after its 4 softmaxes. Not `bmm`: its float32 dot accumulates serially, 10x less
    accurate over V = 49,152 (measured: 1.3e-4 vs 1.0e-5 relative), which broke the 1e-5 agreement with TRL's losses."""
    block = _DOT_BLOCK_ENTRIES_CUDA if a.is_cuda else _DOT_BLOCK_ENTRIES
    rows = max(1, block // max(1, a.shape[-1]))
    if a.shape[0] <= rows:
        return torch.linalg.vecdot(a, b, dim=-1)
    return torch.cat([torch.linalg.vecdot(a[i : i + rows], b[i : i + rows], dim=-1) for i in range(0, a.shape[0], rows)])


_DOT_BLOCK_ENTRIES = 2**20  # 4 MiB of float32 products at once
# On a GPU each block is two kernel launches: at 4 MiB a 512-row chunk over V = 151,936 took 85 blocks per dot and
# the loss path ran launch-bound, 2.2x slower than GKD's (H200, BENCHMARKS.md). 256 MiB blocks: one or two per dot.
_DOT_BLOCK_ENTRIES_CUDA = 2**26


def _log_softmax_and_softmax(z: torch.Tensor, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`(log_softmax(z), softmax(z))` over the last dim from one `exp` pass; with `inplace` the log-softmax
    overwrites `z`, so a chunk holds 2 `(n, V)` buffers per model instead of 3.

    Also more accurate than `torch.log_softmax` in float32 on the CPU: over V = 49,152 its entries are off by up to
    5e-6 (1.8e-6 this way, against float64), which the mixture's gradient amplifies to 3e-5 relative (6e-6 this way).
    """
    m = z.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf rows: nan below, caught by the caller
    p = (z - m).exp_()
    total = p.sum(dim=-1, keepdim=True)
    shift = m + total.log()
    return (z.sub_(shift) if inplace else z - shift), p.div_(total)


@dataclass
class _ChunkTerms(ChunkedDivergence):
    grad: torch.Tensor  # d divergence[i] / d student_logits[i], float32 (n, V)


def _terms_math(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(divergence, student entropy, teacher entropy, logit-gradient norm, gradient)` of a chunk: the closed forms of
    [`_chunk_terms`] written as one pure function, for `torch.compile` to fuse into a few kernels on CUDA (eager, the
    same formulas cost ~30 passes over the `(n, V)` chunk and a buffer per intermediate)."""
    z_s, z_t = student_logits.float() / temperature, teacher_logits.float() / temperature
    ls, lt = torch.log_softmax(z_s, dim=-1), torch.log_softmax(z_t, dim=-1)
    s, t = ls.exp(), lt.exp()
    s_ent, t_ent = -(s * ls).sum(-1), -(t * lt).sum(-1)
    if beta == 0.0:
        div = (t * (lt - ls)).sum(-1)
        grad = s - t
    elif beta == 1.0:
        a = ls - lt
        div = (s * a).sum(-1)
        grad = s * (a - div.unsqueeze(1))
    else:
        lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
        a = ls - lm
        s_a = (s * a).sum(-1)
        div = beta * (t * (lt - lm)).sum(-1) + (1.0 - beta) * s_a
        grad = (1.0 - beta) * s * (a - s_a.unsqueeze(1))
    grad = grad / temperature
    return div, s_ent, t_ent, torch.linalg.vector_norm(grad, dim=-1), grad


# `torch.compile` of `_terms_math` on CUDA. Not on the CPU: there the eager formulas are the more accurate (see
# `_log_softmax_and_softmax`, `_dot_rows`) and compiling costs minutes.
COMPILE_ENV = "HF_ROCKOPD_COMPILE_LOSS"
# Caches, not switches: the compiled function (built on first use) and whether the compiler failed in this process.
_COMPILED_TERMS: Callable | None = None
_COMPILE_FAILED = False


def _compile_requested(compile: bool | None = None) -> bool:
    """The caller's choice, or with `None` the environment's at this call: compiled unless `HF_ROCKOPD_COMPILE_LOSS=0`.

    Example:
    ```python
    >>> from hf_rockopd.losses.closed_form import _compile_requested
    >>> _compile_requested(False), _compile_requested(True)
    (False, True)
    ```
    """
    if compile is not None:
        return bool(compile)
    return os.environ.get(COMPILE_ENV, "1") != "0"


def _compiled_terms(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float):
    """`_terms_math` compiled (once; `dynamic` so the last, shorter chunk of a batch does not recompile), or `None`
    off CUDA or once compiling failed (the failure is logged once and the eager formulas are used from then on)."""
    global _COMPILED_TERMS, _COMPILE_FAILED
    if _COMPILE_FAILED or not student_logits.is_cuda:
        return None
    if _COMPILED_TERMS is None:
        _COMPILED_TERMS = torch.compile(_terms_math, dynamic=True)
    try:
        return _COMPILED_TERMS(student_logits, teacher_logits, beta, temperature)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as err:  # a compiler failure: the eager path computes the same numbers
        _COMPILE_FAILED = True
        logger.warning(f"torch.compile of the chunked loss failed ({type(err).__name__}: {err}); using eager formulas.")
        return None


def _chunk_terms(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    beta: float,
    temperature: float,
    overwrite_student: bool = False,
    overwrite_teacher: bool = False,
    compile: bool = False,
) -> _ChunkTerms | None:
    """Divergence, both entropies and the closed-form gradient of one chunk of logits, with as few `(n, V)` passes
    and buffers as the formulas allow (log-softmaxes are overwritten in place once their entropy is taken; with
    `overwrite_*`, so are the float32 logits passed in).

    The closed forms are those of [`logit_grad_norm`]. They hold wherever both log-softmaxes are finite; a chunk with
    `-inf` logits (banned tokens) gives a non-finite value somewhere and is redone by the masked autograd reference,
    so edge cases cost time only where they occur. If logits were overwritten they are gone by then, and `None` asks
    the caller to project the chunk again. With `compile` (and CUDA logits) the compiled pure formulas run instead.
    """
    compiled = _compiled_terms(student_logits, teacher_logits, beta, temperature) if compile else None
    if compiled is not None:
        # The compiled formulas overwrite nothing: a non-finite chunk can be redone from the same logits.
        return _finite_or_masked(student_logits, teacher_logits, beta, temperature, False, *compiled)
    z_s, z_t = student_logits.float(), teacher_logits.float()
    if temperature != 1.0:
        z_s, z_t = z_s / temperature, z_t / temperature
    own_s, own_t = overwrite_student or z_s is not student_logits, overwrite_teacher or z_t is not teacher_logits
    ls, s = _log_softmax_and_softmax(z_s, inplace=own_s)
    lt, t = _log_softmax_and_softmax(z_t, inplace=own_t)
    del z_s, z_t
    s_ent, t_ent = -_dot_rows(s, ls), -_dot_rows(t, lt)
    if beta == 0.0:
        # KL(t ‖ s); d/dz = s − t.
        div = _dot_rows(t, lt.sub_(ls))
        del ls, lt
        grad = s.sub_(t)
    elif beta == 1.0:
        # KL(s ‖ t); d/dz_j = s_j (a_j − Σ_k s_k a_k) with a = log s − log t, and Σ_k s_k a_k is the divergence itself.
        del t
        a = ls.sub_(lt)
        del lt
        div = _dot_rows(s, a)
        grad = a.sub_(div.unsqueeze(1)).mul_(s)
    else:
        # The mixture is computed once, into one new buffer: log M = log β + logaddexp(log s + log((1−β)/β), log t).
        lm = ls + (math.log1p(-beta) - math.log(beta))
        torch.logaddexp(lm, lt, out=lm).add_(math.log(beta))
        a = ls.sub_(lm)
        s_a = _dot_rows(s, a)
        div = beta * _dot_rows(t, lt.sub_(lm)) + (1.0 - beta) * s_a
        del lm, lt, t
        grad = a.sub_(s_a.unsqueeze(1)).mul_(s).mul_(1.0 - beta)
    if temperature != 1.0:
        grad.div_(temperature)
    del s
    g_norm = torch.linalg.vector_norm(grad, dim=-1)
    return _finite_or_masked(
        student_logits, teacher_logits, beta, temperature, overwrite_student or overwrite_teacher,
        div, s_ent, t_ent, g_norm, grad,
    )  # fmt: skip


def _finite_or_masked(
    student_logits, teacher_logits, beta, temperature, overwritten, div, s_ent, t_ent, g_norm, grad
) -> _ChunkTerms | None:
    """The chunk's terms if all are finite; else the masked reference's, or `None` (project again) if the logits were
    overwritten."""
    if not bool(torch.isfinite(torch.stack([div, s_ent, t_ent, g_norm])).all()):
        del grad
        if overwritten:
            return None
        return _chunk_terms_masked(student_logits, teacher_logits, beta, temperature)
    return _ChunkTerms(div, s_ent, t_ent, g_norm, grad)


def _chunk_terms_masked(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float
) -> _ChunkTerms:
    """[`_chunk_terms`] through the masked reference formulas and autograd: exact 0 (with a finite gradient) for
    entries that are impossible under both distributions, `inf` where only one of them rules a token out."""
    with torch.enable_grad():
        z = student_logits.detach().float().requires_grad_(True)
        ls = _log_probs(z, temperature)
        lt = _log_probs(teacher_logits.detach(), temperature)
        div = _divergence_from_log_probs(ls, lt, beta)
        (grad,) = torch.autograd.grad(div.sum(), z)
    ls = ls.detach()

    def entropy(lp: torch.Tensor) -> torch.Tensor:
        return -(lp.exp() * lp.masked_fill(torch.isneginf(lp), 0.0)).sum(-1)

    return _ChunkTerms(div.detach(), entropy(ls), entropy(lt), torch.linalg.vector_norm(grad, dim=-1), grad)

