"""A generator process forked from the warm server (`generation/pool/prewarm.py`) gets the learner's environment
as it is when the process starts, less `NOT_INHERITED`, and the learner's main script is not imported again; a
stopped server (`stop_prewarm`) leaves generators spawned, and a new one can start."""

import ast
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import os, sys
    print("main script imported as", __name__, flush=True)
    if __name__ == "__main__":
        from async_rlhf.generation.pool.prewarm import prewarm_generators, warm

        assert not warm() and prewarm_generators() and warm()
        os.environ["PROBE_SET_AFTER_PREWARM"] = "yes"
        os.environ["WANDB_MODE"] = "offline"
        from async_rlhf.generation.pool.processes import ProcessLauncher

        launcher = ProcessLauncher()
        inbox, outbox = launcher.queues()
        p = launcher.process(type("Spec", (), {"generator_id": 0})(), None, None)
        p._target = print  # a target that shows what the generator's entry point would get
        p._args = ({"spec": 1}, None, None)
        p.start()
        p.join(120)
        assert p.exitcode == 0, p.exitcode

        from async_rlhf.generation.pool.prewarm import stop_prewarm

        stop_prewarm()  # generators are spawned again; a new server can start
        assert not warm() and not ProcessLauncher()._forked
        assert prewarm_generators() and warm() and ProcessLauncher()._forked
        print("server started again", flush=True)
''')


def test_a_forked_generator_gets_the_learners_environment_at_start(tmp_path):
    path = tmp_path / "learner.py"
    path.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines.count("main script imported as __main__") == 1, lines
    printed = next(line for line in lines if line.startswith("{'spec': 1} None None "))
    environ = ast.literal_eval(printed[len("{'spec': 1} None None "):])
    assert environ["PROBE_SET_AFTER_PREWARM"] == "yes"
    assert "WANDB_MODE" not in environ
    assert "server started again" in lines
