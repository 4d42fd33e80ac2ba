"""The GPU evidence kit: everything worth measuring on one short loan of a GPU machine, in one call.

    python benchmarks/gpu_kit.py --prepare                          # here: what must travel, into .gpu_kit/
    python benchmarks/gpu_kit.py --output_dir outputs/gpu_kit       # on the GPU machine (bash scripts/gpu_check.sh)
    python benchmarks/gpu_kit.py --output_dir outputs/gpu_kit_dry --device cpu --dry_run  # the same parts, tiny, CPU

Made for the lent H100 machine (torch with CUDA, transformers, accelerate and peft installed; no vLLM, no package
registry, no network; 15 minutes of device time per task, the machine's start included): `--prepare` builds here, in
`.gpu_kit/` (in .gitignore, carried by the device call), what the machine lacks and this kit imports (`WHEELS`:
transformers at our pinned version, TRL and datasets with the two packages datasets needs that the machine's image
does not hold) and the built-in task's prepared models (so the machine does not spend a minute building them), and
says how much it is against the 64 MiB a call may carry. `scripts/gpu_check.sh` installs the wheels there and runs
this script.

Parts, each a child process with a time box (`PARTS`: seconds of a 480 s call, scaled by `--budget` over the parts
selected; the last part run takes what is left); a part that fails or runs out of time is recorded with the end of
its output, and the kit goes on with the next. The GPU call runs `GPU_PARTS`, the long-tail workload (issue 45 item
3), and nothing else: its two parts need about 470 s, so the parts measured on the earlier loans (pytest_gpu,
continuous_batching, learner_step, colocated, vs_trl; docs/performance.md has their figures) and cb_backend (whose
question the streaming row of `mechanisms` now answers in a training loop) are dropped from it; `--parts` runs any of
them (a second call, if the loan has time left), and `--dry_run` runs every part.
  env           10 s: the device, library versions, the machine's load
  mechanisms    270 s: `benchmarks/mechanisms.py mechanisms`: GRPO on the long-tail task's prompts with its gold
                reward, a ~101M-parameter policy (hidden 1024, 6 layers) trained on the device from the task's
                demonstrations (300 SFT steps: it must write summaries whose length follows the post, or there is no
                tail), 32 prompts x 2 a step, up to 256 new tokens, 16 steps, bf16, ours on the continuous-batching
                generator backend colocated on cuda:0; the default run, then one run per optional mechanism the
                backend takes (streaming against static batches, train-while-generating, fused reference, shared
                prefixes, in-flight weight loads; autoscaling, partial rollouts, tail migration, speculative rollouts,
                length-aware assignment and the reward's shared prefix are recorded as skipped, with the config's
                or the record's reason): clock, samples/s and the final gold reward against the default
  vs_trl_cb     200 s (what is left): `benchmarks/mechanisms.py vs_trl --seeds 0 1 2`: TRL 1.16's GRPOTrainer with
                `use_transformers_continuous_batching=True` against ours on the same workload and prompts, seeds as
                time allows (seed 0's ours is mechanisms' default run): clocks, seconds to the same gold reward (on
                the clock and from process start), and (c) both trainers' start-up timelines (process start, trainer
                built, generator ready, first optimizer step) from the runs' own records
  pytest_gpu    `pytest -m gpu tests/gpu` (the colocated run, CUDA IPC weights; the NCCL test needs 2 GPUs)
  continuous_batching  `benchmarks/cb_generation.py`: static batches of 64 against transformers' continuous batching
                on 128 long-tail requests (lengths log-normal, capped at 256) with a ~200M bf16 random policy:
                seconds, useful tokens/s, when half and 90% of the samples were ready (issue 45's first question)
  cb_backend    `benchmarks/continuous_batching.py`: our continuous-batching generator backend
                (experimental/continuous_batching) against our static one on 64 long-tail prompts x 2 (~216M bf16):
                samples/s and the time to the first finished sample, as ratios
  learner_step  `benchmarks/learner_step.py --device cuda --bf16` on the SFT policy and on a 203M-parameter random
                policy at 32 to 384 prompts a step (`LEARNER_SIZES`): padded vs length buckets vs shared prefixes,
                to find the batch (padded tokens) from which the ways that save tokens pay. GPU learners run padded
                by default (`trainers/base.py::splits_forwards`): two H100 runs found none that clearly paid from
                2,560 to 34,560 padded tokens
  colocated     `recipes/online_dpo.py --task toy` with a ~100M-parameter random policy, learner and one
                transformers generator colocated on cuda:0 (weights as CUDA IPC handles), at max_staleness 0
                (synchronous) and 1 (asynchronous): sync seconds per GB, the generator's tokens per second, async
                against synchronous wall-clock, and the planner's prediction for that run next to the measurement
  vs_trl        `benchmarks/vs_trl.py --device cuda` over three seeds (online DPO, the built-in task)
The long-tail sizes are set without a GPU measurement of them: a run's start (imports, trainer, generator) on the
H100 took about 25 s before, so the 270 s box may not hold every mechanism's run and three seeds may not fit 200 s;
what did not fit is recorded as "not run", and the first GPU call says what to shrink.
`--output_dir` gets three files (a device call returns at most 8): `gpu_kit.json` (rewritten after every part, so a
call cut short still returns what was done), `gpu_kit.md` (the table docs/performance.md's "GPU evidence kit"
section takes, device named) and `logs.tar.gz` (every part's log and each run's own); the rest (models, run
folders) stays in `--work_dir`. `--dry_run` runs every part at tiny sizes (CPU: shm weights instead of CUDA IPC, the toy
model, two steps; the long-tail parts with `benchmarks/mechanisms.py --tiny`: a 0.25M policy of 20 SFT steps, 4
prompts x 2, up to 24 tokens), which is what `tests/integration/test_gpu_kit.py` runs (slow tier) so the kit cannot
rot.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT_DIR = os.path.join(ROOT, ".gpu_kit")  # what travels: wheels/ and cache/ (in .gitignore; the call's `carry`)
CARRY_LIMIT = 64 * 2**20  # bytes a device call may carry (the tree included)
# what the machine's image lacks (or holds at another version) and this kit imports: our pins, none of their
# dependencies the image already has (huggingface-hub 1.33, tokenizers 0.23.2, pyarrow, pandas, xxhash, fsspec)
WHEELS = ("transformers==5.19.0", "trl==1.16.0", "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19")
# part -> seconds of its time box in a call of the default 480 s budget (scaled over the parts selected; the last
# part run takes whatever is left)
PARTS = {"env": 10, "mechanisms": 270, "vs_trl_cb": 200, "pytest_gpu": 130, "continuous_batching": 80,
         "cb_backend": 60, "learner_step": 45, "colocated": 95, "vs_trl": 115}
# the GPU call's parts (`--parts` default without --dry_run): the long-tail workload. The others were measured on the
# earlier loans (docs/performance.md) and no longer fit beside it; `--parts` runs them.
GPU_PARTS = ("env", "mechanisms", "vs_trl_cb")
# the continuous-batching question (benchmarks/cb_generation.py): a ~200M bf16 policy, 128 long-tail requests
CB_SIZES = dict(hidden_size=1024, layers=8, requests=128, batch=64, max_new_tokens=256)
# our continuous-batching generator backend against our static one (`benchmarks/continuous_batching.py`): ~216M bf16
CB_BACKEND_SIZES = dict(hidden_size=1024, layers=12, prompts=64, n=2, max_new_tokens=256, batch=64, repeats=1)
# (hidden size, layers, prompts a step) timed; (0, 0, ...) is the SFT policy itself. 32 prompts x 2 rows of the
# built-in task are about 2,560 padded tokens, 128 about 10,500, 384 about 34,500.
LEARNER_SIZES = [(0, 0, 32), (1024, 12, 32), (1024, 12, 128), (1024, 12, 384)]
COLOCATED_MODEL = dict(hidden_size=1024, num_layers=8, num_heads=16)  # ~100M parameters, 0.2 GB in bf16
TAIL = 3000  # characters of a failed part's output kept in the JSON


# ---- preparation (here, before the call) -------------------------------------------------------------------------
def prepare(wheels: bool = True, task: bool = True) -> dict:
    """Fill `.gpu_kit/` with what travels; return what is there and whether it fits the carry limit."""
    os.makedirs(KIT_DIR, exist_ok=True)  # ignored by git (.gitignore): it travels only as the call's `carry`
    report = {"wheels": [], "cache": None}
    if wheels:
        wheel_dir = os.path.join(KIT_DIR, "wheels")
        os.makedirs(wheel_dir, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
               "--platform", "manylinux2014_x86_64", "-d", wheel_dir, *WHEELS]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"--prepare: pip download failed:\n{proc.stderr[-2000:]}")
        report["wheels"] = sorted(os.path.basename(w) for w in glob.glob(os.path.join(wheel_dir, "*.whl")))
    if task:
        sys.path.insert(0, ROOT)
        from async_rlhf.tasks.build_builtin import prepare_builtin

        paths = prepare_builtin(seed=0)  # builds it here if it is not built yet (minutes, once)
        task_dir = os.path.dirname(paths["manifest"])
        target = os.path.join(KIT_DIR, "cache", os.path.basename(task_dir))
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(task_dir, target)
        report["cache"] = os.path.relpath(target, ROOT)
    sizes = {"kit": _size(KIT_DIR), "tree": _tree_size()}
    report.update(sizes, total=sizes["kit"] + sizes["tree"], limit=CARRY_LIMIT,
                  fits=sizes["kit"] + sizes["tree"] <= CARRY_LIMIT)
    print(f"prepared {os.path.relpath(KIT_DIR, ROOT)}: wheels {report['wheels'] or 'none'}; built-in task "
          f"{report['cache'] or 'not carried (built on the machine: a minute or two of the loan)'}; {sizes['kit'] / 2**20:.1f} MiB + the tree's {sizes['tree'] / 2**20:.1f} MiB = "
          f"{report['total'] / 2**20:.1f} MiB of the {CARRY_LIMIT / 2**20:.0f} MiB a call carries: "
          f"{'fits' if report['fits'] else 'DOES NOT FIT'}")
    return report


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _tree_size() -> int:
    """Bytes of what git would send: tracked files and untracked files it does not ignore."""
    proc = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                          capture_output=True, timeout=60)
    names = [n for n in proc.stdout.decode().split("\0") if n]
    return sum(os.path.getsize(os.path.join(ROOT, n)) for n in names if os.path.isfile(os.path.join(ROOT, n)))


# ---- running parts -----------------------------------------------------------------------------------------------
class Kit:
    """Runs the parts in order, each bounded in time, and keeps the results file up to date after each one."""

    def __init__(self, args):
        self.args = args
        self.dest = os.path.abspath(args.output_dir)  # gpu_kit.json, gpu_kit.md, logs.tar.gz: 3 files (a device
        # call returns at most 8 from $OUT); the parts' own files (models, runs, logs) go to the work folder
        os.makedirs(self.dest, exist_ok=True)
        self.out = os.path.abspath(args.work_dir or tempfile.mkdtemp(prefix="gpu_kit-"))
        os.makedirs(self.out, exist_ok=True)
        self.t0 = time.monotonic()
        self.results: dict = {"settings": {"device": args.device, "dry_run": args.dry_run, "budget": args.budget,
                                           "parts": list(args.parts)}, "parts": {}}
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cache = glob.glob(os.path.join(KIT_DIR, "cache", "builtin-v*"))
        if cache and not env.get("ASYNC_RLHF_CACHE"):  # the built-in task carried by --prepare
            env["ASYNC_RLHF_CACHE"] = os.path.dirname(cache[0])
        self.env = env

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.t0)

    def box(self, name: str) -> float:
        """A part's time box: its share of the budget, never past what is left (the last part: all that is left)."""
        share = PARTS[name] * self.args.budget / sum(PARTS[p] for p in self.args.parts)
        return max(5.0, self.left() if name == self.args.parts[-1] else min(share, self.left()))

    def run(self, name: str, fn) -> None:
        t0 = time.monotonic()
        entry: dict = {"status": "ok"}
        try:
            entry.update(fn(self.box(name)) or {})
        except subprocess.TimeoutExpired as exc:
            entry.update(status="timeout", error=f"over its {exc.timeout:.0f} s time box")
        except Exception as exc:  # recorded; the kit goes on with the next part
            entry.update(status="failed", error=f"{type(exc).__name__}: {exc}"[-TAIL:])
        entry["seconds"] = round(time.monotonic() - t0, 1)
        self.results["parts"][name] = entry
        print(f"[gpu_kit] {name}: {entry['status']} in {entry['seconds']} s", flush=True)
        self.save()

    def sh(self, name: str, cmd: list[str], timeout: float, check: bool = True) -> str:
        """Run `cmd` from the repository root, its output into `<output_dir>/<name>.log`; return that output."""
        log_path = os.path.join(self.out, f"{name}.log")
        with open(log_path, "a") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            # in the kit's own process group (no new session): whatever ends the kit from outside (the device
            # call's time limit) ends its runs too, which would otherwise hold the GPU until the machine goes back
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_tree(proc.pid)
                proc.wait()
                raise
        text = open(log_path, errors="replace").read()
        if check and proc.returncode != 0:
            raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd[:4])} ...\n{text[-TAIL:]}")
        return text

    def save(self) -> None:
        self.results["wall_seconds"] = round(time.monotonic() - self.t0, 1)
        self.results["work_dir"] = self.out
        with open(os.path.join(self.dest, "gpu_kit.json"), "w") as f:
            json.dump(self.results, f, indent=1)
        with open(os.path.join(self.dest, "gpu_kit.md"), "w") as f:
            f.write(markdown(self.results))
        with tarfile.open(os.path.join(self.dest, "logs.tar.gz"), "w:gz") as tar:  # every part's log, and each
            for path in sorted(glob.glob(os.path.join(self.out, "**", "*.log"), recursive=True)):  # run's own
                tar.add(path, arcname=os.path.relpath(path, self.out))


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (generators and learners of a timed-out run)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def _on_signal(signum, frame) -> None:
    """SIGTERM / SIGINT: end every run the kit started, then leave (the results so far are already saved)."""
    _kill_tree_children()
    raise SystemExit(128 + signum)


