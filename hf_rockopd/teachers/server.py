"""`hf-rockopd serve-teacher`: a teacher served over the subset of vLLM's API that distillation uses, for machines
without vLLM (a CPU, this project's tests and demo). On a GPU, use vLLM itself (`vllm serve TEACHER`).

FastAPI and uvicorn, as TRL's own `vllm-serve` script uses. Routes:

- `POST /v1/completions` with token-id prompts and `prompt_logprobs=k`: each sequence's top-k per position (plus the
  sequence's own token where it is outside them, with its rank), in vLLM's schema (see `protocol`); no generation
  (`max_tokens` is accepted and ignored, the choice's `text` is empty);
- `GET /v1/models`, `GET /health`.

One model, batched forwards under a lock. Limits (sequences, tokens and `prompt_logprobs` per request) are answered
with HTTP 400 and a message naming the limit; a wrong or missing API key with 401; a model name other than the
served one with 404, as vLLM does.

Example:
```python
from fastapi.testclient import TestClient
from hf_rockopd.models import build_tiny_causal_lm
from hf_rockopd.teachers.server import ServerLimits, build_app

app = build_app(build_tiny_causal_lm(), served_name="tiny", limits=ServerLimits(max_top_k=8))
print(TestClient(app).get("/v1/models").json()["data"][0]["id"])  # tiny
```
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..models.introspection import backbone, logits_fn, vocab_size
from .protocol import prompt_logprobs_entry


__all__ = ["ServerLimits", "build_app", "score_sequences"]


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of the server (larger requests get HTTP 400 naming the limit).

    Example:
    ```python
    >>> from hf_rockopd.teachers.server import ServerLimits
    >>> ServerLimits().max_top_k
    64
    ```
    """

    max_top_k: int = 64  # vLLM's counterpart is `--max-logprobs` (default 20)
    max_sequences: int = 64
    max_tokens: int = 65_536  # all sequences of a request together
    batch_tokens: int = 8_192  # padded tokens per forward pass (memory: batch_tokens x vocab float32 logits)


@torch.inference_mode()
def score_sequences(
    model: nn.Module, sequences: list[list[int]], top_k: int, batch_tokens: int = 8_192
) -> list[list[tuple[list[int], list[float], list[int]] | None]]:
    """Per sequence and position, `(ids, log_probs, ranks)` of the model's top-`top_k` for that position's token,
    plus the token itself (with its true rank) when it is not among them; `None` at position 0.

    Sequences are forwarded right-padded, several at a time up to `batch_tokens` padded tokens; the head runs one
    sequence at a time so the `(L, V)` logits of one sequence are the largest tensor.
    """
    model.eval()
    device = next(model.parameters()).device
    head = logits_fn(model)
    stack = backbone(model)
    out: list[list[Any]] = [[] for _ in sequences]
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    start = 0
    while start < len(order):
        width = len(sequences[order[start]])
        end = start + 1
        while end < len(order) and len(sequences[order[end]]) * (end - start + 1) <= batch_tokens:
            end += 1
        group = order[start:end]
        width = max(len(sequences[i]) for i in group)
        ids = torch.zeros((len(group), width), dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(group):
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i], device=device)
            mask[row, : len(sequences[i])] = 1
        hidden = stack(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        for row, i in enumerate(group):
            n = len(sequences[i])
            log_probs = torch.log_softmax(head(hidden[row, : n - 1]).float(), dim=-1)  # row t: token t + 1
            top_lp, top_ids = log_probs.topk(min(top_k, log_probs.shape[-1]), dim=-1) if top_k else (None, None)
            actual = torch.tensor(sequences[i][1:], device=device)
            actual_lp = log_probs.gather(1, actual[:, None])[:, 0]
            actual_rank = (log_probs > actual_lp[:, None]).sum(-1) + 1
            positions: list[Any] = [None]
            for t in range(n - 1):
                row_ids = top_ids[t].tolist() if top_k else []
                row_lp = top_lp[t].tolist() if top_k else []
                ranks = list(range(1, len(row_ids) + 1))
                if int(actual[t]) not in row_ids:
                    row_ids.append(int(actual[t]))
                    row_lp.append(float(actual_lp[t]))
                    ranks.append(int(actual_rank[t]))
                positions.append((row_ids, row_lp, ranks))
            out[i] = positions
        start = end
    return out


def build_app(
    model: nn.Module,
    tokenizer: Any = None,
    served_name: str = "teacher",
    api_key: str | None = None,
    limits: ServerLimits = ServerLimits(),
) -> Any:
    """The FastAPI application serving `model` (see the module docstring). `tokenizer` fills `decoded_token`."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title=f"hf-rockopd teacher: {served_name}")
    lock = threading.Lock()
    vocab = vocab_size(model)
    decode: Callable[[int], str] | None = (lambda i: tokenizer.decode([i])) if tokenizer is not None else None

    def error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
        # vLLM's error body: {"error": {"message", "type", "code"}}.
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            return error(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.", "AuthenticationError")
        return await call_next(request)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        card = {"id": served_name, "object": "model", "owned_by": "hf-rockopd", "max_top_k": limits.max_top_k}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    def completions(body: dict[str, Any]) -> Any:
        if body.get("model", served_name) != served_name:
            return error(404, f"The model `{body.get('model')}` does not exist; this server serves `{served_name}`.",
                         "NotFoundError")  # fmt: skip
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        if not (isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt)):
            return error(400, "prompt must be token ids: a non-empty list of ids, or a list of such lists.")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for p in prompt for t in p):
            return error(400, f"prompt holds a token id outside the model's vocabulary [0, {vocab}).")
        k = body.get("prompt_logprobs")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            return error(400, f"prompt_logprobs must be an integer >= 0, got {k!r}.")
        if k > limits.max_top_k:
            return error(400, f"prompt_logprobs={k} is above this server's limit of {limits.max_top_k} "
                              "(restart it with a larger --max_top_k).")  # fmt: skip
        if len(prompt) > limits.max_sequences:
            return error(400, f"{len(prompt)} sequences in one request, above the limit of {limits.max_sequences}.")
        tokens = sum(len(p) for p in prompt)
        if tokens > limits.max_tokens:
            return error(400, f"{tokens} tokens in one request, above the limit of {limits.max_tokens}.")
        with lock:
            scored = score_sequences(model, prompt, k, limits.batch_tokens)
        choices = [
            {
                "index": i,
                "text": "",
                "logprobs": None,
                "finish_reason": "length",
                "prompt_logprobs": [
                    None if entry is None else prompt_logprobs_entry(*entry, decode=decode) for entry in positions
                ],
            }
            for i, positions in enumerate(scored)
        ]
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": served_name,
            "choices": choices,
            "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
        }

    return app
