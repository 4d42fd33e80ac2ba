"""Where Ray actors may run follows how their weights arrive (`ray_launcher.placement`): pinned to learner rank 0's
node on shm or IPC, anywhere on the network; settings that cannot work on the cluster are refused before any actor
starts. No Ray needed: the cluster is described by its other nodes' addresses."""

from __future__ import annotations

import pytest

from async_rlhf import AsyncOnlineDPOConfig
from async_rlhf.errors import ConfigError
from async_rlhf.generation.pool.ray_launcher import placement

HERE = "10.0.0.1"


def config(tmp_path, **fields):
    return AsyncOnlineDPOConfig(output_dir=str(tmp_path), generator_backend=fields.pop("generator_backend", "vllm"),
                                shm_dir=str(tmp_path), **fields)


def test_one_node_cluster_keeps_shm(tmp_path):
    assert placement(config(tmp_path), HERE, {}) == "shm"


def test_other_nodes_take_the_network_under_auto(tmp_path):
    assert placement(config(tmp_path), HERE, {"b": HERE}) == "network"  # another node on this host: loopback works
    assert placement(config(tmp_path, weight_sync_host=HERE, allow_remote=True), HERE, {"b": "10.0.0.2"}) == "network"


def test_forced_shm_pins_the_actors_whatever_the_cluster(tmp_path):
    assert placement(config(tmp_path, weight_transport="shm"), HERE, {"b": "10.0.0.2"}) == "shm"


def test_transformers_generators_stay_on_shm(tmp_path):
    assert placement(config(tmp_path, generator_backend="transformers"), HERE, {"b": "10.0.0.2"}) == "shm"


def test_forced_network_on_one_node(tmp_path):
    assert placement(config(tmp_path, weight_transport="network"), HERE, {}) == "network"


def test_loopback_group_with_other_hosts_is_refused_naming_them(tmp_path):
    with pytest.raises(ConfigError, match=r"weight_sync_host: '127\.0\.0\.1' is a loopback address.*10\.0\.0\.2.*"
                                          r"--weight_sync_host 10\.0\.0\.1 --allow_remote true"):
        placement(config(tmp_path), HERE, {"b": "10.0.0.2", "c": HERE})


def test_version_zero_in_rank_zeros_shm_is_refused(tmp_path):
    copy = tmp_path / "async_rlhf-init-1234"
    with pytest.raises(ConfigError, match=r"load version 0 from .*async_rlhf-init-1234.*cannot read"):
        placement(config(tmp_path), HERE, {"b": HERE}, str(copy))
    assert placement(config(tmp_path), HERE, {"b": HERE}, "/models/policy") == "network"


def test_pinned_generators_must_fit_on_rank_zeros_node(tmp_path):
    from async_rlhf.generation.pool.ray_launcher import check_room

    args = config(tmp_path, generator_backend="transformers", generator_devices=["cpu"], generator_threads=2)
    check_room(args, "shm", {"CPU": 2.0}, {})
    with pytest.raises(ConfigError, match=r"generator_devices: 1 generator\(s\) need 2 CPU\(s\) \(2 CPUs each\), but "
                                          r"learner rank 0's Ray node has .*0 CPU\(s\).*use vllm for the network"):
        check_room(args, "shm", {}, {"b": {"CPU": 8.0}})


def test_network_generators_may_use_any_node_but_need_room_somewhere(tmp_path):
    from async_rlhf.generation.pool.ray_launcher import check_room

    args = config(tmp_path, generator_devices=["cpu", "cpu"], generator_threads=1)
    check_room(args, "network", {}, {"b": {"CPU": 2.0}})
    with pytest.raises(ConfigError, match=r"need 2 CPU\(s\).*the Ray cluster's nodes have 0, 1 CPU\(s\)"):
        check_room(args, "network", {}, {"b": {"CPU": 1.0}})
    gpus = config(tmp_path, generator_devices=["cuda:0"])
    with pytest.raises(ConfigError, match=r"need 1 GPU\(s\) \(1 GPU each\)"):
        check_room(gpus, "network", {"CPU": 8.0}, {"b": {"CPU": 8.0}})


def test_a_ray_address_with_no_head_is_refused_before_ray_init():
    import socket

    from async_rlhf.generation.pool.ray_launcher import check_ray_address

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConfigError, match=rf"RAY_ADDRESS='127.0.0.1:{port}'.*ray start --head --port {port}"):
        check_ray_address(f"127.0.0.1:{port}", timeout=2)
    with socket.socket() as s:  # a listening head passes
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_ray_address(f"127.0.0.1:{s.getsockname()[1]}", timeout=2)
    for left_to_ray in ("", "auto", "local", "ray://10.0.0.1:10001"):
        check_ray_address(left_to_ray, timeout=0.01)
