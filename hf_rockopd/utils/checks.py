"""Range checks of option dataclasses: a `ValueError` naming the field and the value. Used by every options dataclass,
library (`distill`, `ablate`) and command line alike, so they live below both.

Example:
```python
>>> from types import SimpleNamespace
>>> from hf_rockopd.utils.checks import check_at_least
>>> check_at_least(SimpleNamespace(top_k=3), "top_k")
```
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_at_least", "check_range"]


def check_at_least(obj: Any, *names: str, minimum: int = 1) -> None:
    """Raise `ValueError` naming the field unless each of `names` is None or an integer >= `minimum`.

    Example:
    ```python
    >>> from types import SimpleNamespace
    >>> from hf_rockopd.utils.checks import check_at_least
    >>> check_at_least(SimpleNamespace(top_k=0), "top_k")
    Traceback (most recent call last):
    ...
    ValueError: top_k must be an integer >= 1, got 0.
    ```
    """
    for name in names:
        value = getattr(obj, name)
        values = value if isinstance(value, list) else [value]
        for item in values:
            if item is not None and (isinstance(item, bool) or not isinstance(item, int) or item < minimum):
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")


def check_range(
    obj: Any, name: str, low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> None:
    """Raise `ValueError` naming the field unless it is None or a number in the interval (bounds closed by default).

    Example:
    ```python
    >>> from types import SimpleNamespace
    >>> from hf_rockopd.utils.checks import check_range
    >>> check_range(SimpleNamespace(alpha=1.5), "alpha", 0, 1, low_open=True, high_open=True)
    Traceback (most recent call last):
    ...
    ValueError: alpha must be in (0, 1), got 1.5.
    ```
    """
    value = getattr(obj, name)
    if value is None:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if not number or (value <= low if low_open else value < low) or (value >= high if high_open else value > high):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value!r}.")
