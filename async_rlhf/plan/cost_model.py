"""The cost model: seconds per stage and bytes per device for one plan, from a model shape and a device profile.

Every formula is first-order and says what it counts (P: policy parameters, n_l: learner ranks, b: dtype bytes):
- **Learner memory per device** (mixed precision, Adam): b*P weights + b*P gradients + 12*P optimizer state (fp32
  master weights, two moments), split by ZeRO stage: 0 none, 1 optimizer / n_l, 2 gradients and optimizer / n_l,
  3 everything / n_l (the ZeRO paper's 2+2+12 = 16 bytes per parameter in bf16). Offload (our
  `gpu_deepspeed_zero3_offload.yaml`: ZeRO-3, parameters and optimizer in host RAM) keeps the gradients' share and
  two layers of gathered parameters on the device. Plus the frozen reference model (b*P, partitioned under ZeRO-3),
  the reward model (b*R, likewise), activations with gradient checkpointing (each layer's input, b*h per token per
  layer, plus one layer's full activations, about 34*h*b/2 bytes per token) and fp32 logits (4*V per token).
- **Generator memory per device**: b*P/tp weights, 2 GB of engine buffers, and the KV cache in what is left of
  `gpu_memory_utilization`; the plan fits when the cache holds at least one full-length sequence, and the engine
  then runs at most as many sequences at once as it holds.
- **Decode** (memory-bound): a step reads the weights (b*P/tp bytes) and every running sequence's KV cache at
  `decode_bw_efficiency` of HBM bandwidth, or is compute-bound (2*P/tp FLOPs per sequence) past the knee; plus a fixed
  step overhead. **Prefill**: 2*P/tp FLOPs per prompt token at `prefill_efficiency`.
- **Training**: FLOPs per trained token of online DPO = 6P (policy forward+backward) + 2P (recomputed forward,
  gradient checkpointing) + 2P (reference forward) + 2R (reward forward), at `train_mfu` of peak, scaled down for
  small micro-batches (efficiency tokens / (tokens + 1024)); ZeRO communication at `comm_efficiency` of the slowest
  link the learners span: gradient all-reduce (ZeRO-0) or reduce-scatter + parameter all-gather (1, 2), and under
  ZeRO-3 three parameter gathers and a reduce-scatter per micro-batch (half hidden behind compute; DeepSpeed
  prefetches); offload adds the host copies and a CPU Adam step.
- **Weight sync**: the ZeRO-3 gather (b*P over the learners' link), rank 0's copy to host, the shared-memory file
  write (learner) and each generator's read and copy to its device (generator; `load_seconds`).
A measured profile (`hardware.load_profile`) replaces the engine, learner throughput and sync rate where it has them
(scaled by parameter count when it measured a different model).
"""

from __future__ import annotations

import dataclasses
import math

from async_rlhf.plan.hardware import GB, DeviceProfile
from async_rlhf.plan.model_shapes import ModelShape
from async_rlhf.plan.simulator import EngineModel

