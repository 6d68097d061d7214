"""Peak-memory measurement on CPU for one process: RSS high-water mark since a reset, and an address-space cap.

torch's CPU allocations bypass `tracemalloc`, so the kernel's own resident-set high-water mark (`VmHWM`) is used: it is
reset by writing `5` to `/proc/self/clear_refs` just before the measured region, so setup costs are not counted.
"""

from __future__ import annotations

import gc
import resource

import torch


__all__ = ["cap_address_space", "current_rss", "peak_rss_since_reset", "peak_since_reset", "reset_peak", "reset_peak_rss"]


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key} line; peak-RSS measurement needs Linux.")


def current_rss() -> int:
    """Resident set size of this process in bytes.

    Example:
    ```python
    >>> from benchmarks.memory import current_rss
    >>> current_rss() > 0
    True
    ```
    """
    return _status_kib("VmRSS") * 1024


def reset_peak_rss() -> int:
    """Collect garbage, reset the RSS high-water mark to the current RSS, and return that RSS (bytes): the baseline."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return current_rss()


def peak_rss_since_reset() -> int:
    """RSS high-water mark (bytes) since the last [`reset_peak_rss`]."""
    return _status_kib("VmHWM") * 1024


def reset_peak(device: torch.device | str = "cpu") -> int:
    """Start a peak-memory measurement on `device` and return its baseline (bytes): the RSS reset on the CPU; on CUDA,
    after waiting for queued kernels, the caching allocator's peak is reset and what is allocated now returned."""
    device = torch.device(device)
    if device.type != "cuda":
        return reset_peak_rss()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_since_reset(device: torch.device | str = "cpu") -> int:
    """Peak bytes on `device` since [`reset_peak`]: `VmHWM` on the CPU, `max_memory_allocated` on CUDA.

    Example:
    ```python
    >>> from benchmarks.memory import peak_since_reset, reset_peak
    >>> peak_since_reset() >= reset_peak() > 0
    True
    ```
    """
    device = torch.device(device)
    if device.type != "cuda":
        return peak_rss_since_reset()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def cap_address_space(extra_bytes: int) -> None:
    """Let this process map at most `extra_bytes` more virtual memory than it has now; beyond it allocations fail
    (torch raises `RuntimeError: ... can't allocate memory`), which the benchmark reports as OOM instead of letting a
    case take the shared machine's memory."""
    limit = _status_kib("VmSize") * 1024 + int(extra_bytes)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
