import os

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# 2-core machines: the test process (learner) and the generator processes it starts each get one thread, so they
# run side by side instead of fighting over both cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with the char tokenizer, saved once per test session."""
    from async_rlhf.data.tiny_model import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("tiny_model")))
