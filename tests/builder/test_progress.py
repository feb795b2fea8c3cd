"""Progress lines with the elapsed time and the time left, on a fake clock."""
import pytest

from builder.pipeline.progress import Eta, format_duration


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (44.6, "45s"), (185, "3m05s"),
                                           (3720, "1h02m")])
def test_durations_read_as_a_person_would_say_them(seconds, text):
    assert format_duration(seconds) == text


def test_each_unit_says_its_count_the_time_so_far_and_the_time_left():
    clock, said = _Clock(), []
    eta = Eta("task item", 4, said.append, clock=clock)
    for _ in range(4):
        clock.now += 30
        eta.tick()
    assert said == ["task item 1/4 (30s elapsed, about 1m30s left)",
                    "task item 2/4 (1m00s elapsed, about 1m00s left)",
                    "task item 3/4 (1m30s elapsed, about 30s left)",
                    "task item 4/4 (2m00s)"]


def test_a_dearer_phase_is_estimated_from_the_ratio_then_from_its_own_pace():
    clock, said = _Clock(), []
    eta = Eta("calibration batch", 4, said.append, costs=[1, 1, 10, 10], clock=clock)
    for seconds in (5, 5, 100, 100):
        clock.now += seconds
        eta.tick()
    # After the cheap phase: 5 s per unit of cost, 20 units left. In the dear phase: its own
    # pace (100 s for 10 units) for the 10 units left, whatever the cheap phase measured.
    assert said[1] == "calibration batch 2/4 (10s elapsed, about 1m40s left)"
    assert said[2] == "calibration batch 3/4 (1m50s elapsed, about 1m40s left)"
    assert said[3] == "calibration batch 4/4 (3m30s)"


def test_a_loop_longer_than_announced_is_counted_without_a_guess():
    said: list[str] = []
    eta = Eta("batch", 1, said.append, clock=_Clock())
    eta.tick()
    eta.tick()
    assert said[-1] == "batch 2 (beyond the 1 expected)"
    with pytest.raises(ValueError, match="total must be >= 1"):
        Eta("batch", 0, said.append)
