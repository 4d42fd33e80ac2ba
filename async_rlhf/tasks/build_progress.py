"""What the one-time build of a prepared task (the built-in or the long-tail one, `prepare.py`) shows while it runs: a line saying what is built
where and about how long it takes, then one progress bar per stage (SFT steps, preference-pair sampling, reward
model steps) with tqdm's rate and time left.

Shown by rank 0 only (`RANK` unset or 0): under `accelerate launch` the other ranks wait for rank 0's cache.
Bars go to stderr; tqdm redraws one line on a terminal and writes a line per update elsewhere (at most every
`MIN_SECONDS`), so a log file stays short too."""

from __future__ import annotations

import contextlib
import os
import sys

from tqdm.auto import tqdm

MIN_SECONDS = 5.0  # at most one redraw per this many seconds
_label = ["task"]  # what the bars name: set by `building` for the build in progress


def shown() -> bool:
    return os.environ.get("RANK", "0") == "0"


def announce(message: str) -> None:
    if shown():
        print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def building(label: str):
    """The bars opened inside name `label` ("built-in task", "long-tail task")."""
    previous, _label[0] = _label[0], label
    try:
        yield
    finally:
        _label[0] = previous


def stage(index: int, count: int, what: str, total: int, unit: str = "step") -> tqdm:
    """A bar for stage `index` of `count`; a no-op bar off rank 0."""
    return tqdm(total=total, desc=f"{_label[0]} [{index}/{count}] {what}", unit=unit, disable=not shown(),
                mininterval=MIN_SECONDS, file=sys.stderr, dynamic_ncols=True)


@contextlib.contextmanager
def without_library_bars():
    """transformers' own bars (loading and writing each model, several times a build) would interleave with ours."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
