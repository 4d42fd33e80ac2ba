"""The trainer's HTTP calls to one vLLM server (`generation/serve.py`): sampling, health, and the weight routes.

Every call sends the bearer token (when one is set) and has a timeout; every failure becomes `ServerError` with a
message naming the route and what went wrong (status and the server's body, a refused token, a timeout, a reset
connection, JSON that is not what vLLM sends). Nothing here retries: the pool decides what a failure means.

* `generate` (async, aiohttp): one prompt's `n` samples from vLLM's token-in token-out route
  `/inference/v1/generate` (served with `--enable-scale-out`), with `logprobs: 0`, which vLLM answers with the
  sampled token's log-prob only (under `--logprobs-mode processed_logprobs`: of the distribution actually sampled),
  and with each sample's weight-version spans, so every token carries the policy version that sampled it. The
  answer is parsed strictly: a NaN/Infinity constant, a null log-prob (vLLM writes NaN as null) or vLLM's clamp value
  -9999.0 (a log-prob of -inf) is refused, as are token and log-prob lists of different lengths and spans that do
  not cover the sample from its first token.
* `WeightSyncClient` (blocking, `requests`): the four methods of vLLM's `VLLMWeightSyncClient`, which vLLM's
  trainer-side engines drive (`weight_sync/vllm_shm_engine.py`), plus `/pause?mode=keep`, `/resume` and
  `/reset_prefix_cache` for weight loads under running requests. vLLM's own `HTTPVLLMWeightSyncClient` sends no
  token, hence this one.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from typing import Any

from async_rlhf.config.checks import base_url
from async_rlhf.types import Completion, SamplingSettings

CLAMPED_LOGPROB = -9999.0  # vLLM's OpenAI layer writes max(logprob, -9999.0)


class ServerError(RuntimeError):
    """A call to a generator server failed (the message says which route and why)."""


class Unauthorized(ServerError):
    """The server refused the token (HTTP 401)."""


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


GENERATE = "/inference/v1/generate"  # vLLM's token-in token-out route (`--enable-scale-out`)


def generate_body(model: str, prompt: list[int], settings: SamplingSettings, seed: int | None) -> dict:
    return {"model": model, "token_ids": prompt, "output_mode": "tokens",
            "sampling_params": {"n": settings.n, "max_tokens": settings.max_new_tokens,
                                "temperature": settings.temperature, "top_p": settings.top_p,
                                "top_k": max(settings.top_k, 0), "min_p": settings.min_p,
                                "repetition_penalty": settings.repetition_penalty, "seed": seed, "logprobs": 0,
                                "detokenize": False}}


def _version(label: Any, default: int) -> int:
    """A weight-version label as vLLM returns it: ours (str(policy version)), or "default" before any update."""
    if label == "default":
        return default
    if not (isinstance(label, str) and label.isdigit()):
        raise ValueError(f"weight version {label!r} is not a policy version")
    return int(label)


def parse_generated(answer: Any, n: int, default_version: int, route: str = GENERATE) -> list[Completion]:
    """The `n` completions of one prompt from vLLM's `/inference/v1/generate` answer, in sample order, each with its
    tokens' weight versions (`default_version` for the server's start-up weights). Raises ServerError."""
    try:
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != n:
            raise ValueError(f"{len(choices)} choices for n={n}")
        out = []
        for c in choices:
            tokens, content = c["token_ids"], c["logprobs"]["content"]
            if not (isinstance(tokens, list) and isinstance(content, list) and len(tokens) == len(content)):
                raise ValueError("token_ids and logprobs.content differ in length (or are missing)")
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
                raise ValueError("token_ids must be non-negative integers")
            logprobs = []
            for t, (token, entry) in enumerate(zip(tokens, content)):
                lp = entry["logprob"]
                if entry["token_id"] != token:
                    raise ValueError(f"log-prob of token {entry['token_id']} for sampled token {token}")
                if not isinstance(lp, (int, float)) or isinstance(lp, bool) or not math.isfinite(lp) \
                        or lp <= CLAMPED_LOGPROB:
                    raise ValueError(f"non-finite behaviour log-prob {lp!r} for sample {c['index']}, token {t}")
                logprobs.append(float(lp))
            if c["finish_reason"] not in ("stop", "length"):
                raise ValueError(f"finish_reason {c['finish_reason']!r}")
            spans = c.get("weight_versions") or []
            starts = [[_version(sp["version"], default_version), sp["start"]] for sp in spans if sp["end"] > sp["start"]]
            if tokens and (not starts or starts[0][1] != 0):
                raise ValueError(f"weight_versions {spans} do not start at token 0 (is the server started with "
                                 "--enable-scale-out by `python -m async_rlhf.generation.serve`?)")
            out.append(Completion(token_ids=tokens, logprobs=logprobs, finish_reason=c["finish_reason"],
                                  version_starts=starts))
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


async def generate(session, url: str, model: str, prompt: list[int], settings: SamplingSettings, seed: int | None,
                   timeout: float, token: str, default_version: int) -> list[Completion]:
    answer = await request_json(session, "POST", url, GENERATE, timeout, token,
                                generate_body(model, prompt, settings, seed))
    return parse_generated(answer, settings.n, default_version)


class WeightSyncClient:
    """vLLM's `VLLMWeightSyncClient` over HTTP with our token and a timeout on every call (blocking: the pool runs
    it off its event loop)."""

    def __init__(self, url: str, token: str, timeout: float):
        self.url = url
        self.token = token
        self.timeout = timeout

    def _post(self, route: str, body: dict | None = None) -> Any:
        import requests

        try:
            response = requests.post(self.url + route, json=body, headers=auth_headers(self.token),
                                     timeout=(min(10.0, self.timeout), self.timeout))
        except requests.Timeout:
            raise ServerError(f"{route}: no answer within {self.timeout:.0f}s") from None
        except (requests.RequestException, OSError) as exc:
            raise ServerError(f"{route}: {type(exc).__name__}: {exc}") from None
        check_status(route, response.status_code, response.text)
        return parse_json(response.text, route)  # vLLM answers JSON: anything else is not a vLLM server

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("/start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("/finish_weight_update", {"weight_version": weight_version})

    # vLLM's pause/resume for asynchronous RL: with mode "keep", running requests stay in the engine, frozen, and
    # continue on whatever weights are loaded when generation resumes
    def pause_keep(self) -> None:
        self._post("/pause?mode=keep")

    def resume(self) -> None:
        self._post("/resume")

    def reset_prefix_cache(self) -> None:
        """Drop cached blocks computed by the old weights; running requests recompute theirs (vLLM preempts them)."""
        route = "/reset_prefix_cache?reset_running_requests=true"
        if not (self._post(route) or {}).get("success"):
            raise ServerError(f"{route}: the server could not reset its prefix cache")


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
