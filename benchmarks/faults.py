"""Fault campaign: kill -9 a run at a random moment, resume it, and check it trained exactly what an uninterrupted run
of the same seed trained.

    python benchmarks/faults.py --trials 30
    python benchmarks/faults.py --trials 4 --quick       # the slow test tier's form: one learner rank only
    python benchmarks/faults.py --trials 8 --quick --backend vllm   # streaming vLLM generators (slower starts)

Each trial starts a short online DPO run on the toy task (transformers generator, or with `--backend vllm` a
streaming vLLM generator loading weights in flight, `max_staleness` 1, a checkpoint
every 3 steps, its own `--shm_dir` under the campaign directory) in a session of its own, then SIGKILLs one
randomly chosen victim at one randomly chosen fault point:

  victims       rank0 (the learner rank that owns the generators), rank1 (the other rank of a 2-rank gloo launch),
                generator (a spawned generator process: the pool restarts it and the run should finish by itself),
                launch (every process of the launch at once: the launcher's session and each rank's, since torch
                elastic starts every learner rank in a session of its own)
  fault points  before_first_step (a random delay after the start, before step 0 is recorded), mid_generation (a
                random delay after a random step is recorded), mid_weight_sync (the moment a new policy weight file
                appears in shm_dir), mid_checkpoint (the moment a checkpoint-N directory appears without its
                completion marker)

The moment is found by watching the run's own files (trained_batches.jsonl, checkpoint directories, weight files in
shm_dir). If the run did not finish by itself, it is resumed with `--resume_from_checkpoint last` in the same
output_dir (or started afresh when no checkpoint was complete yet). A trial is exact when
* the final per-step records (trained_batches.jsonl, the last record of each step winning: steps trained after the
  last checkpoint are trained again on resume) hold steps 0..max_steps-1, each with the prompt ids the uninterrupted
  run of the same seed (and number of ranks) trained at that step: no prompt skipped or trained twice;
* every step trained a batch from policy version step-k with 0 <= k <= max_staleness (policy versions themselves are
  not compared: at max_staleness 1 which version a batch comes from depends on timing);
* no process of either session is left once the runs have ended, and shm_dir is empty after the resumed run.
Prints one line per trial, a table (fault point x outcome) and `N/N trials exact`; exits 1 if any trial is not.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "online_dpo.py")
TWO_RANKS = os.path.join(ROOT, "launch", "accelerate", "cpu_2proc_gloo.yaml")
POINTS = ["before_first_step", "mid_generation", "mid_weight_sync", "mid_checkpoint"]
VICTIMS = ["rank0", "rank1", "generator", "launch"]
MAX_STALENESS = 1
RUN_TIMEOUT = 300.0
GENERATOR = ["--generator_backend", "transformers"]  # `--backend vllm`: streaming, weights loaded in flight


# ---- one run ----------------------------------------------------------------------------------------------------
def command(out: str, shm: str, seed: int, steps: int, ranks: int, resume: bool) -> list[str]:
    launch = ([sys.executable, "-m", "accelerate.commands.launch", "--config_file", TWO_RANKS] if ranks == 2
              else [sys.executable])
    return launch + [RECIPE, "--task", "toy", *GENERATOR, "--max_steps", str(steps),
                     "--save_strategy", "steps", "--save_steps", "3", "--max_staleness", str(MAX_STALENESS),
                     "--seed", str(seed), "--output_dir", out, "--shm_dir", shm, "--disable_tqdm", "true",
                     "--rollout_timeout", "60", "--generator_start_timeout", "120"] + (
        ["--resume_from_checkpoint", "last"] if resume else [])


def start(cmd: list[str], log_path: str) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    with open(log_path, "a") as log:  # a file, not a pipe: an undrained pipe blocks the run inside print()
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def session_processes(sids: set[int]) -> list[str]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getsid(p.pid) in sids and p.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{p.pid} " + " ".join(p.info["cmdline"] or [])[:160])
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            pass
    return found


def launch_sessions(proc: subprocess.Popen, sids: set[int]) -> set[int]:
    """Add to `sids` the sessions of the launch and of every process under it. Not the launch's session alone:
    torch elastic (`accelerate launch`) starts each learner rank in a session of its own, and the rank's generators
    live in the rank's session."""
    sids.add(proc.pid)
    try:
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                sids.add(os.getsid(child.pid))
            except (ProcessLookupError, PermissionError):
                pass
    except psutil.NoSuchProcess:
        pass
    return sids


