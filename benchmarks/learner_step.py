"""One online DPO learner step on the built-in task, phase by phase: padded to the longest row vs length buckets.

    python benchmarks/learner_step.py                    # 32 prompts x 2 samples, 1 thread (the learner's share)
    python benchmarks/learner_step.py --n 4 --threads 2 --repeats 10
    python benchmarks/learner_step.py --device cuda --bf16  # on the first GPU, under bf16 autocast as --bf16 trains

The built-in task's SFT policy samples `--n` completions for each of `--prompts` training prompts (temperature 1,
up to 24 tokens: what the first steps of a run train on); a chosen and a rejected row per prompt then go through
what `AsyncOnlineDPOTrainer.compute_rollout_loss` and the optimizer do, each phase timed (median of `--repeats`
after a warm-up; the ways take turns, so a change in load hits each), four ways: every row padded to the longest (one forward per model), rows in length buckets
(`logprobs.length_buckets`), length buckets with the shared-prefix reference (`reference_shared_prefix`), and
both models running each prompt once (the policy with gradient: online DPO's default, `policy_shared_prefix`). Also prints the tokens each way runs and the largest log-prob difference to the padded
forward (float tolerance).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MODES = ("padded", "buckets", "shared prefix, ref", "shared prefix, both")
PHASES = ("pack", "policy forward", "reference forward", "loss", "backward", "optimizer step")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step (the default run's 32)")
    parser.add_argument("--n", type=int, default=2, help="completions sampled per prompt (2 rows trained each)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the learner's share of 2 cores)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (the first GPU); phases end in a device sync")
    parser.add_argument("--bf16", action="store_true", help="run the models under bf16 autocast (as --bf16 true)")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.n < 2 or args.repeats < 1 or args.threads < 1:
        raise SystemExit(f"--prompts, --repeats, --threads must be >= 1 and --n >= 2, got {args.prompts}, "
                         f"{args.repeats}, {args.threads}, {args.n}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from async_rlhf.data.builtin_task import make_splits
    from async_rlhf.tasks.build_builtin import prepare_builtin
    from async_rlhf.generation.engine.hf_backend import TransformersSampler
    from async_rlhf.learner.logprobs import (bucketed_token_logps, completion_batch, length_buckets, shared_prefix_logps,
                                     shared_prefix_token_logps)
    from async_rlhf.losses.dpo import dpo_loss
    from async_rlhf.types import SamplingSettings, ScoredGroup

    torch.set_num_threads(args.threads)
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch sees no CUDA GPU")
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    paths = prepare_builtin(seed=0)
    tok = AutoTokenizer.from_pretrained(paths["tokenizer"])
    policy = AutoModelForCausalLM.from_pretrained(paths["sft_model"], dtype=torch.float32).train()
    ref = AutoModelForCausalLM.from_pretrained(paths["sft_model"], dtype=torch.float32).eval().requires_grad_(False)
    sampler = TransformersSampler(ref, tok.pad_token_id, tok.eos_token_id)  # samples on the CPU: same rows anywhere
    policy, ref = policy.to(device), ref.to(device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-12)  # the step's cost, not its effect, is measured
    rows = make_splits(seed=0)["train"].select(range(args.prompts))
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in rows["prompt"]]
    samples = sampler.generate(prompts, SamplingSettings(max_new_tokens=24, temperature=1.0, n=args.n, seed=0))
    groups = [ScoredGroup(i, p, s, [0.0] * args.n, 0) for i, (p, s) in enumerate(zip(prompts, samples))]
    select = [(g, 0) for g in range(len(groups))] + [(g, 1) for g in range(len(groups))]  # chosen, then rejected
    max_length = 128
    n = len(groups)

    def step(mode: str, times: dict | None = None) -> torch.Tensor:
        marks = [time.perf_counter()]

        def mark():
            sync()
            marks.append(time.perf_counter())

        ids, attn, comp, _ = completion_batch(groups, tok.pad_token_id, max_length, device, select)
        buckets = [list(range(len(select)))] if mode == "padded" else length_buckets(attn.sum(-1).tolist())
        mark()
        out = None
        with autocast:
            if mode == "shared prefix, both":
                out = shared_prefix_token_logps(policy, groups, select, comp[:, 1:].float(), max_length)
            logps, mask, _ = bucketed_token_logps(policy, ids, attn, comp, buckets) if out is None else (*out, 0)
        mask = comp[:, 1:].float()
        mark()
        reference = None
        with autocast:
            if mode.startswith("shared prefix"):
                reference = shared_prefix_logps(ref, groups, select, mask, max_length)
            if reference is None:
                with torch.no_grad():
                    reference, _, _ = bucketed_token_logps(ref, ids, attn, comp, buckets)
        mark()
        seq, ref_seq = logps.sum(-1), reference.sum(-1)
        loss, metrics = dpo_loss(seq[:n], seq[n:], ref_seq[:n], ref_seq[n:], 0.1)
        _ = {k: float(v) for k, v in metrics.items()}  # the trainer reads every metric as a float
        mark()
        loss.backward()
        mark()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mark()
        if times is not None:
            for phase, a, b in zip(PHASES, marks, marks[1:]):
                times.setdefault(phase, []).append(b - a)
        return logps.detach()

    ids, attn, _, _ = completion_batch(groups, tok.pad_token_id, max_length, "cpu", select)
    lengths = attn.sum(-1).tolist()
    buckets = length_buckets(lengths)
    tokens = {"padded": ids.numel(), "buckets": sum(len(b) * max(lengths[r] for r in b) for b in buckets),
              "shared prefix": n * max(len(p) for p in prompts)
              + len(select) * max(len(groups[g].completions[i].token_ids) for g, i in select)}
    print(f"policy {sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M parameters; {n} prompts x {args.n} "
          f"samples, {len(select)} rows trained; real tokens {sum(lengths)}, padded to the longest {tokens['padded']} "
          f"(width {ids.shape[1]}), in {len(buckets)} length buckets {tokens['buckets']} (widths "
          f"{[max(lengths[r] for r in b) for b in buckets]}), with each prompt once {tokens['shared prefix']}; {args.threads} thread(s), median of {args.repeats}; {args.device}{', bf16 autocast' if args.bf16 else ''}")
    baseline = step("padded")
    diffs = {mode: float((step(mode) - baseline).abs().max()) for mode in MODES}  # warm-up, and the log-prob check
    times: dict[str, dict[str, list[float]]] = {mode: {} for mode in MODES}
    for _ in range(args.repeats):  # the modes take turns, so a change in the machine's load hits each of them
        for mode in MODES:
            step(mode, times[mode])
    results = {}
    for mode in MODES:
        results[mode] = {phase: statistics.median(times[mode][phase]) for phase in PHASES}
        results[mode]["total"] = statistics.median([sum(ts) for ts in zip(*(times[mode][p] for p in PHASES))])
        results[mode]["max_abs_diff"] = diffs[mode]
    print(f"{'ms per step':<21}" + "".join(f"{m:>21}" for m in results))
    for phase in (*PHASES, "total"):
        print(f"{phase:<21}" + "".join(f"{1000 * results[m][phase]:>21.1f}" for m in results))
    print(f"{'max |diff| vs padded':<21}" + "".join(f"{results[m]['max_abs_diff']:>21.1e}" for m in results))
    return {"tokens": tokens, "results": results}


if __name__ == "__main__":
    main()
