"""Generators forked from the warm server (`generation/pool/prewarm.py`): started after `prewarm_generators()`, a
generator is a child of the fork server with `PRELOAD` already imported, runs with the learner's environment as it is
when the generator starts (not the server's), does not import the learner's main script again, samples as a spawned
one does, and dies with the learner (the server exits with it; the kernel's death signal reaches the generator)."""

import json
import subprocess
import sys
import textwrap
import time

import psutil

PROBE = textwrap.dedent('''
    import json, os, queue, sys, time
    print("main script imported as", __name__, flush=True)
    if __name__ == "__main__":
        from async_rlhf.generation.pool.prewarm import prewarm_generators

        assert prewarm_generators()
        os.environ["PROBE_SET_AFTER_PREWARM"] = "yes"  # the server never saw it; the generator must
        os.environ["WANDB_MODE"] = "offline"  # never passed on to a generator

        from async_rlhf.generation.engine.worker import GeneratorSpec
        from async_rlhf.generation.pool.local import GeneratorPool
        from async_rlhf.types import GenerationRequest, SamplingSettings

        model_dir, log_dir, mode = sys.argv[1], sys.argv[2], sys.argv[3]
        spec = GeneratorSpec(generator_id=0, backend="transformers", model_path=model_dir, device="cpu", seed=0,
                             threads=1, log_path=os.path.join(log_dir, "generator-0.log"))
        got = queue.Queue()
        pool = GeneratorPool([spec], got.put, start_timeout=120, weight_sync_timeout=60, max_restarts=0)
        pool.start()
        settings = SamplingSettings(max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, n=2)
        pool.send_request(0, GenerationRequest(batch_id=0, prompt_ids=[0], prompt_token_ids=[[5, 6, 7]],
                                               settings=settings))
        deadline = time.monotonic() + 120
        while got.empty():
            pool.check()
            assert time.monotonic() < deadline, "no rollouts"
            time.sleep(0.05)
        batch = got.get()
        import psutil

        generator = pool.processes[0].pid
        print("RESULT " + json.dumps({"completions": [len(c.token_ids) for c in batch.completions[0]],
                                      "generator": generator, "parent": psutil.Process(generator).ppid(),
                                      "learner": os.getpid()}), flush=True)
        if mode == "die":  # the learner dies without closing anything
            os._exit(0)
        pool.close()
''')


def _run(tmp_path, model_dir: str, mode: str) -> tuple[dict, list[str]]:
    path = tmp_path / "learner.py"
    path.write_text(PROBE)
    out = subprocess.run([sys.executable, str(path), model_dir, str(tmp_path), mode], capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    return json.loads(next(line for line in lines if line.startswith("RESULT "))[len("RESULT "):]), lines


def test_a_prewarmed_generator_is_forked_from_the_server_with_the_learners_environment(tmp_path, tiny_model_dir):
    result, lines = _run(tmp_path, tiny_model_dir, "close")
    assert result["completions"] and all(n >= 1 for n in result["completions"])
    assert result["parent"] != result["learner"]  # the fork server's child
    assert lines.count("main script imported as __main__") == 1, lines  # not again as __mp_main__
    log = (tmp_path / "generator-0.log").read_text()
    assert "Running in WANDB offline mode" not in log


def test_a_prewarmed_generator_dies_with_its_learner(tmp_path, tiny_model_dir):
    result, _ = _run(tmp_path, tiny_model_dir, "die")
    deadline = time.monotonic() + 30
    while psutil.pid_exists(result["generator"]):
        try:
            if psutil.Process(result["generator"]).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        assert time.monotonic() < deadline, "the generator outlived its learner by 30 s"
        time.sleep(0.2)
