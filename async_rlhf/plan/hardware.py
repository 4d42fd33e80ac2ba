"""Device profiles: what the cost model needs to know about a device, analytical or measured.

The GPU profiles below are **analytical**: vendor datasheet peaks (dense bf16 tensor FLOP/s, HBM bandwidth, memory,
NVLink / PCIe bandwidth per direction, a 400 Gb/s (H100, H200) or 200 Gb/s (A100, L40S) network port per GPU)
times efficiencies that are assumptions, not measurements (training MFU 0.40, decode at 0.6 of HBM bandwidth,
collectives at 0.7 of link bandwidth). The `cpu` profile holds what was measured on the 2-core AMD EPYC machine
this project is developed on, for the built-in task's policy (docs/planning.md). `python benchmarks/device_profile.py --model PATH
--output profile.json` measures the machine at hand; `--profile profile.json` makes the planner use it
(`load_profile`), and whatever it measured replaces the analytical value.
"""

from __future__ import annotations

import dataclasses
import json

GB = 1e9


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    name: str
    source: str                     # "analytical (...)" or "measured (...)": printed with every plan
    peak_flops: float               # dense bf16 (fp32 on CPU) FLOP/s
    mem_bandwidth: float            # bytes/s, device memory
    memory: float                   # bytes per device
    link_bandwidth: float           # bytes/s per device per direction inside a node (NVLink, or PCIe peer-to-peer)
    network_bandwidth: float        # bytes/s per device between nodes
    host_bandwidth: float           # bytes/s device <-> host RAM (PCIe)
    gpus_per_node: int = 8
    dtype_bytes: int = 2            # weights and activations (bf16 on GPU, fp32 on CPU)
    train_mfu: float = 0.40         # training FLOP/s over peak, at a saturating micro-batch
    prefill_efficiency: float = 0.5
    decode_bw_efficiency: float = 0.6
    comm_efficiency: float = 0.7
    decode_step_overhead: float = 2e-3   # seconds per engine step besides memory traffic (launch, sampling)
    shm_bandwidth: float = 10 * GB       # host RAM bytes/s writing and reading the shared-memory weight files
    cpu_adam_params_per_s: float = 1e9   # optimizer offload: parameters updated per second per rank
    # measured engine, when a profile has one: seconds per step = overhead + per_seq * running (this model only)
    engine_overhead: float | None = None
    engine_per_seq: float | None = None
    engine_prefill_token: float | None = None
    engine_model_params: float | None = None
    learner_tokens_per_s: float | None = None  # measured forward+backward tokens/s per device (that model)
    sync_seconds_per_gb: float | None = None       # measured: learner side (gather + publish), per GB of weights
    load_seconds_per_gb: float | None = None       # measured: a generator loading them
    kind: str = "gpu"


def _gpu(name, flops, bw, mem, link, net, host) -> DeviceProfile:
    return DeviceProfile(name, "analytical (datasheet peaks x assumed efficiencies)", flops, bw, mem * GB,
                         link * GB, net * GB, host * GB)


PROFILES = {
    "H100": _gpu("H100 SXM 80GB", 989e12, 3.35e12, 80, 450, 50, 50),
    "H200": _gpu("H200 SXM 141GB", 989e12, 4.8e12, 141, 450, 50, 50),
    "A100": _gpu("A100 SXM 80GB", 312e12, 2.039e12, 80, 300, 25, 25),
    "L40S": _gpu("L40S 48GB", 362e12, 0.864e12, 48, 25, 25, 25),
    # measured: the stage times of the S = 0, 1 learner + 1 generator run of benchmarks/simulator_validation.py
    # (evals/results/simulator_validation, built-in task policy of 1.2M parameters, one thread per process, fp32);
    # the analytical fields are placeholders that the measured ones override for the model it measured
    "cpu": DeviceProfile(
        "CPU, 2-core AMD EPYC (one core per process)",
        "measured (stage times of a built-in task run, evals/results/simulator_validation)",
        peak_flops=2.0e10, mem_bandwidth=10 * GB, memory=12 * GB, link_bandwidth=2 * GB, network_bandwidth=1 * GB,
        host_bandwidth=10 * GB, gpus_per_node=2, dtype_bytes=4, train_mfu=1.0, prefill_efficiency=1.0,
        decode_bw_efficiency=1.0, comm_efficiency=1.0, decode_step_overhead=0.0, engine_overhead=0.0,
        engine_per_seq=8.0e-4, engine_prefill_token=0.0, engine_model_params=1.215e6, learner_tokens_per_s=6850.0,
        sync_seconds_per_gb=1.8, load_seconds_per_gb=5.2, kind="cpu"),
}
ALIASES = {"H100_SXM": "H100", "H100-SXM": "H100", "A100_80GB": "A100", "A100-80GB": "A100", "CPU": "cpu"}


def get_profile(gpu_type: str) -> DeviceProfile:
    key = ALIASES.get(gpu_type, gpu_type)
    key = next((k for k in PROFILES if k.lower() == key.lower()), key)
    if key not in PROFILES:
        raise ValueError(f"gpu_type: unknown device {gpu_type!r}; known: {sorted(PROFILES)} "
                         "(or measure one: python benchmarks/device_profile.py --model PATH --output profile.json)")
    return PROFILES[key]


def load_profile(path: str, base: DeviceProfile | None = None) -> DeviceProfile:
    """A profile written by `benchmarks/device_profile.py`, over `base` (default: the `cpu` profile): what was measured
    replaces the base's value; the source says so."""
    with open(path) as f:
        data = json.load(f)
    base = base or PROFILES["cpu"]
    fields = {f.name for f in dataclasses.fields(DeviceProfile)}
    device = data.get("device", {})
    unknown = sorted(set(device) - fields)
    if unknown:
        raise ValueError(f"{path}: device has unknown fields {unknown}; expected some of {sorted(fields)}")
    updates = dict(device)
    gen, learn, sync = data.get("generation", {}), data.get("learner", {}), data.get("weight_sync", {})
    if "fit" in gen:
        updates.update(engine_overhead=gen["fit"]["overhead_s"], engine_per_seq=gen["fit"]["per_seq_s"],
                       engine_prefill_token=gen.get("prefill_token_s", 0.0),
                       engine_model_params=data.get("model", {}).get("params"))
    if "tokens_per_s" in learn:
        updates["learner_tokens_per_s"] = learn["tokens_per_s"]
    if sync:  # the fastest transport measured
        best = min(sync.values(), key=lambda v: v["seconds_per_gb"])
        updates["sync_seconds_per_gb"] = best.get("publish_seconds_per_gb", best["seconds_per_gb"])
        updates["load_seconds_per_gb"] = best.get("load_seconds_per_gb", best["seconds_per_gb"])
    updates["source"] = f"measured ({path}: {data.get('machine', 'unknown machine')})"
    return dataclasses.replace(base, **updates)
