"""The continuous-batching generator backend against the transformers static-batch one, on the same prompts, the same
policy and the same machine, as ratios: the measurement `continuous_batching` (experimental/continuous_batching/) needs
before it could leave `experimental/` or be considered by `generator_backend='auto'`.

    python benchmarks/continuous_batching.py                                   # CPU, ~1M-parameter policy
    python benchmarks/continuous_batching.py --prompts 4 --max_new_tokens 16 --repeats 1   # a smoke run
    python benchmarks/continuous_batching.py --device cuda --dtype bfloat16 --hidden_size 1024 --layers 12

The policy is a random Llama built in code (`--hidden_size`, `--layers`; a 32000-token vocabulary, so a sample almost
never ends on EOS and each runs to its budget) and saved once to a temporary directory; both backends load it from
there, exactly as a generator process does. `--prompts` prompts of `--prompt_len` random tokens, `--n` samples each,
each prompt with its own budget: log-normal, median `--max_new_tokens`/8, capped at `--max_new_tokens` (a long tail;
`--equal_budgets` gives every prompt `--max_new_tokens`). Sampling at temperature 1. Timed (`--repeats` times each,
after one warm-up of each, the median reported):
  static      `HFBackend.generate` on chunks of `--batch` prompts in order (what a batch-level generator does with a
              request); each chunk runs to its longest budget and its samples are ready when it returns
  continuous  `ContinuousBatchingBackend`: every sample added at once (`add`), collected as each finishes (`results`);
              the backend's defaults for the device, or `--cb_config` (a JSON object of ContinuousBatchingConfig
              arguments)
Reported per backend: wall seconds, samples/s, generated tokens/s, and the time to the first finished sample; then the
ratios continuous / static (samples/s: > 1 means continuous is faster; first sample: < 1 means it answers sooner).
Nothing is asserted; the figures are this machine's. `--json PATH` also writes them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def budgets(n: int, cap: int, seed: int, equal: bool) -> list[int]:
    """Per-prompt budgets: log-normal, median cap/8 and sigma 1 (about 2% at the cap), at least 4 tokens."""
    if equal:
        return [cap] * n
    rng = random.Random(seed)
    return [max(4, min(cap, int(rng.lognormvariate(math.log(cap / 8), 1.0)))) for _ in range(n)]


def save_policy(args, path: str) -> str:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    heads = max(1, args.hidden_size // 64)
    config = LlamaConfig(vocab_size=32000, hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
                         num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=args.prompt_len + args.max_new_tokens + 8, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(path)
    return path


def run_static(backend, prompts, settings, limits, batch: int) -> dict:
    t0 = time.perf_counter()
    first, tokens = None, 0
    for start in range(0, len(prompts), batch):
        out = backend.generate(prompts[start:start + batch], settings, limits[start:start + batch])
        first = first if first is not None else time.perf_counter() - t0
        tokens += sum(len(c.token_ids) for group in out for c in group)
    return {"seconds": time.perf_counter() - t0, "first_sample_s": first, "tokens": tokens}


def run_continuous(backend, prompts, settings, limits, tag: str) -> dict:
    backend.use(settings)
    t0 = time.perf_counter()
    ids = set()
    with backend.paused():  # every sample reaches the decode loop at the same step
        for p, (prompt, limit) in enumerate(zip(prompts, limits)):
            for i in range(settings.n):
                rid = f"{tag}.{p}.{i}"
                ids.add(rid)
                backend.add(rid, prompt, limit, streaming=False)
    first, tokens, deadline = None, 0, time.monotonic() + 3600
    while ids:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(ids)} samples not finished after an hour")
        for r in backend.results(wait=0.05):
            if r.is_finished() and r.request_id in ids:
                ids.discard(r.request_id)
                tokens += len(r.generated_tokens)
                first = first if first is not None else time.perf_counter() - t0
    return {"seconds": time.perf_counter() - t0, "first_sample_s": first, "tokens": tokens}


def summary(runs: list[dict], samples: int) -> dict:
    seconds = statistics.median(r["seconds"] for r in runs)
    return {"seconds": seconds, "samples_per_s": samples / seconds,
            "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in runs),
            "first_sample_s": statistics.median(r["first_sample_s"] for r in runs)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="'cpu' or 'cuda' (default: cpu)")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (default: float32)")
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--n", type=int, default=2, help="samples per prompt")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--equal_budgets", action="store_true", help="every prompt's budget is --max_new_tokens")
    parser.add_argument("--batch", type=int, default=64, help="prompts per static generate call")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: torch's)")
    parser.add_argument("--cb_config", default=None, help="ContinuousBatchingConfig arguments, a JSON object")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)

    import torch

    from async_rlhf.experimental.continuous_batching import ContinuousBatchingBackend
    from async_rlhf.generation.engine.hf_backend import HFBackend
    from async_rlhf.types import SamplingSettings

    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 32000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    limits = budgets(args.prompts, args.max_new_tokens, args.seed, args.equal_budgets)
    settings = SamplingSettings(max_new_tokens=args.max_new_tokens, temperature=1.0, n=args.n)
    samples = args.prompts * args.n
    with tempfile.TemporaryDirectory(prefix="cb_bench_") as tmp:
        path = save_policy(args, tmp)
        static = HFBackend(path, device=args.device, seed=args.seed, dtype=args.dtype)
        run_static(static, prompts[:2], settings, limits[:2], args.batch)  # warm-up
        static_runs = [run_static(static, prompts, settings, limits, args.batch) for _ in range(args.repeats)]
        static.close()
        continuous = ContinuousBatchingBackend(path, device=args.device, seed=args.seed, dtype=args.dtype,
                                               continuous_batching=json.loads(args.cb_config or "{}"))
        try:
            run_continuous(continuous, prompts[:2], settings, limits[:2], "warm-up")
            cb_runs = [run_continuous(continuous, prompts, settings, limits, f"r{r}") for r in range(args.repeats)]
            cb_config = dict(continuous.cb_config)
        finally:
            continuous.close()
    result = {"static": summary(static_runs, samples), "continuous": summary(cb_runs, samples)}
    result["ratio"] = {"samples_per_s": result["continuous"]["samples_per_s"] / result["static"]["samples_per_s"],
                       "first_sample_s": result["continuous"]["first_sample_s"] / result["static"]["first_sample_s"]}
    result["setup"] = {**vars(args), "budgets_mean": sum(limits) / len(limits), "cb_config": cb_config,
                       "torch_threads": torch.get_num_threads()}
    print(f"{samples} samples ({args.prompts} prompts x {args.n}), budgets mean {sum(limits) / len(limits):.1f} "
          f"max {max(limits)}, {args.device} {args.dtype}, median of {args.repeats}")
    print(f"{'':12}{'seconds':>10}{'samples/s':>12}{'tokens/s':>12}{'first (s)':>12}")
    for name in ("static", "continuous"):
        r = result[name]
        print(f"{name:12}{r['seconds']:>10.2f}{r['samples_per_s']:>12.1f}{r['tokens_per_s']:>12.1f}"
              f"{r['first_sample_s']:>12.3f}")
    print(f"continuous / static: samples/s x{result['ratio']['samples_per_s']:.2f}, time to the first finished "
          f"sample x{result['ratio']['first_sample_s']:.2f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
