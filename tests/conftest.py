import os
import pathlib

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# 2-core machines: the test process (learner) and the generator processes it starts each get one thread, so they
# run side by side instead of fighting over both cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


INTEGRATION_DIRS = [pathlib.Path(__file__).parent / name for name in ("integration", "compat")]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Everything under tests/integration/ and tests/compat/ (TRL's cases, which train with generator processes)
    is marked `integration`: `-m "not integration"` is the unit tier."""
    for item in items:
        if any(item.path.is_relative_to(d) for d in INTEGRATION_DIRS):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _collect_unused_generators():
    """A trainer built but never trained keeps the generators it spawned early (generation/pool/early_start.py) until it
    is garbage-collected; trainers sit in reference cycles, so collect after any test that leaves generator children,
    before the next test counts its own."""
    yield
    import multiprocessing

    if any(p.name.startswith("async_rlhf-generator") for p in multiprocessing.active_children()):
        import gc

        gc.collect()


@pytest.fixture(scope="module")
def forked_generators():
    """For a module whose subject is not how a generator process starts: generators forked from the warm server, as
    the recipes start them (`generation/pool/prewarm.py`), which spares each one its imports (about 4 s on 2 cores).
    Ended with the module, so the other modules spawn theirs, as a trainer built in a user's script does."""
    from async_rlhf.generation.pool import prewarm

    started = not prewarm.warm() and prewarm.prewarm_generators()
    yield
    if started:
        prewarm.stop_prewarm()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with the char tokenizer, saved once per test session."""
    from async_rlhf.data.tiny_model import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("tiny_model")))


@pytest.fixture
def make_config(tmp_path):
    """`make_config(cls=AsyncOnlineDPOConfig, **fields)`: a config with the library's defaults and `fields`,
    writing to `tmp_path/out` unless `output_dir` is given."""
    from async_rlhf import AsyncOnlineDPOConfig

    def make(cls=AsyncOnlineDPOConfig, **fields):
        return cls(**{"output_dir": str(tmp_path / "out"), **fields})

    return make


# A training run small enough for a test on 2 CPU cores: 2 prompts x 2 completions of at most 6 tokens per step,
# on the transformers generator backend (starts in seconds, where vLLM on CPU takes 20-50 s), with timeouts that
# fail a stuck run in minutes rather than the library's 5-10.
TINY_RUN = dict(max_steps=3, per_device_train_batch_size=2, num_generations=2, max_new_tokens=6, max_length=48,
                learning_rate=5e-3, lr_scheduler_type="constant", generator_backend="transformers", disable_tqdm=True,
                generator_start_timeout=120, rollout_timeout=120)


@pytest.fixture
def tiny_run_config():
    """`tiny_run_config(output_dir, **overrides)`: an online DPO config for a tiny CPU run (TINY_RUN above)."""
    from async_rlhf import AsyncOnlineDPOConfig

    def make(output_dir, **overrides):
        return AsyncOnlineDPOConfig(**{**TINY_RUN, "output_dir": str(output_dir), **overrides})

    return make


# The guessing task's policy SFT'd for seconds on its demonstrations (it calls the tool in most turns): what
# multi-turn runs start from without the whole task's build (tests/compat/test_grpo_tools_compat.py,
# tests/integration/test_multi_turn_run.py).
TINY_GUESS_SFT = dict(num_examples=256, steps=100, batch_size=16, learning_rate=3e-3, hidden_size=64, num_layers=2,
                      num_heads=2)


@pytest.fixture(scope="session")
def guess_policy(tmp_path_factory):
    """The directory of that policy (built once per session, in its own cache)."""
    from async_rlhf.tasks import build_guess
    from async_rlhf.tasks.build_builtin import SFTSettings

    cache = tmp_path_factory.mktemp("guess-cache")
    old = os.environ.get("ASYNC_RLHF_CACHE")
    os.environ["ASYNC_RLHF_CACHE"] = str(cache)
    try:
        return build_guess.prepare_guess(sft=SFTSettings(**TINY_GUESS_SFT), eval_episodes=4)["sft_model"]
    finally:
        if old is None:
            os.environ.pop("ASYNC_RLHF_CACHE")
        else:
            os.environ["ASYNC_RLHF_CACHE"] = old