ENGINE_BUFFERS = 2 * GB          # vLLM activations, CUDA graphs, allocator slack (assumed)
LEARNER_HEADROOM = 2 * GB        # CUDA context and fragmentation (assumed)
GPU_MEMORY_UTILIZATION = 0.9     # what the planner's commands pass as --vllm_gpu_memory_utilization
MAX_NUM_SEQS = 256               # vLLM's default cap on running sequences


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts_per_step: int = 64
    n: int = 2
    prompt_tokens: int = 256
    response_mean: float = 256.0
    response_cv: float = 0.5         # coefficient of variation of response lengths (lognormal)
    response_max: int = 1024
    reward_params: float | None = None   # None: the same size as the policy

    def __post_init__(self):
        for name in ("prompts_per_step", "n", "prompt_tokens", "response_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.response_mean <= self.response_max:
            raise ValueError(f"response_mean: must be in [1, response_max={self.response_max}], got {self.response_mean}")
        if self.response_cv < 0:
            raise ValueError(f"response_cv: must be >= 0, got {self.response_cv}")

    def lengths(self, k: int = 256) -> tuple[int, ...]:
        """k quantiles of a lognormal with this mean and coefficient of variation, capped at response_max."""
        if self.response_cv == 0:
            return (round(self.response_mean),)
        sigma = math.sqrt(math.log(1 + self.response_cv ** 2))
        mu = math.log(self.response_mean) - sigma ** 2 / 2
        from statistics import NormalDist

        z = NormalDist()
        return tuple(min(self.response_max, max(1, round(math.exp(mu + sigma * z.inv_cdf((i + 0.5) / k)))))
                     for i in range(k))

    @property
    def samples(self) -> int:
        return self.prompts_per_step * self.n


@dataclasses.dataclass(frozen=True)
class Plan:
    learners: int
    generators: int
    tp: int = 1
    zero_stage: int = 3
    offload: bool = False
    micro_batch: int = 1             # prompts per learner per micro-batch (per_device_train_batch_size)
    max_staleness: int = 1
    nodes: int = 1

    @property
    def gpus(self) -> int:
        return self.learners + self.generators * self.tp

    def grad_accum(self, w: Workload) -> int:
        return w.prompts_per_step // (self.micro_batch * self.learners)


def learner_memory(shape: ModelShape, dev: DeviceProfile, w: Workload, plan: Plan) -> dict[str, float]:
    """Bytes per learner device, by kind."""
    P, b, n = shape.params, dev.dtype_bytes, plan.learners
    R = w.reward_params if w.reward_params is not None else P
    weights, grads, optim = b * P, b * P, 12.0 * P
    if plan.zero_stage >= 1:
        optim /= n
    if plan.zero_stage >= 2:
        grads /= n
    if plan.zero_stage >= 3:
        weights /= n
    if plan.offload:  # ZeRO-3 with parameters and optimizer in host RAM: two gathered layers stay on the device
        weights, optim = 2 * b * P / max(shape.layers, 1), 0.0
    frozen = b * (P + R) / (n if plan.zero_stage == 3 else 1)
    tokens = plan.micro_batch * w.n * (w.prompt_tokens + w.response_max)  # padded micro-batch
    activations = tokens * shape.hidden * b * shape.layers + tokens * 17 * shape.hidden * b
    logits = tokens * shape.vocab * 4.0
    out = {"weights": weights, "gradients": grads, "optimizer": optim, "reference+reward": frozen,
           "activations": activations + logits, "headroom": LEARNER_HEADROOM if dev.kind == "gpu" else 0.0}
    out["total"] = sum(out.values())
    return out


def generator_memory(shape: ModelShape, dev: DeviceProfile, w: Workload, tp: int) -> dict[str, float]:
    """Bytes per generator device; `max_running`: full-length sequences the KV cache holds."""
    weights = dev.dtype_bytes * shape.params / tp
    usable = (GPU_MEMORY_UTILIZATION if dev.kind == "gpu" else 1.0) * dev.memory
    kv_room = usable - weights - (ENGINE_BUFFERS if dev.kind == "gpu" else 0.0)
    per_seq = (w.prompt_tokens + w.response_max) * shape.kv_bytes_per_token(dev.dtype_bytes) / tp
    running = int(kv_room // per_seq) if kv_room > 0 else 0
    return {"weights": weights, "kv_cache": max(kv_room, 0.0), "total": usable, "max_running": min(running, MAX_NUM_SEQS)}


def engine_model(shape: ModelShape, dev: DeviceProfile, w: Workload, tp: int) -> EngineModel:
    running = max(1, generator_memory(shape, dev, w, tp)["max_running"])
    if dev.engine_per_seq is not None:  # measured engine; another model's time scales with its parameters
        scale = shape.params / dev.engine_model_params if dev.engine_model_params else 1.0
        return EngineModel(overhead=dev.engine_overhead * max(1.0, scale) ** 0.5, compute_per_seq=dev.engine_per_seq * scale,
                           prefill_token=(dev.engine_prefill_token or 0.0) * scale, max_running=running)
    bw = dev.mem_bandwidth * dev.decode_bw_efficiency * tp
    context = w.prompt_tokens + w.response_mean / 2
    tp_latency = 2 * shape.layers * 15e-6 if tp > 1 else 0.0  # two all-reduces per layer, ~15 us each (assumed)
    return EngineModel(
        overhead=dev.decode_step_overhead + tp_latency,
        weight_read=dev.dtype_bytes * shape.params / bw,
        kv_per_seq=context * shape.kv_bytes_per_token(dev.dtype_bytes) / bw,
        compute_per_seq=2 * shape.params / (dev.peak_flops * dev.prefill_efficiency * tp),
        prefill_token=2 * shape.params / (dev.peak_flops * dev.prefill_efficiency * tp),
        max_running=running)


def _learner_link(dev: DeviceProfile, plan: Plan) -> float:
    spans_nodes = plan.learners > dev.gpus_per_node or plan.nodes > 1 and plan.learners > 1
    return (dev.network_bandwidth if spans_nodes else dev.link_bandwidth) * dev.comm_efficiency


def train_seconds(shape: ModelShape, dev: DeviceProfile, w: Workload, plan: Plan) -> float:
    """One optimizer step of online DPO on all learners (weight sync excluded)."""
    P, n, b = shape.params, plan.learners, dev.dtype_bytes
    R = w.reward_params if w.reward_params is not None else P
    tokens = w.samples * (w.prompt_tokens + w.response_mean)
    micro_tokens = plan.micro_batch * w.n * (w.prompt_tokens + w.response_mean)
    if dev.learner_tokens_per_s is not None:  # measured forward+backward throughput (policy only)
        compute = tokens / (dev.learner_tokens_per_s * n) * (1 + 2 * R / (6 * P))
    else:
        flops = tokens * (10 * P + 2 * R)
        efficiency = dev.train_mfu * micro_tokens / (micro_tokens + 1024)
        compute = flops / (n * dev.peak_flops * efficiency)
    comm = 0.0
    if n > 1:
        link, share = _learner_link(dev, plan), (n - 1) / n
        micro = plan.grad_accum(w)
        if plan.zero_stage == 0:
            comm = 2 * b * P * share * 2 / link
        elif plan.zero_stage in (1, 2):
            comm = 2 * b * P * share / link * (micro if plan.zero_stage == 2 else 1)
        else:  # 3 gathers (forward, recomputed forward, backward) + reduce-scatter per micro-batch, half hidden
            comm = 0.5 * micro * (4 * b * P + b * (P + R)) * share / link
    offload = 0.0
    if plan.offload:
        offload = 2 * b * P / n / dev.host_bandwidth * (plan.grad_accum(w) + 1) + P / n / dev.cpu_adam_params_per_s
    return compute + comm + offload


# seconds of the network transport's wire over those of a plain socket moving the same bytes on the same link: the
# worse of the two invocations of benchmarks/weight_broadcast.py in docs/performance.md (1.36x, one generator)
NETWORK_WIRE_RATIO = 1.36


def sync_seconds(shape: ModelShape, dev: DeviceProfile, plan: Plan, network: bool = False) -> tuple[float, float]:
    """(learner seconds per sync, generator seconds per load) for the shared-memory transport, or with `network` for
    the network transport (generators on any node): the learner is blocked for its copy of the weights only (the send
    runs on the pool's thread), and a generator's load is the bytes over the node's link at `NETWORK_WIRE_RATIO` of a
    socket. Under ZeRO-3 on the network each learner copies only its own partitions and rank 0 gathers the rest while
    it sends (`weight_sync/partitions.py`), so the gather moves from the learner's side to the generator's."""
    size = dev.dtype_bytes * shape.params
    if dev.sync_seconds_per_gb is not None and not network:
        return size / GB * dev.sync_seconds_per_gb, size / GB * (dev.load_seconds_per_gb or dev.sync_seconds_per_gb)
    gather = size / _learner_link(dev, plan) if plan.zero_stage == 3 and plan.learners > 1 else 0.0
    to_host = size / dev.host_bandwidth if dev.kind == "gpu" else 0.0
    if network:
        wire = size * NETWORK_WIRE_RATIO / (dev.network_bandwidth * dev.comm_efficiency)
        if gather:
            copy = size / plan.learners / (dev.host_bandwidth if dev.kind == "gpu" else dev.shm_bandwidth)
            return copy, gather + wire
        return to_host, wire
    publish = gather + to_host + size / dev.shm_bandwidth
    load = size / dev.shm_bandwidth + (size / plan.tp / dev.host_bandwidth if dev.kind == "gpu" else 0.0)
    return publish, load
