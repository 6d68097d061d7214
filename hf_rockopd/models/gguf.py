"""GGUF checkpoints: load one as a plain, trainable causal LM (dequantized weights, no quantization flag)."""

from __future__ import annotations

import copy
import os

import torch


__all__ = ["load_gguf_causal_lm"]


def load_gguf_causal_lm(gguf_path: str, dtype: torch.dtype = torch.float32):
    """Load a GGUF checkpoint as a plain, trainable and savable causal LM, with its tokenizer.

    transformers dequantizes GGUF weights but flags the model as quantized with gguf, so Trainer refuses to train it
    and `save_pretrained` refuses to save it. Rebuilding it from its config (without `quantization_config`) and loading
    the dequantized state dict gives an ordinary model with the same weights.

    Example:
    ```python
    from hf_rockopd.models import load_gguf_causal_lm, smollm2_gguf_path
    teacher, tokenizer = load_gguf_causal_lm(smollm2_gguf_path())
    ```
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    flagged = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    config = copy.deepcopy(flagged.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(flagged.state_dict(), strict=False)
    # Tied embeddings: the head is the embedding matrix, so its key may be absent from the GGUF state dict.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{gguf_path}: state dict mismatch after rebuilding (missing {missing}, unexpected {unexpected}).")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = flagged.generation_config
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
