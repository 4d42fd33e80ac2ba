"""The optional mechanisms projected at the scale the seed papers report: the "projected" column of the verdict table
in docs/performance.md (*Verdicts: every optional mechanism*).

    python benchmarks/verdicts.py
    python benchmarks/verdicts.py --seeds 3

Every figure is a prediction of the planner's models (`async_rlhf/plan/`), nothing is run: the cost model
(`cost_model.py`: seconds per stage from the model's shape and an analytical device profile of `hardware.py`) prices
the stages, and the simulator (`simulator.py`: admission, FIFO inboxes, streaming or batch-level engines whose decode
step reads the weights once per step, lengths drawn per sample) turns them into a step time. The split is the
planner's own pick (`search.py`) at `max_staleness` 1, the project's default, unless a row says otherwise; each
ratio is the mechanism's step time (or cost) against the default's on that split (> 1: the mechanism pays).

Three settings, one per seed paper. The model sizes and device kinds follow the papers (13B-65B LLaMA for RLHFuse,
arXiv 2409.13221; Qwen2.5 3B/7B on 8-GPU L40S nodes for RLHFless, arXiv 2602.22718, as summaries of it report; up to
70B on 128 GPUs for ReaL, arXiv 2406.14088); GPU counts, batch sizes and length distributions are ours (stated in
SETTINGS), not the papers' (not confirmed from their text). The models are the standard shapes of `model_shapes.py`
(Llama 2 7B / 13B, Llama 3.1 70B), with a reward model of the policy's size; the FLOPs are online DPO's.

What is modelled, and how:
- streaming (`generation_mode stream`, and transformers' `continuous_batching`, the same engine-level mechanism):
  the simulator's streaming engine against its batch-level one (a request answered when its longest sample ends);
- in-flight weight loads (`weight_load in_flight`): the streaming engine loading between two steps, not draining;
- shared prefixes (`reference_shared_prefix`, `reward_shared_prefix`): the cost model's FLOPs of the reference (2P)
  or reward (2R) forward counted with each prompt once per group instead of once per sample; the step then
  simulated. FLOPs only: the extra forwards and kernel launches that made the split lose on an H100 at small
  batches are not in the model;
- generator autoscaling (`generator_autoscale`, RLHFless's cost-aware scaling): the project's own rule
  (`experimental/autoscale_rule.decide`) fed windows of simulated steps while the response lengths drift upward,
  against the best fixed generator count for the whole run (chosen in hindsight); cost = device-seconds, a
  generator device priced as a learner device (`generator_autoscale_cost` 1), starts of new generators free;
- the planned split (`python -m async_rlhf.plan`, ReaL's cost-model-chosen plan): the planner's pick against an even
  split (half the devices learning) and against the median plan it ranked;
- `score_while_generating` and `reference_while_generating`: not applicable at these scales (the learners need
  DeepSpeed, under which scoring as parts arrive is refused, and the fused reference needs it).
Not modelled (printed as such): partial rollouts, tail migration, train-while-generating, length-aware assignment
(the simulator's groups all look alike before sampling), speculative rollouts, length buckets, the fork server and
early start (start-up), the newest-token bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from async_rlhf.experimental import autoscale_rule as ar  # noqa: E402
from async_rlhf.plan import cost_model as cm  # noqa: E402
from async_rlhf.plan import search as sr  # noqa: E402
from async_rlhf.plan.hardware import get_profile  # noqa: E402
from async_rlhf.plan.model_shapes import shape_for_size  # noqa: E402
from async_rlhf.plan.simulator import SimConfig, simulate  # noqa: E402

# name: (model size, device, devices, nodes, generators on any node, workload)
SETTINGS = {
    "rlhfuse": ("13B", "H100", 32, 4, True,
                cm.Workload(prompts_per_step=512, n=2, prompt_tokens=512, response_mean=512, response_cv=1.0,
                            response_max=4096)),  # lognormal cv 1: 99.9th percentile about 13x the median (capped)
    "rlhfless": ("7B", "L40S", 8, 1, False,
                 cm.Workload(prompts_per_step=64, n=8, prompt_tokens=256, response_mean=256, response_cv=0.5,
                             response_max=1024)),
    "real": ("70B", "H100", 128, 16, True,
             cm.Workload(prompts_per_step=512, n=2, prompt_tokens=512, response_mean=512, response_cv=0.5,
                         response_max=2048)),
}
DRIFT = (128, 256, 512, 1024)  # response means of the autoscaling run's four phases (RLHFless: lengths vary)
WINDOWS_PER_PHASE = 6
STEPS = 16  # simulated steps per figure (as the planner's search)


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    shape: object
    dev: object
    gpus: int
    nodes: int
    network: bool
    w: cm.Workload

    def describe(self) -> str:
        w = self.w
        return (f"{self.shape.name} policy and reward, {self.gpus} x {self.dev.name}"
                f"{f' ({self.nodes} nodes, generators on any node)' if self.nodes > 1 else ''}; "
                f"{w.prompts_per_step} prompts x {w.n}, prompt {w.prompt_tokens}, response mean {w.response_mean:g} "
                f"cv {w.response_cv:g} max {w.response_max}")


def setting(name: str) -> Setting:
    size, device, gpus, nodes, network, w = SETTINGS[name]
    return Setting(name, shape_for_size(size), get_profile(device), gpus, nodes, network, w)


def best_plan(s: Setting, staleness: int = 1, seeds: int = 1) -> sr.Evaluated:
    """The planner's fastest fitting split at this staleness (its search, restricted to one staleness)."""
    plans = [p for p in sr.search(s.shape, s.dev, s.w, s.gpus, s.nodes, any_node_generators=s.network, seeds=seeds)
             if p.plan.max_staleness == staleness]
    return sr.best(plans)


