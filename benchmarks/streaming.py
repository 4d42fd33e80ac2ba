"""Batch-level vs streaming generation on a long-tailed workload, against the ideal, in one invocation.

    python benchmarks/streaming.py --quick       # 6 steps each, about 3 minutes on 2 cores
    python benchmarks/streaming.py --steps 12 --generators 2
    python benchmarks/streaming.py --steps 12 --max_staleness 2 --partial 8
    python benchmarks/streaming.py --steps 12 --partial 8 --runs stream/in_flight partial partial/newest
    python benchmarks/streaming.py --steps 12 --generators 2 --tail 4 --runs batch stream/in_flight tail
    python benchmarks/streaming.py --steps 12 --micro_batches 4 --runs batch stream/in_flight fused
    python benchmarks/streaming.py --quick --speculative history --runs batch stream/drain spec

The workload: online DPO on the toy task with a tiny random Llama that rarely samples EOS, each prompt with its own
completion budget drawn from a lognormal (`--lengths MEAN CV`, default 48 and 1.0, capped at `--new_tokens` 224:
`toy_prompts(lengths=...)`), so lengths are heavy-tailed and follow the prompt: most samples are short and a few
run to the cap, the shape that makes one `generate()` per batch wait on its longest sample. `--lengths 0 0`: no
budgets, lengths near-geometric up to the cap. One learner process and
`--generators` vLLM generator processes, one CPU thread each, `--max_staleness` (default 1), a weight sync every
step.

Runs, each the real trainer and pipeline (times are of the training loop; engine start-up excluded):
  batch               generation_mode=batch: one generate call per batch (chunk), the baseline
  stream/drain        one request per prompt group, weights loaded once the running samples end
  stream/in_flight    the same, weights loaded between two engine steps (per-token versions)
  partial             stream/in_flight with `partial_rollouts` = `--partial` extra groups in flight (0: not run):
                      a step closes on the first groups to finish, the rest are carried
  partial/newest      the partial run under `staleness_bound="newest"` (`--max_oldest_staleness`, default 2 x
                      max_staleness): a carried group may outlive max_staleness while it samples on fresh weights
  tail                stream/in_flight with `tail_migration` = `--tail` (0: not run; needs --generators 2 or
                      more): once at most that many groups of a batch are left on several generators, one takes them
  fused               stream/in_flight with `train_while_generating` (needs --micro_batches 2 or more): a step's
                      micro-batches train on its groups as they arrive, all but the last before the batch is whole
  spec                stream/drain with `--speculative METHOD` (speculative rollouts need drained weight loads): its
                      fraction of the ideal next to stream/drain's is what speculation adds (the ideals sample
                      without it)
`--micro_batches K` splits every run's step into K gradient-accumulation micro-batches (the same prompts per step).

Two yardsticks, each the same prompts and seeds sampled by one engine in a process of its own (one thread, started
and warmed up first, untimed), at the initial policy, with no learner:
  ideal               never drains: as many groups in flight as `max_staleness + 1` steps hold, a group entering the
                      moment another leaves (for the partial run, that many plus `--partial`: `ideal+partial`);
  ideal under bound   the same engine under the staleness rule: a group of batch c enters only once every group of
                      batch c - S - 1 has finished (admission with a learner that takes no time). The gap between
                      the two is what the bound itself costs; no schedule that keeps it can beat the second.
Reported: samples/s, learner wait as a fraction of the loop, generator busy fraction (time its engine spent
sampling, over the loop), scoring time hidden behind generation, generator imbalance with several generators, each
run's speed-up over batch-level and its fraction of both ideals (samples/s over theirs).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

RUNS = (("batch", "batch", "drain", 0), ("stream/drain", "stream", "drain", 0),
        ("stream/in_flight", "stream", "in_flight", 0), ("partial", "stream", "in_flight", "partial"),
        ("partial/newest", "stream", "in_flight", "newest"), ("tail", "stream", "in_flight", "tail"),
        ("fused", "stream", "in_flight", "fused"), ("spec", "stream", "drain", "spec"))


def config(args, out: str, mode: str, weight_load: str, partial: int = 0, tail: int = 0, fused: bool = False,
           newest: bool = False, speculative: str = "off"):
    from async_rlhf import AsyncOnlineDPOConfig

    if args.batch % args.micro_batches:
        raise SystemExit(f"--micro_batches {args.micro_batches} must divide --batch {args.batch}")
    return AsyncOnlineDPOConfig(
        output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch // args.micro_batches,
        gradient_accumulation_steps=args.micro_batches, train_while_generating=fused, num_generations=2,
        max_new_tokens=args.new_tokens, max_length=args.new_tokens + 32, learning_rate=1e-5, temperature=1.0,
        max_staleness=args.max_staleness, partial_rollouts=partial, tail_migration=tail, generator_backend="vllm",
        generator_devices=["cpu"] * args.generators,
        generator_threads=1, learner_threads=1, generation_mode=mode, weight_load=weight_load,
        logging_steps=1000, save_strategy="no", seed=0, disable_tqdm=True, report_to=[],
        staleness_bound="newest" if newest else "oldest",
        max_oldest_staleness=args.max_oldest_staleness if newest else None, speculative=speculative,
    )


def dataset(args):
    from async_rlhf.data.toy_task import toy_prompts

    mean, cv = args.lengths
    return toy_prompts(512, seed=0, lengths=(mean, cv, args.new_tokens) if mean else None)


def run(args, model_dir: str, mode: str, weight_load: str, partial: int, tail: int, fused: bool = False,
        newest: bool = False, speculative: str = "off") -> dict:
    from async_rlhf import AsyncOnlineDPOTrainer
    from async_rlhf.data.toy_task import lowercase_reward

    out = tempfile.mkdtemp(prefix=f"bench-stream-{mode}-")
    trainer = AsyncOnlineDPOTrainer(model=model_dir, reward_funcs=lowercase_reward,
                                    args=config(args, out, mode, weight_load, partial, tail, fused, newest,
                                                speculative),
                                    train_dataset=dataset(args))
    trainer.train()
    return trainer.run_summary


def ideal(args, model_dir: str, window: int, bound: int | None = None) -> float:
    """Samples/s of one never-draining engine over the runs' prompts and seeds (see the docstring), measured in a
    process of its own with one thread, like a generator process."""
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(_ideal, args, model_dir, window, bound).result()


def _ideal(args, model_dir: str, window: int, bound: int | None) -> float:
    """`window`: groups in flight. `bound` = S: a group of batch c enters only once every group of batch c - S - 1
    has finished (the admission rule with a learner that takes no time); None: whenever a group leaves."""
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch and vLLM load, as `generation/engine/worker.py` does
    import collections
    import dataclasses

    import torch

    from async_rlhf import AsyncOnlineDPOTrainer
    from async_rlhf.data.toy_task import lowercase_reward
    from async_rlhf.generation.engine.stream_engine import StreamEngine
    from async_rlhf.generation.engine.vllm_backend import VLLMBackend
    from async_rlhf.pipeline.prompt_stream import PromptStream
    from async_rlhf.types import GenerationRequest

    torch.set_num_threads(1)
    torch._dynamo.config.disable = True  # as in a CPU generator process (`generation/engine/worker.py`)
    # the trainer only to tokenize the prompts and build the sampling settings exactly as the runs do
    t = AsyncOnlineDPOTrainer(model=model_dir, reward_funcs=lowercase_reward,
                              args=config(args, tempfile.mkdtemp(), "stream", "drain"),
                              train_dataset=dataset(args))
    settings, prompts = t.sampling_settings(), t.prompt_token_ids
    stream = PromptStream(len(prompts), args.batch, settings.seed)
    requests = []
    for step in range(args.steps):
        for j, pid in enumerate(stream.prompts_for_step(step)):
            seed = (settings.seed * 1_000_003 + step) * 1_000_003 + j * settings.n
            requests.append(GenerationRequest(step, [pid], [prompts[pid]], dataclasses.replace(settings, seed=seed),
                                              chunk=j, num_chunks=args.batch,
                                              max_new_tokens=[t.prompt_budgets[pid]] if t.prompt_budgets else []))
    backend = VLLMBackend(model_dir, dtype="float32", max_model_len=args.new_tokens + 32)
    engine = StreamEngine(backend, 0)
    backend.llm.update_weight_version("0")
    finished = collections.Counter()  # batch -> its groups finished

    def admit() -> None:
        while pending and in_flight[0] < window:
            c = pending[-1].batch_id - bound - 1 if bound is not None else -1
            if c >= 0 and finished[c] < args.batch:
                return
            engine.submit(pending.pop(), 0)
            in_flight[0] += 1

    done, in_flight, t0 = 0, [0], time.perf_counter()
    pending = list(reversed(requests))
    admit()
    while engine.busy:
        for out in engine.step():
            done += 1
            in_flight[0] -= 1
            finished[out.batch_id] += 1
        admit()
    seconds = time.perf_counter() - t0
    backend.close()
    return done * settings.n / seconds


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=16, help="prompts per step (2 samples each)")
    p.add_argument("--new_tokens", type=int, default=224)
    p.add_argument("--generators", type=int, default=1)
    p.add_argument("--lengths", type=float, nargs=2, default=[48.0, 1.0], metavar=("MEAN", "CV"))
    p.add_argument("--max_staleness", type=int, default=1)
    p.add_argument("--partial", type=int, default=0, help="partial_rollouts of the partial run (0: no partial run)")
    p.add_argument("--max_oldest_staleness", type=int, default=None,
                   help="the partial/newest run's cap on the oldest token (default: 2 x max_staleness)")
    p.add_argument("--tail", type=int, default=0, help="tail_migration of the tail run (0: no tail run)")
    p.add_argument("--micro_batches", type=int, default=1,
                   help="gradient_accumulation_steps of every run (each step's prompts split into that many "
                        "micro-batches); 2 or more adds the fused run")
    p.add_argument("--speculative", default=None, choices=("ngram", "suffix", "history"),
                   help="adds the spec run: stream/drain with this speculative method")
    p.add_argument("--runs", nargs="+", default=[r[0] for r in RUNS], choices=[r[0] for r in RUNS],
                   help="which runs (batch first: the others are compared with it)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure everything this many times, interleaved; each row is its median round")
    p.add_argument("--quick", action="store_true", help="6 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 6

    from async_rlhf.data.tiny_model import save_tiny_model

    model_dir = save_tiny_model(tempfile.mkdtemp(prefix="bench-model-"))
    if args.tail and args.generators < 2:
        raise SystemExit(f"--tail {args.tail} needs --generators 2 or more (got {args.generators})")
    extra = {0: 0, "partial": args.partial, "newest": args.partial, "tail": args.tail, "fused": args.micro_batches > 1,
             "spec": args.speculative}
    runs = [(n, m, w, extra[x] if x in ("partial", "newest") else 0, extra[x] if x == "tail" else 0, x == "fused",
             x == "newest", args.speculative if x == "spec" else "off")
            for n, m, w, x in RUNS if n in args.runs and (not x or extra[x])]
    rounds = []  # each round: every ideal, then every run, so that a drift of the machine's speed hits all alike
    for _ in range(args.rounds):
        # the ideals first: the first vLLM engine on a machine compiles kernels (torch inductor, cached on disk,
        # about 30 s here), which would otherwise land in the first run's loop
        window = (args.max_staleness + 1) * args.batch
        ideals = {"ideal": ideal(args, model_dir, window),
                  "ideal under bound": ideal(args, model_dir, window, bound=args.max_staleness)}
        if args.partial and {"partial", "partial/newest"} & set(args.runs):
            ideals["ideal+partial"] = ideal(args, model_dir, window + args.partial)
        results = {name: run(args, model_dir, mode, wl, partial, tail, fused, newest, spec)
                   for name, mode, wl, partial, tail, fused, newest, spec in runs}
        rounds.append((ideals, results))
    report(args, rounds)


def rate(summary: dict) -> float:
    return summary["samples"] / summary["loop_seconds"]


def report(args, rounds: list[tuple[dict, dict]]) -> None:
    """One row per run: the round whose samples/s is the median of the rounds (its other columns are that round's);
    ideals: medians."""
    import statistics

    ideals = {k: statistics.median(r[0][k] for r in rounds) for k in rounds[0][0]}
    median_runs = {}
    for name in rounds[0][1]:
        ranked = sorted((r[1][name] for r in rounds), key=rate)
        median_runs[name] = ranked[(len(ranked) - 1) // 2]
    print(f"\nmachine: {platform.machine()} {os.cpu_count()} cores; {args.steps} steps x {args.batch} prompts x 2 "
          f"samples, max_new_tokens {args.new_tokens}, budgets lognormal mean/cv {args.lengths}, max_staleness "
          f"{args.max_staleness}, partial_rollouts {args.partial}, tail_migration {args.tail}, micro-batches "
          f"{args.micro_batches}, {args.generators} generator(s), {len(rounds)} round(s)"
          + (f", speculative {args.speculative} in the spec run" if args.speculative else ""))
    if len(rounds) > 1:
        print("samples/s per round: " + " | ".join(
            f"{name} " + " ".join(f"{rate(r[1][name]):.1f}" for r in rounds) for name in median_runs) + " | " +
            " | ".join(f"{k} " + " ".join(f"{r[0][k]:.1f}" for r in rounds) for k in ideals))
    base = None
    print(f"{'run':18} {'samples/s':>9} {'speed-up':>8} {'of ideal':>8} {'of bound':>8} {'wait':>6} {'gen busy':>8} "
          f"{'hidden':>6} {'imbalance (count split)':>24}")
    for name, s in median_runs.items():
        r = rate(s)
        base = base or r
        own_ideal = ideals["ideal+partial"] if name.startswith("partial") else ideals["ideal"]
        imb = s["generator_imbalance"]
        imb = f"{imb['imbalance']:.2f} ({imb['imbalance_count_split']:.2f})" if imb else ""
        busy = s["generator_busy_seconds"] / (s["generators"] * s["loop_seconds"])
        hidden = s.get("scoring_hidden_fraction")
        hidden = f"{hidden:6.2f}" if hidden is not None else f"{'-':>6}"
        of_bound = f"{r / ideals['ideal under bound']:8.2f}" if not name.startswith("partial") else f"{'-':>8}"
        pr = s.get("partial_rollouts")
        pr = (f"  carried {pr['carried']:.0f}, dropped {pr['dropped']:.0f} groups ("
              f"{pr['dropped_tokens'] / (pr['dropped_tokens'] + s['generated_tokens']):.2f} of the tokens); "
              f"steps behind of each step's oldest token: {s['staleness_histogram']}") if pr else ""
        if s.get("early_micro_batches") is not None:
            pr += f"  {s['early_micro_batches']:.0f} micro-batches trained before their batch was complete"
        tm = s.get("tail_migration")
        pr += (f"  handed over {tm['moved']:.0f} of {tm['handoffs']:.0f} groups asked, {tm['moved_tokens']:.0f} tokens "
               "kept") if tm else ""
        sp = s.get("speculative") or {}
        pr += (f"  speculative {sp['method']}: acceptance {sp.get('acceptance_rate', 0):.2f}, accepted length "
               f"{sp.get('mean_accepted_length', 0):.2f}") if sp.get("method", "off") != "off" else ""
        print(f"{name:18} {r:9.2f} {r / base:7.2f}x {r / own_ideal:8.2f} {of_bound} "
              f"{s['wait_seconds'] / s['loop_seconds']:6.2f} {busy:8.2f} {hidden} {imb:>24}{pr}")
    for k, v in ideals.items():
        print(f"{k:18} {v:9.2f} {v / base:7.2f}x {v / ideals['ideal']:8.2f}")
    best = max(median_runs, key=lambda k: rate(median_runs[k]))
    r = rate(median_runs[best])
    own_ideal = ideals["ideal+partial"] if best.startswith("partial") else ideals["ideal"]
    print(f"best: {best}; speed-up over batch-level: {r / base:.2f}x; fraction of the ideal: {r / own_ideal:.2f}"
          + (f"; fraction of the ideal under the staleness bound: {r / ideals['ideal under bound']:.2f}"
             if not best.startswith("partial") else ""))


if __name__ == "__main__":
    main()
