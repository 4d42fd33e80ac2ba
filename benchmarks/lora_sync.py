"""LoRA policy -> vLLM generator: merged weights (what the trainers do) against vLLM's own LoRA adapters.

    python benchmarks/lora_sync.py                       # ~10M and ~100M-parameter Llamas, r=16 on every linear layer
    python benchmarks/lora_sync.py --sizes 10M --rank 8 --threads 2

Per size, each arm runs in its own subprocess (one vLLM engine per process), on the same random-init Llama (no hub),
with the same LoRA adapter (random B, as after training), the same prompts (`--prompts` x 32 tokens) and greedy
generation of `--new_tokens` tokens per prompt (EOS ignored, so both arms generate the same number of tokens):
  merged   per sync: `gather_full_state` (peft's merge per layer, a CPU copy, the base put back), the shm publish
           (`ShmWeightTransport.publish`) and `VLLMBackend.load_weights`; then a plain engine generates.
  adapter  per sync: the adapter saved to /dev/shm (`PeftModel.save_pretrained`), loaded by the engine under a new
           LoRA id (`add_lora`: into the engine's CPU-side adapter cache; moving it into an active slot happens at
           the first request that uses it and is not timed, so this is a lower bound) and the previous id removed;
           the engine is built with `enable_lora` and every request carries the adapter.
Medians of `--repeats` after a warm-up. Both arms check their output against the merged transformers model (greedy
tokens of the first prompt equal), so the two are compared at equal results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from weight_load import SIZES, median_seconds  # noqa: E402  (benchmarks/ is on the path when run as a script)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lora_policy(model_dir: str, rank: int):
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank,
                                                       target_modules="all-linear"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    return policy


def prompts(n: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(4, 100) for _ in range(32)] for _ in range(n)]


def expected_tokens(policy, prompt: list[int], new_tokens: int) -> list[int]:
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, policy(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def run_arm(arm: str, model_dir: str, rank: int, n_prompts: int, new_tokens: int, repeats: int) -> dict:
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    policy = lora_policy(model_dir, rank)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts(n_prompts)]
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    want = expected_tokens(policy, batch[0]["prompt_token_ids"], new_tokens)
    out: dict = {"arm": arm}
    if arm == "merged":
        from async_rlhf.generation.engine.vllm_backend import VLLMBackend
        from async_rlhf.weight_sync import ShmWeightTransport, gather_full_state

        backend = VLLMBackend(model_dir, dtype="float32", max_model_len=128)
        transport = ShmWeightTransport("/dev/shm")
        version = [0]
        state = gather_full_state(policy, True)

        def publish_and_load():
            version[0] += 1
            update = transport.publish(state, version[0])
            backend.load_weights(update)
            transport.release(version[0])

        out["merge_seconds"] = median_seconds(lambda: gather_full_state(policy, True), repeats)
        out["publish_and_load_seconds"] = median_seconds(publish_and_load, repeats)
        out["sync_seconds"] = out["merge_seconds"] + out["publish_and_load_seconds"]
        out["sync_bytes"] = sum(t.numel() * t.element_size() for t in state.values())
        llm, request = backend.llm, {}
    else:
        from vllm import LLM
        from vllm.lora.request import LoRARequest

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        llm = LLM(model=model_dir, dtype="float32", max_model_len=128, enforce_eager=True, seed=0,
                  kv_cache_memory_bytes=1 << 30, enable_lora=True, max_lora_rank=rank, max_loras=1)
        shm = tempfile.mkdtemp(dir="/dev/shm", prefix="lora_bench-")
        current = [None]
        load_times: list[float] = []

        def sync():  # what a weight sync would be: save the adapter, load it as a new LoRA, drop the previous one
            policy.save_pretrained(shm)
            previous = current[0]
            current[0] = LoRARequest(f"v{previous.lora_int_id + 1 if previous else 1}",
                                     previous.lora_int_id + 1 if previous else 1, shm)
            t0 = time.perf_counter()
            llm.llm_engine.add_lora(current[0])
            load_times.append(time.perf_counter() - t0)
            if previous is not None:
                llm.llm_engine.remove_lora(previous.lora_int_id)

        out["sync_seconds"] = median_seconds(sync, repeats)
        out["adapter_load_seconds"] = statistics.median(load_times[1:])  # the warm-up's excluded
        out["sync_bytes"] = os.path.getsize(os.path.join(shm, "adapter_model.safetensors"))
        shutil.rmtree(shm)  # vLLM holds the adapter in memory from here on
        request = {"lora_request": current[0]}
    generate = lambda: llm.generate(batch, greedy, use_tqdm=False, **request)  # noqa: E731
    out["generate_seconds"] = median_seconds(generate, repeats)
    got = generate()[0].outputs[0].token_ids
    out["matches_merged_transformers"] = list(got) == want
    out["tokens_per_s"] = n_prompts * new_tokens / out["generate_seconds"]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["10M", "100M"], choices=list(SIZES))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # internal: run one arm in this process
    parser.add_argument("--model_dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.arm:
        print("RESULT " + json.dumps(run_arm(args.arm, args.model_dir, args.rank, args.prompts, args.new_tokens,
                                             args.repeats)), flush=True)
        return
    from async_rlhf.data.tiny_model import save_tiny_model

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    print(f"rank {args.rank}, all linear layers | {args.prompts} prompts x {args.new_tokens} new tokens, greedy | "
          f"{args.threads} thread(s) | medians of {args.repeats}")
    print(f"{'size':>5} {'arm':>8} {'sync s':>8} {'sync MB':>8} {'generate s':>10} {'tok/s':>7}  equal  details")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            hidden, layers, heads = SIZES[size]
            model_dir = save_tiny_model(os.path.join(tmp, size), hidden_size=hidden, num_layers=layers,
                                        num_heads=heads)
            for arm in ("merged", "adapter"):
                cmd = [sys.executable, os.path.abspath(__file__), "--arm", arm, "--model_dir", model_dir,
                       "--rank", str(args.rank), "--prompts", str(args.prompts), "--new_tokens", str(args.new_tokens),
                       "--repeats", str(args.repeats)]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
                lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
                if proc.returncode != 0 or not lines:
                    print(proc.stdout[-3000:], proc.stderr[-3000:])
                    raise SystemExit(f"{size} {arm}: failed (exit {proc.returncode})")
                r = json.loads(lines[-1][7:])
                details = {k: round(v, 4) for k, v in r.items() if k.endswith("_seconds") and k not in
                           ("sync_seconds", "generate_seconds")}
                print(f"{size:>5} {arm:>8} {r['sync_seconds']:8.3f} {r['sync_bytes'] / 1e6:8.2f} "
                      f"{r['generate_seconds']:10.3f} {r['tokens_per_s']:7.1f}  "
                      f"{str(r['matches_merged_transformers']):5}  "
                      f"{details}", flush=True)


if __name__ == "__main__":
    main()
