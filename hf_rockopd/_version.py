"""The installed version of `hf_rockopd`, in a leaf module that any module of the package may import.

Read from the installed distribution's metadata (pyproject.toml's `version`), so there is one number to bump. A source
tree used without installing (`PYTHONPATH=.`) has no metadata and reports `0+unknown`.

Example:
```python
>>> from hf_rockopd._version import __version__
>>> isinstance(__version__, str) and len(__version__) > 0
True
```
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


__all__ = ["__version__"]

try:
    __version__: str = version("hf_rockopd")
except PackageNotFoundError:  # a source checkout on sys.path, never installed
    __version__ = "0+unknown"
