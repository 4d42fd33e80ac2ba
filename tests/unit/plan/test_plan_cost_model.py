"""The planner's cost model on hand-computed cases, and the search dropping what does not fit (`async_rlhf/plan/`)."""

from __future__ import annotations

import json

import pytest

from async_rlhf.plan import cost_model as cm
from async_rlhf.plan import search as sr
from async_rlhf.plan.hardware import get_profile
from async_rlhf.plan.model_shapes import ModelShape, shape_for_size, shape_from_config

H100 = get_profile("H100")
SEVEN_B = ModelShape("7B-exact", 32, 4096, 32, 32, 11008, 32000, params_override=7e9)


def test_7b_zero3_on_8_gpus_model_states():
    # ZeRO-3, 8 learners, bf16 + Adam: (2 + 2 + 12) bytes x 7e9 / 8 = 14e9 bytes per GPU
    mem = cm.learner_memory(SEVEN_B, H100, cm.Workload(), cm.Plan(learners=8, generators=1, zero_stage=3))
    assert mem["weights"] == pytest.approx(2 * 7e9 / 8)       # 1.75e9
    assert mem["gradients"] == pytest.approx(2 * 7e9 / 8)     # 1.75e9
    assert mem["optimizer"] == pytest.approx(12 * 7e9 / 8)    # 10.5e9
    assert mem["weights"] + mem["gradients"] + mem["optimizer"] == pytest.approx(14e9)
    # ZeRO-2 keeps the bf16 weights whole: 2 x 7e9 + 14 x 7e9 / 8 = 14e9 + 12.25e9
    z2 = cm.learner_memory(SEVEN_B, H100, cm.Workload(), cm.Plan(learners=8, generators=1, zero_stage=2))
    assert z2["weights"] + z2["gradients"] + z2["optimizer"] == pytest.approx(26.25e9)
    # DDP holds all 16 bytes per parameter: 112e9, more than an 80 GB H100 before any activation
    z0 = cm.learner_memory(SEVEN_B, H100, cm.Workload(), cm.Plan(learners=8, generators=1, zero_stage=0))
    assert z0["total"] > H100.memory


def test_decode_is_bandwidth_bound():
    shape = shape_for_size("8B")
    w = cm.Workload(prompt_tokens=256, response_mean=256)
    engine = cm.engine_model(shape, H100, w, tp=1)
    # reading 2 bytes x 8.03e9 parameters at 0.6 x 3.35e12 B/s: 7.99 ms per step, whatever the batch
    assert engine.weight_read == pytest.approx(2 * shape.params / (3.35e12 * 0.6))
    assert engine.weight_read == pytest.approx(7.99e-3, rel=1e-3)
    # one sequence: the weight read dominates its arithmetic (2P FLOPs at half of 989 TFLOP/s: 32 us)
    assert engine.compute_per_seq < engine.weight_read / 100
    assert engine.step(1) == pytest.approx(H100.decode_step_overhead + engine.weight_read + engine.kv_per_seq)
    # the same GPU with more bandwidth (H200) decodes a step faster in proportion
    h200 = cm.engine_model(shape, get_profile("H200"), w, tp=1)
    assert h200.weight_read / engine.weight_read == pytest.approx(3.35 / 4.8)
    # tensor parallel size 2 halves each device's share of the weights
    assert cm.engine_model(shape, H100, w, tp=2).weight_read == pytest.approx(engine.weight_read / 2)


def test_generator_memory_needs_room_for_a_sequence():
    seventy = shape_for_size("70B")
    assert cm.generator_memory(seventy, H100, cm.Workload(), tp=1)["max_running"] == 0  # 141 GB of weights
    assert cm.generator_memory(seventy, H100, cm.Workload(), tp=4)["max_running"] >= 1


def test_search_drops_plans_that_do_not_fit():
    assert sr.search(shape_for_size("70B"), H100, cm.Workload(), gpus=2) == []
    plans = sr.search(shape_for_size("8B"), H100, cm.Workload(), gpus=8)
    assert plans
    for e in plans:
        assert e.learner_memory <= H100.memory and e.generator_memory <= H100.memory
        assert e.plan.zero_stage != 0  # 16 bytes x 8e9 parameters cannot sit on one learner
        assert e.plan.gpus <= 8 and e.devices == 8
    assert all(a.step_seconds <= b.step_seconds + 1e-6 for a, b in zip(plans, plans[1:]))  # ranked
    best = sr.best(plans)
    assert best.step_seconds <= min(e.step_seconds for e in plans) * (1 + sr.TIE)


