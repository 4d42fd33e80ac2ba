"""The generator-server edge, without any server: what may be bound, what a frame may hold, how configs that name
servers are checked, and how the starting weights are read from a model directory."""

from __future__ import annotations

import socket

import pytest
import torch

from async_rlhf.config import AsyncOnlineDPOConfig, ConfigError
from async_rlhf.generation import wire
from async_rlhf.generation.server import check_bind, is_loopback
from async_rlhf.types import Completion, GenerationRequest, RolloutBatch, SamplingSettings, WeightUpdate
from async_rlhf.weight_sync.broadcast import GroupInfo, check_update_metadata

SETTINGS = SamplingSettings(max_new_tokens=4, temperature=0.9, top_p=1.0, top_k=-1, n=2, seed=7)
REQUEST = GenerationRequest(batch_id=3, prompt_ids=[5, 9], prompt_token_ids=[[2, 40], [2, 41, 42]], settings=SETTINGS,
                            chunk=1, num_chunks=2)


def test_bind_rules():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert is_loopback(host)
        check_bind(host, allow_remote=False, token="")  # loopback: no flag, no token needed
    with pytest.raises(SystemExit, match="--allow_remote"):
        check_bind("0.0.0.0", allow_remote=False, token="t")
    with pytest.raises(SystemExit, match="shared token"):
        check_bind("0.0.0.0", allow_remote=True, token="")
    check_bind("10.1.2.3", allow_remote=True, token="t")


def test_server_refuses_an_exposed_bind_before_loading_anything(monkeypatch):
    from async_rlhf.generation import server

    monkeypatch.delenv(wire.TOKEN_ENV, raising=False)
    monkeypatch.setattr(server, "build_backend", lambda args: pytest.fail("the engine must not start"))
    with pytest.raises(SystemExit, match="--allow_remote"):
        server.main(["--model", "/nonexistent", "--host", "0.0.0.0"])
    with pytest.raises(SystemExit, match="needs a shared token"):
        server.main(["--model", "/nonexistent", "--host", "0.0.0.0", "--allow_remote"])


def test_parse_address():
    assert wire.parse_address("node7:8765") == ("node7", 8765)
    assert wire.parse_address("[::1]:9") == ("::1", 9)
    for bad in ("node7", "node7:", ":80", "node7:http", "node7:70000"):
        with pytest.raises(ValueError):
            wire.parse_address(bad)


def test_request_and_rollouts_round_trip():
    assert wire.decode_request(wire.encode_request(REQUEST)) == REQUEST
    completions = [[Completion([4, 5, 1], [-0.5, -1.25, -0.125], "stop"), Completion([6], [-2.0], "length")],
                   [Completion([7], [-0.25], "length"), Completion([1], [-3.5], "stop")]]
    batch = RolloutBatch(batch_id=3, generator_id=0, policy_version=2, prompt_ids=[5, 9], prompt_token_ids=[],
                         completions=completions, seconds=0.5, chunk=1, num_chunks=2)
    frame = wire.encode_rollouts(batch)
    decoded = wire.decode_rollouts(frame, REQUEST, generator_id=4)
    assert decoded.completions == completions and decoded.policy_version == 2 and decoded.generator_id == 4
    assert decoded.prompt_token_ids == REQUEST.prompt_token_ids  # filled in from the request, not sent back
    with pytest.raises(wire.ProtocolError, match="do not match the request"):
        wire.decode_rollouts({**frame, "batch_id": 4}, REQUEST, 0)
    with pytest.raises(wire.ProtocolError, match="2 prompts and 1 completion groups"):
        wire.decode_rollouts({**frame, "completions": frame["completions"][:1]}, REQUEST, 0)