def sim_config(s: Setting, e: sr.Evaluated, w: cm.Workload | None = None, staleness: int | None = None,
               train_seconds: float | None = None, seed: int = 0, **overrides) -> SimConfig:
    """The SimConfig the search builds for this plan (`search.evaluate_split`), with `overrides`."""
    w = w or s.w
    plan = dataclasses.replace(e.plan, max_staleness=e.plan.max_staleness if staleness is None else staleness)
    publish, load = cm.sync_seconds(s.shape, s.dev, plan, s.network and s.nodes > 1)
    train = cm.train_seconds(s.shape, s.dev, w, plan) if train_seconds is None else train_seconds
    cfg = dict(steps=max(STEPS, 4 * (plan.max_staleness + 1)), max_staleness=plan.max_staleness,
               prompts_per_step=w.prompts_per_step, n=w.n, engine=cm.engine_model(s.shape, s.dev, w, plan.tp),
               lengths=w.lengths(), train_seconds=train, sync_seconds=publish, load_seconds=load,
               generators=plan.generators, prompt_tokens=w.prompt_tokens, seed=seed)
    cfg.update(overrides)
    return SimConfig(**cfg)


def step_seconds(cfg: SimConfig, seeds: int) -> float:
    """Mean steady step time over `seeds` length draws."""
    return statistics.mean(simulate(dataclasses.replace(cfg, seed=k)).steady_step_seconds for k in range(seeds))


def ratio(base: float, other: float) -> str:
    return f"{base / other:.2f}x"


# ---- the mechanisms ------------------------------------------------------------------------------------------------
def streaming(s: Setting, seeds: int) -> list[str]:
    """Batch-level against streaming engines on the planner's split. The simulator caps the running sequences at what
    the KV cache holds (`EngineModel.max_running`) only in a streaming engine: a batch-level request runs all its
    sequences at once. So the fair comparison lifts the cap from both (the KV cache assumed to hold every sequence);
    the capped streaming figure is printed beside it."""
    rows = []
    for staleness in (1, 0):
        e = best_plan(s, staleness)
        capped = sim_config(s, e)
        uncapped = dataclasses.replace(capped.engine, max_running=1 << 30)
        batch = step_seconds(sim_config(s, e, mode="batch"), seeds)
        drain = step_seconds(sim_config(s, e, mode="stream", weight_load="drain", engine=uncapped), seeds)
        flight = step_seconds(sim_config(s, e, mode="stream", weight_load="in_flight", engine=uncapped), seeds)
        drain_capped = step_seconds(sim_config(s, e, mode="stream", weight_load="drain"), seeds)
        rows.append(f"S={staleness} {sr_plan(e)}: batch {batch:.1f} s/step, stream (drain) {drain:.1f}, stream "
                    f"(in_flight) {flight:.1f}; streaming {ratio(batch, drain)} of batch-level, in-flight loads "
                    f"{ratio(drain, flight)} of drain (streaming with the KV cap, {capped.engine.max_running} "
                    f"sequences a generator: {drain_capped:.1f} s, {ratio(batch, drain_capped)})")
    return rows


