"""The start-up timeline (trainers/startup.py): milestones in seconds since this process started, first reach kept."""

from __future__ import annotations

import time

import psutil
import pytest

from async_rlhf.trainers.startup import StartupTimeline


def test_milestones_count_from_the_process_start_and_keep_their_first_time():
    timeline = StartupTimeline()
    assert timeline.process_start == pytest.approx(psutil.Process().create_time())
    timeline.mark("trainer_entered")
    first = timeline.marks["trainer_entered"]
    assert 0 < first == pytest.approx(time.time() - psutil.Process().create_time(), abs=0.5)
    time.sleep(0.05)
    timeline.mark("trainer_entered")  # a second train(): the milestone stays where it was first reached
    assert timeline.marks["trainer_entered"] == first
    timeline.mark("generators_ready")
    timeline.mark("generators_spawned", seconds_ago=10.0, replace=True)  # the pool's own start time
    assert list(timeline.as_dict()) == ["generators_spawned", "trainer_entered", "generators_ready"]
    assert timeline.marks["generators_ready"] - timeline.marks["generators_spawned"] == pytest.approx(10.0, abs=0.1)
    line = StartupTimeline.format({"trainer_entered": 5.25, "first_step": 11.84})
    assert line == "start-up (seconds since process start): trainer entered 5.2 | first step 11.8"


def test_an_unknown_milestone_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown start-up milestone 'first_stpe'.*'first_step'"):
        StartupTimeline().mark("first_stpe")
