"""The training time of a run that may span several sittings: a callback whose total is saved in every checkpoint.

`Trainer` times each `train()` call (`train_runtime`), so a run stopped and resumed from a checkpoint knows only its
last sitting's time. [`TrainingClock`] adds up the time inside optimizer steps and stores the sum in the checkpoint's
`trainer_state.json` (transformers' `ExportableState`), where a resumed run reads it back.

Example:
```python
from hf_rockopd.trainers.clock import TrainingClock
clock = TrainingClock.from_checkpoint("out/checkpoint-50")  # a fresh clock when there is none
trainer.add_callback(clock)
trainer.train(resume_from_checkpoint="out/checkpoint-50")
print(TrainingClock.of(trainer).seconds, "s over", TrainingClock.of(trainer).steps, "steps")
```
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback, TrainerState
from transformers.trainer_callback import ExportableState


__all__ = ["TrainingClock"]

_STATE_FILE = "trainer_state.json"


class TrainingClock(TrainerCallback, ExportableState):
    """Seconds spent inside optimizer steps (`on_step_begin` to `on_step_end`) over every sitting of a run.

    What runs between steps (a checkpoint's save, an evaluation callback) is left out, as it is from the console's
    seconds per step. `steps` counts the steps timed: it is less than `global_step` when a sitting ran without the
    clock (a checkpoint written by an older version), and the card then says which steps the time covers.

    Args:
        seconds: Time already spent (restored from a checkpoint).
        steps: Steps already timed.

    Example:
    ```python
    >>> from hf_rockopd.trainers.clock import TrainingClock
    >>> ticks = iter([0.0, 2.5])
    >>> clock = TrainingClock(clock=lambda: next(ticks))
    >>> clock.on_step_begin(None, None, None); clock.on_step_end(None, None, None)
    >>> clock.seconds, clock.steps, clock.state()["attributes"]
    (2.5, 1, {'seconds': 2.5, 'steps': 1})
    ```
    """

    def __init__(self, seconds: float = 0.0, steps: int = 0, clock: Callable[[], float] = time.perf_counter):
        if seconds < 0 or steps < 0:
            raise ValueError(f"TrainingClock needs seconds >= 0 and steps >= 0, got seconds={seconds}, steps={steps}.")
        self.seconds, self.steps = float(seconds), int(steps)
        self._clock = clock
        self._started: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        """Start timing the step."""
        self._started = self._clock()

    def on_step_end(self, args, state, control, **kwargs):
        """Add the step's time (transformers calls this before it saves the step's checkpoint)."""
        if self._started is not None:
            self.seconds += self._clock() - self._started
            self.steps += 1
            self._started = None

    def state(self) -> dict[str, Any]:
        """What the checkpoint's `trainer_state.json` keeps (`stateful_callbacks["TrainingClock"]`)."""
        return {"args": {}, "attributes": {"seconds": round(self.seconds, 3), "steps": self.steps}}

    @classmethod
    def from_checkpoint(cls, checkpoint: str | os.PathLike | None) -> TrainingClock:
        """The clock saved in `checkpoint` (a `checkpoint-N` folder), or a fresh one when it has none.

        Example:
        ```python
        clock = TrainingClock.from_checkpoint("out/checkpoint-50")
        ```
        """
        path = os.path.join(checkpoint, _STATE_FILE) if checkpoint else None
        if path is None or not os.path.isfile(path):
            return cls()
        stored = (TrainerState.load_from_json(path).stateful_callbacks or {}).get(cls.__name__)
        if isinstance(stored, list):  # transformers keeps a list when a trainer had several clocks
            stored = stored[0] if stored else None
        return cls(**(stored or {}).get("attributes", {}))

    @classmethod
    def of(cls, trainer: Any) -> TrainingClock | None:
        """The clock among `trainer`'s callbacks (transformers swaps in a new instance when
        `restore_callback_states_from_checkpoint` is set, so a reference kept from before `train()` may be stale)."""
        return next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, cls)), None)