def sr_plan(e: sr.Evaluated) -> str:
    p = e.plan
    tp = f" tp{p.tp}" if p.tp > 1 else ""
    return f"{p.learners}L/{p.generators}x{tp}G ZeRO-{p.zero_stage}{'+offload' if p.offload else ''} mb{p.micro_batch}"


def _efficiency(dev, micro_tokens: float) -> float:
    """The cost model's training efficiency at a micro-batch of `micro_tokens` (`cost_model.train_seconds`)."""
    return dev.train_mfu * micro_tokens / (micro_tokens + 1024)


def shared_prefixes(s: Setting, seeds: int) -> list[str]:
    """Reference or reward forward with each prompt once per group: fewer FLOPs in the learners' step (scoring runs
    in the step under DeepSpeed, as at these sizes)."""
    e = best_plan(s)
    w, P = s.w, s.shape.params
    R = w.reward_params if w.reward_params is not None else P
    base = cm.train_seconds(s.shape, s.dev, w, e.plan)
    per_flop = 1.0 / (e.plan.learners * s.dev.peak_flops *
                      _efficiency(s.dev, e.plan.micro_batch * w.n * (w.prompt_tokens + w.response_mean)))
    tokens = w.samples * (w.prompt_tokens + w.response_mean)
    shared = w.prompts_per_step * (w.prompt_tokens + w.n * w.response_mean)
    saved_ref = 2 * P * (tokens - shared) * per_flop
    saved_rew = 2 * R * (tokens - shared) * per_flop
    t0 = step_seconds(sim_config(s, e), seeds)
    t_ref = step_seconds(sim_config(s, e, train_seconds=base - saved_ref), seeds)
    t_rew = step_seconds(sim_config(s, e, train_seconds=base - saved_rew), seeds)
    t_both = step_seconds(sim_config(s, e, train_seconds=base - saved_ref - saved_rew), seeds)
    return [f"S=1 {sr_plan(e)}: train {base:.1f} s of which the reference forward saves {saved_ref:.1f} s and the "
            f"reward forward {saved_rew:.1f} s ({tokens / shared:.2f}x fewer tokens each); step {t0:.1f} s -> "
            f"reference {t_ref:.1f} ({ratio(t0, t_ref)}), reward {t_rew:.1f} ({ratio(t0, t_rew)}), both "
            f"{t_both:.1f} ({ratio(t0, t_both)})"]


def _window(s: Setting, e: sr.Evaluated, w: cm.Workload, generators: int, steps: int, seed: int) -> ar.Window:
    """A window of `steps` steady steps simulated with `generators` generators (the pipeline's fill excluded)."""
    learner = sr.learner_setups(s.shape, s.dev, w, e.plan.learners, s.nodes)[0]
    plan = dataclasses.replace(e.plan, generators=generators, zero_stage=learner[2], offload=learner[3],
                               micro_batch=learner[4])
    cfg = sim_config(s, dataclasses.replace(e, plan=plan), w=w, steps=steps + 1, seed=seed,
                     train_seconds=learner[0])
    r = simulate(cfg)
    first_wait = r.step_ends[0] - cfg.train_seconds - cfg.sync_seconds  # step 0 waits for the first batch
    seconds = r.step_ends[-1] - r.step_ends[0]
    busy = sum(r.generator_busy_seconds) * steps / (steps + 1)
    return ar.Window(steps, seconds, r.learner_wait_seconds - first_wait, busy, generators)