def test_cost_aware_selection_respects_deadline_and_budget():
    shape, w = shape_for_size("1B"), cm.Workload(prompts_per_step=16, response_mean=128, response_max=256)
    plans = sr.search(shape, get_profile("A100"), w, gpus=4, gpu_counts=[2, 3, 4], seeds=2)
    fastest = min(e.worst_step_seconds for e in plans)
    loose = sr.cost_aware(plans, 1000, deadline_hours=10 * fastest * 1000 / 3600)
    assert loose is not None and loose.gpu_hours(1000) == min(e.gpu_hours(1000) for e in plans
                                                               if e.worst_step_seconds <= 10 * fastest)
    assert sr.cost_aware(plans, 1000, deadline_hours=0.5 * fastest * 1000 / 3600) is None
    cheapest = min(e.gpu_hours(1000) for e in plans)
    within = sr.cost_aware(plans, 1000, budget_gpu_hours=cheapest * 1.0001)
    assert within is not None and within.gpu_hours(1000) <= cheapest * 1.0001


def test_model_shapes_from_config_and_size(tmp_path):
    assert shape_for_size("8B").params == pytest.approx(8.03e9, rel=1e-3)
    assert shape_for_size("70B").params == pytest.approx(70.55e9, rel=1e-3)
    assert shape_for_size("2.5B").params == 2.5e9
    with pytest.raises(ValueError, match="model_size"):
        shape_for_size("eight")
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
         "intermediate_size": 16, "vocab_size": 10, "tie_word_embeddings": True}))
    shape = shape_from_config(str(tmp_path))
    # per layer: q 64 + k,v 2*8*4 + o 64 + MLP 3*8*16 + norms 16 = 592; embeddings 80 (tied); final norm 8
    assert shape.params == 2 * 592 + 80 + 8
    with pytest.raises(ValueError, match="neither a config.json"):
        shape_from_config(str(tmp_path / "missing"))


def test_a_measured_profile_replaces_what_it_measured(tmp_path):
    from async_rlhf.plan.hardware import load_profile

    path = tmp_path / "profile.json"
    path.write_text(json.dumps({  # the shape benchmarks/device_profile.py writes
        "machine": "test box", "model": {"params": 1.2e6}, "device": {"kind": "cpu", "name": "CPU (2 cores)"},
        "generation": {"fit": {"overhead_s": 0.002, "per_seq_s": 0.0003}, "prefill_token_s": 4e-5},
        "learner": {"tokens_per_s": 8000.0},
        "weight_sync": {"shm": {"seconds_per_gb": 6.0, "publish_seconds_per_gb": 0.8, "load_seconds_per_gb": 5.2}}}))
    dev = load_profile(str(path))
    assert (dev.engine_overhead, dev.engine_per_seq, dev.learner_tokens_per_s) == (0.002, 0.0003, 8000.0)
    assert (dev.sync_seconds_per_gb, dev.load_seconds_per_gb) == (0.8, 5.2)
    assert "measured" in dev.source and "test box" in dev.source
    shape = ModelShape("same", 4, 128, 4, 4, 512, 646, params_override=1.2e6)
    engine = cm.engine_model(shape, dev, cm.Workload(prompt_tokens=26, response_mean=5, response_max=24), tp=1)
    assert engine.step(64) == pytest.approx(0.002 + 64 * 0.0003)  # the measured fit, for the model it measured
    path.write_text(json.dumps({"device": {"flops": 1.0}}))
    with pytest.raises(ValueError, match="flops"):
        load_profile(str(path))


def test_evaluate_split_at_a_given_micro_batch():
    w = cm.Workload(prompts_per_step=64)
    shape = shape_for_size("8B")
    fastest = sr.evaluate_split(shape, H100, w, 4, 1, 4, 1, staleness=[1])
    assert len(fastest) == 1
    for mb in (1, 2, 4):
        (e,) = sr.evaluate_split(shape, H100, w, 4, 1, 4, 1, staleness=[1], micro_batch=mb)
        assert e.plan.micro_batch == mb and e.train_seconds >= fastest[0].train_seconds
    assert sr.evaluate_split(shape, H100, w, 4, 1, 4, 1, staleness=[1], micro_batch=3) == []  # 3 does not divide 16


