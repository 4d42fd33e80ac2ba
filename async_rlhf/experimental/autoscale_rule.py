"""When to add or retire a generator during a run (`generator_autoscale`): a cost-aware rule after RLHFless, as pure
functions of what rank 0 measured over a window of steps. `experimental/elastic.py` measures and applies it.

What a window holds (`Window`): its steps, its wall time T per step on learner rank 0, the learner's wait W per step
(in `batch_for_step`), the generators' sampling time B per step summed over the k generators that ran it (their
`busy_seconds`, acknowledged with each weight load). The learner's own time per step is then T - W, and a batch's
generation latency with k generators is g(k) = B / k (every batch is split over all of them, `pipeline._send`).

Predicted wait with k' generators: W(k') = max(0, W + g(k') - g(k) - slack). The latency a change saves or adds
moves the wait one for one, except for the slack that overlap gives: none at max_staleness 0 (generation and
training alternate), and max(0, (T - W) - g(k)) at max_staleness >= 1 (how much longer generation could take before
the learner, which trains the previous batch meanwhile, would wait). Predicted step time: T(k') = T - W + W(k').

Cost per step: C(k) = (L + c k) T(k) device-seconds, for L learner devices at price 1 and k generator devices at
price c (`generator_autoscale_cost`: 0.5 for an inference device at half a training device's price; 0 makes
generators free, so only the wait decides). Samples per step are fixed, so C is also the cost per sample.

The rule, checked once per window, in this order:
* **undo** an addition that did not pay: on the first window measured after a generator was added, if the measured
  C(k) is not below the C(k - 1) measured on the window that decided the addition, retire it. The prediction's
  assumption (below) may fail, and then measurement overrules it: the C(k) measured is remembered, and k generators
  are not tried again until the cost measured with k - 1 exceeds it (the workload grew), so that a generator is not
  started and stopped over and over (each start costs time, and on a shared CPU, the others' speed);
* **add** a generator when the learner waited at least `wait_threshold` of the window, a spare device is free, and
  C(k + 1) <= (1 - MIN_GAIN) C(k): the learner's wait it removes pays for the device it takes;
* **retire** one when the generators sampled at most 1 - `idle_threshold` of the window (idle fraction
  1 - B / (k T) >= `idle_threshold`), more than one runs, and C(k - 1) <= (1 - MIN_GAIN) C(k): the wait it adds
  costs less than the device it frees;
* else **hold**. MIN_GAIN keeps measurement noise from flipping a generator in and out.

The prediction assumes B stays put when k changes (each generator's speed does not depend on how many run); on a
CPU whose cores the generators share it does not hold, and the next window, measured with the new k, says so.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_GAIN = 0.05  # a change must cut the predicted cost per step by this fraction


@dataclass(frozen=True)
class Window:
    steps: int
    seconds: float  # wall time of those steps on learner rank 0
    wait_seconds: float  # of which the learner waited for rollouts
    busy_seconds: float  # generator sampling time in the window, summed over generators
    generators: int  # k: generators that took work during the window

    @property
    def step_seconds(self) -> float:
        return self.seconds / self.steps

    @property
    def wait_fraction(self) -> float:
        return self.wait_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def idle_fraction(self) -> float:
        """Share of the generators' time not spent sampling (clamped to [0, 1]: busy times arrive with a lag)."""
        if self.seconds <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.busy_seconds / (self.generators * self.seconds)))


@dataclass(frozen=True)
class AutoscaleRule:
    learners: int  # L: learner devices (learner processes), each at price 1
    max_staleness: int
    generator_cost: float = 1.0  # c: a generator device's price relative to a learner device's
    wait_threshold: float = 0.1
    idle_threshold: float = 0.5