def wait_gone(sids: set[int], seconds: float = 20.0) -> list[str]:
    """Processes of these sessions still alive after `seconds` (orphaned generators notice rank 0's death in a
    second or two; shutdown escalates to SIGKILL after 25 s at most)."""
    deadline = time.monotonic() + seconds
    while (left := session_processes(sids)) and time.monotonic() < deadline:
        time.sleep(0.3)
    return left


def finish(proc: subprocess.Popen, timeout: float, sids: set[int]) -> int:
    """The launch's exit code, noting the sessions of its processes in `sids` meanwhile; on timeout every one of
    them is killed and the result is -1."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        launch_sessions(proc, sids)
        if time.monotonic() > deadline:
            kill_sessions(sids)
            return proc.wait()
        time.sleep(0.2)
    return proc.returncode


def kill_sessions(sids: set[int]) -> None:
    for sid in sids:
        try:
            os.killpg(sid, signal.SIGKILL)  # a session leader's pid is also its process group's id
        except (ProcessLookupError, PermissionError):
            pass


def records(out: str) -> dict[int, dict]:
    """step -> the last record of that step in trained_batches.jsonl (a torn last line, from a kill, is skipped)."""
    final = {}
    path = os.path.join(out, "trained_batches.jsonl")
    if os.path.exists(path):
        for line in open(path):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            final[r["step"]] = r
    return final


def line_count(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


# ---- finding the victim and the moment ---------------------------------------------------------------------------
def victims(proc: subprocess.Popen, victim: str) -> list[psutil.Process]:
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    family = [proc_ for proc_ in [psutil.Process(proc.pid)] + children if proc_.is_running()]
    found = []
    for p in family:
        try:
            cmd = " ".join(p.cmdline())
            if victim == "generator" and "spawn_main" in cmd:
                found.append(p)
            elif victim.startswith("rank") and "online_dpo.py" in cmd and "accelerate" not in cmd:
                if int(p.environ().get("RANK", "0")) == int(victim[-1]):
                    found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def weight_files(shm: str) -> set[str]:
    return set(glob.glob(os.path.join(shm, "async_rlhf-weights-*", "policy-v*")))


def incomplete_checkpoints(out: str) -> list[str]:
    return [d for d in glob.glob(os.path.join(out, "checkpoint-*"))
            if not os.path.exists(os.path.join(d, "async_rlhf_complete.json"))]


def wait_for_moment(point: str, proc: subprocess.Popen, out: str, shm: str, steps: int, rng: random.Random,
                    deadline: float, sids: set[int]) -> str:
    """Block until the fault point is reached; returns what the run's files showed at that moment."""
    batches = os.path.join(out, "trained_batches.jsonl")

    last_look = [0.0]

    def alive():
        if time.monotonic() - last_look[0] > 0.2:  # the processes' sessions, for the leftover check
            launch_sessions(proc, sids)
            last_look[0] = time.monotonic()
        if proc.poll() is not None:
            raise RuntimeError(f"the run exited (code {proc.returncode}) before {point}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {point}")

    if point == "before_first_step":
        until = time.monotonic() + rng.uniform(0.5, 8.0)
        while time.monotonic() < until and not os.path.exists(batches):
            alive()
            time.sleep(0.005)
        return f"{line_count(batches)} steps recorded"
    if point == "mid_generation":
        k = rng.randint(1, steps - 3)  # not the last steps: their batches may all be generated already
        while line_count(batches) < k:
            alive()
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.15))  # a toy step takes tens of milliseconds once the generators run
        return f"{line_count(batches)} steps recorded"
    if point == "mid_weight_sync":
        k = rng.randint(1, steps - 3)
        while line_count(batches) < k:
            alive()
            time.sleep(0.01)
        before = weight_files(shm)
        while not (new := weight_files(shm) - before):
            alive()
            time.sleep(0.001)
        return f"new weight file {os.path.basename(sorted(new)[0])}"
    if point == "mid_checkpoint":
        want = rng.choice([c for c in (3, 6, 9) if c < steps])
        while not any(int(d.rsplit("-", 1)[1]) >= want for d in incomplete_checkpoints(out)):
            alive()
            time.sleep(0.001)
        return "incomplete " + ",".join(sorted(os.path.basename(d) for d in incomplete_checkpoints(out)))
    raise ValueError(point)


