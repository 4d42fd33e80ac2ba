"""Soak: a long run of tiny steps that shows whether any process leaks memory, file descriptors or threads.

    python benchmarks/soak.py                         # 1,000 steps, one learner, one vLLM generator (CPU)
    python benchmarks/soak.py --steps 200 --every 10  # a quicker look
    accelerate launch --config_file launch/accelerate/cpu_2proc_gloo.yaml benchmarks/soak.py --steps 300

Online DPO on the toy task at `max_staleness` 4 with the real pipeline: generator processes, the staleness queue,
a weight sync after every step (a safetensors file in /dev/shm, reloaded by vLLM). The model and batches are as
small as they go, so a thousand steps take minutes and per-step costs (messages, files, threads) dominate.

Every `--every` steps each learner rank samples itself, and rank 0 samples every generator process and the
pipeline (queue depth, files in the weight directory, batches buffered for reassembly): RSS, open file
descriptors, threads. The report fits a least-squares line to RSS against step after `--warmup` steps (engines
and allocators settle first) and prints the slope in MB per 100 steps per process, with the change in fds and
threads over the same window. Samples go to `<output_dir>/soak_samples_rank<r>.jsonl`, the report to
`<output_dir>/soak_report.json`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def process_sample(pid: int) -> dict | None:
    """RSS (MB), open fds and threads of one process, or None if it is gone."""
    import psutil

    try:
        p = psutil.Process(pid)
        with p.oneshot():
            return {"rss_mb": p.memory_info().rss / 2**20, "fds": p.num_fds(), "threads": p.num_threads()}
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def make_sampler(trainer, every: int, path: str):
    from transformers import TrainerCallback

    class SoakSampler(TrainerCallback):
        """Appends one JSON line per process every `every` optimizer steps (and after the first step)."""

        def __init__(self):
            self.t0 = time.monotonic()
            self.file = open(path, "a", buffering=1)

        def on_step_end(self, args, state, control, **kwargs):
            step = state.global_step
            if step != 1 and step % every:
                return
            rank = trainer.accelerator.process_index
            rows = [{"process": f"learner rank {rank}", "pid": os.getpid(), **process_sample(os.getpid())}]
            pipeline = trainer.pipeline
            extra = {}
            if trainer.accelerator.is_main_process and pipeline.pool is not None:
                for spec, proc in zip(pipeline.pool.specs, pipeline.pool.processes):
                    sample = process_sample(proc.pid) if proc.pid else None
                    if sample is not None:
                        rows.append({"process": f"generator {spec.generator_id}", "pid": proc.pid, **sample})
                extra = {"queue_depth": len(pipeline.queue), "partial_batches": len(getattr(pipeline.forming, "_parts", {})),
                         "weight_files": len(os.listdir(pipeline.transport.dir)),
                         "in_flight_requests": sum(len(v) for v in pipeline.pool._in_flight.values()),
                         "pending_acks": pipeline.pool.acks.waiting()}
            for row in rows:
                self.file.write(json.dumps({"step": step, "t": time.monotonic() - self.t0, **row, **extra}) + "\n")

        def on_train_end(self, args, state, control, **kwargs):
            self.file.close()

    return SoakSampler()


def slope_per_100(steps: list[int], values: list[float]) -> float:
    """Least-squares slope of values against steps, per 100 steps (0 with fewer than two points)."""
    n = len(steps)
    if n < 2:
        return 0.0
    mx, my = sum(steps) / n, sum(values) / n
    sxx = sum((x - mx) ** 2 for x in steps)
    sxy = sum((x - mx) * (y - my) for x, y in zip(steps, values))
    return 100.0 * sxy / sxx if sxx else 0.0


def report(output_dir: str, warmup: int) -> dict:
    """Per process: RSS at warm-up end and at the end, slope, fd and thread growth; pipeline gauges."""
    rows = [json.loads(line) for f in sorted(glob.glob(os.path.join(output_dir, "soak_samples_rank*.jsonl")))
            for line in open(f)]
    table = {}
    for name in sorted({r["process"] for r in rows}):
        mine = sorted((r for r in rows if r["process"] == name), key=lambda r: r["step"])
        window = [r for r in mine if r["step"] >= warmup] or mine
        first, last = window[0], window[-1]
        table[name] = {
            "pids": sorted({r["pid"] for r in mine}),
            "samples": len(window),
            "rss_mb_start": first["rss_mb"], "rss_mb_end": last["rss_mb"],
            "rss_mb_max": max(r["rss_mb"] for r in window),
            "rss_slope_mb_per_100_steps": slope_per_100([r["step"] for r in window], [r["rss_mb"] for r in window]),
            "fds_start": first["fds"], "fds_end": last["fds"], "fds_max": max(r["fds"] for r in window),
            "threads_start": first["threads"], "threads_end": last["threads"],
            "threads_max": max(r["threads"] for r in window),
        }
    main_rows = [r for r in rows if r["process"] == "learner rank 0" and r["step"] >= warmup]
    gauges = {k: {"max": max(r[k] for r in main_rows), "end": main_rows[-1][k]}
              for k in ("queue_depth", "partial_batches", "weight_files", "in_flight_requests", "pending_acks")
              if main_rows and k in main_rows[0]}
    return {"processes": table, "pipeline": gauges}


def format_report(rep: dict, header: str) -> str:
    lines = [header, "",
             f"{'process':<16}{'pid(s)':>14}{'RSS MB start':>14}{'end':>9}{'max':>9}{'MB/100 steps':>14}"
             f"{'fds':>11}{'threads':>11}"]
    for name, r in rep["processes"].items():
        pids = ",".join(str(p) for p in r["pids"])
        lines.append(f"{name:<16}{pids:>14}{r['rss_mb_start']:>14.1f}{r['rss_mb_end']:>9.1f}{r['rss_mb_max']:>9.1f}"
                     f"{r['rss_slope_mb_per_100_steps']:>+14.2f}{r['fds_start']:>5} -> {r['fds_end']:<3}"
                     f"{r['threads_start']:>5} -> {r['threads_end']:<3}")
    if rep["pipeline"]:
        lines.append("pipeline (after warm-up): " + ", ".join(
            f"{k} max {v['max']} end {v['end']}" for k, v in rep["pipeline"].items()))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=25, help="sample every this many optimizer steps")
    p.add_argument("--warmup", type=int, default=300, help="steps left out of the slope (vLLM settles in ~250)")
    p.add_argument("--max_staleness", type=int, default=4)
    p.add_argument("--batch", type=int, default=2, help="prompts per step per learner rank")
    p.add_argument("--new_tokens", type=int, default=8)
    p.add_argument("--backend", default="vllm", choices=["vllm", "transformers"])
    p.add_argument("--generators", type=int, default=1)
    p.add_argument("--logging_steps", type=int, default=1)
    p.add_argument("--output_dir", default=None)
    args = p.parse_args()

    import torch

    from async_rlhf import AsyncOnlineDPOConfig, AsyncOnlineDPOTrainer
    from async_rlhf.data.tiny_model import save_tiny_model
    from async_rlhf.data.toy_task import lowercase_reward, toy_prompts

    torch.set_num_threads(1)
    out = args.output_dir or tempfile.mkdtemp(prefix="soak-")
    config = AsyncOnlineDPOConfig(
        output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch, num_generations=2,
        max_new_tokens=args.new_tokens, max_length=args.new_tokens + 40, learning_rate=1e-4,
        lr_scheduler_type="constant", max_staleness=args.max_staleness, generator_backend=args.backend,
        generator_devices=["cpu"] * args.generators, generator_threads=1, logging_steps=args.logging_steps,
        seed=0, disable_tqdm=True, rollout_timeout=300,
    )
    model_dir = os.path.join(out, "init_model")
    with config.main_process_first(desc="tiny model"):
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            save_tiny_model(model_dir)
    trainer = AsyncOnlineDPOTrainer(model=model_dir, reward_funcs=lowercase_reward, args=config,
                                    train_dataset=toy_prompts(512, seed=0))
    rank = trainer.accelerator.process_index
    trainer.add_callback(make_sampler(trainer, args.every, os.path.join(out, f"soak_samples_rank{rank}.jsonl")))
    t0 = time.monotonic()
    trainer.train()
    wall = time.monotonic() - t0
    trainer.accelerator.wait_for_everyone()
    if not trainer.accelerator.is_main_process:
        return
    rep = report(out, args.warmup)
    s = trainer.run_summary
    header = (f"soak: {s['steps']} steps in {wall:.0f}s ({wall / max(1, s['steps']):.2f} s/step); machine "
              f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}; backend {args.backend}, "
              f"{args.generators} generator(s), {trainer.accelerator.num_processes} learner rank(s); "
              f"max_staleness {args.max_staleness}; {args.batch} prompt(s) x 2 samples x <= {args.new_tokens} "
              f"tokens per rank per step; weight sync every step; sampled every {args.every} steps, slope over "
              f"steps >= {args.warmup}; staleness histogram {s['staleness_histogram']}, restarts "
              f"{s['generator_restarts']}")
    rep.update(header=header, wall_seconds=wall, args=vars(args))
    with open(os.path.join(out, "soak_report.json"), "w") as f:
        json.dump(rep, f, indent=2)
    print(format_report(rep, header), flush=True)
    print(f"samples and report in {out}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
