"""`TrainingClock`: the time inside optimizer steps, saved in every checkpoint and read back by a resumed run."""

import pytest
from transformers import TrainerState

from hf_rockopd.trainers.clock import TrainingClock


def _ticks(*values):
    it = iter(values)
    return lambda: next(it)


def test_it_times_steps_only_and_round_trips_through_trainer_state(tmp_path):
    clock = TrainingClock(clock=_ticks(0.0, 2.0, 10.0, 13.5))
    for _ in range(2):  # 8 s between the two steps (a checkpoint's evaluation) are not a step's time
        clock.on_step_begin(None, None, None)
        clock.on_step_end(None, None, None)
    assert (clock.seconds, clock.steps) == (5.5, 2)
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    TrainerState(global_step=2, stateful_callbacks=[clock]).save_to_json(str(checkpoint / "trainer_state.json"))
    again = TrainingClock.from_checkpoint(str(checkpoint))
    assert (again.seconds, again.steps) == (5.5, 2)


def test_a_checkpoint_without_a_clock_or_no_checkpoint_starts_at_zero(tmp_path):
    TrainerState(global_step=3).save_to_json(str(tmp_path / "trainer_state.json"))
    for checkpoint in (str(tmp_path), None, str(tmp_path / "missing")):
        clock = TrainingClock.from_checkpoint(checkpoint)
        assert (clock.seconds, clock.steps) == (0.0, 0)


def test_negative_values_are_refused():
    with pytest.raises(ValueError, match="seconds=-1"):
        TrainingClock(seconds=-1)
