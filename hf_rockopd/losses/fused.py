"""The chunked, token-weighted loss: hidden states projected through the two output heads `chunk_size` rows at a time,
so no `(N, V)` tensor ever exists, with the gradient written in closed form (see [`closed_form`](./closed_form.py))
instead of back-propagated through the softmaxes.

Everything here is a pure function of tensors (and of the two output heads, called as modules): the trainer decides
which rows to project and with which weights, and this module turns that into numbers.

- [`chunked_weighted_loss`]: weights known before projecting (fixed rock sets, the usual case). Each chunk's gradient
  is formed and pushed through the head in the forward pass, 4 matrix products per chunk, as many as full logits need.
- [`chunked_divergence`]: per-row divergences that stay differentiable, for weights computed from them (quantile or
  entropy policies). 3 matrix products per chunk with a frozen head (LoRA), 6 with a trainable one.

The measured effect is in BENCHMARKS.md (`python -m benchmarks.loss_path`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from packaging.version import Version

from .closed_form import ChunkedDivergence, _chunk_terms, _chunk_terms_masked, _ChunkTerms, _compile_requested
from .reference import _validate_beta, _validate_temperature
from .sparse import sparse_chunk_terms


__all__ = ["chunked_divergence", "chunked_weighted_loss", "weighted_loss"]


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
    teacher: Callable[[torch.Tensor], torch.Tensor] | None  # None: `teacher_hidden` holds packed top-k targets
    beta: float
    temperature: float
    chunk_size: int
    compile: bool  # the chunk's closed forms through `torch.compile` (CUDA only)


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
    if heads.teacher is None:
        # A top-k teacher: `h_t` holds its packed ids and log-probabilities (see `sparse.pack_topk`), no head to run.
        with torch.no_grad():
            terms = _ChunkTerms(*sparse_chunk_terms(z_s.detach(), h_t, heads.beta, heads.temperature))
        return (z_s if track else None), terms
    with torch.no_grad():
        z_t = _logits(heads.teacher, h_t)
        # The student's logits are overwritten only when no graph needs them (a head may save its output).
        terms = _chunk_terms(
            z_s.detach(), z_t, heads.beta, heads.temperature, overwrite_student=not track, overwrite_teacher=True,
            compile=heads.compile,
        )  # fmt: skip
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
    teacher_head: Callable[[torch.Tensor], torch.Tensor] | None,
    beta: float,
    temperature: float = 1.0,
    chunk_size: int = 512,
    *,
    compile: bool | None = None,
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
        student_head, teacher_head (`Callable`): map `(n, H)` hidden states to `(n, V)` logits. `teacher_head=None`:
            the teacher is known by its top-k only, and `teacher_hidden` is its `(N, 2, k)` packed ids and
            log-probabilities (`hf_rockopd.losses.sparse.pack_topk`); the divergence is then the tail-bin one of
            [`~hf_rockopd.losses.sparse.sparse_divergence`].
        beta (`float`): see [`per_token_divergence`].
        temperature (`float`, *optional*, defaults to `1.0`): divergence temperature.
        chunk_size (`int`, *optional*, defaults to `512`): rows projected at once.
        compile (`bool`, *optional*): run each chunk's closed forms through `torch.compile` on CUDA (the CPU always
            runs the eager formulas). `None`: on unless the environment has `HF_ROCKOPD_COMPILE_LOSS=0`, read at this
            call.

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
    heads = _Heads(student_head, teacher_head, beta, float(temperature), int(chunk_size), _compile_requested(compile))
    want_hidden, params = _grad_targets(student_hidden, student_head)
    stats = _RowDivergence.apply(student_hidden, teacher_hidden, heads, want_hidden, *params)
    return ChunkedDivergence(*stats)


def chunked_weighted_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    student_head: Callable[[torch.Tensor], torch.Tensor],
    teacher_head: Callable[[torch.Tensor], torch.Tensor] | None,
    weights: torch.Tensor,
    normalizer: torch.Tensor | float,
    beta: float,
    temperature: float = 1.0,
    chunk_size: int = 512,
    *,
    compile: bool | None = None,
) -> tuple[torch.Tensor, ChunkedDivergence]:
    """`Σ weights · divergence / normalizer` of hidden states projected in chunks, with the gradient fused in.

    The same value and gradients as `weighted_loss(chunked_divergence(...).divergence, weights, normalizer)`, in 4
    matrix products per chunk instead of 6: each chunk's gradient is taken while its logits exist (see
    [`chunked_divergence`] for the heads and the chunking). Rows of weight 0 still cost their projection, so pass only
    the rows that carry weight.

    Args:
        student_hidden, teacher_hidden, student_head, teacher_head, beta, temperature, chunk_size, compile:
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
    heads = _Heads(student_head, teacher_head, beta, float(temperature), int(chunk_size), _compile_requested(compile))
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
