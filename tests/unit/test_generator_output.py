"""A generator process keeps the console to real problems and everything else in its log file
(`generation/engine/process_log.py`): vLLM's per-sync INFO lines and its known-harmless warnings, Python library warnings
and raw C++ output go to the file only; a real warning reaches the console too."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent("""
    import os, sys, warnings
    from async_rlhf.generation.engine.process_log import route_output

    route_output(sys.argv[1], "generator-0")
    assert os.environ["VLLM_CONFIGURE_LOGGING"] == "0"
    from vllm.logger import init_logger  # vLLM's own loggers, as its modules create them

    init_logger("vllm.model_executor.model_loader.reload.layerwise").warning(
        "RotaryEmbedding: Failed to load weights")
    init_logger("vllm.model_executor.model_loader.reload.inplace").info(
        "Reloading and processing weights took 0.02 seconds")
    init_logger("vllm.v1.worker.cpu_worker").warning("libtcmalloc is not found in LD_PRELOAD. For best performance")
    init_logger("vllm.v1.core.kv_cache_utils").warning("REAL PROBLEM: the KV cache holds fewer tokens than needed")
    warnings.warn("`torch.distributed.reduce_op` is deprecated", FutureWarning)
    os.write(2, b"[W utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy\\n")
    print("printed by a library")
""")


def test_console_shows_real_problems_and_the_file_keeps_everything(tmp_path):
    log = tmp_path / "logs" / "generator-0.log"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("VLLM_CONFIGURE_LOGGING", None)
    run = subprocess.run([sys.executable, "-c", CHILD, str(log)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    console = run.stdout + run.stderr
    assert "REAL PROBLEM" in console
    for quiet in ("RotaryEmbedding", "Reloading and processing", "libtcmalloc", "reduce_op", "NUMA", "printed by"):
        assert quiet not in console, f"{quiet!r} reached the console:\n{console}"
    kept = log.read_text()
    for line in ("RotaryEmbedding", "Reloading and processing", "libtcmalloc", "REAL PROBLEM", "reduce_op", "NUMA",
                 "printed by a library"):
        assert line in kept, f"{line!r} missing from the log file:\n{kept}"
