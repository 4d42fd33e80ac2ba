"""Which weight transport a generator gets (`config.checks.choose_transport`, config `weight_transport`), the
checks on the network transport's settings, the group info a generator accepts, and the probe that tells a server on
another host (or with a private /dev/shm) from one on learner rank 0's host."""

from __future__ import annotations

import os

import pytest

from async_rlhf import AsyncOnlineDPOConfig
from async_rlhf.config.checks import choose_transport
from async_rlhf.errors import ConfigError
from async_rlhf.weight_sync import broadcast
from async_rlhf.weight_sync.network import StateTransport, for_transport, reads_probe, write_probe


def test_auto_is_ipc_on_the_learners_gpu_shm_on_its_host_network_otherwise():
    assert choose_transport("auto", "g", same_gpu=True, sees_shm=True) == "ipc"
    assert choose_transport("auto", "g", same_gpu=False, sees_shm=True) == "shm"
    assert choose_transport("auto", "g", same_gpu=False, sees_shm=False) == "network"
    assert choose_transport("network", "g", same_gpu=False, sees_shm=True) == "network"
    with pytest.raises(ValueError, match="weight_transport='shm' but generator server 3 cannot read"):
        choose_transport("shm", "generator server 3", same_gpu=False, sees_shm=False)
    with pytest.raises(ValueError, match="'ipc' but g does not run on learner rank 0's GPU"):
        choose_transport("ipc", "g", same_gpu=False, sees_shm=True)
    with pytest.raises(ValueError, match="'pigeon' is not one of"):
        choose_transport("pigeon", "g", same_gpu=False, sees_shm=True)


def test_config_checks_name_the_field(tmp_path):
    def config(**fields):
        return AsyncOnlineDPOConfig(output_dir=str(tmp_path), **fields)

    assert config().local_weight_transport == "shm" and config().network_engine == "gloo"
    assert config(weight_transport="network").local_weight_transport == "network"
    with pytest.raises(ConfigError, match="weight_sync_host: '10.0.0.5' is not a loopback address; set allow_remote"):
        config(weight_sync_host="10.0.0.5")
    config(weight_sync_host="10.0.0.5", allow_remote=True)
    with pytest.raises(ConfigError, match="weight_transport: 'ipc' needs generators on learner rank 0's GPU"):
        config(weight_transport="ipc", generator_servers=["127.0.0.1:8000"])
    with pytest.raises(ConfigError, match="'network' needs vLLM generators"):
        config(weight_transport="network", generator_backend="transformers")
    with pytest.raises(ConfigError, match="weight_transport='ipc' but local generators"):
        config(weight_transport="ipc")
    with pytest.raises(ConfigError, match="network_backend: 'mpi' is not one of"):
        config(network_backend="mpi")


def test_group_info_is_validated_before_anything_connects():
    good = broadcast.GroupInfo(host="127.0.0.1", port=1234, rank=1, world_size=2, timeout=5.0,
                               prefix=broadcast.new_prefix()).to_dict()
    assert broadcast.GroupInfo.from_dict(good).port == 1234
    for bad, match in (({**good, "extra": 1}, "expected keys"), ({**good, "port": "1234"}, "port has type str"),
                       ({**good, "rank": 0}, "out of range"), ({**good, "timeout": float("inf")}, "timeout"),
                       ({**good, "bucket_bytes": 0}, "out of range"), ({**good, "world_size": True}, "type bool")):
        with pytest.raises(ValueError, match=match):
            broadcast.GroupInfo.from_dict(bad)


def test_metadata_checks_refuse_what_could_size_buffers_wrongly():
    broadcast.check_metadata(["a"], ["float32"], [[2, 3]], "u")
    for names, dtypes, shapes, match in ((["a"], ["float32", "int8"], [[1]], "1 names, 2 dtypes"),
                                         (["a"], ["object"], [[1]], "dtype 'object'"),
                                         (["a"], ["float32"], [[-1]], "shape"), (["a"], ["float32"], [[True]], "shape"),
                                         ([3], ["float32"], [[1]], "not a string")):
        with pytest.raises(ValueError, match=match):
            broadcast.check_metadata(names, dtypes, shapes, "u")


def test_probe_reads_only_probe_files(tmp_path):
    path, nonce = write_probe(str(tmp_path))
    assert reads_probe(path, nonce) and not reads_probe(path, "other")
    other = tmp_path / "secret"
    other.write_text(nonce)
    assert not reads_probe(str(other), nonce)  # the same content, but not a probe file: never opened
    os.unlink(path)
    assert not reads_probe(path, nonce)


def test_state_transport_writes_shm_only_when_used_and_keeps_states_until_released(tmp_path):
    import torch

    state = {"w": torch.ones(2, 3)}
    transport = StateTransport(str(tmp_path))
    transport.use("network")
    update = transport.publish(state, 1)
    assert update.transport == "network" and not update.path and update.shapes == [[2, 3]]
    assert update.num_bytes == 24 and transport.state(1) is state
    with pytest.raises(ValueError, match="no shm file was written"):
        for_transport(update, "shm")
    transport.use("shm")
    update = transport.publish(state, 2)
    assert os.path.isfile(update.path) and for_transport(update, "shm").transport == "shm"
    transport.release(2)
    with pytest.raises(KeyError, match="v1 are not held"):
        transport.state(1)
    transport.close()


def test_a_transport_is_network_only_until_a_generator_takes_shm(tmp_path):
    """What decides, under ZeRO-3 with `weight_transport='auto'`, that the learners keep partitions instead of
    gathering (`pipeline/rollout_pipeline.py::_partition_store`): no generator needs a file of the whole state."""
    transport = StateTransport(str(tmp_path))
    assert not transport.network_only()  # nothing in use yet
    transport.use("network")
    assert transport.network_only()
    transport.use("shm")
    assert not transport.network_only()
    transport.close()
