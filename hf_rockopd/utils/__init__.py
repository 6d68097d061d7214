"""Small helpers used across the package, with no job of their own: `checks` (the option dataclasses' range checks)
and `memory` (returning freed heap to the operating system).

Example:
```python
>>> from types import SimpleNamespace
>>> from hf_rockopd.utils.checks import check_range
>>> check_range(SimpleNamespace(beta=0.5), "beta", low=0.0, high=1.0)
```
"""