@pytest.mark.parametrize("change, message", [
    ({"batch_id": "3"}, "batch_id: expected an integer"),
    ({"batch_id": -1}, "batch_id: expected >= 0"),
    ({"prompt_token_ids": [[2], [True]]}, "prompt_token_ids: expected an integer"),
    ({"settings": {"n": 2}}, "missing field"),
    ({"evil": "__import__('os')"}, "unknown field"),
])
def test_malformed_requests_are_refused_naming_the_field(change, message):
    with pytest.raises(wire.ProtocolError, match=message):
        wire.decode_request({**wire.encode_request(REQUEST), **change})


def test_weight_update_metadata_is_checked():
    update = WeightUpdate(version=1, transport="broadcast", names=["a", "b"], dtypes=["float32", "bfloat16"],
                          shapes=[[2, 3], []], num_bytes=26)
    assert wire.decode_update(wire.encode_update(update)) == update
    for bad in (dict(dtypes=["float32", "Tensor"]), dict(shapes=[[2, -3], []]), dict(names=["a"])):
        with pytest.raises(ValueError):
            check_update_metadata(WeightUpdate(**{**update.__dict__, **bad}))
    with pytest.raises(ValueError, match="broadcast"):
        wire.encode_update(WeightUpdate(version=1, transport="shm", path="/dev/shm/x"))


def test_group_info_is_validated():
    info = GroupInfo(host="127.0.0.1", port=2345, rank=1, world_size=2, backend="gloo", timeout=10.0, prefix="p/")
    assert GroupInfo.from_dict(info.to_dict()) == info
    for bad in ({"rank": 0}, {"rank": 2}, {"backend": "mpi"}, {"port": "2345"}, {"extra": 1}):
        with pytest.raises(ValueError):
            GroupInfo.from_dict({**info.to_dict(), **bad})


def test_frames_are_json_and_bounded():
    a, b = socket.socketpair()
    with a, b:
        wire.send_frame(a, {"kind": "hello", "token": "t", "protocol": 1})
        assert wire.recv_frame(b) == {"kind": "hello", "token": "t", "protocol": 1}
        wire.send_frame(a, {"kind": "hello", "padding": "x" * 100})
        with pytest.raises(wire.ProtocolError, match="exceeds the limit"):
            wire.recv_frame(b, max_bytes=64)
    a, b = socket.socketpair()
    with a, b:
        a.sendall((5).to_bytes(4, "big") + b"\x80\x04N.x")  # a pickle is not JSON
        with pytest.raises(wire.ProtocolError, match="not JSON"):
            wire.recv_frame(b)
    a, b = socket.socketpair()
    with b:
        a.close()
        with pytest.raises(wire.ConnectionClosed):
            wire.recv_frame(b)


def test_config_checks_generator_servers(tmp_path):
    config = AsyncOnlineDPOConfig(output_dir=str(tmp_path), generator_servers="127.0.0.1:8765, node2:8765")
    assert config.generator_servers == ["127.0.0.1:8765", "node2:8765"]
    with pytest.raises(ConfigError, match="generator_servers: 'node2' is not 'host:port'"):
        AsyncOnlineDPOConfig(output_dir=str(tmp_path), generator_servers=["node2"])
    with pytest.raises(ConfigError, match="weight_transport: 'shm' cannot reach generator servers"):
        AsyncOnlineDPOConfig(output_dir=str(tmp_path), generator_servers=["node2:1"], weight_transport="shm")
    with pytest.raises(ConfigError, match="weight_transport: 'broadcast' needs generator_servers"):
        AsyncOnlineDPOConfig(output_dir=str(tmp_path), weight_transport="broadcast")
    with pytest.raises(ConfigError, match="weight_broadcast_backend"):
        AsyncOnlineDPOConfig(output_dir=str(tmp_path), generator_servers=["a:1"], weight_broadcast_backend="mpi")


def test_state_from_model_dir_restores_tied_weights(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from async_rlhf.weight_sync.broadcast import state_from_model_dir

    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)  # leaves out lm_head.weight: it is the embedding
    state = state_from_model_dir(str(tmp_path))
    expected = model.state_dict()
    assert list(state) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
