"""The HTTP edge of remote generators, without vLLM's engine: the launcher's bind rules and defaults, the bearer-token
middleware on every route vLLM registers (dev routes included), and how the trainer's client and pool handle a
misbehaving server. The fake server below exists only to inject errors (a hang, garbage, a reset connection, an
error status); the happy path runs against a real vLLM server in tests/integration/test_remote_generators.py."""

from __future__ import annotations

import asyncio
import http.server
import json
import socket
import threading
import time

import pytest
import torch

from async_rlhf.errors import ConfigError
from async_rlhf.config.algorithms import AsyncOnlineDPOConfig
from async_rlhf.generation import serve
from async_rlhf.generation.pool import http_client
from async_rlhf.generation.pool.http_client import ServerError, Unauthorized, WeightSyncClient
from async_rlhf.errors import GeneratorFailed
from async_rlhf.types import GenerationRequest, SamplingSettings

TOKEN = "t" * 16
SETTINGS = SamplingSettings(max_new_tokens=4, temperature=1.0, n=2, seed=3)


# ---- launcher ------------------------------------------------------------------------------------------------


def test_bind_rules():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        serve.check_bind(host, allow_remote=False, token="")  # loopback: no flag, no token needed
    with pytest.raises(SystemExit, match="--allow_remote"):
        serve.check_bind("0.0.0.0", allow_remote=False, token=TOKEN)
    with pytest.raises(SystemExit, match="at least 16 bytes"):
        serve.check_bind("0.0.0.0", allow_remote=True, token="")
    with pytest.raises(SystemExit, match="at least 16 bytes"):
        serve.check_bind("10.1.2.3", allow_remote=True, token="short-token")
    serve.check_bind("10.1.2.3", allow_remote=True, token=TOKEN)


def test_launcher_refuses_an_exposed_bind_before_starting_the_engine(monkeypatch):
    pytest.importorskip("vllm")
    import uvloop

    monkeypatch.setattr(uvloop, "run", lambda *a, **k: pytest.fail("the server must not start"))
    monkeypatch.delenv(serve.TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit, match="--allow_remote"):
        serve.main(["--model", "/nonexistent", "--host", "0.0.0.0"])
    monkeypatch.setenv(serve.TOKEN_ENV, "short")
    with pytest.raises(SystemExit, match="at least 16 bytes"):
        serve.main(["--model", "/nonexistent", "--host", "0.0.0.0", "--allow_remote"])


def test_launcher_defaults_are_added_unless_given():
    argv = serve.vllm_argv(["--model", "m", "--port", "0", "--logprobs_mode=raw_logprobs",
                            "--enable-chunked-prefill"], token="", on_cpu=True)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert 0 < int(argv[argv.index("--port") + 1]) < 65536 and argv.count("--port") == 1
    assert "processed_logprobs" not in argv and "--no-enable-chunked-prefill" not in argv  # the user's choice stays
    for flag in ("--worker-extension-cls", "--weight-transfer-config", "--generation-config",
                 "--enable-prefix-caching", "--kv-cache-memory-bytes"):
        assert flag in argv, flag
    assert argv[-2:] == ["--middleware", serve.MIDDLEWARE]
    assert "--kv-cache-memory-bytes" not in serve.vllm_argv(["--model", "m"], token="", on_cpu=False)
    with pytest.raises(SystemExit, match="--api-key"):
        serve.vllm_argv(["--model", "m", "--api-key", "k"], token="", on_cpu=False)


# ---- middleware ------------------------------------------------------------------------------------------------


