"""The trainer's HTTP calls to one vLLM server (`generation/serve.py`): sampling, health, and the weight routes.

Every call sends the bearer token (when one is set) and has a timeout; every failure becomes `ServerError` with a
message naming the route and what went wrong (status and the server's body, a refused token, a timeout, a reset
connection, JSON that is not what vLLM sends). Nothing here retries: the pool decides what a failure means.

* `complete` (async, aiohttp): one prompt's `n` samples from `/v1/completions`, with the prompt as token ids,
  `return_token_ids`, and `logprobs: 0`, which vLLM answers with the sampled token's log-prob only (under
  `--logprobs-mode processed_logprobs`: of the distribution actually sampled). The answer is parsed strictly: a
  NaN/Infinity constant, a null log-prob (vLLM writes NaN as null) or vLLM's clamp value -9999.0 (a log-prob of
  -inf) is refused, as are token and log-prob lists of different lengths.
* `WeightSyncClient` (blocking, `requests`): the four methods of vLLM's `VLLMWeightSyncClient`, which vLLM's
  trainer-side engines drive (`weight_sync/vllm_shm_engine.py`). vLLM's own `HTTPVLLMWeightSyncClient` sends no
  token, hence this one.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from typing import Any

from async_rlhf.types import Completion, SamplingSettings

CLAMPED_LOGPROB = -9999.0  # vLLM's OpenAI layer writes max(logprob, -9999.0)


class ServerError(RuntimeError):
    """A call to a generator server failed (the message says which route and why)."""


class Unauthorized(ServerError):
    """The server refused the token (HTTP 401)."""


def base_url(address: str) -> str:
    """'host:port' or 'http(s)://host:port' -> 'http(s)://host:port'. Raises ValueError for anything else."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "http", address
    if scheme not in ("http", "https"):
        raise ValueError(f"generator server {address!r}: scheme must be http or https")
    host, colon, port = rest.rstrip("/").rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
        raise ValueError(f"generator server {address!r}: expected host:port (e.g. node7:8000)")
    return f"{scheme}://{host}:{port}"


def auth_headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _refuse_constant(name: str):
    raise ValueError(f"non-finite number {name} in the answer")


def parse_json(text: str, route: str) -> Any:
    """The answer's JSON; None for an empty body (`/health`)."""
    if not text:
        return None
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise ServerError(f"{route}: answer is not valid JSON ({exc}): {text[:200]!r}") from None


def check_status(route: str, status: int, text: str) -> None:
    if status == 401:
        raise Unauthorized(f"{route}: refused the token (HTTP 401): set ASYNC_RLHF_GENERATOR_TOKEN to the server's")
    if status != 200:
        raise ServerError(f"{route}: HTTP {status}: {text[:500]}")


def completion_body(model: str, prompt: list[int], settings: SamplingSettings, seed: int | None) -> dict:
    return {"model": model, "prompt": prompt, "n": settings.n, "max_tokens": settings.max_new_tokens,
            "temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k, "seed": seed,
            "min_p": settings.min_p, "repetition_penalty": settings.repetition_penalty, "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False}


def parse_completions(answer: Any, n: int, route: str = "/v1/completions") -> list[Completion]:
    """The `n` completions of one prompt from vLLM's answer, in sample order. Raises ServerError."""
    try:
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != n:
            raise ValueError(f"{len(choices)} choices for n={n}")
        out = []
        for c in choices:
            tokens, logprobs = c["token_ids"], c["logprobs"]["token_logprobs"]
            if not (isinstance(tokens, list) and isinstance(logprobs, list) and len(tokens) == len(logprobs)):
                raise ValueError("token_ids and logprobs.token_logprobs differ in length (or are missing)")
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
                raise ValueError("token_ids must be non-negative integers")
            for t, lp in enumerate(logprobs):
                if not isinstance(lp, (int, float)) or isinstance(lp, bool) or not math.isfinite(lp) \
                        or lp <= CLAMPED_LOGPROB:
                    raise ValueError(f"non-finite behaviour log-prob {lp!r} for sample {c['index']}, token {t}")
            if c["finish_reason"] not in ("stop", "length"):
                raise ValueError(f"finish_reason {c['finish_reason']!r}")
            out.append(Completion(token_ids=tokens, logprobs=[float(x) for x in logprobs],
                                  finish_reason=c["finish_reason"]))
        return out
    except (KeyError, TypeError, ValueError) as exc:
        raise ServerError(f"{route}: unexpected answer ({type(exc).__name__}: {exc})") from None


async def request_json(session, method: str, url: str, route: str, timeout: float, token: str,
                       body: dict | None = None) -> Any:
    """One aiohttp call; returns the parsed JSON answer. Every failure is a ServerError naming `route`."""
    import aiohttp

    try:
        async with session.request(method, url + route, json=body, headers=auth_headers(token),
                                   timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            text = await response.text()
    except asyncio.TimeoutError:
        raise ServerError(f"{route}: no answer within {timeout:.0f}s") from None
    except (aiohttp.ClientError, OSError, UnicodeDecodeError) as exc:
        raise ServerError(f"{route}: {type(exc).__name__}: {exc}") from None
    check_status(route, response.status, text)
    return parse_json(text, route)


async def complete(session, url: str, model: str, prompt: list[int], settings: SamplingSettings, seed: int | None,
                   timeout: float, token: str) -> list[Completion]:
    answer = await request_json(session, "POST", url, "/v1/completions", timeout, token,
                                completion_body(model, prompt, settings, seed))
    return parse_completions(answer, settings.n)


class WeightSyncClient:
    """vLLM's `VLLMWeightSyncClient` over HTTP with our token and a timeout on every call (blocking: the pool runs
    it off its event loop)."""

    def __init__(self, url: str, token: str, timeout: float):
        self.url = url
        self.token = token
        self.timeout = timeout

    def _post(self, route: str, body: dict | None = None) -> None:
        import requests

        try:
            response = requests.post(self.url + route, json=body, headers=auth_headers(self.token),
                                     timeout=(min(10.0, self.timeout), self.timeout))
        except requests.Timeout:
            raise ServerError(f"{route}: no answer within {self.timeout:.0f}s") from None
        except (requests.RequestException, OSError) as exc:
            raise ServerError(f"{route}: {type(exc).__name__}: {exc}") from None
        check_status(route, response.status_code, response.text)
        parse_json(response.text, route)  # vLLM answers JSON: anything else is not a vLLM server

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("/start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("/finish_weight_update", {"weight_version": weight_version})


def trainer_engine(client: WeightSyncClient):
    """vLLM's trainer-side engine for our `async_rlhf_shm` backend (its init calls `/init_weight_transfer_engine`)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from async_rlhf.weight_sync.vllm_shm_engine import ShmTrainerInitInfo

    return WeightTransferTrainerFactory.trainer_init(ShmTrainerInitInfo(rank=0), client=client)


async def in_daemon_thread(fn, *args):
    """`await fn(*args)` run on a daemon thread of its own: a hung blocking call holds up neither the event loop nor
    the interpreter's exit (the default executor's threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, exc):
        if future.done():  # cancelled meanwhile (the pool is closing)
            return
        if exc is None:
            future.set_result(result)
        else:
            future.set_exception(exc)

    def run():
        try:
            outcome = (fn(*args), None)
        except BaseException as exc:  # handed to the awaiting coroutine, which records it
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: the pool is gone, nobody is waiting
            pass

    threading.Thread(target=run, daemon=True, name="async_rlhf-http-weights").start()
    return await future