# ---- a trial ------------------------------------------------------------------------------------------------------
def reference(root: str, seed: int, steps: int, ranks: int, cache: dict) -> dict[int, list[int]]:
    key = (seed, ranks)
    if key not in cache:
        out, shm = os.path.join(root, f"reference-s{seed}-r{ranks}"), os.path.join(root, f"reference-s{seed}-r{ranks}-shm")
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(shm, exist_ok=True)
        log = out + ".log"
        proc = start(command(out, shm, seed, steps, ranks, resume=False), log)
        rc = finish(proc, RUN_TIMEOUT, set())
        final = records(out)
        if rc != 0 or sorted(final) != list(range(steps)) or line_count(os.path.join(out, "trained_batches.jsonl")) != steps:
            raise RuntimeError(f"the uninterrupted run (seed {seed}, {ranks} rank(s)) failed, code {rc}: see {log}")
        cache[key] = {s: r["prompt_ids"] for s, r in final.items()}
    return cache[key]


def check(out: str, shm: str, steps: int, want: dict[int, list[int]]) -> list[str]:
    problems = []
    final = records(out)
    if sorted(final) != list(range(steps)):
        missing = sorted(set(range(steps)) - set(final))
        problems.append(f"steps missing {missing}" if missing else f"steps recorded {sorted(final)}")
    wrong = [s for s in final if s in want and final[s]["prompt_ids"] != want[s]]
    if wrong:
        problems.append(f"prompts differ from the uninterrupted run at steps {wrong}")
    stale = {s: s - r["policy_version"] for s, r in final.items() if not 0 <= s - r["policy_version"] <= MAX_STALENESS}
    if stale:
        problems.append(f"staleness outside 0..{MAX_STALENESS} (step: behind) {stale}")
    left = os.listdir(shm) if os.path.isdir(shm) else []
    if left:
        problems.append(f"left in shm_dir: {left}")
    return problems


