"""transformers' continuous batching as a generator backend: `ContinuousBatchingBackend`, the transformers policy of
`HFBackend` sampled by transformers' `ContinuousBatchingManager` (paged attention, requests scheduled token by token).

What it owns: the model (loaded and swapped as `HFBackend` does) and one manager, whose background thread runs the
decode loop (transformers' own, started with `manager.start()`). The streaming engine (`engine.py`) talks to it
through `add`, `cancel`, `results` and `paused`; `generate` (the `GeneratorBackend` call) runs a whole batch through
the same manager, for tests and for a caller that wants one call.

Behaviour log-probs. The manager is built with `return_logprobs=True`: its sampler returns `log(softmax(scores))[token]`
where `scores` are the logits after its processors (temperature, then top-k, then top-p, then min-p: transformers'
`_get_logits_processor` order, filtered tokens at -inf), so each log-prob is that of the distribution the token was
drawn from, as `HFBackend`'s and vLLM's processed log-probs are. At temperature 0 it takes the argmax and the
log-prob is the raw `log_softmax`, as with the other two backends.

What it cannot honour, refused with a message (`unsupported`): `repetition_penalty` other than 1 (transformers drops
that processor under continuous batching: it sees only each sequence's last token). The processors are fixed when a
manager is built, so a manager serves one sampling setting; a request with another setting waits for no one: the
manager is rebuilt when nothing is running, and refused while samples of another setting run.

Seeds. transformers' continuous batching has no per-request seed: every running sample draws from torch's global
generator, which the manager seeds once, when it starts, with the generator's `seed` (`ContinuousBatchingConfig.seed`;
the run's seed + generator index). `SamplingSettings.seed` is therefore not used. Samples are reproducible only for the
same requests reaching the decode loop at the same steps: one `generate` call on a fresh backend draws the same
samples each time, but in a generator process the loop picks requests up as they arrive, so which samples share a
step, and so which random numbers each draws, depends on timing. The samples stay samples of the policy either way,
with exact behaviour log-probs.

Settings that would break the guarantees are forced (`FORCED`; a `continuous_batching_config` that asks otherwise is
refused by the config): block sharing off (prefix blocks cached under old weights would be reused after a load),
no CPU offloading of the cache (a request offloaded before a load would come back with keys and values of the old
weights), no asynchronous double-buffered batching (a step launched before a pause could deliver old-weight tokens
after a load), logprobs on.

Cache size (what made it slow on CPU). Left to itself transformers sizes the paged cache from the device's free
memory, on CPU from host RAM: about 20 GiB here, 21 s to allocate before the first token (the tiny test policy, 4
prompts x 10 tokens: 27 s in all, against 0.03 s with 16 pages of 16 tokens), then a MemoryError for the next manager
of the process. Its static attention masks are [max_batch_tokens, cache tokens + max_batch_tokens], so the two sizes
multiply: with the default 8192 batch tokens a 1M-token cache asks for 34 GB of masks alone. On CPU this backend
therefore fixes `page_size` 32, `max_batch_tokens` 512 and `num_blocks` for at most `CPU_CACHE_TOKENS` tokens and at
most `kv_cache_memory_bytes` of keys and values (default 1 GiB, vLLM's CPU default); on GPU it keeps transformers'
sizing with `max_memory_percent` 0.5, as TRL does (the learner needs the rest). Anything the user passes wins. A full
cache is not an error: transformers frees a running sample's cache and prefills it again later (same weights, same
result).
"""

from __future__ import annotations

import contextlib
import time

import torch

from async_rlhf.config.checks import CONTINUOUS_BATCHING_FORCED
from async_rlhf.generation.engine.hf_backend import HFBackend
from async_rlhf.types import Completion, SamplingSettings, WeightUpdate

FORCED = CONTINUOUS_BATCHING_FORCED  # what the guarantees above need; the config refuses other values
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
CPU_CACHE_TOKENS = 32768  # the most tokens a CPU cache holds by default (module docstring: the masks)
CPU_PAGE_SIZE = 32
CPU_MAX_BATCH_TOKENS = 512
GPU_MAX_MEMORY_PERCENT = 0.5  # TRL's default for its continuous-batching generation
GENERATE_TIMEOUT = 600.0  # seconds one `generate` call may take
STOP_TIMEOUT = 10.0  # seconds `close` waits for the decode loop to end


