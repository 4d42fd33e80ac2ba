"""Speculative rollouts: generator tokens/s and training-loop samples/s with speculation off / ngram / suffix / history.

    python benchmarks/speculative.py --quick                      # long-tail task, about 10 minutes on 2 cores
    python benchmarks/speculative.py --task builtin --steps 20
    python benchmarks/speculative.py --quick --skip_loop          # generator figures only
    python benchmarks/speculative.py --quick --task tiny          # no prepared task needed: minutes

Two measurements per method, each in processes of their own, in one invocation (ratios are within it):
* generator: one vLLM engine (one CPU thread, float32, as a generator process builds it) on the task's policy
  samples `--rounds` rounds of the same `--prompts` training prompts, `num_generations` samples each at
  temperature 1 with the task's token limit, as RL does (every prompt sampled n times per step, again in later
  epochs); timed after one warm-up round on other prompts. Reported: generated tokens/s, acceptance rate, mean
  accepted length (accepted tokens per draft) and drafted tokens;
* loop (not with --skip_loop): `recipes/online_dpo.py` on the task, one vLLM generator, max_staleness 1, `--steps`
  steps, then its gold evaluation: loop samples/s (samples over the training loop's seconds, engine start
  excluded) and the gold win-rate, which must stay within the seed spread (speculation must not change learning).

`--task tiny` stands in where the tasks are not prepared yet (the long-tail task's first build takes 10-15 minutes on
an idle 2-core machine): the test suite's tiny Llama with its output layer scaled 25x, so that its samples are peaked
and repeat themselves (tests/integration/test_speculative_exactness.py), on the toy task's prompts; its loop runs
the toy task (no gold evaluation).

Methods whose package is missing (suffix: arctic-inference) are reported as skipped. The last line is
`speculative speed-up: N.NNx` (generator tokens/s of the best method over off) with its acceptance length.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

METHODS = ("off", "ngram", "suffix", "history")


def _task(task: str):
    """(policy directory, training prompts as token ids, max_new_tokens) of `task`."""
    from transformers import AutoTokenizer

    from async_rlhf.data.prompts import prompt_text

    if task == "tiny":
        import torch

        from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama
        from async_rlhf.data.toy_task import toy_prompts

        path = os.path.join(tempfile.gettempdir(), "async_rlhf-spec-bench-tiny")
        if not os.path.isfile(os.path.join(path, "config.json")):
            tokenizer = char_tokenizer()
            model = tiny_llama(tokenizer, seed=0)
            with torch.no_grad():
                model.lm_head.weight.mul_(25.0)
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        prompts = [tokenizer(prompt_text(p, tokenizer), add_special_tokens=False)["input_ids"]
                   for p in toy_prompts(256, 0)["prompt"]]
        return path, prompts, 96
    if task == "longtail":
        from async_rlhf.data import longtail_task
        from async_rlhf.tasks.build_longtail import prepare_longtail

        paths, splits, limit = prepare_longtail(seed=0), longtail_task.make_splits(seed=0), longtail_task.MAX_NEW_TOKENS
    else:
        from async_rlhf.data.builtin_task import make_splits
        from async_rlhf.tasks.build_builtin import prepare_builtin

        paths, splits, limit = prepare_builtin(seed=0), make_splits(seed=0), 64
    tokenizer = AutoTokenizer.from_pretrained(paths["tokenizer"])
    prompts = [tokenizer(prompt_text(p, tokenizer), add_special_tokens=False)["input_ids"]
               for p in splits["train"].select(range(256))["prompt"]]
    return paths["sft_model"], prompts, limit


def engine_run(args) -> dict:
    """In a process of its own: one engine with `args.method`, timed on the task's prompts."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    torch.set_num_threads(1)
    torch._dynamo.config.disable = True  # as generator processes run it (generation/engine/worker.py)
    from async_rlhf.config.speculative import vllm_config
    from async_rlhf.generation.engine.vllm_backend import VLLMBackend
    from async_rlhf.types import SamplingSettings

    model, prompts, limit = _task(args.task)
    t0 = time.perf_counter()
    backend = VLLMBackend(model, dtype="float32", speculative_config=vllm_config(args.method, args.tokens))
    start = time.perf_counter() - t0
    settings = SamplingSettings(max_new_tokens=limit, temperature=1.0, n=args.n, seed=0)
    timed = prompts[:args.prompts]
    backend.generate(prompts[-args.prompts:], settings)  # warm-up (numba compiles the ngram proposer here)
    before = backend.spec_counters()
    t0, tokens = time.perf_counter(), 0
    for r in range(args.rounds):
        out = backend.generate(timed, SamplingSettings(max_new_tokens=limit, temperature=1.0, n=args.n, seed=1 + r))
        tokens += sum(len(c.token_ids) for g in out for c in g)
    seconds = time.perf_counter() - t0
    after = backend.spec_counters()
    backend.close()
    c = {k: after[k] - before.get(k, 0) for k in after}
    return {"method": args.method, "start_seconds": start, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "drafted": c.get("draft_tokens", 0),
            "acceptance_rate": c["accepted_tokens"] / c["draft_tokens"] if c.get("draft_tokens") else 0.0,
            "accepted_length": c["accepted_tokens"] / c["drafts"] if c.get("drafts") else 0.0}


