"""Per-token divergences between a student and a teacher, and the chunked, token-weighted loss built on them.

Everything here is a pure function of tensors (and of the two output heads, called as modules): the trainer decides
which rows to project and with which weights, and this module turns that into numbers.

Conventions follow TRL's `GKDTrainer.generalized_jsd_loss` exactly (Agarwal et al., 2024, Eq. 1):

- `beta == 0`: forward KL, `KL(teacher ‖ student)`;
- `beta == 1`: reverse KL, `KL(student ‖ teacher)` (the rock-token paper's on-policy loss);
- `0 < beta < 1`: `beta · KL(teacher ‖ M) + (1 − beta) · KL(student ‖ M)` with `M = (1 − beta) · student + beta · teacher`.

Two chunked entry points project hidden states through the heads `chunk_size` rows at a time, so no `(N, V)` tensor
ever exists, and write the gradient in closed form instead of back-propagating through the softmaxes:

- [`chunked_weighted_loss`]: weights known before projecting (fixed rock sets, the usual case). Each chunk's gradient
  is formed and pushed through the head in the forward pass, 4 matrix products per chunk, as many as full logits need.
- [`chunked_divergence`]: per-row divergences that stay differentiable, for weights computed from them (quantile or
  entropy policies). 3 matrix products per chunk with a frozen head (LoRA), 6 with a trainable one.

The measured effect is in BENCHMARKS.md (`python -m benchmarks.loss_path`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from packaging.version import Version
from transformers.utils import logging


logger = logging.get_logger(__name__)


__all__ = [
    "ChunkedDivergence",
    "chunked_divergence",
    "chunked_weighted_loss",
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
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student_logits and teacher_logits must have the same shape, got {tuple(student_logits.shape)} and "
            f"{tuple(teacher_logits.shape)}."
        )
    beta = _validate_beta(beta)
    _validate_temperature(temperature)
    return _chunk_terms(student_logits.detach(), teacher_logits.detach(), beta, temperature).logit_grad_norm


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


# `torch.compile` of `_terms_math` on CUDA; `HF_ROCKOPD_COMPILE_LOSS=0` keeps the eager formulas. Not on the CPU: there
# the eager formulas are the more accurate (see `_log_softmax_and_softmax`, `_dot_rows`) and compiling costs minutes.
_COMPILE_ON_CUDA = os.environ.get("HF_ROCKOPD_COMPILE_LOSS", "1") != "0"
_COMPILED_TERMS: Callable | None = None


def _compiled_terms(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float):
    """`_terms_math` compiled (once; `dynamic` so the last, shorter chunk of a batch does not recompile), or `None`
    where compiling is off or failed (the failure is logged once and the eager formulas are used from then on)."""
    global _COMPILE_ON_CUDA, _COMPILED_TERMS
    if not (_COMPILE_ON_CUDA and student_logits.is_cuda):
        return None
    if _COMPILED_TERMS is None:
        _COMPILED_TERMS = torch.compile(_terms_math, dynamic=True)
    try:
        return _COMPILED_TERMS(student_logits, teacher_logits, beta, temperature)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as err:  # a compiler failure: the eager path computes the same numbers
        _COMPILE_ON_CUDA = False
        logger.warning(f"torch.compile of the chunked loss failed ({type(err).__name__}: {err}); using eager formulas.")
        return None


def _chunk_terms(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    beta: float,
    temperature: float,
    overwrite_student: bool = False,
    overwrite_teacher: bool = False,
) -> _ChunkTerms | None:
    """Divergence, both entropies and the closed-form gradient of one chunk of logits, with as few `(n, V)` passes
    and buffers as the formulas allow (log-softmaxes are overwritten in place once their entropy is taken; with
    `overwrite_*`, so are the float32 logits passed in).

    The closed forms are those of [`logit_grad_norm`]. They hold wherever both log-softmaxes are finite; a chunk with
    `-inf` logits (banned tokens) gives a non-finite value somewhere and is redone by the masked autograd reference,
    so edge cases cost time only where they occur. If logits were overwritten they are gone by then, and `None` asks
    the caller to project the chunk again.
    """
    compiled = _compiled_terms(student_logits, teacher_logits, beta, temperature)
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


def _trainable_leaves(head: Callable[[torch.Tensor], torch.Tensor], probe: torch.Tensor) -> list[torch.Tensor]:
    """The tensors requiring grad that `head` reads (its weight, LoRA factors, a tied embedding, ...), found from the
    autograd graph of one row, so closures and wrapped or quantized modules need no declaration."""
    # The graph is only walked, never back-propagated: save nothing for it.
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda _: None, lambda _: None):
        out = head(probe.detach())
    leaves: dict[int, torch.Tensor] = {}
    stack, seen = [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves[id(variable)] = variable
        stack.extend(fn for fn, _ in node.next_functions)
    return list(leaves.values())


@dataclass(frozen=True)
class _Heads:
    student: Callable[[torch.Tensor], torch.Tensor]
    teacher: Callable[[torch.Tensor], torch.Tensor]
    beta: float
    temperature: float
    chunk_size: int


def _bare_linear(head: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether `head` is a bare `nn.Linear`: no hooks, no subclass such as a LoRA or 4-bit layer."""
    if type(head) is not torch.nn.Linear:
        return False
    hooks = (head._forward_hooks, head._forward_pre_hooks)
    return not (
        any(hooks) or torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks
    )


