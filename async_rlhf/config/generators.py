"""The generators: which engine samples, where and how they run, what they are sent, and how long anything
waits for them (`generation/`).

Mixed into `config/base.AsyncRLConfig` under flat names, as TRL's are; types, ranges and relations are checked in
`config/checks.py`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class GeneratorFields:
    """Plain fields with defaults, collected by the config class's dataclass machinery."""

    generator_backend: str = field(
        default="auto",
        metadata={"help": "Sampling engine in each generator process: 'vllm', 'transformers' or 'auto': transformers "
                  "where vLLM cannot serve the policy on the generator devices (architecture, dtype and head size, "
                  "read from the policy's config against the installed vLLM), with one warning naming why; where it "
                  "can, vLLM on GPU, and on CPU the one measured faster for this run (both timed on the policy once "
                  "per machine, cached; generation/pool/backend_probe.py), with one line giving the figures. The trainer "
                  "decides when it is built, before any generator starts, and writes the choice here. TRL's "
                  "use_vllm=True sets 'vllm' (False, TRL's default, leaves it). 'auto' never picks transformers' "
                  "continuous batching (the experimental continuous_batching option; not measured faster than "
                  "either); that option sets 'transformers' itself."},
    )
    generation_mode: str = field(
        default="auto",
        metadata={"help": "'stream': each prompt group is its own request, sampled as soon as it is admitted next to "
                  "whatever else the engine runs and returned the moment its samples end (vLLM, or transformers "
                  "with continuous_batching); 'batch': one "
                  "generate call per batch chunk, returned when its longest sample ends (the baseline); 'auto': "
                  "stream with vllm, batch with transformers (decided after generator_backend)."},
    )
    weight_load: str = field(
        default="drain",
        metadata={"help": "How a streaming generator loads new weights while samples are in flight: 'drain' (the "
                  "samples already started finish on the old weights first, so every sample has one version) or "
                  "'in_flight' (load at once; running samples continue on the new weights, every token keeps the "
                  "version and behaviour log-prob it was sampled with, and the staleness bound applies to the "
                  "oldest token). Multi-turn episodes (tools, environments) on batch-level generators: "
                  "'in_flight' loads the updates that arrive while a request's episodes run between two of their "
                  "turns (later turns sample with the new weights; `version_starts` records each turn's version), "
                  "'drain' only between requests."},
    )
    generator_assignment: str = field(
        default="tokens",
        metadata={"help": "How a streamed batch's groups are spread over several generators: 'tokens' (by expected "
                  "token load: each prompt's earlier completion lengths, else the run's mean, counting what each "
                  "generator still has in flight) or 'count' (equal numbers of prompts)."},
    )
    generator_devices: list[str] = field(
        default_factory=lambda: ["cpu"],
        metadata={"help": "One entry per generator process: 'cpu' or 'cuda:<i>' (a learner's GPU only with "
                  "colocate)."},
    )
    colocate: bool = field(
        default=False,
        metadata={"help": "Let generators share the learners' devices (one GPU for everything: what TRL's "
                  "vllm_mode='colocate' does; ours runs vLLM in generator processes either way). vLLM then takes vllm_gpu_memory_utilization of the GPU next to the "
                  "learner (0.3 leaves room for a small policy's training), and a generator on learner rank 0's GPU "
                  "receives weights as CUDA IPC handles to rank 0's copy (no bytes copied between processes); "
                  "elsewhere, and on CPU, through shm files as usual. Staleness and records are unchanged."},
    )
    generator_launcher: str = field(
        default="process",
        metadata={"help": "How generators start: 'process' (processes spawned by learner rank 0) or 'ray' (Ray actors, "
                  "a GPU each for cuda entries, placed by Ray: on any node of the cluster with weights over the "
                  "network when it has nodes besides rank 0's, else on rank 0's node; needs requirements-ray.txt)."},
    )
    generator_threads: int | None = field(
        default=None, metadata={"help": "torch/OMP threads per CPU generator (None: half the cores, at least 1)."}
    )
    learner_threads: int | None = field(
        default=None, metadata={"help": "torch threads per CPU learner rank (None: the cores left after the local "
                                        "generators' threads, shared among the local ranks, at least 1)."}
    )
    generator_early_start: bool = field(
        default=False,
        metadata={"help": "Spawn the generators in the trainer's constructor, so that their engines start while the "
                  "learner loads its models (generation/pool/early_start.py); train() uses them if they are what it "
                  "needs. The recipes turn it on; off by default so that a trainer built and not trained (a script "
                  "that inspects it, a test) starts no process."},
    )
    generator_start_timeout: float = field(
        default=600.0, metadata={"help": "Seconds to wait for a generator's engine to start, counted from its spawn "
                                         "(in the trainer's constructor with generator_early_start)."}
    )
    generator_max_restarts: int = field(
        default=3, metadata={"help": "Restarts allowed per generator that dies; then the run fails naming it."}
    )
    rollout_timeout: float = field(
        default=600.0,
        metadata={"help": "Seconds a learner waits for the rollouts of one step before failing. With several learner "
                  "ranks, the other ranks wait that long inside a collective, so it must stay at least 60 s "
                  "(ROLLOUT_TIMEOUT_MARGIN) below ddp_timeout, the process group's timeout: checked at start."},
    )
    generator_servers: list[str] | None = field(
        default=None,
        metadata={"help": "'host:port' (or 'http://host:port') of vLLM servers started separately with `python -m "
                  "async_rlhf.generation.serve`, driven over HTTP. When set, no local generator is started "
                  "(generator_devices is ignored). Weights go through vLLM's weight-transfer routes as files in "
                  "shm_dir, so the servers must run on learner rank 0's host. The bearer token, if the servers "
                  "need one, is read from the ASYNC_RLHF_GENERATOR_TOKEN environment variable (never a config "
                  "field: configs are saved with checkpoints)."},
    )
    vllm_gpu_memory_utilization: float = field(default=0.55, metadata={"help": "vLLM GPU memory fraction."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "vLLM tensor parallel size (GPU only)."})
    vllm_enforce_eager: bool = field(default=True, metadata={"help": "Disable CUDA graphs / compilation in vLLM."})
    vllm_max_model_len: int | None = field(default=None, metadata={"help": "vLLM max_model_len (None: max_length)."})

    def generator_device_fields(self) -> dict[str, list[str]]:
        """Every device a local generator may run on, by the field that names it (`generator_devices`, and the spare
        devices of an optional schedule)."""
        return {"generator_devices": list(self.generator_devices), **self.spare_generator_devices()}

    def cpu_learner_threads(self) -> int:
        """Threads for one CPU learner rank. More threads than free cores is far worse than fewer: OpenMP's
        barriers then wait on descheduled threads (measured here: a 0.7M-parameter forward/backward took 0.9 s
        with 1 thread and 4.5-9.7 s with 2 while a generator shared the 2 cores)."""
        if self.learner_threads is not None:
            return self.learner_threads
        cores = os.cpu_count() or 1
        local_generators = 0 if self.generator_servers else sum(d == "cpu" for d in self.generator_devices)
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return max(1, (cores - local_generators * self.generator_threads) // local_ranks)

    @property
    def streaming(self) -> bool:
        """Generators take one request per prompt group and answer each as it finishes (`generation_mode`)."""
        if self.generation_mode == "auto":
            return self.generator_backend == "vllm" or bool(self.generator_servers)
        return self.generation_mode == "stream"
