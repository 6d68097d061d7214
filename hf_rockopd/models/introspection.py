"""What the package needs to know about a causal LM: its backbone, its output head, its vocabulary and its stop ids.

One place for the model introspection that training, rollout, evaluation and the lab share, so that a packed 4-bit
head, a PEFT wrapper or a soft-capped head is handled the same way everywhere.

Example:
    >>> from hf_rockopd.models import build_tiny_causal_lm
    >>> from hf_rockopd.models.introspection import vocab_size
    >>> vocab_size(build_tiny_causal_lm(vocab_size=259))
    259
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from transformers.utils import is_peft_available


def backbone(model: nn.Module) -> nn.Module:
    """The decoder stack without the output head (`LlamaModel` for `LlamaForCausalLM`), through a PEFT wrapper.

    Example:
        >>> from hf_rockopd.models import build_tiny_causal_lm
        >>> type(backbone(build_tiny_causal_lm())).__name__
        'LlamaModel'
    """
    inner = model
    if is_peft_available():
        from peft import PeftModel

        if isinstance(inner, PeftModel):
            inner = inner.get_base_model()
    stack = getattr(inner, "base_model", inner)
    if stack is inner:
        raise ValueError(
            f"{type(inner).__name__} exposes no backbone through `base_model` (its `base_model_prefix` is empty), so "
            "its hidden states cannot be projected in chunks. hf_rockopd supports transformers causal LMs."
        )
    return stack


def logit_scale(config: Any) -> float | None:
    """The multiplier a model applies to its head's output before any soft-cap, from its (text) config; `None` when
    it declares none.

    Models name it differently: `logit_scale` (Cohere), `output_multiplier`, `lm_head_multiplier` (Falcon-H1), or a
    divisor `logits_scaling` (Granite, MiniCPM3; a multiplier for HyperCLOVA X). TRL's `DistillationTrainer` reads
    the same names, so both trainers compare the same distributions.

    Example:
        >>> from types import SimpleNamespace
        >>> logit_scale(SimpleNamespace(logits_scaling=4.0, model_type="granite")), logit_scale(SimpleNamespace())
        (0.25, None)
    """
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(config, name, None)
        if value is not None:
            return value
    scaling = getattr(config, "logits_scaling", None)
    if scaling is None:
        return None
    return scaling if getattr(config, "model_type", None) == "hyperclovax" else 1 / scaling


def logits_fn(model: nn.Module, head: nn.Module | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Hidden states -> logits through the model's own output module, with its logit scale and soft-cap.

    `head` replaces the output module (the engine passes a gathered copy of an FSDP2-sharded head); the model's
    config still gives the scale and soft-cap.

    Example:
        >>> from hf_rockopd.models import build_tiny_causal_lm
        >>> model = build_tiny_causal_lm()
        >>> logits_fn(model)(torch.zeros(2, model.config.hidden_size)).shape[-1] == model.config.vocab_size
        True
    """
    head = model.get_output_embeddings() if head is None else head
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (`get_output_embeddings()` is None).")
    config = model.config.get_text_config()
    scale = logit_scale(config)
    softcap = getattr(config, "final_logit_softcapping", None)
    if (scale is None or scale == 1.0) and softcap is None:
        # The module itself, not a closure: a bare `nn.Linear` head gets the loss's hand-written, in-place gradient
        # (one (V, H) buffer instead of one per chunk, see `losses.fused`).
        return head

    def fn(hidden: torch.Tensor) -> torch.Tensor:
        logits = head(hidden)
        if scale is not None and scale != 1.0:
            logits = logits * scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        return logits

    return fn


def vocab_size(model: nn.Module) -> int:
    """Rows of the model's output head: the size of its next-token distribution.

    A bitsandbytes 4-bit head stores packed weights, so its config is then the only reliable size.
    """
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is not None and weight.dim() == 2 and weight.shape[0] > 1 and not hasattr(weight, "quant_state"):
        return int(weight.shape[0])
    if weight is None and isinstance(getattr(head, "out_features", None), int):
        return head.out_features  # a head packed for CPU inference (`models.PackedLinear`) keeps no dense weight
    return int(model.config.get_text_config().vocab_size)


def check_same_vocabulary(student: nn.Module, teacher: nn.Module) -> int:
    """The shared vocabulary size of student and teacher; `ValueError` naming both sizes when they differ.

    Example:
        >>> from hf_rockopd.models import build_tiny_causal_lm
        >>> check_same_vocabulary(build_tiny_causal_lm(vocab_size=259), build_tiny_causal_lm(vocab_size=259))
        259
    """
    student_vocab, teacher_vocab = vocab_size(student), vocab_size(teacher)
    if student_vocab != teacher_vocab:
        raise ValueError(
            f"Student and teacher vocabularies differ: student {student_vocab}, teacher {teacher_vocab}. Token-level "
            "distillation compares full next-token distributions token by token, so both must share one vocabulary: "
            "use a teacher and student that share a tokenizer."
        )
    return student_vocab


def eos_token_ids(tokenizer: Any, model: nn.Module | None = None) -> list[int]:
    """The ids that end a completion: the model's generation config's list, else the tokenizer's eos.

    Example:
        >>> from hf_rockopd.models import build_tiny_tokenizer
        >>> eos_token_ids(build_tiny_tokenizer())
        [256]
    """
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def cut_at_eos(ids: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """The completion up to and including its first stop id: what follows is padding.

    Example:
        >>> cut_at_eos([5, 6, 2, 0, 0], [2])
        [5, 6, 2]
    """
    ids = [int(i) for i in ids]
    for position, token in enumerate(ids):
        if token in eos_ids:
            return ids[: position + 1]
    return ids


def special_token_ids(tokenizer: Any, model: nn.Module | None = None) -> list[int]:
    """The ids a rock-token selection never picks by default: stop and control tokens, sorted.

    Freezing the stop token removes the only signal that teaches the student when to stop, and control tokens are
    template structure, not content. The ids: the stop ids (`eos_token_ids`: the generation config's list, else the
    tokenizer's eos), pad, bos, every special token of the tokenizer (`all_special_ids`, the added tokens marked
    special) and every added token the chat template writes (Qwen's `<|im_start|>`, `<|im_end|>`, `<|endoftext|>`).

    Example:
        >>> from hf_rockopd.models import build_tiny_tokenizer
        >>> special_token_ids(build_tiny_tokenizer())  # <|im_end|>, <pad>, <|im_start|>
        [256, 257, 258]
    """
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps its tokenizer
    ids = set(eos_token_ids(tokenizer, model))
    for name in ("pad_token_id", "bos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            ids.add(int(value))
    ids.update(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates ("default", "tool_use", ...)
        template = " ".join(map(str, template.values()))
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        content = getattr(token, "content", str(token))
        if getattr(token, "special", False) or (content and content in template):
            ids.add(int(token_id))
    return sorted(ids)
