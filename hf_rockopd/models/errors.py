"""The errors of finding a model: nothing found, an offline source not installed, an offline source broken."""

from __future__ import annotations


__all__ = ["GgufNotInstalledError", "GgufSourceError", "ModelNotFoundError"]


class ModelNotFoundError(OSError):
    """No model could be found for a name or path, with the places looked at and how to fix it."""


class GgufNotInstalledError(FileNotFoundError):
    """None of an offline GGUF source's packages is installed (the resolver then tries the next place).

    Example:
    ```python
    >>> issubclass(GgufNotInstalledError, FileNotFoundError)
    True
    ```
    """


class GgufSourceError(ModelNotFoundError):
    """An offline GGUF source is installed but unusable: a package or part missing, a wrong version, size or checksum,
    or a header that is not the model it claims to be. The message names the package and the command that fixes it.

    Example:
    ```python
    >>> issubclass(GgufSourceError, ModelNotFoundError)
    True
    ```
    """
