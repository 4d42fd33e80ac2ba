"""Config values of the wrong type, non-finite numbers and unusable paths are refused when the config is built
(before anything loads), with a ConfigError naming the field and the value."""

import math

import pytest

from async_rlhf.config.algorithms import AsyncOnlineDPOConfig, AsyncPPOConfig, AsyncRLOOConfig
from async_rlhf.config.checks import ROLLOUT_TIMEOUT_MARGIN
from async_rlhf.config.cli import parse_args
from async_rlhf.errors import ConfigError


def make(cls=AsyncOnlineDPOConfig, **kw):
    return cls(output_dir="/tmp/async_rlhf-test-config", **kw)


@pytest.mark.parametrize("kw, message", [
    ({"sync_every": "2"}, r"sync_every: expected an integer, got '2' \(str\)"),
    ({"sync_every": 1.5}, r"sync_every: expected an integer, got 1.5 \(float\)"),
    ({"max_staleness": True}, r"max_staleness: expected an integer, got True \(bool\)"),
    ({"generator_servers": [8765]}, r"generator_servers\[0\]: expected a string, got 8765 \(int\)"),
    ({"generator_max_restarts": -5}, r"generator_max_restarts: must be >= 0, got -5"),
    ({"weight_sync_timeout": math.inf}, r"weight_sync_timeout: must be finite, got inf"),
    ({"rollout_timeout": math.nan}, r"rollout_timeout: must be finite, got nan"),
    ({"generator_start_timeout": 0}, r"generator_start_timeout: must be > 0 seconds, got 0.0"),
    ({"temperature": math.inf}, r"temperature: must be finite, got inf"),
    ({"vllm_enforce_eager": 1}, r"vllm_enforce_eager: expected True or False, got 1 \(int\)"),
    ({"reward_weights": [1.0, "x"]}, r"reward_weights\[1\]: expected a number, got 'x' \(str\)"),
    ({"model_init_kwargs": {1: 2}}, r"model_init_kwargs: expected a dict with string keys"),
    ({"vllm_gpu_memory_utilization": 1.5}, r"vllm_gpu_memory_utilization: must be in \(0, 1\], got 1.5"),
    ({"beta": "0.1"}, r"beta: expected a number, got '0.1' \(str\)"),
    ({"max_nonfinite_steps": -1}, r"max_nonfinite_steps: must be >= 0, got -1"),
])
def test_wrong_types_and_values_name_the_field_and_value(kw, message):
    with pytest.raises(ConfigError, match=message):
        make(**kw)


@pytest.mark.parametrize("cls, kw, message", [
    (AsyncRLOOConfig, {"is_cap": math.inf}, r"is_cap: must be finite, got inf"),
    (AsyncRLOOConfig, {"epsilon": "0.2"}, r"epsilon: expected a number, got '0.2'"),
    (AsyncPPOConfig, {"gamma": 1.5}, r"gamma: must be in \[0, 1\], got 1.5"),
    (AsyncPPOConfig, {"whiten_advantages": "no"}, r"whiten_advantages: expected True or False, got 'no'"),
])
def test_subclass_fields_are_checked_too(cls, kw, message):
    with pytest.raises(ConfigError, match=message):
        make(cls, **kw)


def test_valid_values_still_pass_and_ints_become_floats():
    c = make(rollout_timeout=30, generator_devices="cpu,cpu", beta=0.2, reward_weights=[1, 2])
    assert c.rollout_timeout == 30.0 and isinstance(c.rollout_timeout, float)
    assert c.generator_devices == ["cpu", "cpu"] and c.beta == 0.2 and c.reward_weights == [1.0, 2.0]


def test_missing_shm_dir_is_refused_before_anything_loads():
    with pytest.raises(ConfigError, match=r"shm_dir: '/nonexistent' is not an existing directory"):
        make(shm_dir="/nonexistent")


def test_unwritable_shm_dir_is_refused(tmp_path):
    d = tmp_path / "ro"
    d.mkdir(mode=0o500)
    try:
        import os
        if os.access(d, os.W_OK):  # running as root: permission bits do not apply
            pytest.skip("root can write anywhere")
        with pytest.raises(ConfigError, match=rf"shm_dir: '{d}' is not writable"):
            make(shm_dir=str(d))
    finally:
        d.chmod(0o700)


def test_rollout_timeout_beyond_the_process_group_timeout_is_refused_with_several_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"rollout_timeout=2000 s with ddp_timeout=1800 s"):
        make(rollout_timeout=2000.0, ddp_timeout=1800, use_cpu=True)
    with pytest.raises(ConfigError, match=rf"rollout_timeout must be at most ddp_timeout - {ROLLOUT_TIMEOUT_MARGIN} s"):
        make(rollout_timeout=1800.0 - ROLLOUT_TIMEOUT_MARGIN + 1, ddp_timeout=1800, use_cpu=True)
    # (a valid multi-rank config is not built here: TrainingArguments would start torch.distributed)
    monkeypatch.setenv("WORLD_SIZE", "1")
    make(rollout_timeout=2000.0, ddp_timeout=1800)  # one rank: no collective waits on rollouts


def test_command_line_types_still_parse(tmp_path):
    (c,) = parse_args((AsyncOnlineDPOConfig,), ["--output_dir", str(tmp_path), "--sync_every", "2",
                                                "--max_staleness", "1", "--rollout_timeout", "30"])
    assert c.sync_every == 2 and c.rollout_timeout == 30.0


def test_shm_dir_too_small_for_the_policy_is_refused_before_it_loads(tmp_path):
    from datasets import Dataset

    from async_rlhf import AsyncOnlineDPOTrainer

    model = tmp_path / "huge_model"
    model.mkdir()
    with open(model / "model.safetensors", "wb") as f:  # sparse: claims 1 TiB, uses no disk
        f.truncate(1 << 40)

    def reward(prompts, completions, **kw):
        return [0.0] * len(completions)

    with pytest.raises(ConfigError, match=r"shm_dir: '/dev/shm' has .* GiB free; the shm weight transport needs about "
                                          r"2048.00 GiB"):
        AsyncOnlineDPOTrainer(str(model), reward_funcs=reward, args=make(shm_dir="/dev/shm"),
                              train_dataset=Dataset.from_dict({"prompt": ["x"]}))


def test_colocate_is_shm_on_cpu_and_ipc_refuses_a_cpu_learner(tmp_path):
    """Colocated mode on CPU runs the same pipeline with the shm transport; the ipc transport is CUDA only and says
    so before anything is published."""
    import torch

    from async_rlhf.errors import WeightTransportError
    from async_rlhf.weight_sync import ShmWeightTransport, make_transport
    from async_rlhf.weight_sync.ipc import IpcWeightTransport

    args = AsyncOnlineDPOConfig(output_dir=str(tmp_path), colocate=True, use_cpu=True)
    assert args.local_weight_transport == "shm"
    transport = make_transport(args, torch.device("cpu"))
    assert isinstance(transport, ShmWeightTransport)
    transport.close()
    with pytest.raises(WeightTransportError, match="needs a CUDA learner device"):
        IpcWeightTransport(torch.device("cpu"))