def test_any_node_plan_prints_servers_per_node_and_the_network_flags():
    """`--any_node_generators`: every generator is a server on the node whose free devices it takes (never split
    across nodes); those off node 0 bind a routable address with --allow_remote, and the learners listen for their
    weight groups on node 0's address."""
    from async_rlhf.plan.commands import any_node_command

    plan = cm.Plan(learners=8, generators=4, tp=2, nodes=2)
    lines = any_node_command(plan, cm.Workload(), gpus_per_node=8).splitlines()
    servers = [line for line in lines if "async_rlhf.generation.serve" in line]
    assert [s.split(":")[0] for s in servers] == ["# node 0", "# node 0", "# node 1", "# node 1"]
    assert all("CUDA_VISIBLE_DEVICES=4,5 " in s or "CUDA_VISIBLE_DEVICES=6,7 " in s for s in servers)
    assert all(("--allow_remote" in s) == s.startswith("# node 1") for s in servers)
    assert "--generator_servers 127.0.0.1:8760 127.0.0.1:8761 <node 1 address>:8762 <node 1 address>:8763" in lines[-1]
    assert "--weight_sync_host <node 0 address> --allow_remote true" in lines[-1]
    # tp 8 cannot fit in the 4 devices a node has left: no command rather than a generator split across nodes
    assert "no command" in any_node_command(cm.Plan(learners=8, generators=1, tp=8, nodes=2), cm.Workload(), 8)


def test_cpu_any_node_plan_prints_a_ray_cluster_and_the_learners_with_ray_generators():
    """CPU plans with `--any_node_generators`: a Ray head on node 0 offering the cores the learners leave, every
    core of the other nodes, and the learners' command with Ray generators over the network; a routable head address
    needs --allow_remote, a loopback one (every node on this machine) does not."""
    from async_rlhf.plan.commands import ray_any_node_command

    plan = cm.Plan(learners=2, generators=3, tp=1, nodes=2, zero_stage=3)
    lines = ray_any_node_command(plan, cm.Workload(), cores_per_node=4).splitlines()
    commands = [line for line in lines if not line.startswith("#")][2:]
    assert lines[1:3] == ["export RAY_AUTH_MODE=token", "ray get-auth-token --generate > /dev/null"]
    assert commands[0] == "ray start --head --port 6379 --num-cpus 2 --disable-usage-stats"
    assert commands[1] == "ray start --address <node 0 address>:6379 --num-cpus 4 --disable-usage-stats"
    assert commands[2].startswith("RAY_ADDRESS=<node 0 address>:6379 accelerate launch --config_file "
                                  "launch/accelerate/cpu_deepspeed_zero3.yaml --num_processes 2 recipes/online_dpo.py")
    assert commands[2].endswith("--generator_launcher ray --generator_backend vllm --generator_devices cpu cpu cpu "
                                "--weight_sync_host <node 0 address> --allow_remote true --output_dir outputs/plan")
    local = ray_any_node_command(plan, cm.Workload(), cores_per_node=4, head="127.0.0.1")
    assert "--weight_sync_host 127.0.0.1 --output_dir" in local and "allow_remote" not in local
    assert "no command" in ray_any_node_command(cm.Plan(learners=6, generators=2, tp=1, nodes=2), cm.Workload(), 4)


def test_network_sync_blocks_the_learner_for_its_own_copy_only():
    """The network transport: no shm write on the learner's side; each generator receives the bytes over its node's
    link at the benchmark's wire/socket ratio. Under ZeRO-3 each learner copies only its partitions to the host and
    the gather goes with the send (`weight_sync/partitions.py`); under ZeRO-2 rank 0 copies the whole state."""
    size = H100.dtype_bytes * SEVEN_B.params
    wire = size * cm.NETWORK_WIRE_RATIO / (H100.network_bandwidth * H100.comm_efficiency)
    zero3 = cm.Plan(learners=8, generators=2, tp=2, nodes=2)
    shm_publish, _ = cm.sync_seconds(SEVEN_B, H100, zero3)
    publish, load = cm.sync_seconds(SEVEN_B, H100, zero3, network=True)
    gather = shm_publish - size / H100.host_bandwidth - size / H100.shm_bandwidth
    assert publish == pytest.approx(size / 8 / H100.host_bandwidth)
    assert load == pytest.approx(gather + wire)
    zero2 = cm.Plan(learners=8, generators=2, tp=2, nodes=2, zero_stage=2)
    assert cm.sync_seconds(SEVEN_B, H100, zero2, network=True) == pytest.approx((size / H100.host_bandwidth, wire))