def loop_run(args, method: str, out: str) -> dict:
    task = ["--task", "toy", "--model_name_or_path", _task("tiny")[0], "--max_new_tokens", "96", "--max_length",
            "160"] if args.task == "tiny" else ["--task", args.task]
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "online_dpo.py"), *task, "--output_dir", out,
           "--max_steps", str(args.steps), "--generator_backend", "vllm", "--max_staleness", "1",
           "--speculative", method, "--num_speculative_tokens", str(args.tokens), "--eval_prompts",
           str(args.eval_prompts), "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(os.path.join(out + ".log"), "w") as log:
        done = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout, check=False)
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}, see {out}.log"}
    with open(os.path.join(out, "run_summary.json")) as f:
        summary = json.load(f)
    evaluation = {}
    if os.path.isfile(os.path.join(out, "eval_results.json")):
        with open(os.path.join(out, "eval_results.json")) as f:
            evaluation = json.load(f)
    return {"samples_per_s": summary["samples"] / summary["loop_seconds"],
            "gold_win_rate": evaluation.get("gold_win_rate"), "speculative": summary.get("speculative", {})}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=("longtail", "builtin", "tiny"), default="longtail")
    p.add_argument("--quick", action="store_true", help="8 prompts x 2 rounds, 6 loop steps")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--tokens", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval_prompts", type=int, default=64)
    p.add_argument("--skip_loop", action="store_true")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per process")
    p.add_argument("--method", help=argparse.SUPPRESS)  # internal: run one engine and print its JSON
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.rounds, args.steps, args.eval_prompts = 8, 2, 6, 32
    if args.method:
        print("RESULT " + json.dumps(engine_run(args)), flush=True)
        return
    from async_rlhf.config.speculative import suffix_available

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f} at start; task {args.task}, {args.tokens} draft tokens", flush=True)
    if args.task != "tiny":  # prepared here, its progress on this console (10-15 min the first time), not silently
        _task(args.task)     # inside the first method's process, whose output is captured
    gen, loop = {}, {}
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="spec-bench-") as tmp:
        for method in args.methods:
            if method == "suffix" and not suffix_available():
                gen[method] = {"error": "skipped: arctic-inference is not installed"}
                continue
            cmd = [sys.executable, __file__, "--method", method, "--task", args.task, "--tokens", str(args.tokens),
                   "--prompts", str(args.prompts), "--rounds", str(args.rounds), "--n", str(args.n)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            gen[method] = json.loads(lines[-1][7:]) if lines else {"error": done.stderr[-2000:]}
            print(f"generator {method}: {gen[method]}", flush=True)
            if not args.skip_loop and "error" not in gen[method]:
                loop[method] = loop_run(args, method, os.path.join(tmp, method))
                print(f"loop {method}: {loop[method]}", flush=True)
    base = gen.get("off", {}).get("tokens_per_s")
    base_loop = loop.get("off", {}).get("samples_per_s")
    print("\n| method | generator tokens/s | x off | acceptance | accepted length | drafted | loop samples/s | x off "
          "| gold win-rate |\n|---|---|---|---|---|---|---|---|---|")
    for method in args.methods:
        g, l_ = gen.get(method, {}), loop.get(method, {})
        if "error" in g:
            print(f"| {method} | {g['error'][:80]} | | | | | | | |")
            continue
        sps = l_.get("samples_per_s")
        print(f"| {method} | {g['tokens_per_s']:.1f} | {g['tokens_per_s'] / base if base else 0:.2f} | "
              f"{g['acceptance_rate']:.2f} | {g['accepted_length']:.2f} | {g['drafted']} | "
              f"{f'{sps:.2f}' if sps else '-'} | {f'{sps / base_loop:.2f}' if sps and base_loop else '-'} | "
              f"{l_.get('gold_win_rate', '-') if l_ else '-'} |")
    ranked = [m for m in args.methods if m != "off" and "error" not in gen.get(m, {"error": 1})]
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if base and ranked:
        best = max(ranked, key=lambda m: gen[m]["tokens_per_s"])
        print(f"speculative speed-up: {gen[best]['tokens_per_s'] / base:.2f}x ({best}, acceptance length "
              f"{gen[best]['accepted_length']:.2f})")


if __name__ == "__main__":
    main()
