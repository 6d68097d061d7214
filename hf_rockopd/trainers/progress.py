"""The training progress of `hf-rockopd distill`: transformers' progress bar with one compact line per logged step.

Example:
```python
from transformers.trainer_callback import ProgressCallback
from hf_rockopd.trainers.progress import CompactProgressCallback
trainer.remove_callback(ProgressCallback)
trainer.add_callback(CompactProgressCallback())
```
"""

from __future__ import annotations

import statistics
import time

from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from ..console import compact_step_line


__all__ = ["CompactProgressCallback"]


def _duration(seconds: float) -> str:
    """`h:mm:ss` (or `m:ss` under an hour)."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class CompactProgressCallback(TrainerCallback):
    """Trainer callback that prints [`~hf_rockopd.console.compact_step_line`] under the progress bar, instead of the
    full log dict.

    Install it in place of transformers' `ProgressCallback`, whose bar it keeps driving through
    `progress_callback`; `trainer.state.log_history` still holds every metric.

    Example:
    ```python
    from transformers.trainer_callback import ProgressCallback
    from hf_rockopd.trainers.progress import CompactProgressCallback
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(CompactProgressCallback())
    ```
    """

    def __init__(self, clock=time.perf_counter):
        self.progress = ProgressCallback()
        self._clock = clock
        # Seconds inside optimizer steps (on_step_begin to on_step_end): what a checkpoint's save and evaluation
        # cost between steps is not a step's time, and an evaluation of minutes would make the ETA hours off.
        self._busy = self._busy_at_log = 0.0
        # Each step's time in this sitting: the ETA takes their median, so that one step stalled for minutes (a
        # process paused with SIGSTOP, the machine swapping) does not stretch the ETA of every step after it.
        self._step_seconds: list[float] = []
        self._step_started: float | None = None
        self._last_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        """Start the bar and the step clock."""
        self.progress.on_train_begin(args, state, control, **kwargs)
        # The ETA counts the steps of this process only: a resumed run's earlier steps ran at another time.
        self._last_step = state.global_step
        self._busy_at_log = self._busy
        self._step_seconds = []

    def on_step_begin(self, args, state, control, **kwargs):
        """Start the step's clock."""
        self._step_started = self._clock()

    def on_step_end(self, args, state, control, **kwargs):
        """Stop the step's clock and move the bar."""
        if self._step_started is not None:
            seconds = self._clock() - self._step_started
            self._busy += seconds
            self._step_seconds.append(seconds)
            self._step_started = None
        self.progress.on_step_end(args, state, control, **kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Write the compact line: seconds per step since the previous log, and the ETA from the median step of this
        sitting; both count only the time inside optimizer steps (not checkpoint saves and evaluations between
        them)."""
        if not state.is_world_process_zero or self.progress.training_bar is None:
            return
        steps = state.global_step - self._last_step
        seconds = (self._busy - self._busy_at_log) / steps if steps > 0 else None
        line = compact_step_line(logs or {}, state.global_step, state.max_steps, seconds)
        if line is not None and self._step_seconds and state.max_steps > state.global_step:
            per_step = statistics.median(self._step_seconds)
            line += f" | eta {_duration(per_step * (state.max_steps - state.global_step))}"
        if line is not None:
            self._busy_at_log, self._last_step = self._busy, state.global_step
            self.progress.training_bar.write(line)

    def on_train_end(self, args, state, control, **kwargs):
        """Close the bar."""
        self.progress.on_train_end(args, state, control, **kwargs)
