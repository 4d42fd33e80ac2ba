"""The search: every plan for a number of devices, priced by the cost model and timed by the simulator.

Enumerated: the generator/learner split, vLLM tensor parallel size (1, 2, 4, 8; generators of tp > 1 run as vLLM
servers), the learners' ZeRO stage (0 = DDP, 2, 3, 3 with offload: the configurations `launch/accelerate/` has; no
ZeRO-1 config exists, and several nodes have only the ZeRO-3 one), the micro-batch (prompts per learner per
micro-batch, dividing prompts per step) and `max_staleness` 0..4. A plan whose learner memory exceeds `FIT` of a
device, or whose generator cannot hold one full-length sequence, is dropped. Generators sit on node 0 (the
shared-memory weight transport needs the learners' host), so they get at most the GPUs of one node less node 0's
learners; `any_node_generators` lifts that: generators on any node, as vLLM servers whose weights cross nodes over the
network transport (`commands.any_node_command`), its sync costed as such (`cost_model.sync_seconds`).

For each split the fastest fitting learner set-up (ZeRO stage, offload, micro-batch) is kept: the others have the
same generation and a slower step. Each (split, staleness) is then simulated (`simulator.py`, streaming, drain).
The best plan is the fastest; between plans within `TIE` of each other the one with the smaller staleness (then
fewer GPUs) wins: a larger staleness costs learning (the paper's ablations), so it must buy time to be chosen.
Cost-aware (RLHFless): `deadline_hours` picks the plan of fewest GPU-hours (within `TIE`, the smallest staleness)
whose slowest of three length draws ends the run in time; `budget_gpu_hours` the fastest within the budget; both try every GPU count up to `gpus`.
"""

from __future__ import annotations

import dataclasses

from async_rlhf.plan import cost_model as cm
from async_rlhf.plan.hardware import DeviceProfile
from async_rlhf.plan.model_shapes import ModelShape
from async_rlhf.plan.simulator import SimConfig, simulate

TIE = 0.03
FIT = 0.95  # a learner plan must leave 5% of device memory free besides the cost model's headroom
SIM_STEPS = 16


@dataclasses.dataclass(frozen=True)
class Evaluated:
    plan: cm.Plan
    step_seconds: float
    worst_step_seconds: float       # slowest of three response-length draws
    train_seconds: float
    sync_seconds: float
    generation_seconds: float       # one batch on all generators, nothing else running
    learner_memory: float           # bytes per device
    generator_memory: float
    staleness_mean: float
    samples_per_step: int
    devices: int                    # devices the run holds (whole nodes when it spans several, idle ones included)

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.step_seconds

    def gpu_hours(self, steps: int) -> float:
        return self.devices * self.step_seconds * steps / 3600


def learner_setups(shape, dev, w, learners: int, nodes: int):
    """(train seconds, plan fields) of every learner set-up that fits, fastest first."""
    stages = [(3, False), (3, True)] if nodes > 1 else [(0, False), (2, False), (3, False), (3, True)]
    if learners == 1:
        stages = [(0, False)]
    out = []
    per_rank = w.prompts_per_step // learners
    for stage, offload in stages:
        for mb in (1, 2, 4, 8, 16, 32, 64):
            if w.prompts_per_step % (mb * learners) or mb > per_rank:
                continue
            plan = cm.Plan(learners, 1, zero_stage=stage, offload=offload, micro_batch=mb, nodes=nodes)
            mem = cm.learner_memory(shape, dev, w, plan)["total"]
            if mem <= FIT * dev.memory:
                out.append((cm.train_seconds(shape, dev, w, plan), mem, stage, offload, mb))
    return sorted(out, key=lambda o: (round(o[0], 9), -o[4], o[1]))  # equal times: fewer, larger micro-batches


