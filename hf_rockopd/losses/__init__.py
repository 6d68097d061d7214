"""Per-token divergences between a student and a teacher, and the chunked, token-weighted loss built on them.

A pure package: it imports nothing else of `hf_rockopd`, so any trainer base can use it.

- [`reference`](./reference.py): divergences and entropies from full `(N, V)` logits, differentiated by autograd
  (TRL's `beta` convention); the reference the chunked paths are tested against.
- [`closed_form`](./closed_form.py): one chunk's divergence, entropies and logit gradient in closed form, compiled
  on CUDA (`compile=` per call, or `HF_ROCKOPD_COMPILE_LOSS=0` to keep the eager formulas).
- [`fused`](./fused.py): the chunked loss over hidden states and output heads, with the gradient fused in.
- [`sparse`](./sparse.py): the divergence against a teacher known by its top-k log-probabilities only (a served or
  cached teacher), over the listed ids plus a tail bin; the chunked loss takes it with `teacher_head=None`.

Example:
```python
>>> import torch
>>> from hf_rockopd.losses import chunked_weighted_loss, per_token_divergence, weighted_loss
>>> head = torch.nn.Linear(4, 11, bias=False)
>>> h_s, h_t, w = torch.randn(5, 4), torch.randn(5, 4), torch.rand(5)
>>> fused, _ = chunked_weighted_loss(h_s, h_t, head, head, w, normalizer=5, beta=1.0, chunk_size=2)
>>> full = weighted_loss(per_token_divergence(head(h_s), head(h_t), beta=1.0), w, normalizer=5)
>>> torch.allclose(fused, full, atol=1e-6)
True
```
"""

from .closed_form import ChunkedDivergence, logit_grad_norm
from .fused import chunked_divergence, chunked_weighted_loss, weighted_loss
from .reference import per_token_divergence, per_token_entropy
from .sparse import pack_topk, sparse_divergence, topk_log_probs, unpack_topk


__all__ = [
    "ChunkedDivergence",
    "chunked_divergence",
    "chunked_weighted_loss",
    "logit_grad_norm",
    "pack_topk",
    "per_token_divergence",
    "per_token_entropy",
    "sparse_divergence",
    "topk_log_probs",
    "unpack_topk",
    "weighted_loss",
]
