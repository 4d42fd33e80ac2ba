"""Static batches against transformers' continuous batching on a long-tail length mix: the question issue 45 asks of a
GPU before a continuous-batching generator backend is worth building (does a sample that leaves as it finishes, and a
slot that refills, beat a batch that waits for its longest sample there?).

    python benchmarks/cb_generation.py --device cpu --requests 16 --max_new_tokens 32 --json outputs/cb_dry.json
    python benchmarks/cb_generation.py --device cuda --bf16 --hidden_size 1024 --layers 12 --json outputs/cb.json

One random Llama-style policy built in code (no hub), `--requests` prompts of 32 tokens, each with its own length drawn
from a log-normal mix (median `--max_new_tokens`/8, capped at `--max_new_tokens`: RLHFuse's long tail). End of
sequence is off in both ways so each sample is exactly its drawn length. Timed, after one warm-up of each:
  static      `model.generate` over batches of `--batch` prompts in arrival order; a batch runs to its longest length
              (what a static-batch generator does); its samples are ready when the batch ends
  continuous  `model.init_continuous_batching` (paged attention; transformers' own defaults for the device) with every
              request added at once, each with its own `max_new_tokens`; a sample is ready when its result arrives
Reported: wall seconds, useful tokens per second (drawn lengths summed), and when half / 90% of the samples were ready.
The ratio is this machine's; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lengths(n: int, cap: int, seed: int) -> list[int]:
    """Log-normal lengths, median cap/8 and sigma 1 (about 2% at the cap), at least 4 tokens."""
    rng = random.Random(seed)
    return [max(4, min(cap, int(rng.lognormvariate(math.log(cap / 8), 1.0)))) for _ in range(n)]


def build(args):
    import torch

    sys.path.insert(0, ROOT)
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden_size // 64),
                         num_key_value_heads=max(1, args.hidden_size // 64),
                         max_position_embeddings=args.max_new_tokens + 64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype=torch.bfloat16 if args.bf16 else torch.float32, device=args.device)
    model.eval()
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens,
                           eos_token_id=None, pad_token_id=0)
    return model, gen


def ready_times(finish: list[float]) -> dict:
    done = sorted(finish)
    return {"half_ready_s": done[len(done) // 2 - 1] if len(done) > 1 else done[0], "p90_ready_s": done[int(0.9 * len(done)) - 1]
            if len(done) >= 10 else done[-1]}


def run_static(model, gen, prompts, lens, batch: int, device: str) -> dict:
    import torch

    t0 = time.perf_counter()
    finish = []
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i:i + batch], device=device)
        longest = max(lens[i:i + batch])
        batch_gen = copy.deepcopy(gen)
        batch_gen.max_new_tokens = batch_gen.min_new_tokens = longest
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=batch_gen)
        if device == "cuda":
            torch.cuda.synchronize()
        finish += [time.perf_counter() - t0] * len(lens[i:i + batch])
    return {"seconds": time.perf_counter() - t0, **ready_times(finish)}


def run_continuous(model, gen, prompts, lens, timeout: float) -> dict:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    t_init = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=gen,
                                             continuous_batching_config=ContinuousBatchingConfig(return_logprobs=True))
    manager.start()
    init = time.perf_counter() - t_init
    try:
        t0 = time.perf_counter()
        for k, (p, n) in enumerate(zip(prompts, lens)):
            manager.add_request(p, request_id=f"r{k}", max_new_tokens=n, eos_token_id=-1)
        finish, produced, logprobs = [], 0, 0
        deadline = t0 + timeout
        while len(finish) < len(prompts):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"continuous batching: {len(finish)} of {len(prompts)} results in {timeout:.0f} s")
            out = manager.get_result(timeout=1.0)
            if out is None:
                continue
            if out.error:
                raise RuntimeError(f"continuous batching: request {out.request_id} failed: {out.error}")
            if out.is_finished():
                finish.append(time.perf_counter() - t0)
                produced += len(out.generated_tokens)
                logprobs += len(out.logprobs or [])
        seconds = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=30)
    return {"seconds": seconds, "init_seconds": init, "produced_tokens": produced, "logprobs": logprobs,
            **ready_times(finish)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--hidden_size", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--batch", type=int, default=64, help="static batch size (prompts per generate call)")
    p.add_argument("--max_new_tokens", type=int, default=512)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds the continuous run may take")
    p.add_argument("--json")
    args = p.parse_args(argv)
    model, gen = build(args)
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 32000) for _ in range(32)] for _ in range(args.requests)]
    lens = lengths(args.requests, args.max_new_tokens, seed=2)
    useful = sum(lens)
    # warm-up of each way on a few short requests (kernels, allocator, CUDA graphs), not timed
    run_static(model, gen, prompts[:4], [8] * 4, 4, args.device)
    run_continuous(model, gen, prompts[:4], [8] * 4, args.timeout)
    static = run_static(model, gen, prompts, lens, args.batch, args.device)
    continuous = run_continuous(model, gen, prompts, lens, args.timeout)
    if continuous["produced_tokens"] != useful:
        raise RuntimeError(f"continuous batching produced {continuous['produced_tokens']} tokens, {useful} asked")
    for r in (static, continuous):
        r["useful_tokens_per_s"] = useful / r["seconds"]
    result = {"device": args.device, "bf16": args.bf16, "parameters": sum(t.numel() for t in model.parameters()),
              "requests": args.requests, "batch": args.batch, "max_new_tokens": args.max_new_tokens,
              "useful_tokens": useful, "longest": max(lens), "mean_length": useful / len(lens),
              "static": static, "continuous": continuous,
              "continuous_over_static": static["seconds"] / continuous["seconds"]}
    print(json.dumps(result, indent=1))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