def vllm_app(monkeypatch, tiny_model_dir):
    """vLLM's own app (no engine behind it), with every route of a dev-mode server and our middleware."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.setenv(serve.TOKEN_ENV, TOKEN)
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        serve.vllm_argv(["--model", tiny_model_dir], token=TOKEN, on_cpu=True))
    return build_app(args, ("generate",), None)


def test_every_vllm_route_needs_the_token(monkeypatch, tiny_model_dir):
    from starlette.testclient import TestClient

    app = vllm_app(monkeypatch, tiny_model_dir)
    routes = {(r.path, m) for r in app.routes for m in (getattr(r, "methods", None) or {"GET"})}
    paths = {p for p, _ in routes}
    for dev in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
                "/pause", "/resume", "/get_world_size", "/collective_rpc", "/health", "/v1/completions",
                "/inference/v1/generate", "/reset_prefix_cache"):
        assert dev in paths, dev
    client = TestClient(app)
    for path, method in sorted(routes):
        for headers in ({}, {"Authorization": "Bearer wrong-token-0000000"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}):
            response = client.request(method, path, headers=headers)
            assert response.status_code == 401, (method, path, headers, response.status_code)


def test_the_middleware_lets_the_token_through():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    app = Starlette(routes=[Route("/update_weights", lambda request: PlainTextResponse("ok"), methods=["POST"])])
    import os

    os.environ[serve.TOKEN_ENV] = TOKEN
    try:
        client = TestClient(serve.BearerTokenMiddleware(app))
    finally:
        del os.environ[serve.TOKEN_ENV]
    assert client.post("/update_weights", headers={"Authorization": f"Bearer {TOKEN}"}).text == "ok"
    assert client.post("/update_weights", headers={"Authorization": f"bearer {TOKEN}"}).text == "ok"
    assert client.post("/update_weights", headers={"Authorization": f"Bearer {TOKEN}x"}).status_code == 401


# ---- client and pool against a misbehaving server -------------------------------------------------------------


class Fake(http.server.ThreadingHTTPServer):
    """Answers start-up routes like vLLM; `mode` decides what the sampling and weight routes do."""

    daemon_threads = True

    def __init__(self, mode: str):
        self.mode = mode
        self.release = threading.Event()
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        answers = {"/health": b"", "/weight_info": b'{"weight_version": "default"}',
                   "/v1/models": b'{"data": [{"id": "m", "max_model_len": 256}]}'}
        self.reply(200, answers[self.path])

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        mode = self.server.mode
        if self.path == "/init_weight_transfer_engine":
            return self.reply(200, b"{}")
        if mode == "hang":
            self.server.release.wait(30)
        elif mode == "garbage":
            self.reply(200, b"<html>not json")
        elif mode == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            self.connection.close()
        elif mode == "error":
            self.reply(500, b'{"error": "engine dead"}')
        elif mode == "ok":  # a well-formed answer, for the on_rollouts failure below
            choices = [{"index": i, "token_ids": [4], "finish_reason": "length",
                        "logprobs": {"content": [{"token_id": 4, "logprob": -1.0}]},
                        "weight_versions": [{"version": "default", "start": 0, "end": 1}]} for i in range(2)]
            self.reply(200, json.dumps({"choices": choices}).encode())


@pytest.mark.parametrize("mode, message", [
    ("hang", "no answer within 1s"),
    ("garbage", "not valid JSON"),
    ("reset", "ServerDisconnectedError|ClientOSError|Connection reset"),
    ("error", "HTTP 500: .*engine dead"),
])
def test_client_errors_name_the_route(mode, message):
    fake = Fake(mode)
    url = http_client.base_url(fake.address)
    try:
        async def sample():
            import aiohttp

            async with aiohttp.ClientSession() as session:
                return await http_client.generate(session, url, "m", [2, 40], SETTINGS, 3, 1.0, TOKEN, 0)

        t0 = time.monotonic()
        with pytest.raises(ServerError, match=f"/inference/v1/generate: .*({message})"):
            asyncio.run(sample())
        with pytest.raises(ServerError, match=f"/start_weight_update: .*({message})"):
            WeightSyncClient(url, TOKEN, timeout=1.0).start_weight_update()
        assert time.monotonic() - t0 < 10
    finally:
        fake.release.set()
        fake.shutdown()


def test_a_refused_token_is_unauthorized():
    with pytest.raises(Unauthorized, match="HTTP 401"):
        http_client.check_status("/health", 401, "")


@pytest.mark.parametrize("mode", ["garbage", "reset", "on_rollouts"])
def test_pool_check_raises_any_failure_naming_the_server(mode):
    """Every exception in the pool's loop, whatever its type, is raised by `check` naming the server."""
    pytest.importorskip("vllm")
    from async_rlhf.generation.pool.http_pool import HTTPGeneratorPool

    fake = Fake("ok" if mode == "on_rollouts" else mode)

    def on_rollouts(batch):
        raise RecursionError("maximum recursion depth exceeded")

    pool = HTTPGeneratorPool([fake.address], on_rollouts, None, "/nonexistent", initial_version=0, start_timeout=30,
                             weight_sync_timeout=30, request_timeout=5, token=TOKEN, min_model_len=48)
    try:
        pool.start()
        pool.send_request(0, GenerationRequest(0, [0], [[2, 40]], SETTINGS))
        deadline = time.monotonic() + 20
        with pytest.raises(GeneratorFailed, match=rf"generator server 0 \({fake.address}\) failed: "):
            while time.monotonic() < deadline:
                pool.check()
                time.sleep(0.05)
        if mode == "on_rollouts":
            with pytest.raises(GeneratorFailed, match="RecursionError"):
                pool.check()
    finally:
        t0 = time.monotonic()
        pool.close(timeout=2)
        assert time.monotonic() - t0 < 10
        fake.shutdown()


def test_pool_start_fails_naming_a_server_that_never_answers():
    from async_rlhf.generation.pool.http_pool import HTTPGeneratorPool
    from async_rlhf.errors import StageTimeout

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there
    pool = HTTPGeneratorPool([address], print, None, "/nonexistent", initial_version=0, start_timeout=2,
                             weight_sync_timeout=30, request_timeout=5)
    t0 = time.monotonic()
    with pytest.raises(StageTimeout, match=rf"generator server 0 \({address}\) did not answer within"):
        pool.start()
    assert time.monotonic() - t0 < 10
    pool.close(timeout=1)


# ---- config and starting weights ----------------------------------------------------------------------------------


def test_config_checks_generator_servers(tmp_path):
    config = AsyncOnlineDPOConfig(output_dir=str(tmp_path), generator_servers="127.0.0.1:8765, http://node2:8765")
    assert config.generator_servers == ["127.0.0.1:8765", "http://node2:8765"]
    for bad in ("node7", "node7:", "node7:http", "node7:70000", "ftp://node7:1"):
        with pytest.raises(ConfigError, match="generator_servers: "):
            AsyncOnlineDPOConfig(output_dir=str(tmp_path), generator_servers=[bad])


def test_state_from_model_dir_restores_tied_weights(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from async_rlhf.weight_sync.safetensors_io import state_from_model_dir

    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)  # leaves out lm_head.weight: it is the embedding
    state = state_from_model_dir(str(tmp_path))
    expected = model.state_dict()
    assert list(state) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
