"""The start-up timeline: when, in seconds since this process started, each stage of a run's start-up was reached.

A trainer records its milestones here (rank 0 reports them in `run_summary.json` under `startup` and in one printed
line): the trainer is entered (imports and the task's set-up before it), its models are loaded, the Trainer is built,
the generators are spawned and ready, and the first optimizer step ends. "Process start" is the kernel's start time
of this process (`psutil`), so the imports before any of our code runs are counted too. Each milestone is kept the
first time it is reached (a resumed or repeated `train()` does not move it).
"""

from __future__ import annotations

import time

MILESTONES = ("trainer_entered", "generators_spawned", "models_loaded", "trainer_built", "train_called",
              "generators_ready", "first_step")


def _process_start() -> float:
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # no psutil, or no /proc: count from the first milestone instead
        return time.time()


class StartupTimeline:
    def __init__(self):
        self.process_start = _process_start()
        self.marks: dict[str, float] = {}

    def mark(self, name: str, seconds_ago: float = 0.0, replace: bool = False) -> None:
        """Record `name` as reached now (or `seconds_ago`); kept the first time unless `replace`."""
        if name not in MILESTONES:
            raise ValueError(f"unknown start-up milestone {name!r}; expected one of {MILESTONES}")
        if replace or name not in self.marks:
            self.marks[name] = round(time.time() - seconds_ago - self.process_start, 3)

    def as_dict(self) -> dict[str, float]:
        """Milestone -> seconds since process start, in the order reached."""
        return dict(sorted(self.marks.items(), key=lambda kv: kv[1]))

    @staticmethod
    def format(marks: dict[str, float]) -> str:
        steps = " | ".join(f"{name.replace('_', ' ')} {seconds:.1f}" for name, seconds in marks.items())
        return f"start-up (seconds since process start): {steps or 'none recorded'}"
