"""Tiny offline models for tests, demos and docstring examples: a byte-level ChatML tokenizer and a small Llama."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


__all__ = ["CHATML_TEMPLATE", "build_tiny_causal_lm", "build_tiny_tokenizer"]


# ChatML, as SmolLM2 and Qwen use it.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with no merges (one token per byte) and a ChatML chat template, built offline.

    Its vocabulary is the 256 byte symbols plus `<|im_start|>`, `<|im_end|>` (eos) and `<pad>`.

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_tokenizer
    >>> tok = build_tiny_tokenizer()
    >>> len(tok), tok.decode(tok("Hi!")["input_ids"])
    (259, 'Hi!')
    ```
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens(
        {"eos_token": "<|im_end|>", "pad_token": "<pad>", "additional_special_tokens": ["<|im_start|>"]}
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def build_tiny_causal_lm(
    tokenizer: PreTrainedTokenizerFast | None = None,
    hidden_size: int = 32,
    num_hidden_layers: int = 2,
    seed: int = 0,
    vocab_size: int | None = None,
) -> LlamaForCausalLM:
    """A randomly initialised Llama causal LM small enough for CPU tests (about 30k parameters by default).

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer
    >>> model = build_tiny_causal_lm(build_tiny_tokenizer())
    >>> model.config.num_hidden_layers, model.config.vocab_size
    (2, 259)
    ```
    """
    tokenizer = tokenizer or build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