def _plain_linear(head: Callable[[torch.Tensor], torch.Tensor], params: list[torch.Tensor]) -> bool:
    """Whether `head` is a bare `nn.Linear` whose trainable tensors are exactly its weight and, if it trains one, its
    bias."""
    if not params or not _bare_linear(head):
        return False
    own = [head.weight] + ([head.bias] if head.bias is not None and head.bias.requires_grad else [])
    return head.weight.requires_grad and {id(p) for p in params} == {id(p) for p in own}


# `torch.mm(..., out_dtype=torch.float32)` on bf16/fp16 CUDA tensors (torch >= 2.8): a half-precision product on the
# tensor cores with a float32 result, as TRL's `kernels/chunked_logprob._addmm_fp32` uses it. Elsewhere (CPU) the
# operands are upcast instead; a float32 product there costs about what a bf16 one does.
_MM_OUT_DTYPE = Version(torch.__version__.split("+")[0]) >= Version("2.8")


def _half_on_cuda(t: torch.Tensor) -> bool:
    return _MM_OUT_DTYPE and t.device.type == "cuda" and t.dtype in (torch.float16, torch.bfloat16)


def _addmm_float32(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`acc + a @ b` in float32, in place when `acc` exists (rounding each chunk's product to bf16 before summing
    would bias the head's gradient, see TRL's `kernels/chunked_logprob._addmm_fp32`).

    With half-precision CUDA operands `a` is rounded to `b`'s dtype (the logit gradient, as autograd and TRL's kernel
    round it) and the product runs on the tensor cores: upcasting both to float32 instead made the head's gradient
    the slowest matrix product of the loss on a GPU (float32 without TF32 is ~15x slower than bf16 on an H100)."""
    if _half_on_cuda(b):
        a = a.to(b.dtype)
        if acc is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    a, b = a.float(), b.float()
    return torch.mm(a, b) if acc is None else acc.addmm_(a, b)


def _logits(head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """`head(h)`, but a bare half-precision `nn.Linear` on CUDA writes float32 logits: rounding logits to bf16 before
    the softmax costs up to 2^-9 of each logit (0.04 at a logit of 10), more than the divergence tolerates. TRL's
    DistillationTrainer kernel projects the same way (`kernels/chunked_divergence._project`). Only for projections
    that no graph is built through."""
    if _half_on_cuda(h) and _bare_linear(head) and head.weight.dtype == h.dtype:
        z = torch.mm(h, head.weight.t(), out_dtype=torch.float32)
        return z if head.bias is None else z.add_(head.bias)
    return head(h)


class _StudentGrads:
    """Gradients of the student hidden rows and head tensors, accumulated chunk by chunk from `d loss / d logits`.

    Through autograd, every chunk allocates its own `(V, H)` head gradient before it is added to the total: twice
    the head's size at once (2.3 GiB at Qwen3's 151,936 × 2,048 head in float32). A bare `nn.Linear` head, the
    usual case, is instead differentiated by hand: `d W += g^T h` written in place into one float32 buffer.
    """

    def __init__(self, heads: _Heads, hidden: torch.Tensor, want_hidden: bool, params: list[torch.Tensor]):
        self.heads, self.want_hidden, self.params = heads, want_hidden, params
        self.linear = _plain_linear(heads.student, params)
        self.hidden = torch.zeros_like(hidden) if want_hidden else None
        self.head: list[torch.Tensor | None] = [None] * len(params)

    def project(self, h_s: torch.Tensor, h_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, _ChunkTerms]:
        """`(h, z_s, terms)` of one chunk; `z_s` keeps its graph back to `h` and the head unless differentiated by
        hand."""
        h = h_s.detach().requires_grad_(self.want_hidden and not self.linear)
        track = (self.want_hidden or bool(self.params)) and not self.linear
        return (h, *_project_chunk(self.heads, h, h_t, track))

    def add(self, rows: slice, h: torch.Tensor, z_s: torch.Tensor, grad_logits: torch.Tensor) -> None:
        """Push `grad_logits`, the float32 `d loss / d z_s` of the chunk's rows, through the head."""
        if self.linear:
            head = self.heads.student
            low = grad_logits.to(head.weight.dtype)  # one cast per chunk, shared by both products where they can
            if self.want_hidden:
                self.hidden[rows] = low @ head.weight
            # On CUDA half precision `_addmm_float32` rounds its first operand to `h`'s dtype: hand it the cast one.
            g_t = (low if _half_on_cuda(h) and low.dtype == h.dtype else grad_logits).t()
            for i, p in enumerate(self.params):
                if p is head.weight:
                    self.head[i] = _addmm_float32(self.head[i], g_t, h)
                else:
                    bias = grad_logits.sum(dim=0)
                    self.head[i] = bias if self.head[i] is None else self.head[i].add_(bias)
            return
        inputs = ([h] if self.want_hidden else []) + list(self.params)
        if not inputs:
            return
        grads = torch.autograd.grad(z_s, inputs, grad_logits.to(z_s.dtype), allow_unused=True)
        if self.want_hidden:
            self.hidden[rows] = grads[0]
        for i, g in enumerate(grads[int(self.want_hidden) :]):
            if g is not None:
                # float32 sums over chunks, as one matrix product over all rows would accumulate.
                self.head[i] = g.float() if self.head[i] is None else self.head[i].add_(g)