def cpu_num_blocks(model_config, dtype_bytes: int, page_size: int = CPU_PAGE_SIZE,
                   kv_cache_memory_bytes: int | None = None) -> int:
    """Pages of the CPU cache: keys and values of at most `CPU_CACHE_TOKENS` tokens, within `kv_cache_memory_bytes`
    (default `DEFAULT_CPU_KV_CACHE_BYTES`)."""
    text = model_config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * heads * head_dim * dtype_bytes  # keys, values
    tokens = min(CPU_CACHE_TOKENS, (kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES) // per_token)
    return max(4, tokens // page_size)


def unsupported(settings: SamplingSettings) -> str | None:
    """Why transformers' continuous batching cannot sample with `settings` (None: it can)."""
    if settings.repetition_penalty != 1.0:
        return (f"repetition_penalty={settings.repetition_penalty}: transformers' continuous batching drops the "
                "repetition penalty (its processors see only each sequence's last token); use repetition_penalty=1 "
                "or another generator backend")
    return None


def _setting(settings: SamplingSettings) -> tuple:
    """What a manager is built for: the processors and whether it samples (not the budget, n or seed)."""
    if settings.temperature == 0:
        return (False,)
    return (True, settings.temperature, max(settings.top_k, 0), settings.top_p, settings.min_p)


class ContinuousBatchingBackend(HFBackend):
    """A transformers policy sampled by transformers' continuous-batching manager. One caller thread (the generator's
    serve loop); the manager's decode loop runs in its own thread and touches the model only between `paused` blocks."""

    name = "transformers-continuous-batching"

    def __init__(self, model_path: str, device: str = "cpu", seed: int = 0, dtype: str = "float32",
                 continuous_batching: dict | None = None, kv_cache_memory_bytes: int | None = None) -> None:
        super().__init__(model_path, device=device, seed=seed, dtype=dtype)
        self.seed = seed
        self.cb_config = self._resolve(dict(continuous_batching or {}), kv_cache_memory_bytes)
        print(f"sampling with transformers' continuous batching: {self.cb_config}", flush=True)  # the process log
        self.manager = None
        self.setting: tuple | None = None
        self.running: set[str] = set()  # request ids added and not yet seen finished or cancelled
        self._calls = 0

    def _resolve(self, given: dict, kv_cache_memory_bytes: int | None) -> dict:
        """The `ContinuousBatchingConfig` arguments: `given` over this device's defaults, with `FORCED`."""
        clash = {k: v for k, v in given.items() if k in FORCED and v != FORCED[k]}
        if clash:
            raise ValueError(f"continuous_batching_config: {clash} would break this backend's guarantees "
                             f"(it needs {FORCED}; see experimental/continuous_batching/backend.py)")
        config = {"seed": self.seed}
        if self.device.type == "cpu":
            config["page_size"] = page = given.get("page_size", CPU_PAGE_SIZE)
            config["max_batch_tokens"] = CPU_MAX_BATCH_TOKENS
            if "num_blocks" not in given:
                config["num_blocks"] = cpu_num_blocks(self.model.config, self.model.dtype.itemsize, page,
                                                      kv_cache_memory_bytes)
        else:
            config["max_memory_percent"] = GPU_MAX_MEMORY_PERCENT
        return {**config, **given, **FORCED}

    # ---- the manager -----------------------------------------------------------------------------------------
    def use(self, settings: SamplingSettings) -> None:
        """Have a running manager built for `settings`; rebuilt if it was built for others and nothing runs."""
        why = unsupported(settings)
        if why is not None:
            raise ValueError(why)
        setting = _setting(settings)
        if self.manager is not None and setting == self.setting:
            return
        if self.running:
            raise ValueError(f"continuous batching serves one sampling setting at a time: {len(self.running)} samples "
                             f"of {self.setting} are running and a request asks for {setting}")
        self._stop()
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        warpers = {}
        if setting[0]:
            warpers = dict(temperature=settings.temperature, top_k=max(settings.top_k, 0), top_p=settings.top_p)
            if settings.min_p > 0:
                warpers["min_p"] = settings.min_p
        generation = GenerationConfig(do_sample=setting[0], max_new_tokens=settings.max_new_tokens,
                                      eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id, **warpers)
        self.manager = self.model.init_continuous_batching(
            generation_config=generation, continuous_batching_config=ContinuousBatchingConfig(**self.cb_config))
        self.manager.start()
        self.setting = setting

    def add(self, request_id: str, prompt_ids: list[int], budget: int, streaming: bool = True) -> None:
        """Start sampling one sequence after `prompt_ids`, at most `budget` tokens (after `use`). `streaming`: every
        step reports its tokens so far; else only the finished sample."""
        if self.manager is None:
            raise RuntimeError("ContinuousBatchingBackend.add before use(settings)")
        added = self.manager.add_request(list(prompt_ids), request_id=request_id, max_new_tokens=budget,
                                         streaming=streaming, eos_token_id=sorted(self.eos_ids))
        if added is None:
            raise RuntimeError(f"transformers' continuous batching refused request {request_id}: {self._why()}")
        self.running.add(request_id)

    def cancel(self, request_id: str) -> None:
        """Stop sampling `request_id` (takes effect at the loop's next step; nothing more is reported for it)."""
        self.running.discard(request_id)
        self.manager.cancel_request(request_id)

    def results(self, wait: float) -> list:
        """Every `GenerationOutput` reported so far (waiting up to `wait` s for the first): the tokens so far of each
        streaming sample that took a step, and finished samples. Raises if the decode loop died or a sample failed."""
        if self.manager is None:
            return []
        out = []
        first = self.manager.get_result(timeout=wait)
        while first is not None:
            out.append(first)
            first = self.manager.get_result(timeout=0)
        for r in out:
            if r.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed request {r.request_id}: {r.error}")
            if r.is_finished():
                self.running.discard(r.request_id)
        if not out and self.running and not self.manager.is_running():
            raise RuntimeError(f"transformers' continuous batching loop stopped with samples running: {self._why()}")
        return out

    def _why(self) -> str:
        status = self.manager.background_thread_status
        return repr(status.fatal_error) if status.fatal_error is not None else "its loop is not running"

    @contextlib.contextmanager
    def paused(self):
        """The decode loop parked between two steps (every token it sampled before is in `results`); it resumes on
        exit. The wait is one decode step at most: transformers ends it with an error if the loop dies meanwhile."""
        if self.manager is None or not self.manager.is_running():
            yield
            return
        with self.manager.pause():
            yield

    def _stop(self) -> None:
        if self.manager is None:
            return
        manager, self.manager, self.setting = self.manager, None, None
        self.running.clear()
        manager.stop(block=True, timeout=STOP_TIMEOUT, hard_stop=True)
        manager.destroy()

    # ---- GeneratorBackend ------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], settings: SamplingSettings,
                 max_new_tokens: list[int] | None = None) -> list[list[Completion]]:
        """All `settings.n` samples of every prompt as separate sequences of one manager; returns when the last ends
        (at most `GENERATE_TIMEOUT` s). Not while a streaming engine has samples running here."""
        if self.running:
            raise RuntimeError("ContinuousBatchingBackend.generate while streamed samples are running")
        self.use(settings)
        self._calls += 1
        n, where = settings.n, {}
        with self.paused():  # every sequence reaches the decode loop at the same step
            for p, ids in enumerate(prompt_token_ids):
                budget = max_new_tokens[p] if max_new_tokens else settings.max_new_tokens
                for i in range(n):
                    rid = f"generate-{self._calls}.{p}.{i}"
                    where[rid] = (p, i)
                    self.add(rid, ids, budget, streaming=False)
        done: dict[str, Completion] = {}
        deadline = time.monotonic() + GENERATE_TIMEOUT
        while len(done) < len(where):
            if time.monotonic() > deadline:
                raise TimeoutError(f"continuous batching: {len(where) - len(done)} of {len(where)} samples not done "
                                   f"after {GENERATE_TIMEOUT:.0f} s")
            for r in self.results(wait=0.1):
                if r.request_id in where and r.is_finished():
                    done[r.request_id] = self.completion(r.generated_tokens, r.logprobs)
        out = [[None] * n for _ in prompt_token_ids]
        for rid, (p, i) in where.items():
            out[p][i] = done[rid]
        return out

    def completion(self, tokens: list[int], logprobs: list[float], version_starts=None) -> Completion:
        """A finished sample: 'stop' when it ends on EOS, else 'length' (its budget)."""
        if len(tokens) != len(logprobs):
            raise RuntimeError(f"continuous batching returned {len(logprobs)} log-probs for {len(tokens)} tokens")
        reason = "stop" if tokens and tokens[-1] in self.eos_ids else "length"
        return Completion(list(tokens), [float(x) for x in logprobs], reason, version_starts or [])

    def load_weights(self, update: WeightUpdate) -> None:
        """Load `update` with the decode loop parked (samples running keep the keys and values they had: the
        streaming engine restarts them, `engine.py`)."""
        with self.paused():
            self.swap_weights(update)

    def swap_weights(self, update: WeightUpdate) -> None:
        """Copy `update` into the model in place (`HFBackend.load_weights`); only inside `paused`, or idle."""
        HFBackend.load_weights(self, update)

    def close(self) -> None:
        """Stop the decode loop, then free the model. Idempotent."""
        try:
            self._stop()
        finally:
            super().close()