@dataclass(frozen=True)
class Decision:
    action: str  # "add" | "retire" | "hold"
    reason: str
    wait_fraction: float
    idle_fraction: float
    cost_now: float  # device-seconds per step with k generators (measured step time)
    cost_after: float  # predicted, with the generators the action leaves (cost_now when holding)

    def to_dict(self) -> dict:
        return {"action": self.action, "reason": self.reason, "wait_fraction": self.wait_fraction,
                "idle_fraction": self.idle_fraction, "cost_now": self.cost_now, "cost_after": self.cost_after}


def predicted_step_seconds(w: Window, generators: int, max_staleness: int) -> float:
    """T(k') for k' generators, from the window measured with w.generators (see the module docstring)."""
    t, wait = w.step_seconds, w.wait_seconds / w.steps
    latency = w.busy_seconds / w.steps  # B: one generator's latency for a whole batch
    g_now, g_then = latency / w.generators, latency / generators
    learner = t - wait
    slack = 0.0 if max_staleness == 0 else max(0.0, learner - g_now)
    return learner + max(0.0, wait + g_then - g_now - slack)


def cost_per_step(rule: AutoscaleRule, generators: int, step_seconds: float) -> float:
    return (rule.learners + rule.generator_cost * generators) * step_seconds


def decide(rule: AutoscaleRule, w: Window, can_add: bool, can_retire: bool,
           before_add: Window | None = None, undone_cost: float | None = None) -> Decision:
    """Undo, add, retire or hold, by the rule of the module docstring. `can_add`: a spare device is free;
    `can_retire`: more than one generator runs; `before_add`: on the first window after an addition, the window
    (with one generator fewer) that decided it; `undone_cost`: the C(k + 1) measured when an addition to k + 1
    generators was undone, if one was. An undo is a "retire" whose reason says so."""
    k = w.generators
    now = cost_per_step(rule, k, w.step_seconds)

    def decision(action, reason, after=now):
        return Decision(action, reason, w.wait_fraction, w.idle_fraction, now, after)

    if w.steps < 1 or w.seconds <= 0 or k < 1:
        return decision("hold", "nothing measured")
    if before_add is not None and can_retire:
        was = cost_per_step(rule, before_add.generators, before_add.step_seconds)
        if now >= was:
            return decision("retire", f"undo: with {k} generators {now:.3g} device-s/step measured against {was:.3g} "
                                      f"with {before_add.generators} before the addition", was)
    reasons = []
    if w.wait_fraction >= rule.wait_threshold:
        after = cost_per_step(rule, k + 1, predicted_step_seconds(w, k + 1, rule.max_staleness))
        if not can_add:
            reasons.append(f"learner waited {w.wait_fraction:.0%} but no spare device is free")
        elif undone_cost is not None and now <= undone_cost:
            reasons.append(f"learner waited {w.wait_fraction:.0%}, but {k + 1} generators measured "
                           f"{undone_cost:.3g} device-s/step when last tried, more than {now:.3g} now")
        elif after <= (1 - MIN_GAIN) * now:
            return decision("add", f"learner waited {w.wait_fraction:.0%}; {k + 1} generators predicted "
                                   f"{after:.3g} device-s/step against {now:.3g}", after)
        else:
            reasons.append(f"learner waited {w.wait_fraction:.0%}, but another generator would cost more than the "
                           f"wait it removes ({after:.3g} against {now:.3g} device-s/step)")
    if w.idle_fraction >= rule.idle_threshold and can_retire:
        after = cost_per_step(rule, k - 1, predicted_step_seconds(w, k - 1, rule.max_staleness))
        if after <= (1 - MIN_GAIN) * now:
            return decision("retire", f"generators idle {w.idle_fraction:.0%}; {k - 1} predicted {after:.3g} "
                                      f"device-s/step against {now:.3g}", after)
        reasons.append(f"generators idle {w.idle_fraction:.0%}, but the wait one fewer adds would cost more than "
                       f"its device ({after:.3g} against {now:.3g} device-s/step)")
    return decision("hold", "; ".join(reasons) or f"learner waited {w.wait_fraction:.0%}, generators idle "
                                                  f"{w.idle_fraction:.0%}")
