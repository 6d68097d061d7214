"""The training progress line of `hf-rockopd distill`: seconds per step and the ETA count only the time inside
optimizer steps, so a checkpoint's evaluation of minutes (at the start or between steps) does not make the ETA hours
off, a step stalled for minutes (a paused process) does not stretch the ETA, and a resumed run's ETA counts its own
steps."""

from types import SimpleNamespace

from hf_rockopd.trainers.progress import CompactProgressCallback


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _run(callback, clock, state, steps, step_seconds, between=None, slow=None):
    lines = []
    callback.on_train_begin(None, state, None)
    callback.progress.training_bar.write = lines.append
    for _ in range(steps):
        callback.on_step_begin(None, state, None)
        clock.now += (slow or {}).get(state.global_step + 1, step_seconds)
        state.global_step += 1
        callback.on_step_end(None, state, None)
        callback.on_log(None, state, None, logs={"loss": 0.5})
        clock.now += (between or {}).get(state.global_step, 0.0)  # a checkpoint's save and evaluation
    callback.progress.training_bar.close()
    return lines


def test_checkpoint_evaluations_between_steps_are_not_step_time():
    clock = _Clock()
    callback = CompactProgressCallback(clock=clock)
    state = SimpleNamespace(global_step=0, max_steps=10, is_world_process_zero=True)
    clock.now += 500.0  # the step-0 evaluation runs in on_train_begin, before the first step
    lines = _run(callback, clock, state, steps=4, step_seconds=80.0, between={2: 470.0})
    assert lines[0] == "step 1/10  loss 0.5000  80.0 s/step | eta 12:00"
    assert lines[2] == "step 3/10  loss 0.5000  80.0 s/step | eta 9:20"  # after the evaluation at step 2
    assert lines[3].endswith("80.0 s/step | eta 8:00")


def test_a_resumed_run_counts_its_own_steps():
    clock = _Clock()
    state = SimpleNamespace(global_step=6, max_steps=10, is_world_process_zero=True)
    lines = _run(CompactProgressCallback(clock=clock), clock, state, steps=2, step_seconds=30.0)
    assert lines == ["step 7/10  loss 0.5000  30.0 s/step | eta 1:30", "step 8/10  loss 0.5000  30.0 s/step | eta 1:00"]


def test_a_stalled_step_shows_in_its_line_but_not_in_the_eta():
    # The real-budget run was paused (SIGSTOP) for 22 minutes inside step 5: its ETA read 12:31:24 for 190 steps of
    # about 95 s (5:00:00) when it counted the mean step.
    clock = _Clock()
    state = SimpleNamespace(global_step=0, max_steps=10, is_world_process_zero=True)
    lines = _run(CompactProgressCallback(clock=clock), clock, state, steps=4, step_seconds=90.0, slow={2: 1400.0})
    assert lines[1] == "step 2/10  loss 0.5000  1400.0 s/step | eta 1:39:20"  # the median of 90 and 1400: too few steps yet
    assert lines[2] == "step 3/10  loss 0.5000  90.0 s/step | eta 10:30"
    assert lines[3] == "step 4/10  loss 0.5000  90.0 s/step | eta 9:00"