def splits(dev: DeviceProfile, gpus: int, nodes: int, any_node_generators: bool):
    """(learners, generators, tp) using exactly `gpus` devices on `nodes` nodes."""
    per_node = dev.gpus_per_node if nodes > 1 else gpus
    for tp in (1, 2, 4, 8):
        if tp > per_node or (dev.kind == "cpu" and tp > 1):
            continue
        for g in range(1, gpus // tp + 1):
            if nodes == 1 or any_node_generators:
                learners = gpus - g * tp
                # on several nodes each generator's tp devices must sit on one node, beside that node's learners
                fits = nodes == 1 or (learners % nodes == 0 and
                                      nodes * ((per_node - learners // nodes) // tp) >= g)
                if learners >= 1 and fits:
                    yield learners, g, tp
            else:  # generators on node 0 beside its learners; the same number of learners on every node
                k = per_node - g * tp
                if k >= 1:
                    yield k * nodes, g, tp


def evaluate_split(shape: ModelShape, dev: DeviceProfile, w: cm.Workload, learners: int, generators: int, tp: int,
                   nodes: int, staleness=range(5), seeds: int = 1, devices: int | None = None,
                   micro_batch: int | None = None, network: bool = False) -> list[Evaluated]:
    """Each staleness of one split with its fastest fitting learner set-up (of micro-batch `micro_batch` if given);
    `network`: weights go over the network transport (generators on any node)."""
    gen_mem = cm.generator_memory(shape, dev, w, tp)
    if gen_mem["max_running"] < 1:
        return []
    setups = [s for s in learner_setups(shape, dev, w, learners, nodes) if micro_batch in (None, s[4])]
    if not setups:
        return []
    train, mem, stage, offload, mb = setups[0]
    engine = cm.engine_model(shape, dev, w, tp)
    lengths = w.lengths()
    out = []
    for s in staleness:
        plan = cm.Plan(learners, generators, tp, stage, offload, mb, s, nodes)
        publish, load = cm.sync_seconds(shape, dev, plan, network)
        times, stale = [], 0.0
        for seed in range(seeds):
            r = simulate(SimConfig(steps=max(SIM_STEPS, 4 * (s + 1)), max_staleness=s,
                                   prompts_per_step=w.prompts_per_step, n=w.n, engine=engine, lengths=lengths,
                                   train_seconds=train, sync_seconds=publish, load_seconds=load,
                                   generators=generators, prompt_tokens=w.prompt_tokens, seed=seed))
            times.append(r.steady_step_seconds)
            stale = r.staleness_mean if seed == 0 else stale
        alone = simulate(SimConfig(steps=1, max_staleness=0, prompts_per_step=w.prompts_per_step, n=w.n,
                                   engine=engine, lengths=lengths, train_seconds=0.0, generators=generators,
                                   prompt_tokens=w.prompt_tokens)).total_seconds
        out.append(Evaluated(plan, times[0], max(times), train, publish, alone, mem, gen_mem["weights"] +
                             gen_mem["kv_cache"], stale, w.samples,
                             devices or plan.gpus))
    return out


def search(shape: ModelShape, dev: DeviceProfile, w: cm.Workload, gpus: int, nodes: int = 1,
           any_node_generators: bool = False, gpu_counts: list[int] | None = None, seeds: int = 1,
           split: tuple[int | None, int | None, int | None] = (None, None, None)) -> list[Evaluated]:
    """Every fitting plan, fastest first; `split` = (learners, generators, tp) keeps only plans with those (None: any)."""
    if gpus < 2:
        raise ValueError(f"gpus: a plan needs at least 2 devices (one learner, one generator), got {gpus}")
    if nodes < 1 or (nodes > 1 and gpus != nodes * dev.gpus_per_node):
        raise ValueError(f"nodes: {nodes} nodes of {dev.gpus_per_node} devices hold {nodes * dev.gpus_per_node}, "
                         f"not gpus={gpus}")
    out = []
    for count in gpu_counts or [gpus]:
        n_nodes = nodes if count == gpus else max(1, -(-count // dev.gpus_per_node))
        if n_nodes > 1 and count != n_nodes * dev.gpus_per_node:
            continue
        for learners, generators, tp in splits(dev, count, n_nodes, any_node_generators):
            if any(want is not None and want != got for want, got in zip(split, (learners, generators, tp))):
                continue
            out += evaluate_split(shape, dev, w, learners, generators, tp, n_nodes, seeds=seeds, devices=count,
                                  network=any_node_generators and n_nodes > 1)
    return sorted(out, key=rank_key)


def rank_key(e: Evaluated):
    return (round(e.step_seconds, 6), e.plan.max_staleness, e.devices)


def best(plans: list[Evaluated]) -> Evaluated | None:
    """The fastest plan, or within TIE of it the one with the smallest staleness, then fewest GPUs."""
    if not plans:
        return None
    fastest = min(p.step_seconds for p in plans)
    near = [p for p in plans if p.step_seconds <= fastest * (1 + TIE)]
    return min(near, key=lambda p: (p.plan.max_staleness, p.devices, p.step_seconds))


def cost_aware(plans: list[Evaluated], steps: int, deadline_hours: float | None = None,
               budget_gpu_hours: float | None = None) -> Evaluated | None:
    """Cheapest plan that meets the deadline (slowest length draw), or fastest within the budget; None if none does."""
    if deadline_hours is not None:
        ok = [p for p in plans if p.worst_step_seconds * steps / 3600 <= deadline_hours]
        ok = [p for p in ok if budget_gpu_hours is None or p.gpu_hours(steps) <= budget_gpu_hours]
        if not ok:
            return None
        cheapest = min(p.gpu_hours(steps) for p in ok)  # within TIE of it, the smallest staleness
        near = [p for p in ok if p.gpu_hours(steps) <= cheapest * (1 + TIE)]
        return min(near, key=lambda p: (p.plan.max_staleness, p.gpu_hours(steps)))
    ok = [p for p in plans if p.gpu_hours(steps) <= budget_gpu_hours]
    return best(ok)