def trial(root: str, i: int, rng: random.Random, steps: int, seeds: list[int], two_rank_share: float,
          cache: dict) -> dict:
    ranks = 2 if rng.random() < two_rank_share else 1
    victim = rng.choice(VICTIMS if ranks == 2 else [v for v in VICTIMS if v != "rank1"])
    point = rng.choice(POINTS if victim != "generator" else [p for p in POINTS if p != "before_first_step"])
    seed = rng.choice(seeds)
    want = reference(root, seed, steps, ranks, cache)
    out, shm = os.path.join(root, f"trial{i}"), os.path.join(root, f"trial{i}-shm")
    log = out + ".log"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)
    os.makedirs(shm)
    row = {"trial": i, "ranks": ranks, "victim": victim, "point": point, "seed": seed, "log": log, "problems": []}
    t0 = time.monotonic()
    proc = start(command(out, shm, seed, steps, ranks, resume=False), log)
    sids: set[int] = set()
    try:
        row["at"] = wait_for_moment(point, proc, out, shm, steps, rng, time.monotonic() + RUN_TIMEOUT, sids)
        targets = [psutil.Process(proc.pid)] if victim == "launch" else victims(proc, victim)
        if not targets:
            raise RuntimeError(f"no {victim} process found")
        if victim == "launch":  # every process of the launch: the launcher, each rank's session, the generators
            kill_sessions(launch_sessions(proc, sids))
        else:
            rng.choice(targets).kill()
        row["killed"] = True
    except RuntimeError as exc:  # the run ended or stalled before the moment: recorded as a miss, not a result
        row["at"], row["killed"] = str(exc), False
    rc = row["killed_run_code"] = finish(proc, RUN_TIMEOUT, sids)
    left = wait_gone(sids)
    if left:
        row["problems"].append(f"left running after the killed run: {left}")
        for line in left:
            try:
                os.kill(int(line.split()[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
    summary = os.path.join(out, "run_summary.json")
    if rc == 0 and os.path.exists(summary) and json.load(open(summary))["steps"] == steps:
        row["outcome"] = "survived"  # a generator restarted, or the kill came too late
    else:
        from async_rlhf.learner.checkpointing import latest_complete_checkpoint

        last = latest_complete_checkpoint(out)
        row["resumed_from"] = os.path.basename(last) if last else "start"
        resumed = start(command(out, shm, seed, steps, ranks, resume=last is not None), log)
        sids2: set[int] = set()
        rc2 = finish(resumed, RUN_TIMEOUT, sids2)
        left = wait_gone(sids2)
        if rc2 != 0:
            row["problems"].append(f"the resumed run exited with code {rc2}")
        if left:
            row["problems"].append(f"left running after the resumed run: {left}")
        row["outcome"] = "resumed"
    row["problems"] += check(out, shm, steps, want)
    row["exact"] = not row["problems"]
    row["seconds"] = round(time.monotonic() - t0, 1)
    row["generator_kill_ended_run"] = victim == "generator" and row["killed"] and row["outcome"] == "resumed"
    if row["exact"] and not row["generator_kill_ended_run"]:  # keep what needs a look
        shutil.rmtree(out, ignore_errors=True)
    return row


def table(rows: list[dict]) -> str:
    outcomes = ["resumed exact", "survived exact", "not exact", "missed"]
    counts = collections.Counter()
    for r in rows:
        o = "missed" if not r["killed"] and r["exact"] else ("not exact" if not r["exact"] else f"{r['outcome']} exact")
        counts[(r["point"], o)] += 1
    lines = [f"{'fault point':<20}" + "".join(f"{o:>16}" for o in outcomes)]
    for p in POINTS:
        lines.append(f"{p:<20}" + "".join(f"{counts[(p, o)]:>16}" for o in outcomes))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--backend", default="transformers", choices=["transformers", "vllm"])
    p.add_argument("--quick", action="store_true", help="one learner rank only (no accelerate launch): faster")
    p.add_argument("--max_steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=0, help="seed of the campaign's random choices")
    p.add_argument("--two_rank_share", type=float, default=0.2,
                   help="fraction of trials run with 2 gloo learner ranks (0 with --quick)")
    p.add_argument("--dir", default=None, help="where runs are kept (default: a new temporary directory); the "
                                               "output of exact trials is deleted, that of the others kept")
    a = p.parse_args(argv)
    if a.backend == "vllm":
        GENERATOR[:] = ["--generator_backend", "vllm", "--weight_load", "in_flight"]
    rng = random.Random(a.seed)
    root = a.dir or tempfile.mkdtemp(prefix="async_rlhf-faults-")
    os.makedirs(root, exist_ok=True)
    seeds = [1, 2, 3]
    cache: dict = {}
    rows = []
    print(f"campaign directory {root}", flush=True)
    for i in range(a.trials):
        row = trial(root, i, rng, a.max_steps, seeds, 0.0 if a.quick else a.two_rank_share, cache)
        rows.append(row)
        print(f"trial {i:>3}  ranks {row['ranks']}  kill {row['victim']:<9} {row['point']:<18} seed {row['seed']}  "
              f"at [{row['at']}]  {row['outcome']}{' from ' + row['resumed_from'] if 'resumed_from' in row else ''}"
              f"  killed run code {row['killed_run_code']}  {row['seconds']:.0f}s  {'exact' if row['exact'] else 'NOT EXACT: ' + '; '.join(row['problems'])}",
              flush=True)
        if not row["exact"] or row["generator_kill_ended_run"]:
            print(f"  log {row['log']}", flush=True)
    print()
    print(table(rows))
    exact = sum(r["exact"] for r in rows)
    generator_kills = [r for r in rows if r["victim"] == "generator" and r["killed"]]
    ended = sum(r["generator_kill_ended_run"] for r in generator_kills)
    if generator_kills:  # a killed generator is restarted: the run should finish without a resume
        print(f"\ngenerator kills that ended the run (a restart should have carried it): {ended}/{len(generator_kills)}")
    print(f"\n{exact}/{len(rows)} trials exact")
    return 0 if exact == len(rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
