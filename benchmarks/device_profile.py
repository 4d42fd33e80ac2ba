"""Measure a device profile for the planner on the machine at hand (`python -m async_rlhf.plan --profile ...`).

    python benchmarks/device_profile.py --model ~/.cache/async_rlhf/builtin-v5/sft_model --output profile.json

Measures, with one thread per process as our CPU runs use (`--threads`):
- generation: our vLLM backend's engine (`VLLMBackend`, the one generator processes run) sampling fixed-length
  completions (`ignore_eos`) for 1..64 concurrent sequences and several lengths; seconds per engine step against
  running sequences, fitted as `overhead + per_seq * running` (least squares), and prefill seconds per prompt token;
- learner: forward + backward + AdamW step of the policy (transformers, fp32 on CPU) in tokens per second;
- weight sync: the shared-memory transport we use (`ShmWeightTransport.publish`, then `VLLMBackend.load_weights`),
  seconds per GB each way; (`BroadcastWeightTransport` is not used by the trainer and is not measured);
- memory per parameter: the bytes of weights, gradients and optimizer state the learner actually holds after a step,
  and what each ZeRO stage would leave per rank on `--ranks` ranks (derived from those, not measured under DeepSpeed).
A few minutes on a 2-core CPU with the built-in task's policy. The JSON's `device` entries are DeviceProfile fields.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))

from weight_load import median_seconds  # noqa: E402  (benchmarks/ is on the path when run as a script)


def _median(fn, repeats: int) -> float:
    return median_seconds(fn, repeats, warm_up=False)  # where a warm-up matters the caller makes it


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares a + b * x."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-12, sum((x - mx) ** 2 for x in xs))
    return my - b * mx, b


def measure_generation(backend, vocab: int, prompt_len: int, lengths: list[int], seqs: list[int], repeats: int):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def run(r: int, new: int) -> float:
        prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % (vocab - 2) + 2 for j in range(prompt_len)])
                   for i in range(r)]
        params = SamplingParams(max_tokens=new, min_tokens=new, ignore_eos=True, temperature=1.0, seed=0)
        return _median(lambda: backend.llm.generate(prompts, params, use_tqdm=False), repeats)

    run(4, 4)  # warm-up
    points = []
    for new in lengths:
        for r in seqs:
            seconds = run(r, new)
            points.append({"sequences": r, "new_tokens": new, "seconds": seconds, "step_seconds": seconds / new,
                           "tokens_per_s": r * new / seconds})
    a, b = _fit([(p["sequences"], p["step_seconds"]) for p in points])
    r = max(seqs)
    prefill = max(0.0, (run(r, 1) - (a + b * r)) / (r * prompt_len))
    return {"points": points, "fit": {"overhead_s": a, "per_seq_s": b}, "prefill_token_s": prefill,
            "prompt_tokens": prompt_len}


def measure_learner(model_path: str, seq_len: int, batches: list[int], repeats: int):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = model.config.vocab_size
    out = {"points": []}
    for b in batches:
        ids = torch.randint(2, vocab, (b, seq_len))

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        step()
        seconds = _median(step, repeats)
        out["points"].append({"batch": b, "seq_len": seq_len, "seconds": seconds, "tokens_per_s": b * seq_len / seconds})
    out["tokens_per_s"] = max(p["tokens_per_s"] for p in out["points"])
    params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    optim = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    memory = {"params": params, "bytes_per_param": {"weights": weights / params, "gradients": grads / params,
                                                    "optimizer": optim / params}}
    return out, memory, model


def per_stage(memory: dict, ranks: int) -> dict:
    w, g, o = (memory["bytes_per_param"][k] for k in ("weights", "gradients", "optimizer"))
    return {"zero0": w + g + o, "zero1": w + g + o / ranks, "zero2": w + (g + o) / ranks, "zero3": (w + g + o) / ranks}


def measure_sync(backend, model, shm_dir: str, repeats: int) -> dict:
    from async_rlhf.weight_sync import ShmWeightTransport

    transport = ShmWeightTransport(shm_dir)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    size = sum(t.numel() * t.element_size() for t in state.values())
    version = [0]
    updates = []

    def publish():
        version[0] += 1
        updates.append(transport.publish(state, version[0]))

    try:
        pub = _median(publish, repeats)
        load = _median(lambda: backend.load_weights(updates[-1]), repeats)
    finally:
        transport.close()
    gb = size / 1e9
    return {"shm": {"bytes": size, "publish_seconds_per_gb": pub / gb, "load_seconds_per_gb": load / gb,
                    "seconds_per_gb": (pub + load) / gb}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a local model directory (config.json + safetensors)")
    p.add_argument("--output", required=True, help="the profile JSON to write")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--sequences", default="1,4,16,64", help="concurrent sequences to time")
    p.add_argument("--lengths", default="16,48", help="completion lengths to time (tokens)")
    p.add_argument("--prompt_length", type=int, default=32)
    p.add_argument("--learner_batches", default="8,32", help="sequences per learner step")
    p.add_argument("--ranks", type=int, default=2, help="ranks to derive the per-ZeRO-stage memory for")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shm_dir", default="/dev/shm")
    args = p.parse_args(argv)
    seqs = [int(x) for x in args.sequences.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        p.error(f"--model: {args.model!r} has no config.json")
    if min(seqs) < 1 or min(lengths) < 1 or args.threads < 1 or args.repeats < 1:
        p.error("--sequences, --lengths, --threads and --repeats take positive numbers")

    import torch

    from async_rlhf.generation.engine.vllm_backend import VLLMBackend
    from async_rlhf.plan.model_shapes import shape_from_config

    torch.set_num_threads(args.threads)
    shape = shape_from_config(args.model)
    if args.prompt_length + max(lengths) > 128:  # the built-in policy's context; larger models: raise lengths freely
        with open(os.path.join(args.model, "config.json")) as f:
            ctx = json.load(f).get("max_position_embeddings", 2048)
        if args.prompt_length + max(lengths) > ctx:
            p.error(f"--prompt_length {args.prompt_length} + --lengths max {max(lengths)} exceeds the model's "
                    f"max_position_embeddings {ctx}")
    t0 = time.perf_counter()
    backend = VLLMBackend(args.model, dtype="float32")
    try:
        generation = measure_generation(backend, shape.vocab, args.prompt_length, lengths, seqs, args.repeats)
        learner, memory, model = measure_learner(args.model, args.prompt_length + max(lengths),
                                                 [int(x) for x in args.learner_batches.split(",")], args.repeats)
        sync = measure_sync(backend, model, args.shm_dir, args.repeats)
    finally:
        backend.close()
    memory["per_rank_bytes_per_param"] = {"ranks": args.ranks, **per_stage(memory, args.ranks)}
    profile = {
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"{args.threads} thread(s) per process, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "model": {"path": args.model, "params": shape.params},
        "device": {"kind": "cpu", "dtype_bytes": 4, "name": f"CPU ({os.cpu_count()} cores)"},
        "generation": generation, "learner": learner, "weight_sync": sync, "memory": memory,
        "seconds": time.perf_counter() - t0,
    }
    with open(args.output, "w") as f:
        json.dump(profile, f, indent=2)
    fit = generation["fit"]
    print(f"generation: step = {fit['overhead_s'] * 1e3:.2f} ms + {fit['per_seq_s'] * 1e3:.3f} ms x sequences; "
          f"learner {learner['tokens_per_s']:.0f} tokens/s; shm sync {sync['shm']['seconds_per_gb']:.2f} s/GB; "
          f"{memory['per_rank_bytes_per_param']}; {profile['seconds']:.0f} s -> {args.output}")


if __name__ == "__main__":
    main()
