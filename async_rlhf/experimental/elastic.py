"""Elastic generators at run time (`generator_autoscale`): measure, decide, add or retire. Lives on learner rank 0.

`ElasticGenerators.after_step` is called by the pipeline on rank 0's main thread after each optimizer step (so the
processes it starts are tied to the main thread, as `generation/pool/local.py` requires). It measures windows of
`generator_autoscale_window` steps (wall time, the learner's wait, the generators' sampling time), hands each to
`autoscale_rule.decide` (the cost rule; after an addition, with the window that decided it, so that an addition that
did not pay is undone, and that many generators not tried again until the cost grows past what they measured),
and applies the decision to the pool: `add_generator` on the first free spare device, or
`retire_generator` on the newest generator. A window starts only once the pool has settled (no generator
joining or retiring), so that what it measures is the set of generators it will be judged with; the first step of
the run (engine warm-up) is not measured.

Devices: the pool of allowed devices is `generator_devices` (in use from the start) plus `generator_autoscale_devices`
(spare). A retired generator's device becomes free again once its process is gone. Every decision other than "hold"
is appended to `<output_dir>/autoscale.jsonl` with what it was based on (`events` keeps them for the run summary).
The pool's own guarantees (no request lost, newest weights before any request, staleness bound) are what make a
change safe at any step; this module only chooses when.

Experimental because it has not paid where measured: 0.69x and 0.85x of one fixed generator on 2 CPU cores (a
second CPU engine slows the first); no GPU measurement (docs/performance.md, Verdicts).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Callable

from async_rlhf.experimental.autoscale_rule import AutoscaleRule, Window, decide
from async_rlhf.generation.engine.worker import GeneratorSpec
from async_rlhf.generation.pool.scheduling import FixedGenerators

logger = logging.getLogger(__name__)


class ElasticGenerators(FixedGenerators):
    """`generator_autoscale` as a `generation/pool/scheduling.py` schedule: after each optimizer step, measure a
    window, then add or retire a generator as the rule decides."""

    def __init__(self, pool, rule: AutoscaleRule, window: int, devices: list[str], spare: list[str],
                 new_spec: Callable[[int, str], GeneratorSpec], record_path: str | None = None):
        """`devices`: the device of each generator the pool started with (by id); `spare`: the devices it may add
        generators on; `new_spec(generator_id, device)`: the spec of a generator to add."""
        self.pool = pool
        self.rule = rule
        self.window = window
        self.device_of = dict(enumerate(devices))  # generator id -> device
        self.free = list(spare)
        self.new_spec = new_spec
        self.record_path = record_path
        self.events: list[dict] = []
        self.windows: list[dict] = []  # every window measured: step, generators, step seconds, wait and idle, action
        self._mark: tuple[int, float, float, float] | None = None  # step, time, learner wait, generator busy
        self._releasing: set[int] = set()  # retired generators whose device is not free yet
        self._before_add: Window | None = None  # the window that decided the last addition, until the next window
        self._undone: dict[int, float] = {}  # generators -> cost per step measured with them when undone

    def _busy(self) -> float:
        return sum(self.pool.acks.busy_seconds.values())

    def after_step(self, step: int, wait_seconds: float, queued_version: int) -> None:
        """After optimizer step `step` (the learner now holds version `step`); `wait_seconds`: the learner's total
        wait for rollouts so far; `queued_version`: the newest weights queued to the generators."""
        self.pool.advance_retiring(time.monotonic())  # a drained generator gets Shutdown even if no one waits
        for gid in [g for g in self._releasing if g in self.pool.retired]:
            self._releasing.discard(gid)
            self.free.append(self.device_of[gid])
        now = time.monotonic()
        if step <= 1 or self._mark is None or not self.pool.settled():
            self._mark = (step, now, wait_seconds, self._busy())  # measure from here
            return
        start, t0, wait0, busy0 = self._mark
        if step - start < self.window:
            return
        busy = self._busy()
        active = self.pool.active_generators()
        # a restarted generator reports its busy time from 0 again: never let the sum go backwards
        w = Window(step - start, now - t0, wait_seconds - wait0, max(0.0, busy - busy0), len(active))
        self._mark = (step, now, wait_seconds, busy)
        d = decide(self.rule, w, can_add=bool(self.free), can_retire=len(active) > 1, before_add=self._before_add,
                   undone_cost=self._undone.get(len(active) + 1))
        self._before_add = w if d.action == "add" else None
        if d.reason.startswith("undo"):
            self._undone[len(active)] = d.cost_now
        self.windows.append({"step": step, "generators": w.generators, "step_seconds": w.step_seconds,
                             "wait_fraction": d.wait_fraction, "idle_fraction": d.idle_fraction, "action": d.action})
        if d.action == "hold":
            logger.debug("autoscale at step %d: hold (%s)", step, d.reason)
            return
        if d.action == "add":
            device = self.free.pop(0)
            gid = len(self.pool.specs)
            self.device_of[gid] = device
            self.pool.add_generator(self.new_spec(gid, device))
        else:
            gid = max(active)  # the newest generator goes first
            device = self.device_of[gid]
            self.pool.retire_generator(gid)
            self._releasing.add(gid)
        event = {"step": step, "generator_id": gid, "device": device, "queued_version": queued_version,
                 "generators_before": len(active), "window_steps": w.steps, "step_seconds": w.step_seconds,
                 **d.to_dict()}
        self.events.append(event)
        logger.info("autoscale at step %d: %s generator %d on %s (%s)", step, d.action, gid, device, d.reason)
        if self.record_path:
            os.makedirs(os.path.dirname(self.record_path) or ".", exist_ok=True)
            with open(self.record_path, "a") as f:
                f.write(json.dumps(event) + "\n")

    def summary(self) -> dict[str, dict]:
        """For the run summary: decisions taken, every window measured, and what each generator answered (parts,
        oldest version)."""
        return {"generator_autoscale": {
            "events": self.events, "windows": self.windows, "generators_final": len(self.pool.active_generators()),
            "joining_at_end": self.pool.joining(), "retired": sorted(self.pool.retired),
            "answered": {str(g): v for g, v in sorted(self.pool.answered.items())}}}


def make_elastic(args, pool, learners: int, new_spec: Callable[[int, str], GeneratorSpec]) -> ElasticGenerators:
    """The controller `args.generator_autoscale` asks for; `learners`: learner processes."""
    rule = AutoscaleRule(learners=learners, max_staleness=args.max_staleness,
                         generator_cost=args.generator_autoscale_cost,
                         wait_threshold=args.generator_autoscale_wait, idle_threshold=args.generator_autoscale_idle)
    return ElasticGenerators(pool, rule, args.generator_autoscale_window, list(args.generator_devices),
                             list(args.generator_autoscale_devices), new_spec,
                             os.path.join(args.output_dir, "autoscale.jsonl"))
