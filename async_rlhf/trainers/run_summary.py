"""The end-of-run summary: what `run_summary.json` holds and the lines printed at the end of training.

Built on rank 0 from the pipeline's counters (time generating, training, waiting, syncing; the staleness histogram
of trained batches; drops, regenerations, restarts) and the last logged learner metrics. Sweeps and benchmarks
read the JSON; a person reads the printed block. Its last line compares the measured step time with the simulator's
prediction from the run's own stage times and names a predicted-faster configuration if any (`plan/feedback.py`).
"""

from __future__ import annotations

from async_rlhf.config.experimental import summary_lines
from async_rlhf.plan.feedback import feedback, format_feedback
from async_rlhf.trainers.startup import StartupTimeline

FINAL_METRICS = ("objective/scores", "objective/kl", "objective/rlhf_reward", "loss")


def build_summary(pipeline, args, accelerator, steps: int, wall: float, loop_seconds: float,
                  rewards_skipped: int, last_metrics: dict[str, float], eval_seconds: float = 0.0) -> dict:
    """`loop_seconds`: the training loop as timed, periodic evaluations (`eval_seconds` of it) included; the summary's
    `loop_seconds` and `train_seconds` are net of them."""
    p, r = pipeline, pipeline.records
    stats = p.stats()
    loop_seconds = max(0.0, loop_seconds - eval_seconds)
    summary = {
        "steps": steps,
        "prompts": steps * args.prompts_per_step,
        "samples": steps * args.prompts_per_step * args.num_generations,
        "wall_seconds": wall,
        "loop_seconds": loop_seconds,  # net of periodic evaluations
        "eval_seconds": eval_seconds,  # periodic evaluations during training (rank 0), off the loop's clock
        "generator_start_seconds": r.start_seconds,  # spawned -> ready (spawned while the trainer was built)
        "generator_start_wait_seconds": r.start_wait_seconds,  # of which the learner waited, in train()
        "generate_seconds": r.gen_seconds,
        "train_seconds": loop_seconds - r.timers["wait"],  # learner busy: all but waiting for rollouts
        "wait_seconds": r.timers["wait"],
        "sync_seconds": r.timers["sync_gather"] + r.timers["sync_transfer"],
        "sync_load_seconds": stats.get("sync/load_seconds", 0.0),
        "sync_bytes": r.sync_bytes,
        "generators": len(args.generator_servers or args.generator_devices),  # at start (autoscale: see below)
        "generator_places": r.places,  # generator id -> {device, where, weights}: where it ran, how weights came
        "generator_versions": r.loaded_versions,  # the run's end waits for every live generator's acknowledgement
        "generator_versions_pending": r.pending_versions,  # ... and names here what it never got ({}: none)
        "generation_mode": "stream" if args.streaming else "batch",
        "generator_busy_seconds": r.busy_seconds,  # as of each generator's last weight acknowledgement
        "generated_tokens": r.gen_tokens,
        "rollout_latency_seconds": r.latency[0],  # summed over batches: dispatch -> complete batch queued
        "handoff_seconds": r.latency[1],  # summed over batches: last part received on rank 0 -> batch queued
        "timed_batches": r.latency[2],
        "syncs": r.syncs,
        "scoring_seconds": stats.get("scoring/seconds", 0.0),  # rank 0's scoring thread (score_while_generating)
        "scoring_hidden_fraction": stats.get("scoring/hidden_fraction"),  # of it, before a batch's last part landed
        "completion_length_counts": {int(k): v for k, v in sorted(r.length_counts.items())},
        **args.experimental_summary(stats),  # the optional settings' own sections (config/experimental.py)
        "generator_imbalance": {k.split("/")[1]: v for k, v in stats.items() if k.startswith("generator/imbalance")},
        "staleness_histogram": {int(k): v for k, v in sorted(p.queue.staleness_counts.items())},
        "dropped": p.queue.dropped,
        "generator_restarts": r.restarts,
        "regenerated": p.regenerated,
        "rewards_skipped": rewards_skipped,
        "max_staleness": args.max_staleness,
        # what max_staleness bounds: every token of a sample, unless a batch schedule says otherwise ("bound_rule", from
        # its summary; the histogram counts steps behind of each batch's oldest token)
        "sync_every": args.sync_every,
        "learners": {"processes": accelerator.num_processes,
                     "distributed_type": accelerator.distributed_type.value,
                     "zero_stage": getattr(accelerator.state.deepspeed_plugin, "zero_stage", None)},
        "final": {k: v for k, v in last_metrics.items() if k in FINAL_METRICS},
    }
    summary.update(r.schedule_summary)  # what the run's optional schedules report, each under its own key
    # the simulator fed with this run's stage times: its predicted step time, and a faster set-up if it finds one
    summary["plan"] = feedback(summary, args, accelerator.num_processes)
    return summary


def _format_places(places: dict) -> str:
    """One clause per generator: where it ran last and how its weights arrived."""
    return "generators: " + " | ".join(f"{g} {p['device']}: {p['where']}, weights over {p['weights']}"
                                       for g, p in sorted(places.items()))


def format_summary(s: dict) -> str:
    hist = ", ".join(f"{k}: {v}" for k, v in s["staleness_histogram"].items()) or "none"
    final = ", ".join(f"{k} {v:.4g}" for k, v in s["final"].items())
    return "\n".join([
        "=== async_rlhf run summary ===",
        f"steps {s['steps']} | prompts {s['prompts']} | samples {s['samples']} | wall {s['wall_seconds']:.1f}s "
        f"(generator start {s['generator_start_seconds'] or 0:.1f}s, {s.get('generator_start_wait_seconds') or 0:.1f}s of it "
        "waited in train())",
        f"time: generating {s['generate_seconds']:.1f}s | training {s['train_seconds']:.1f}s | learner waiting "
        f"{s['wait_seconds']:.1f}s | syncing {s['sync_seconds']:.2f}s (+{s['sync_load_seconds']:.2f}s loading in "
        f"generators, {s['sync_bytes'] / 1e6:.1f} MB)" + (f" | evaluating {s['eval_seconds']:.1f}s (not in training)"
                                                        if s.get("eval_seconds") else ""),
        f"staleness histogram (steps behind: batches) {{{hist}}} | bound {s['max_staleness']}"
        + (f" {s['bound_rule']}" if s.get("bound_rule") else "") + " | dropped "
        f"{s['dropped']} | regenerated {s['regenerated']} | rewards skipped {s['rewards_skipped']}",
        f"final: {final}",
    ] + ([_format_places(s["generator_places"])] if s.get("generator_places") else [])
      + ([f"weights never acknowledged (generator: versions): {s['generator_versions_pending']}"]
         if s.get("generator_versions_pending") else [])
      + summary_lines(s)
      + ([StartupTimeline.format(s["startup"])] if s.get("startup") else []) + ([format_feedback(s["plan"])] if s.get("plan") else []))
