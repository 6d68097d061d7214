"""What a run prints: scoped filters for library notices a user can do nothing about, phase lines, a compact step line.

Standard library only at import time: `hf_rockopd/__init__.py` imports this module before TRL and transformers, to
wrap their imports. The trainer callback that prints the compact line is `hf_rockopd.trainers.progress`.

Filters are scoped: they hold only while our own calls run (`quiet_library_imports` around our imports of TRL and
transformers, `quiet_training` around `trainer.train()`), each matches one notice by category and message, and
everything else, a real warning included, still shows. Nothing here changes the global warning or logging setup.

Example:
```python
>>> import warnings
>>> from hf_rockopd.console import quiet_training
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     with quiet_training():
...         warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
...         warnings.warn("a real problem", UserWarning)
>>> [str(w.message) for w in caught]
['a real problem']
```
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any


__all__ = ["PhaseLog", "compact_step_line", "quiet_library_imports", "quiet_training"]

# bitsandbytes logs this when it imports (peft imports it, whether or not a 4-bit model is ever used): a missing
# optional kernel package that only speeds up 4-bit matmuls on CPU. `hf_rockopd.distill` says it when a 4-bit student
# is really loaded.
_BNB_KERNEL_NOTICE = "Failed to load CPU gemm_4bit_forward"
# TRL's GKD passes `return_dict_in_generate` next to a `generation_config`: a transformers deprecation about TRL's call.
_GENERATE_NOTICE = "Passing `generation_config` together with generation-related"
# DeepSpeed, when installed, is imported by accelerate as our trainers are built (`extract_model_from_parallel`, even in
# a run that does not use DeepSpeed) and logs this when torch sees no GPU: it only reports that DeepSpeed picked its CPU
# backend, the one such a machine has, and nothing a user can change. On a GPU machine it is not said.
_DEEPSPEED_CPU_NOTICE = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."


class _DropMessages(logging.Filter):
    """Drops log records whose message starts with one of `prefixes`."""

    def __init__(self, *prefixes: str):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


@contextmanager
def _log_filter(logger_name: str, *prefixes: str) -> Iterator[None]:
    logger, dropper = logging.getLogger(logger_name), _DropMessages(*prefixes)
    logger.addFilter(dropper)
    try:
        yield
    finally:
        logger.removeFilter(dropper)


@contextmanager
def quiet_library_imports() -> Iterator[None]:
    """While our package imports TRL and transformers: no `trl.experimental` notice (we import TRL's GKD from there on
    purpose) and no bitsandbytes CPU-kernel notice (see `_BNB_KERNEL_NOTICE`). Other warnings show.

    Example:
    ```python
    from hf_rockopd.console import quiet_library_imports
    with quiet_library_imports():
        from trl.experimental.gkd import GKDTrainer
    ```
    """
    with warnings.catch_warnings(), _log_filter("bitsandbytes.backends.cpu.ops", _BNB_KERNEL_NOTICE):
        try:
            from trl.import_utils import TRLExperimentalWarning
        except ImportError:  # an older TRL without the class warns nothing
            pass
        else:
            warnings.filterwarnings("ignore", category=TRLExperimentalWarning)
        yield


@contextmanager
def quiet_training() -> Iterator[None]:
    """While our trainers are built and `trainer.train()` runs: no deprecation notices about calls TRL and peft make
    inside their own code (`is_gradient_checkpointing`, read by peft's `PeftModel` and by TRL; `generation_config`
    passed with generation arguments), and no DeepSpeed notice that it found no GPU (see `_DEEPSPEED_CPU_NOTICE`).
    Other warnings show.

    Example:
    ```python
    from hf_rockopd.console import quiet_training
    with quiet_training():
        trainer.train()
    ```
    """
    with (
        warnings.catch_warnings(),
        _log_filter("transformers.generation.utils", _GENERATE_NOTICE),
        _log_filter("DeepSpeed", _DEEPSPEED_CPU_NOTICE),
    ):
        # TRL's trainers call transformers' renamed `*gradient_checkpointing*` methods during train().
        warnings.filterwarnings(
            "ignore", message=r"`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated", category=FutureWarning
        )
        yield


class PhaseLog:
    """Prints the phase a run is in with the time since the run started: `[1:02] evaluating before training (16 ...)`.

    Lines go to stderr (where the progress bars are), so a redirected stdout keeps only the results.

    Example:
    ```python
    >>> import sys
    >>> from hf_rockopd.console import PhaseLog
    >>> phases = PhaseLog(stream=sys.stdout, clock=lambda: 75.0, start=0.0)
    >>> phases("training", "20 steps")
    [1:15] training: 20 steps
    ```
    """

    def __init__(self, stream: Any = None, clock: Any = time.perf_counter, start: float | None = None):
        self.stream, self.clock = stream, clock
        self.start = clock() if start is None else start

    def elapsed(self) -> str:
        """Time since the start as `m:ss` (or `h:mm:ss`)."""
        seconds = int(self.clock() - self.start)
        hours, rest = divmod(seconds, 3600)
        return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"

    def __call__(self, phase: str, detail: str | None = None) -> None:
        """Print `[elapsed] phase: detail`."""
        print(f"[{self.elapsed()}] {phase}{f': {detail}' if detail else ''}", file=self.stream or sys.stderr,
              flush=True)


def compact_step_line(logs: Mapping[str, Any], step: int, max_steps: int, seconds: float | None) -> str | None:
    """One short line for a training log: step, loss, frozen share, clipped ratio and seconds per step.

    Returns None for logs without a loss (the end-of-training summary, evaluations), which keep their own output.

    Example:
    ```python
    >>> from hf_rockopd.console import compact_step_line
    >>> logs = {"loss": 0.7636, "rock/frozen_fraction": 0.16, "completions/clipped_ratio": 0.75, "grad_norm": 4.9}
    >>> compact_step_line(logs, step=3, max_steps=20, seconds=17.3)
    'step 3/20  loss 0.7636  frozen 16.0%  clipped 75%  17.3 s/step'
    ```
    """
    if not isinstance(logs.get("loss"), (int, float)):
        return None
    parts = [f"step {step}/{max_steps}", f"loss {logs['loss']:.4f}"]
    frozen = logs.get("rock/frozen_fraction")
    if isinstance(frozen, (int, float)):
        parts.append(f"frozen {100 * frozen:.1f}%")
    clipped = logs.get("completions/clipped_ratio")
    if isinstance(clipped, (int, float)):
        parts.append(f"clipped {100 * clipped:.0f}%")
    if seconds is not None:
        parts.append(f"{seconds:.1f} s/step")
    return "  ".join(parts)
