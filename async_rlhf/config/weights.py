"""How weights reach the generators: the transport (`weight_sync/`; which one each generator gets is decided by
`checks.choose_transport`), the network's engine and address, and how long a generator may take to load them.

Mixed into `config/base.AsyncRLConfig` under flat names, as TRL's are; types, ranges and relations are checked in
`config/checks.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from async_rlhf.config.checks import choose_transport


@dataclass
class WeightFields:
    """Plain fields with defaults, collected by the config class's dataclass machinery."""

    weight_sync_timeout: float = field(
        default=300.0, metadata={"help": "Seconds a generator may take to acknowledge a weight update."}
    )
    shm_dir: str = field(default="/dev/shm", metadata={"help": "RAM-backed directory for the shm weight transport."})
    weight_transport: str = field(
        default="auto",
        metadata={"help": "How weights reach each generator: 'auto' (CUDA IPC on learner rank 0's own GPU, shm on its "
                  "host, the network otherwise: a server that cannot read learner rank 0's shm_dir is recognised "
                  "by a probe file), or 'shm' / 'ipc' / 'network' for all (refused, naming the generator, where it "
                  "cannot work). 'network' is vLLM's weight-transfer interface over a group of its own per "
                  "generator: our gloo backend on CPU, vLLM's nccl one on GPUs (network_backend). Under ZeRO-3, when every "
                  "generator takes the network, each version is kept as every learner's own partitions and "
                  "assembled bucket by bucket as it is sent, so learner rank 0 never holds a whole version "
                  "(weight_sync/partitions.py)."},
    )
    network_backend: str = field(
        default="auto", metadata={"help": "The network transport's engine: 'gloo' (CPU; the generator runs our "
                                  "async_rlhf_gloo backend, the serve launcher's default), 'nccl' (vLLM's own; "
                                  "the generator must be started with --weight-transfer-config "
                                  "'{\"backend\": \"nccl\"}'), 'auto': nccl on a CUDA learner, else gloo."},
    )
    weight_sync_host: str = field(
        default="127.0.0.1",
        metadata={"help": "Address on learner rank 0 where network weight groups listen (generators on other hosts "
                  "must reach it). Anything but loopback needs allow_remote: gloo and NCCL authenticate nobody."},
    )
    allow_remote: bool = field(
        default=False, metadata={"help": "Let weight_sync_host be a non-loopback address (a private network)."},
    )

    @property
    def local_weight_transport(self) -> str:
        """What local generator processes get (`checks.choose_transport`): with 'auto', 'ipc' when every generator is
        colocated on learner rank 0's GPU (cuda:0 of its node: learners take cuda:0..n-1), else 'shm'."""
        same_gpu = self.colocate and not self.generator_servers and self.device.type == "cuda" and all(
            d == "cuda:0" for d in self.generator_devices)
        return choose_transport(self.weight_transport, "local generators", same_gpu=same_gpu, sees_shm=True)

    @property
    def network_engine(self) -> str:
        """'gloo' or 'nccl': `network_backend` with 'auto' resolved by the learner's device."""
        if self.network_backend != "auto":
            return self.network_backend
        return "nccl" if self.device.type == "cuda" else "gloo"