def autoscaling(s: Setting, seeds: int) -> list[str]:
    """The autoscale rule on simulated windows while response lengths drift (DRIFT), against fixed counts."""
    e = best_plan(dataclasses.replace(s, w=dataclasses.replace(s.w, response_mean=DRIFT[0])))
    learners, spare = e.plan.learners, s.gpus - e.plan.learners  # generators of tp 1 on the devices left
    rule = ar.AutoscaleRule(learners=learners, max_staleness=1)
    window = 4  # generator_autoscale_window's default
    phases = [dataclasses.replace(s.w, response_mean=m, response_max=max(s.w.response_max, 4 * m)) for m in DRIFT]

    def run(fixed: int | None) -> tuple[float, float, list[int]]:
        k, cost, seconds, counts, before, undone = fixed or 1, 0.0, 0.0, [], None, None
        for p, w in enumerate(phases):
            for i in range(WINDOWS_PER_PHASE):
                win = _window(s, e, w, k, window, seed=p * WINDOWS_PER_PHASE + i)
                cost += ar.cost_per_step(rule, k, win.step_seconds) * win.steps
                seconds += win.seconds
                counts.append(k)
                if fixed:
                    continue
                d = ar.decide(rule, win, can_add=k < spare, can_retire=k > 1, before_add=before,
                              undone_cost=undone)
                if d.action == "retire" and d.reason.startswith("undo"):
                    undone, before, k = d.cost_now, None, k - 1
                elif d.action == "add":
                    before, k = win, k + 1
                else:
                    before, k = None, k - (d.action == "retire")
        return cost, seconds, counts

    auto_cost, auto_seconds, counts = run(None)
    fixed = {k: run(k) for k in range(1, spare + 1)}
    best_k = min(fixed, key=lambda k: fixed[k][0])
    f_cost, f_seconds, _ = fixed[best_k]
    first = min(fixed, key=lambda k: ar.cost_per_step(rule, k, _window(s, e, phases[0], k, window, 0).step_seconds))
    path = " ".join(str(c) for c in counts)
    return [f"{learners} learners, generators 1..{spare} (tp 1), response mean {'->'.join(map(str, DRIFT))} over "
            f"{len(DRIFT)} phases of {WINDOWS_PER_PHASE} windows of {window} steps: generators per window {path}",
            f"autoscaled {auto_cost / 3600:.2f} device-hours in {auto_seconds:.0f} s; best fixed count ({best_k}) "
            f"{f_cost / 3600:.2f} in {f_seconds:.0f} s: cost {1 - auto_cost / f_cost:+.1%} saved, time "
            f"{ratio(f_seconds, auto_seconds)}; against the count sized for the first phase ({first}): cost "
            f"{1 - auto_cost / fixed[first][0]:+.1%} saved, time {ratio(fixed[first][1], auto_seconds)}; fixed counts: "
            + ", ".join(f"{k}: {c / 3600:.2f} device-h, {t:.0f} s" for k, (c, t, _) in fixed.items())]


def planned_split(s: Setting, seeds: int) -> list[str]:
    plans = [p for p in sr.search(s.shape, s.dev, s.w, s.gpus, s.nodes, any_node_generators=s.network, seeds=seeds)
             if p.plan.max_staleness == 1]
    pick = sr.best(plans)
    even = [p for p in plans if p.plan.learners == s.gpus // 2]
    median = sorted(p.step_seconds for p in plans)[len(plans) // 2]
    if len(plans) == 1:
        return [f"S=1: {sr_plan(pick)} {pick.step_seconds:.1f} s/step is the only split that fits in memory: nothing "
                f"to choose (1.00x)"]
    out = [f"S=1: the pick {sr_plan(pick)} {pick.step_seconds:.1f} s/step; median of the {len(plans)} fitting splits "
           f"{median:.1f} s ({ratio(median, pick.step_seconds)})"]
    if even:
        fastest_even = min(even, key=lambda p: p.step_seconds)
        out.append(f"even split ({sr_plan(fastest_even)}) {fastest_even.step_seconds:.1f} s "
                   f"({ratio(fastest_even.step_seconds, pick.step_seconds)})")
    return out


MECHANISMS = [
    ("streaming, in-flight loads (and continuous batching)", "rlhfuse", streaming),
    ("shared prefixes (reference, reward)", "rlhfless", shared_prefixes),
    ("generator autoscaling", "rlhfless", autoscaling),
    ("planned split", "real", planned_split),
    ("planned split", "rlhfuse", planned_split),
]
NOT_MODELLED = ["partial rollouts", "tail migration", "train-while-generating", "length-aware assignment",
                "speculative rollouts", "length buckets (split_forwards)", "fork server, early start",
                "newest-token bound"]
NOT_APPLICABLE = ["score_while_generating, reference_while_generating: DeepSpeed learners (every setting here) "
                  "refuse scoring as parts arrive, and the fused reference needs it"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=2, help="length draws averaged per simulated figure")
    p.add_argument("--only", nargs="*", choices=sorted({m[2].__name__ for m in MECHANISMS}),
                   help="mechanisms to project (default: all)")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f"--seeds: at least 1, got {args.seeds}")
    print("PREDICTED by the planner's cost model and simulator (async_rlhf/plan), not measured")
    for title, name, project in MECHANISMS:
        if args.only and project.__name__ not in args.only:
            continue
        s = setting(name)
        print(f"\n{title} [{name}: {s.describe()}]")
        for line in project(s, args.seeds):
            print(f"  {line}")
    print("\nnot modelled: " + "; ".join(NOT_MODELLED))
    print("not applicable: " + "; ".join(NOT_APPLICABLE))


if __name__ == "__main__":
    main()
