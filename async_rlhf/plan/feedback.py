"""Run-time feedback: the simulator fed with a run's own stage times, against the run's measured step time.

`inputs_from_summary` turns a `run_summary.json` into the simulator's inputs: the learner's time per step (busy time
less syncs), the sync and weight-load time per sync, the generators' sampling time per batch (as a per-sequence
engine cost over the run's own completion lengths), the hand-off from the last part to the queued batch, and the
transit of a request (the rollout latency, dispatch to queued, less sampling, loading and the hand-off).
`predict` simulates the run's configuration; `advise` simulates other `max_staleness` values and other splits of the
same devices between learners and generators (assuming each stage's time scales inversely with its device count,
which is only a first approximation) and names the fastest if it beats the run's prediction by `MIN_GAIN`.
`feedback` is what `trainers/run_summary.py` calls: it returns a dict (or an empty one) and never raises.
"""

from __future__ import annotations

import dataclasses
import logging

from async_rlhf.plan.simulator import EngineModel, SimConfig, simulate

logger = logging.getLogger(__name__)
MIN_GAIN = 0.10
TIE = 0.03  # as the planner's (search.TIE): staleness must buy more than this to be suggested


def inputs_from_summary(s: dict, prompts_per_step: int, n: int) -> SimConfig:
    steps = int(s["steps"])
    gens = max(1, int(s["generators"]))
    syncs = max(1, int(s.get("syncs") or steps))
    counts = {int(k): v for k, v in (s.get("completion_length_counts") or {}).items()}
    lengths = [k for k, v in sorted(counts.items()) for _ in range(v) if k >= 1] or [1]
    tokens = s.get("generated_tokens") or sum(lengths)
    batches = max(1, steps + s.get("regenerated", 0))
    # sampling time per token-sequence-step on one generator: busy time = sum over engine steps of c * running,
    # i.e. c * tokens (the engine's fixed cost per step is folded into c)
    per_token = s["generator_busy_seconds"] / max(tokens, 1)
    timed = max(1, int(s.get("timed_batches") or batches))
    load = s.get("sync_load_seconds", 0.0) / syncs / gens
    parts = max(1, batches * (prompts_per_step if s.get("generation_mode", "stream") == "stream" else gens))
    score = s.get("scoring_seconds", 0.0) / parts
    handoff_measured = s.get("handoff_seconds", 0.0) / timed
    # the measured hand-off (last part received -> batch queued) is mostly scoring and its backlog; with the scoring
    # thread simulated (its time per part known) only the reassembly is left, which is negligible
    handoff = 0.0 if score else handoff_measured
    # what the rollout latency (dispatch -> queued) holds besides sampling, loading and the hand-off: the transit
    dispatch = max(0.0, s.get("rollout_latency_seconds", 0.0) / timed - handoff_measured - load
                   - s["generate_seconds"] / batches)
    return SimConfig(
        steps=steps, max_staleness=int(s["max_staleness"]), prompts_per_step=prompts_per_step, n=n,
        engine=EngineModel(compute_per_seq=per_token), lengths=lengths,
        train_seconds=max(0.0, (s["train_seconds"] - s["sync_seconds"]) / steps),
        sync_seconds=s["sync_seconds"] / syncs, load_seconds=load, handoff_seconds=handoff, dispatch_seconds=dispatch,
        score_seconds=score,
        generators=gens,
        sync_every=int(s.get("sync_every") or 1), mode=s.get("generation_mode", "stream"))


MAX_SIM_STEPS = 32  # a long run's step time is simulated over its first 32 steps (seconds, not minutes, at its end)


def predict(cfg: SimConfig, seeds: int = 2) -> float:
    """Predicted training-loop seconds per step (mean over length draws)."""
    cfg = dataclasses.replace(cfg, steps=min(cfg.steps, MAX_SIM_STEPS))
    return sum(simulate(dataclasses.replace(cfg, seed=k)).step_seconds for k in range(seeds)) / seeds


def advise(cfg: SimConfig, learners: int, devices_shared: bool) -> list[dict]:
    """Other staleness values and splits, predicted; fastest first (within TIE of it, the smallest staleness)."""
    out = []
    for s in range(0, 5):
        if s == cfg.max_staleness or cfg.sync_every > s + 1:
            continue
        out.append({"change": f"max_staleness {s}", "max_staleness": s,
                    "step_seconds": predict(dataclasses.replace(cfg, max_staleness=s), seeds=1)})
    if not devices_shared:  # moving a device from one side to the other
        for dl, dg in ((-1, 1), (1, -1)):
            L, G = learners + dl, cfg.generators + dg
            if L < 1 or G < 1:
                continue
            moved = dataclasses.replace(cfg, generators=G, train_seconds=cfg.train_seconds * learners / L,
                                        engine=dataclasses.replace(cfg.engine))
            out.append({"change": f"{L} learner(s) + {G} generator(s)", "max_staleness": cfg.max_staleness,
                        "step_seconds": predict(moved, seeds=1)})
    if not out:
        return out
    fastest = min(r["step_seconds"] for r in out)  # within TIE of the fastest, the smallest staleness comes first
    return sorted(out, key=lambda r: (r["step_seconds"] > fastest * (1 + TIE), r["max_staleness"], r["step_seconds"]))


def feedback(summary: dict, args, learners: int) -> dict:
    """Measured vs predicted step time for this run, and a faster configuration where one is predicted."""
    try:
        if summary["steps"] < 2 or not summary.get("generator_busy_seconds"):
            return {}
        cfg = inputs_from_summary(summary, args.prompts_per_step, args.num_generations)
        measured = summary["loop_seconds"] / summary["steps"]
        predicted = predict(cfg)
        out = {"measured_step_seconds": measured, "predicted_step_seconds": predicted,
               "prediction_error": predicted / measured - 1 if measured else None}
        devices = list(args.generator_devices or [])
        shared = not devices or any(d == "cpu" for d in devices)  # CPU: every process shares the same cores
        options = advise(cfg, learners, shared)
        if options and options[0]["step_seconds"] < predicted * (1 - MIN_GAIN):
            out["suggestion"] = {**options[0], "speedup": predicted / options[0]["step_seconds"]}
        return out
    except Exception as exc:  # advice must never fail a run
        logger.warning("plan feedback skipped: %s: %s", type(exc).__name__, exc)
        return {}


def format_feedback(f: dict) -> str:
    if not f:
        return ""
    line = (f"plan: step {f['measured_step_seconds']:.3g}s measured, {f['predicted_step_seconds']:.3g}s simulated from "
            f"this run's stage times ({f['prediction_error']:+.0%})")
    if "suggestion" in f:
        sug = f["suggestion"]
        line += f" | predicted faster: {sug['change']} ({sug['step_seconds']:.3g}s/step, {sug['speedup']:.2f}x)"
    return line