def _project_chunk(heads: _Heads, h_s: torch.Tensor, h_t: torch.Tensor, track: bool):
    """Logits and terms of one chunk. With `track` the student's logits keep their graph back to `h_s` and the head;
    without, both logits are only inputs to the terms, which overwrite them (and `None` is returned for them)."""
    with torch.enable_grad() if track else torch.no_grad():
        z_s = heads.student(h_s) if track else _logits(heads.student, h_s)
    with torch.no_grad():
        z_t = _logits(heads.teacher, h_t)
        # The student's logits are overwritten only when no graph needs them (a head may save its output).
        terms = _chunk_terms(
            z_s.detach(), z_t, heads.beta, heads.temperature, overwrite_student=not track, overwrite_teacher=True
        )
        if terms is None:
            # -inf logits somewhere in the chunk (rare): project it again for the masked reference formulas.
            terms = _chunk_terms_masked(heads.student(h_s), heads.teacher(h_t), heads.beta, heads.temperature)
    return (z_s if track else None), terms


class _WeightedDivergenceLoss(torch.autograd.Function):
    """`Σ_i scale_i · divergence_i` with every gradient computed in the forward pass, chunk by chunk.

    The weights are known before the projection, so the `(n, V)` gradient of a chunk is formed while its logits are
    still in memory and immediately pushed through the head (`d hidden`, `d head weight`). The backward pass only
    scales what the forward stored: 4 matrix products per chunk (2 projections, 2 for the head's backward), where an
    activation checkpoint needs 6, and no `(N, V)` tensor is ever kept. This is the fused linear-cross-entropy
    technique of Liger-Kernel (https://github.com/linkedin/Liger-Kernel), applied to the generalized JSD.
    """

    @staticmethod
    def forward(ctx, student_hidden, teacher_hidden, row_scale, heads: _Heads, want_hidden: bool, *params):
        grads = _StudentGrads(heads, student_hidden, want_hidden, list(params))
        loss = torch.zeros((), dtype=torch.float32, device=student_hidden.device)
        parts = []
        for start in range(0, student_hidden.shape[0], heads.chunk_size):
            rows = slice(start, start + heads.chunk_size)
            h, z_s, terms = grads.project(student_hidden[rows], teacher_hidden[rows])
            scale = row_scale[rows]
            loss += torch.dot(terms.divergence, scale)
            grads.add(rows, h, z_s, terms.grad.mul_(scale.unsqueeze(1)))
            del z_s, terms.grad
            parts.append(terms)
        ctx.saved_grads = (grads.hidden, grads.head, [(p.dtype, p.shape) for p in params])
        stats = [torch.cat([getattr(t, k) for t in parts]) for k in _STAT_FIELDS]
        ctx.mark_non_differentiable(*stats)
        return (loss, *stats)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if ctx.saved_grads is None:
            raise RuntimeError("The chunked RockOPD loss was already back-propagated; its stored gradients are freed.")
        grad_h, grad_p, meta = ctx.saved_grads
        ctx.saved_grads = None
        # The buffers are ours (freed above), so they are scaled in place; a loss back-propagated as is (upstream
        # gradient 1, the usual case) skips a full pass over the (V, H) head gradient.
        unit = bool(grad_loss == 1)

        def scaled(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return (g if unit else g.mul_(grad_loss.to(g.dtype))).to(dtype)

        out_h = None if grad_h is None else scaled(grad_h, grad_h.dtype)
        out_p = [
            torch.zeros(shape, dtype=dtype, device=grad_loss.device) if g is None else scaled(g, dtype)
            for g, (dtype, shape) in zip(grad_p, meta)
        ]
        del grad_p
        return (out_h, None, None, None, None, *out_p)


class _RowDivergence(torch.autograd.Function):
    """Per-row divergences whose backward applies the closed-form gradient, for weights decided after the divergence.

    With no trainable head (LoRA, a frozen or quantized output layer) each row's `d divergence_i / d hidden_i` is
    formed in the forward pass and only scaled in the backward: 3 matrix products per chunk. With a trainable head,
    the head's gradient needs the row weights, so the backward projects each chunk again: 6, as a checkpoint would,
    but without autograd's elementwise passes.
    """

    @staticmethod
    def forward(ctx, student_hidden, teacher_hidden, heads: _Heads, want_hidden: bool, *params):
        eager = want_hidden and not params
        grads = _StudentGrads(heads, student_hidden, eager, [])
        parts = []
        for start in range(0, student_hidden.shape[0], heads.chunk_size):
            rows = slice(start, start + heads.chunk_size)
            h, z_s, terms = grads.project(student_hidden[rows], teacher_hidden[rows])
            if eager:
                grads.add(rows, h, z_s, terms.grad)
            del z_s, terms.grad
            parts.append(terms)
        ctx.heads, ctx.want_hidden, ctx.n_params, ctx.grad_h = heads, want_hidden, len(params), grads.hidden
        if not eager and (want_hidden or params):
            ctx.save_for_backward(student_hidden, teacher_hidden, *params)
        stats = [torch.cat([getattr(t, k) for t in parts]) for k in _STAT_FIELDS]
        ctx.mark_non_differentiable(*stats[1:])
        return tuple(stats)

    @staticmethod
    def backward(ctx, grad_div, *_):
        none = (None, None, None, None)
        if ctx.grad_h is not None:
            return (ctx.grad_h * grad_div.unsqueeze(1).to(ctx.grad_h.dtype), *none[1:])
        if not ctx.saved_tensors:
            return (*none, *([None] * ctx.n_params))
        student_hidden, teacher_hidden, *params = ctx.saved_tensors
        grads = _StudentGrads(ctx.heads, student_hidden, ctx.want_hidden, params)
        for start in range(0, student_hidden.shape[0], ctx.heads.chunk_size):
            rows = slice(start, start + ctx.heads.chunk_size)
            h, z_s, terms = grads.project(student_hidden[rows], teacher_hidden[rows])
            grads.add(rows, h, z_s, terms.grad.mul_(grad_div[rows].unsqueeze(1).float()))
            del z_s, terms.grad
        out_p = [torch.zeros_like(p) if g is None else g.to(p.dtype) for g, p in zip(grads.head, params)]
        return (grads.hidden, None, None, None, *out_p)


_STAT_FIELDS = tuple(f.name for f in fields(ChunkedDivergence))


def _check_chunk_inputs(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, chunk_size: int) -> None:
    if student_hidden.shape[0] != teacher_hidden.shape[0]:
        raise ValueError(
            f"student_hidden and teacher_hidden must have the same number of rows, got {student_hidden.shape[0]} "
            f"and {teacher_hidden.shape[0]}."
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")


def _grad_targets(student_hidden: torch.Tensor, student_head) -> tuple[bool, list[torch.Tensor]]:
    if not torch.is_grad_enabled():
        return False, []
    return student_hidden.requires_grad, _trainable_leaves(student_head, student_hidden[:1])


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

    Only `chunk_size × V` logits exist at any moment, in the forward and in the backward, and the gradient is written
    in closed form (no autograd graph through the softmaxes). Use it when the row weights depend on the divergence
    itself; when they are known before the projection, [`chunked_weighted_loss`] is faster. Heads are called as
    functions, so LoRA-wrapped, quantized or tied output layers and logit post-processing work unchanged; the tensors
    they train are found from their autograd graph.

    Args:
        student_hidden (`torch.Tensor`): `(N, H_s)` student last hidden states of the rows to score.
        teacher_hidden (`torch.Tensor`): `(N, H_t)` teacher last hidden states of the same rows.
        student_head, teacher_head (`Callable`): map `(n, H)` hidden states to `(n, V)` logits.
        beta (`float`): see [`per_token_divergence`].
        temperature (`float`, *optional*, defaults to `1.0`): divergence temperature.
        chunk_size (`int`, *optional*, defaults to `512`): rows projected at once.

    Returns:
        [`ChunkedDivergence`]: the divergence is differentiable with respect to the student hidden states and head.

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
    _check_chunk_inputs(student_hidden, teacher_hidden, chunk_size)
    beta = _validate_beta(beta)
    _validate_temperature(temperature)
    if student_hidden.shape[0] == 0:
        empty = torch.zeros(0, device=student_hidden.device, dtype=torch.float32)
        return ChunkedDivergence(empty, empty, empty, empty)
    heads = _Heads(student_head, teacher_head, beta, float(temperature), int(chunk_size))
    want_hidden, params = _grad_targets(student_hidden, student_head)
    stats = _RowDivergence.apply(student_hidden, teacher_hidden, heads, want_hidden, *params)
    return ChunkedDivergence(*stats)


def chunked_weighted_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    student_head: Callable[[torch.Tensor], torch.Tensor],
    teacher_head: Callable[[torch.Tensor], torch.Tensor],
    weights: torch.Tensor,
    normalizer: torch.Tensor | float,
    beta: float,
    temperature: float = 1.0,
    chunk_size: int = 512,
) -> tuple[torch.Tensor, ChunkedDivergence]:
    """`Σ weights · divergence / normalizer` of hidden states projected in chunks, with the gradient fused in.

    The same value and gradients as `weighted_loss(chunked_divergence(...).divergence, weights, normalizer)`, in 4
    matrix products per chunk instead of 6: each chunk's gradient is taken while its logits exist (see
    [`chunked_divergence`] for the heads and the chunking). Rows of weight 0 still cost their projection, so pass only
    the rows that carry weight.

    Args:
        student_hidden, teacher_hidden, student_head, teacher_head, beta, temperature, chunk_size:
            see [`chunked_divergence`].
        weights (`torch.Tensor`): `(N,)` non-negative row weights, not differentiated.
        normalizer (`torch.Tensor` or `float`): see [`weighted_loss`]; 0 is treated as 1.

    Returns:
        `tuple[torch.Tensor, ChunkedDivergence]`: the scalar loss (differentiable) and the detached per-row scores.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.losses import chunked_weighted_loss
    >>> head = torch.nn.Linear(4, 11, bias=False)
    >>> h = torch.randn(5, 4, requires_grad=True)
    >>> loss, scores = chunked_weighted_loss(h, torch.randn(5, 4), head, head, torch.ones(5), 5, beta=1.0)
    >>> loss.backward(); h.grad.shape
    torch.Size([5, 4])
    ```
    """
    _check_chunk_inputs(student_hidden, teacher_hidden, chunk_size)
    if weights.shape != student_hidden.shape[:1]:
        raise ValueError(
            f"weights must have one entry per row, shape ({student_hidden.shape[0]},), got {tuple(weights.shape)}."
        )
    beta = _validate_beta(beta)
    _validate_temperature(temperature)
    device = student_hidden.device
    if student_hidden.shape[0] == 0:
        empty = torch.zeros(0, device=device, dtype=torch.float32)
        zero = student_hidden.float().sum() * 0.0
        return zero, ChunkedDivergence(empty, empty, empty, empty)
    row_scale = weights.detach().to(device=device, dtype=torch.float32) / _as_normalizer(normalizer, device)
    heads = _Heads(student_head, teacher_head, beta, float(temperature), int(chunk_size))
    want_hidden, params = _grad_targets(student_hidden, student_head)
    loss, *stats = _WeightedDivergenceLoss.apply(student_hidden, teacher_hidden, row_scale, heads, want_hidden, *params)
    return loss, ChunkedDivergence(*stats)


def _as_normalizer(normalizer: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    if not torch.is_tensor(normalizer):
        normalizer = torch.tensor(float(normalizer), device=device)
    normalizer = normalizer.detach().to(device=device, dtype=torch.float32)
    return torch.where(normalizer > 0, normalizer, torch.ones_like(normalizer))


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
    return (divergence * weights.to(divergence.dtype)).sum() / _as_normalizer(normalizer, divergence.device)
