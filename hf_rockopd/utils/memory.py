"""Give the process's freed heap memory back to the system between the phases of a long CPU job.

Why: glibc keeps memory freed by many mid-sized tensors (a training step's activations and gradients) in its heap
for reuse; the next phase (the evaluation's full-vocabulary logits) then comes on top of it. On the Qwen main job,
six training steps left 2.3 GB that `malloc_trim` returned (11.7 -> 9.4 GB RSS), and the job's peak, the evaluation
after training, fell from 15.4 to 13.6 GB (`examples/reports/qwen_distill/packed_cpu/`).

Example:
```python
>>> from hf_rockopd.utils.memory import release_free_memory
>>> release_free_memory() in (True, False)
True
```
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys


__all__ = ["release_free_memory"]


def release_free_memory() -> bool:
    """Collect garbage, then return the free heap memory to the system (`malloc_trim(0)`, glibc only).

    Returns whether the allocator released anything (always False off glibc, where nothing is called)."""
    gc.collect()
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):  # musl and other C libraries have no malloc_trim
        return False
    return bool(trim(0))
