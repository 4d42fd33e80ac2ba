"""A generator process and its parent, for the tests of how a generator ends (`test_generator_process.py`).

    python tests/integration/generator_parent.py MODEL_DIR OUT_DIR

As a script it is a stand-in for learner rank 0 that is about to be SIGKILLed: it spawns `generator_main` (the
transformers backend on MODEL_DIR), asks it for a rollout of more than 1 MiB, waits until that rollout is on its
way into the outbox pipe, never reads it, writes the generator's pid to OUT_DIR/generator.pid and sleeps.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from async_rlhf.generation.engine.worker import GeneratorSpec, generator_main  # noqa: E402
from async_rlhf.types import GenerationRequest, SamplingSettings  # noqa: E402

BIG_PROMPT_IDS = 250_000  # echoed back in the rollout: about 1.2 MiB pickled, far over a pipe's 64 KiB


def start_generator(model_dir: str, out_dir: str):
    """(process, inbox, outbox) of a started generator whose engine is up (its GeneratorReady was read)."""
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    spec = GeneratorSpec(generator_id=0, backend="transformers", model_path=model_dir, device="cpu", seed=0,
                         threads=1, log_path=os.path.join(out_dir, "generator-0.log"))
    process = ctx.Process(target=generator_main, args=(spec, inbox, outbox), daemon=True)
    process.start()
    ready = outbox.get(timeout=180)
    assert ready.kind == "ready", ready
    return process, inbox, outbox


def request(batch_id: int, big: bool) -> GenerationRequest:
    """One prompt, one 2-token completion; with `big`, so many prompt ids (echoed back unread by the backend) that
    the rollout is over a megabyte while sampling it costs milliseconds."""
    prompt_ids = list(range(100_000, 100_000 + BIG_PROMPT_IDS)) if big else [0]
    return GenerationRequest(batch_id, prompt_ids, [[5, 6, 7]], SamplingSettings(max_new_tokens=2, n=1, seed=0))


def wait_until_rollout_is_sent(outbox, timeout: float = 120) -> None:
    """Return once the generator has begun writing its answer into the outbox pipe (without reading any of it)."""
    assert outbox._reader.poll(timeout), "the generator wrote nothing to its outbox"  # a peek: consumes nothing


def main() -> None:
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    process, inbox, outbox = start_generator(model_dir, out_dir)
    inbox.put(request(0, big=True))
    inbox.close()
    inbox.join_thread()  # the request is entirely in the generator's hands
    wait_until_rollout_is_sent(outbox)
    with open(os.path.join(out_dir, "generator.pid.tmp"), "w") as f:
        f.write(str(process.pid))
    os.replace(os.path.join(out_dir, "generator.pid.tmp"), os.path.join(out_dir, "generator.pid"))
    time.sleep(600)  # until the test SIGKILLs this process


if __name__ == "__main__":
    main()