def _kill_tree_children() -> None:
    import psutil

    for child in psutil.Process().children():
        _kill_tree(child.pid)


# ---- the parts ---------------------------------------------------------------------------------------------------
def part_env(kit: Kit, timeout: float) -> dict:
    import importlib.metadata as md

    import torch

    out = {"python": platform.python_version(), "cores": os.cpu_count(),
           "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE"),
           "load": " ".join(open("/proc/loadavg").read().split()[:3]) if os.path.exists("/proc/loadavg") else "?"}
    for name in ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "vllm"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    out["cuda"] = torch.version.cuda
    out["device_name"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    if kit.args.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA GPU")
    kit.results["device_name"] = out["device_name"]
    return out


def part_pytest_gpu(kit: Kit, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests/gpu"]
    text = kit.sh("pytest_gpu", cmd, timeout, check=False)
    last = [line for line in text.splitlines() if line.strip()][-1:] or [""]
    passed = "failed" not in last[0] and "error" not in last[0]
    if not passed:
        raise RuntimeError(f"pytest -m gpu: {last[0]}\n{text[-TAIL:]}")
    return {"summary": last[0].strip("= ")}


def part_continuous_batching(kit: Kit, timeout: float) -> dict:
    path = os.path.join(kit.out, "cb_generation.json")
    sizes = dict(hidden_size=128, layers=2, requests=16, batch=8, max_new_tokens=32) if kit.args.dry_run else CB_SIZES
    cmd = [sys.executable, "benchmarks/cb_generation.py", "--device", kit.args.device, "--json", path,
           "--timeout", str(int(timeout))] + [f"--{k}={v}" for k, v in sizes.items()]
    cmd += ["--bf16"] if kit.args.device == "cuda" else []
    kit.sh("continuous_batching", cmd, timeout)
    with open(path) as f:
        return json.load(f)


def part_cb_backend(kit: Kit, timeout: float) -> dict:
    path = os.path.join(kit.out, "cb_backend.json")
    sizes = (dict(hidden_size=64, layers=2, prompts=4, n=2, max_new_tokens=16, batch=4, repeats=1)
             if kit.args.dry_run else CB_BACKEND_SIZES)
    cmd = [sys.executable, "benchmarks/continuous_batching.py", "--device", kit.args.device, "--json", path]
    cmd += [f"--{k}={v}" for k, v in sizes.items()] + (["--dtype", "bfloat16"] if kit.args.device == "cuda" else [])
    kit.sh("cb_backend", cmd, timeout)
    with open(path) as f:
        return json.load(f)


def part_learner_step(kit: Kit, timeout: float) -> dict:
    dry = kit.args.dry_run
    sizes = [(0, 0, 4), (128, 2, 4)] if dry else LEARNER_SIZES
    deadline = time.monotonic() + timeout
    rows = []
    for hidden, layers, prompts in sizes:
        path = os.path.join(kit.out, f"learner_step_{hidden}x{layers}_{prompts}.json")
        cmd = [sys.executable, "benchmarks/learner_step.py", "--device", kit.args.device, "--json", path,
               "--repeats", "1" if dry else "5", "--prompts", str(prompts)]
        cmd += ["--task", "toy"] if dry else ["--bf16"] if kit.args.device == "cuda" else []
        if hidden:
            cmd += ["--hidden_size", str(hidden), "--layers", str(layers)]
        try:
            kit.sh("learner_step", cmd, max(5.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rows.append({"hidden_size": hidden, "layers": layers, "prompts": prompts, "status": "timeout"})
            break  # bigger sizes would not fit the time box either
        with open(path) as f:
            r = json.load(f)
        totals = {m: v["total"] for m, v in r["results"].items()}
        rows.append({"hidden_size": r["hidden_size"], "layers": r["layers"], "parameters": r["parameters"],
                     "prompts": prompts, "padded_tokens": r["tokens"]["padded"],
                     "ms": {m: round(1000 * t, 2) for m, t in totals.items()},
                     "default_vs_padded": round(totals["padded"] / totals["shared prefix, both"], 3)})
    paying = [r for r in rows if r.get("default_vs_padded", 0) > 1.0]
    return {"sizes": rows, "pays_from_tokens": min((r["padded_tokens"] for r in paying), default=None)}


def part_colocated(kit: Kit, timeout: float) -> dict:
    dry = kit.args.dry_run
    sys.path.insert(0, ROOT)
    from async_rlhf.data.tiny_model import save_tiny_model

    model = os.path.join(kit.out, "colocated_policy")
    if not os.path.isdir(model):
        save_tiny_model(model, **({} if dry else COLOCATED_MODEL))
    deadline = time.monotonic() + timeout
    steps = 2 if dry else 30
    device = ["--generator_devices", "cpu"] if kit.args.device == "cpu" else [
        "--generator_devices", "cuda:0", "--colocate", "true", "--bf16", "true"]
    runs = {}
    for staleness in (0, 1):
        out = os.path.join(kit.out, f"colocated_s{staleness}")
        cmd = [sys.executable, "recipes/online_dpo.py", "--task", "toy", "--model_name_or_path", model,
               "--output_dir", out, "--max_steps", str(steps), "--max_staleness", str(staleness),
               "--generator_backend", "transformers", "--disable_tqdm", "true", *device]
        kit.sh("colocated", cmd, max(5.0, deadline - time.monotonic()))
        runs[staleness] = json.load(open(os.path.join(out, "run_summary.json")))
    s_sync, s_async = runs[0], runs[1]
    gb = s_async["sync_bytes"] / 1e9
    result = {
        "model_parameters": _parameters(model), "steps": steps,
        "weight_transport": "ipc" if kit.args.device == "cuda" else "shm",
        "sync_seconds_per_gb": (s_async["sync_seconds"] + s_async["sync_load_seconds"]) / gb if gb else None,
        "sync_publish_seconds_per_gb": s_async["sync_seconds"] / gb if gb else None,
        "generator_tokens_per_s": (s_async["generated_tokens"] / s_async["generate_seconds"]
                                   if s_async["generate_seconds"] else None),
        "sync_loop_seconds": s_sync["loop_seconds"], "async_loop_seconds": s_async["loop_seconds"],
        "async_speedup": s_sync["loop_seconds"] / s_async["loop_seconds"] if s_async["loop_seconds"] else None,
        "measured_step_seconds": s_async["loop_seconds"] / s_async["steps"],
        # the run's own line: the simulator fed with this run's measured stage times (`plan/feedback.py`)
        "feedback_step_seconds": (s_async.get("plan") or {}).get("predicted_step_seconds"),
    }
    result["planner"] = planner_prediction(model, s_async, "cpu" if kit.args.device == "cpu" else "H100")
    return result


def _parameters(model_dir: str) -> int:
    from safetensors import safe_open

    total = 0
    for path in glob.glob(os.path.join(model_dir, "*.safetensors")):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                shape = f.get_slice(k).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n
    return total


def planner_prediction(model_dir: str, summary: dict, gpu_type: str) -> dict:
    """The planner's step time for this run's workload with one learner and one generator (`plan/search.py`'s
    `evaluate_split`; the planner models them on two devices, the colocated run shares one)."""
    from async_rlhf.plan import search as sr
    from async_rlhf.plan.cost_model import Workload
    from async_rlhf.plan.hardware import get_profile
    from async_rlhf.plan.model_shapes import resolve_model

    counts = {int(k): v for k, v in summary["completion_length_counts"].items()}
    total = sum(counts.values())
    mean = sum(k * v for k, v in counts.items()) / total if total else 1.0
    var = sum(v * (k - mean) ** 2 for k, v in counts.items()) / total if total else 0.0
    steps, samples = summary["steps"], summary["samples"]
    w = Workload(prompts_per_step=summary["prompts"] // steps, n=samples // summary["prompts"], prompt_tokens=8,
                 response_mean=min(max(1.0, mean), max(counts, default=1)),
                 response_cv=(var ** 0.5) / mean if mean else 0.0, response_max=max(counts, default=1),
                 reward_params=1.0)  # the toy task's reward is a function, not a model
    plans = sr.evaluate_split(resolve_model(model_dir, None), get_profile(gpu_type), w, 1, 1, 1, 1,
                              staleness=[summary["max_staleness"]])
    if not plans:
        return {"predicted_step_seconds": None, "note": "no plan fits"}
    measured = summary["loop_seconds"] / steps
    return {"gpu_type": gpu_type, "predicted_step_seconds": plans[0].step_seconds,
            "measured_step_seconds": measured, "measured_over_predicted": measured / plans[0].step_seconds}


def part_vs_trl(kit: Kit, timeout: float) -> dict:
    dry = kit.args.dry_run
    out = os.path.join(kit.out, "vs_trl")
    cmd = [sys.executable, "benchmarks/vs_trl.py", "--device", kit.args.device, "--output_dir", out,
           "--run_timeout", str(int(timeout))]
    cmd += ["--seeds", "0", "--steps", "2", "--eval_every", "2", "--eval_prompts", "8"] if dry else [
        "--seeds", "0", "1", "2", "--steps", "60", "--eval_every", "20"]
    error = None
    try:
        kit.sh("vs_trl", cmd, timeout)
    except (subprocess.TimeoutExpired, RuntimeError) as exc:  # the runs that finished still count
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    runs = []
    for path in sorted(glob.glob(os.path.join(out, "*-seed*.json"))):
        r = json.load(open(path))
        last = r["curve"][-1] if r.get("curve") else {}
        runs.append({"trainer": r["trainer"], "seed": r["seed"], "clock_seconds": r["train_seconds"],
                     "final_win_rate": last.get("gold_win_rate")})
    if not runs:
        raise RuntimeError(error or "no run finished")
    result: dict = {"runs": runs}
    by = {t: [r for r in runs if r["trainer"] == t] for t in ("trl", "ours")}
    seeds = sorted({r["seed"] for r in by["trl"]} & {r["seed"] for r in by["ours"]})
    if seeds:
        clock = {t: sum(r["clock_seconds"] for r in by[t] if r["seed"] in seeds) / len(seeds) for t in by}
        result.update(seeds=seeds, trl_clock=clock["trl"], ours_clock=clock["ours"],
                      clock_ratio=clock["trl"] / clock["ours"] if clock["ours"] else None)
    summary_path = os.path.join(out, "results.json")
    if os.path.isfile(summary_path):
        result["thresholds"] = json.load(open(summary_path)).get("thresholds")
    if error:
        result["incomplete"] = error
    return result


def _longtail(kit: Kit, name: str, what: list[str], timeout: float) -> dict:
    """`benchmarks/mechanisms.py` (`what`: its command and flags) in `<work_dir>/longtail`, which both long-tail
    parts share (the policy, the default run); its own budget ends it before the box does. Whatever it finished
    counts: its JSON is rewritten after every run."""
    out = os.path.join(kit.out, "longtail")
    cmd = [sys.executable, "benchmarks/mechanisms.py", *what, "--device", kit.args.device, "--output_dir", out,
           "--budget", str(int(max(10.0, timeout - 20.0)))] + (["--tiny"] if kit.args.dry_run else [])
    error = None
    try:
        kit.sh(name, cmd, timeout)
    except (subprocess.TimeoutExpired, RuntimeError) as exc:
        error = f"{type(exc).__name__}: {str(exc)[-TAIL:]}"
    path = os.path.join(out, f"{what[0]}.json")
    if not os.path.isfile(path):
        raise RuntimeError(error or f"{path} was not written")
    with open(path) as f:
        result = json.load(f)
    if error:
        result["incomplete"] = error
    return result


def part_mechanisms(kit: Kit, timeout: float) -> dict:
    return _longtail(kit, "mechanisms", ["mechanisms"], timeout)


def part_vs_trl_cb(kit: Kit, timeout: float) -> dict:
    return _longtail(kit, "vs_trl_cb", ["vs_trl", "--seeds", *(["0"] if kit.args.dry_run else ["0", "1", "2"])],
                     timeout)


# ---- the report --------------------------------------------------------------------------------------------------
def markdown(results: dict) -> str:
    """The table docs/performance.md's GPU section takes: one row per figure, the device named."""
    s, parts = results["settings"], results["parts"]
    env = parts.get("env", {})
    head = (f"Device: {results.get('device_name', '?')} ({s['device']}{', dry run' if s['dry_run'] else ''}); "
            f"torch {env.get('torch')}, CUDA {env.get('cuda')}, transformers {env.get('transformers')}, "
            f"TRL {env.get('trl')}; {env.get('cores')} cores, load {env.get('load')}; kit wall "
            f"{results.get('wall_seconds')} s of a {s['budget']:.0f} s budget.")
    rows = ["| part | figure | value |", "| --- | --- | --- |"]

    def row(part, figure, value):
        rows.append(f"| {part} | {figure} | {value} |")

    for name in [n for n in PARTS if n in s.get("parts", PARTS)]:  # the parts this call was to run
        p = parts.get(name)
        if p is None:
            row(name, "status", "not run")
            continue
        if p["status"] != "ok":
            row(name, "status", f"{p['status']} after {p['seconds']} s: {_cell(p.get('error', ''))}")
            continue
        if name == "env":
            row(name, "device", _cell(env.get("device_name")))
        elif name == "pytest_gpu":
            row(name, "result", _cell(p["summary"]))
        elif name == "continuous_batching":
            row(name, "workload", f"{p['parameters'] / 1e6:.0f}M params{', bf16' if p['bf16'] else ''}, "
                                  f"{p['requests']} requests, lengths mean {p['mean_length']:.0f} / longest "
                                  f"{p['longest']}, static batches of {p['batch']}")
            for way in ("static", "continuous"):
                r = p[way]
                row(name, f"{way}: s, useful tokens/s, s to half / 90% of samples ready",
                    f"{_num(r['seconds'])}, {_num(r['useful_tokens_per_s'], 0)}, {_num(r['half_ready_s'])} / "
                    f"{_num(r['p90_ready_s'])}")
            row(name, "continuous over static (wall)", f"{_num(p['continuous_over_static'])}x")
        elif name == "cb_backend":
            u = p["setup"]
            row(name, "workload", f"hidden {u['hidden_size']} x {u['layers']} layers, {u['dtype']}, {u['prompts']} "
                                  f"prompts x {u['n']}, budgets mean {_num(u['budgets_mean'])} / cap "
                                  f"{u['max_new_tokens']}, static chunks of {u['batch']}")
            for way in ("static", "continuous"):
                r = p[way]
                row(name, f"{way}: s, samples/s, s to the first finished sample",
                    f"{_num(r['seconds'])}, {_num(r['samples_per_s'])}, {_num(r['first_sample_s'])}")
            row(name, "continuous over static: samples/s, first sample", f"{_num(p['ratio']['samples_per_s'])}x, "
                                                                         f"{_num(p['ratio']['first_sample_s'])}x")
        elif name == "learner_step":
            for r in p["sizes"]:
                if "ms" not in r:
                    row(name, f"{r['hidden_size']}x{r['layers']}, {r['prompts']} prompts", r["status"])
                    continue
                ms = r["ms"]
                row(name, f"{r['parameters'] / 1e6:.1f}M params (hidden {r['hidden_size']}, {r['layers']} layers), "
                          f"{r['prompts']} prompts ({r['padded_tokens']} padded tokens): ms/step padded / buckets / "
                          "shared-prefix ref / both",
                    f"{ms['padded']} / {ms['buckets']} / {ms['shared prefix, ref']} / {ms['shared prefix, both']}"
                    f" ({r['default_vs_padded']}x)")
            pays = p["pays_from_tokens"]
            row(name, "shared prefixes (both) pay from", f"{pays} padded tokens (GPU learners run padded unless split_forwards is true)"
                if pays else "no batch timed")
        elif name == "colocated":
            row(name, "policy", f"{p['model_parameters'] / 1e6:.1f}M parameters, {p['steps']} steps, weights over "
                                f"{p['weight_transport']}")
            row(name, "weight sync, s per GB (publish + generator load)", _num(p["sync_seconds_per_gb"]))
            row(name, "transformers generator, tokens/s", _num(p["generator_tokens_per_s"], 0))
            row(name, "loop s, synchronous (S=0) / asynchronous (S=1)",
                f"{_num(p['sync_loop_seconds'])} / {_num(p['async_loop_seconds'])} ({_num(p['async_speedup'])}x)")
            pl = p["planner"]
            row(name, f"step s (S=1): planner ({pl.get('gpu_type')} profile, 1 learner + 1 generator) / simulated "
                      "from the run's stage times / measured",
                f"{_num(pl.get('predicted_step_seconds'), 3)} / {_num(p['feedback_step_seconds'], 3)} / "
                f"{_num(p['measured_step_seconds'], 3)}")
        elif name == "mechanisms":
            _mechanism_rows(p, row)
        elif name == "vs_trl_cb":
            _vs_trl_cb_rows(p, row)
        elif name == "vs_trl":
            if "clock_ratio" in p:
                row(name, f"clock s, TRL / ours (mean of seeds {p['seeds']})",
                    f"{_num(p['trl_clock'])} / {_num(p['ours_clock'])} ({_num(p['clock_ratio'])}x)")
            for r in p["runs"]:
                row(name, f"{r['trainer']} seed {r['seed']}: clock s, final gold win-rate",
                    f"{_num(r['clock_seconds'])}, {_num(r['final_win_rate'], 3)}")
            for t in p.get("thresholds") or []:
                row(name, f"s to win-rate {t['win_rate']:.3f} (mean curve)",
                    ", ".join(f"{k} {_num(v)}" for k, v in t["seconds"].items()))
            if p.get("incomplete"):
                row(name, "incomplete", _cell(p["incomplete"]))
    return head + "\n\n" + "\n".join(rows) + "\n"


def _mechanism_rows(p: dict, row) -> None:
    name = "mechanisms"
    pol, w = p.get("policy") or {}, p.get("workload") or {}
    if pol:
        row(name, "workload", f"long-tail task, GRPO, {w.get('prompts')} prompts x 2 a step, {w.get('steps')} steps, "
                              f"up to {w.get('max_new_tokens')} new tokens; policy {pol['parameters'] / 1e6:.1f}M "
                              f"(hidden {w.get('hidden_size')} x {w.get('layers')} layers) trained here "
                              f"{w.get('sft_steps')} SFT steps in {_num(pol.get('sft_seconds'), 1)} s, gold reward "
                              f"{_num(pol['start'].get('gold_reward'), 3)} before RL; ours on the continuous-batching "
                              "backend")
    d = p.get("default") or {}
    if d.get("status") == "ok":
        lengths = d.get("lengths") or {}
        row(name, "default: clock s, samples/s (loop), lengths mean / p90 / longest, final gold reward / win-rate",
            f"{_num(d.get('clock_seconds'))}, {_num(d.get('samples_per_s'))}, {_num(lengths.get('mean'), 1)} / "
            f"{lengths.get('p90')} / {lengths.get('max')}, {_num(d['final'].get('gold_reward'), 3)} / "
            f"{_num(d['final'].get('gold_win_rate'), 3)}")
    elif d:
        row(name, "default", f"{d.get('status')}: {_cell(d.get('error', ''))}")
    for m in p.get("mechanisms") or []:
        figure = f"{m['mechanism']} (`{m['option']}`)"
        if m["status"] == "ok":
            versus = "the default over static batches" if m["side"] == "off" else "against the default"
            row(name, f"{figure}, {versus}: clock, samples/s, final gold reward (difference)",
                f"{_num(m.get('clock_ratio'))}x, {_num(m.get('samples_per_s_ratio'))}x, "
                f"{_num(m.get('gold_on'), 3)} vs {_num(m.get('gold_off'), 3)} ({_num(m.get('gold_difference'), 3)})")
        elif m["status"] == "skipped":
            row(name, figure, f"skipped: {_cell(m.get('reason'))}")
        else:
            row(name, figure, f"{m['status']}: {_cell((m.get('run') or {}).get('error', ''))}")
    if p.get("incomplete"):
        row(name, "incomplete", _cell(p["incomplete"]))


def _vs_trl_cb_rows(p: dict, row) -> None:
    name = "vs_trl_cb"
    for r in p.get("runs") or []:
        label = "TRL GRPOTrainer (continuous batching)" if r["trainer"] == "trl" else "ours"
        if r.get("status") == "ok":
            reused = " (the default run of mechanisms)" if r.get("reused") else ""
            row(name, f"{label} seed {r['seed']}: clock s, final gold reward",
                f"{_num(r.get('clock_seconds'))}, {_num(r['final'].get('gold_reward'), 3)}{reused}")
        else:
            row(name, f"{label} seed {r['seed']}", f"{r.get('status')}: {_cell(r.get('error', ''))}")
    if p.get("clock"):
        row(name, f"clock s, TRL / ours (mean of seeds {p['seeds']})",
            f"{_num(p['clock']['trl'])} / {_num(p['clock']['ours'])} ({_num(p.get('clock_ratio'))}x)")
        to, since = p["seconds_to_threshold"], p["seconds_to_threshold_from_process_start"]
        row(name, f"s to gold reward {_num(p['threshold'], 3)} (from {_num(p['start'], 3)}; mean curve), TRL / ours: "
                  "on the clock; from process start",
            f"{_num(to['trl'])} / {_num(to['ours'])} ({_num(p.get('time_to_threshold_ratio'))}x); "
            f"{_num(since['trl'])} / {_num(since['ours'])}")
        for trainer, marks in p.get("startup", {}).items():
            row(name, f"start-up, {trainer} (s since process start, mean of seeds)",
                ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in marks.items()) or "-")
    if p.get("incomplete"):
        row(name, "incomplete", _cell(p["incomplete"]))


def _num(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _cell(text) -> str:
    return " ".join(str(text).split())[:200].replace("|", "/")


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", help="where gpu_kit.json, gpu_kit.md and logs.tar.gz go (on the device: $OUT)")
    p.add_argument("--work_dir", help="the parts' own files: models, runs, logs (default: a new temporary folder)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dry_run", action="store_true", help="every part at tiny sizes (the CPU check of the kit)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all parts together (default 480 on a GPU: the loan's 15 minutes less the "
                        "machine's start and a rerun's margin; 1800 for a dry run on a shared CPU)")
    p.add_argument("--parts", nargs="+", choices=list(PARTS),
                   help=f"parts to run, in this order (default: {' '.join(GPU_PARTS)}; with --dry_run every part)")
    p.add_argument("--prepare", action="store_true", help="build .gpu_kit/ (wheels, the built-in task) and stop")
    p.add_argument("--no_wheels", action="store_true", help="with --prepare: no wheels (the machine has them)")
    p.add_argument("--no_task", action="store_true", help="with --prepare: no built-in task (built on the machine)")
    args = p.parse_args(argv)
    if args.prepare:
        prepare(wheels=not args.no_wheels, task=not args.no_task)
        return None
    if not args.output_dir:
        p.error("--output_dir is required (unless --prepare)")
    if args.parts is None:
        args.parts = list(PARTS) if args.dry_run else list(GPU_PARTS)
    if args.budget is None:
        args.budget = 1800.0 if args.dry_run else 480.0
    if args.budget <= 0:
        p.error(f"--budget must be > 0, got {args.budget}")
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    kit = Kit(args)
    fns = {"env": part_env, "pytest_gpu": part_pytest_gpu, "continuous_batching": part_continuous_batching,
           "cb_backend": part_cb_backend, "learner_step": part_learner_step,
           "colocated": part_colocated, "vs_trl": part_vs_trl, "mechanisms": part_mechanisms,
           "vs_trl_cb": part_vs_trl_cb}
    for name in args.parts:
        kit.run(name, lambda timeout, fn=fns[name]: fn(kit, timeout))
    print(markdown(kit.results))
    return kit.results


if __name__ == "__main__":
    main()
