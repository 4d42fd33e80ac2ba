"""The exact command that runs a plan, with our recipes' flags and our launch configs.

Learners take `cuda:0..k-1` of every node; generators the next devices of node 0. Generators of tensor parallel size
1 are our local generator processes (`--generator_devices`); larger ones are vLLM servers started first (one per
generator, `python -m async_rlhf.generation.serve ... --tensor-parallel-size tp` on its devices), reached with
`--generator_servers`. `HUB` stands for `--task hub --model_name_or_path <policy> --dataset_name <prompts>
--reward_model_path <reward model>`, as in the README.
"""

from __future__ import annotations

from async_rlhf.plan.cost_model import GPU_MEMORY_UTILIZATION, Plan, Workload

GPU_CONFIGS = {(0, False): "gpu_ddp.yaml", (2, False): "gpu_deepspeed_zero2.yaml", (3, False): "gpu_deepspeed_zero3.yaml",
               (3, True): "gpu_deepspeed_zero3_offload.yaml"}
CPU_CONFIGS = {0: "cpu_2proc_gloo.yaml", 2: "cpu_deepspeed_zero2.yaml", 3: "cpu_deepspeed_zero3.yaml"}


def recipe_flags(plan: Plan, w: Workload, cpu: bool) -> str:
    flags = [f"--per_device_train_batch_size {plan.micro_batch}",
             f"--gradient_accumulation_steps {plan.grad_accum(w)}", f"--num_generations {w.n}",
             f"--max_staleness {plan.max_staleness}"]
    if not cpu:
        flags += [f"--max_new_tokens {w.response_max}", f"--max_length {w.prompt_tokens + w.response_max}",
                  f"--vllm_gpu_memory_utilization {GPU_MEMORY_UTILIZATION}", "--gradient_checkpointing true",
                  "--bf16 true"]
    return " ".join(flags)


def launch_command(plan: Plan, w: Workload, cpu: bool = False, recipe: str = "recipes/online_dpo.py",
                   output_dir: str = "outputs/plan") -> str:
    """The command line(s) that run `plan` (servers first when tp > 1)."""
    flags = recipe_flags(plan, w, cpu)
    if cpu:
        gens = " ".join(["cpu"] * plan.generators)
        tail = f"{recipe} {flags} --generator_devices {gens} --output_dir {output_dir}"
        if plan.learners == 1:
            return f"python {tail}"
        config = CPU_CONFIGS[plan.zero_stage]
        return f"accelerate launch --config_file launch/accelerate/{config} --num_processes {plan.learners} {tail}"
    per_node = plan.learners // plan.nodes
    first = per_node
    if plan.learners == 1:
        launcher = "accelerate launch --config_file launch/accelerate/gpu_1learner.yaml"
    elif plan.nodes > 1:
        launcher = (f"accelerate launch --config_file launch/accelerate/multi_node_zero3.yaml --num_processes "
                    f"{plan.learners} --num_machines {plan.nodes} --machine_rank 0 --main_process_ip <node 0 address>")
    else:
        launcher = (f"accelerate launch --config_file launch/accelerate/{GPU_CONFIGS[(plan.zero_stage, plan.offload)]} "
                    f"--num_processes {plan.learners}")
    if plan.tp == 1:
        devices = ",".join(f"cuda:{first + i}" for i in range(plan.generators))
        return f"{launcher} {recipe} HUB {flags} --generator_devices {devices} --output_dir {output_dir}"
    servers, addresses = [], []
    for i in range(plan.generators):
        devs = ",".join(str(first + i * plan.tp + j) for j in range(plan.tp))
        port = 8760 + i
        servers.append(f"CUDA_VISIBLE_DEVICES={devs} python -m async_rlhf.generation.serve --model <policy> "
                       f"--port {port} --tensor-parallel-size {plan.tp} &")
        addresses.append(f"127.0.0.1:{port}")
    return ("export ASYNC_RLHF_GENERATOR_TOKEN=<secret>\n" + "\n".join(servers) + "\n"
            f"{launcher} {recipe} HUB {flags} --generator_servers {' '.join(addresses)} --output_dir {output_dir}")


def any_node_command(plan: Plan, w: Workload, gpus_per_node: int, recipe: str = "recipes/online_dpo.py",
                     output_dir: str = "outputs/plan") -> str:
    """The commands for a plan whose generators sit on any node (`--any_node_generators`): learners take
    `cuda:0..k-1` of every node, generators the next devices, node by node; every generator is a vLLM server (on
    node n, started there) reached with `--generator_servers`, and a server that cannot read node 0's `shm_dir` gets
    its weights over the network (vLLM's nccl engine on GPUs), so rank 0 listens on its node's address."""
    per_node = plan.learners // plan.nodes
    slots = [(n, first) for n in range(plan.nodes)  # a generator's tp devices stay on one node
             for first in range(per_node, gpus_per_node - plan.tp + 1, plan.tp)]
    if len(slots) < plan.generators:
        return (f"(no command: {plan.generators} generators of tp {plan.tp} do not fit on the devices the "
                f"{plan.learners} learners leave on {plan.nodes} nodes of {gpus_per_node} without splitting one)")
    lines, addresses = ["export ASYNC_RLHF_GENERATOR_TOKEN=<secret>  # on every node"], []
    for i in range(plan.generators):
        node, first = slots[i]
        devs = ",".join(str(d) for d in range(first, first + plan.tp))
        port = 8760 + i
        host = "127.0.0.1" if node == 0 else "0.0.0.0"
        remote = "" if node == 0 else " --allow_remote"
        lines.append(f"# node {node}: CUDA_VISIBLE_DEVICES={devs} python -m async_rlhf.generation.serve --model <policy> "
                     f"--host {host} --port {port} --tensor-parallel-size {plan.tp}{remote} --weight-transfer-config "
                     "'{\"backend\": \"nccl\"}' &")
        addresses.append(f"127.0.0.1:{port}" if node == 0 else f"<node {node} address>:{port}")
    launcher = (f"accelerate launch --config_file launch/accelerate/multi_node_zero3.yaml --num_processes "
                f"{plan.learners} --num_machines {plan.nodes} --machine_rank 0 --main_process_ip <node 0 address>"
                if plan.nodes > 1 else "accelerate launch --config_file launch/accelerate/gpu_deepspeed_zero3.yaml "
                f"--num_processes {plan.learners}")
    lines.append(f"{launcher} {recipe} HUB {recipe_flags(plan, w, cpu=False)} --generator_servers {' '.join(addresses)} "
                 f"--weight_sync_host <node 0 address> --allow_remote true --output_dir {output_dir}")
    return "\n".join(lines)


def ray_any_node_command(plan: Plan, w: Workload, cores_per_node: int, head: str = "<node 0 address>",
                         recipe: str = "recipes/online_dpo.py", output_dir: str = "outputs/plan") -> str:
    """The commands for a CPU plan whose generators sit on any node: a Ray cluster (the head on node 0, where every
    learner runs, offering Ray only the cores the learners leave; every core of the other nodes), then the learners
    with `--generator_launcher ray`, each generator an actor Ray places where a core is free, its weights over the
    network (`generation/pool/ray_launcher.py`). `head`: node 0's address as the other nodes reach it (a loopback one
    runs every node on this machine)."""
    if plan.learners > cores_per_node:
        return (f"(no command: the {plan.learners} CPU learners do not fit on node 0's {cores_per_node} cores; our "
                "CPU launch configs run the learners on one machine)")
    flags = recipe_flags(plan, w, cpu=True)
    launcher = (f"python {recipe}" if plan.learners == 1 else f"accelerate launch --config_file launch/accelerate/"
                f"{CPU_CONFIGS[plan.zero_stage]} --num_processes {plan.learners} {recipe}")
    remote = "" if head.startswith("127.") or head == "localhost" else " --allow_remote true"
    others = plan.nodes - 1
    return "\n".join([
        ("# every node: Ray's token authentication, with the same ~/.ray/auth_token (made once on node 0 by the "
         "second line)"),
        "export RAY_AUTH_MODE=token",
        "ray get-auth-token --generate > /dev/null",
        f"# node 0 (the learners'; Ray gets its {cores_per_node - plan.learners} spare core(s)):",
        f"ray start --head --port 6379 --num-cpus {cores_per_node - plan.learners} --disable-usage-stats",
        f"# each of the other {others} node(s):",
        f"ray start --address {head}:6379 --num-cpus {cores_per_node} --disable-usage-stats",
        "# then on node 0:",
        (f"RAY_ADDRESS={head}:6379 {launcher} {flags} --generator_launcher ray --generator_backend vllm "
         f"--generator_devices {' '.join(['cpu'] * plan.generators)} --weight_sync_host {head}{remote} "
         f"--output_dir {output_dir}")])


def describe(plan: Plan) -> str:
    zero = "DDP" if plan.zero_stage == 0 else f"ZeRO-{plan.zero_stage}" + ("+offload" if plan.offload else "")
    if plan.learners == 1:
        zero = "1 learner"
    gen = f"{plan.generators}x tp{plan.tp}" if plan.tp > 1 else f"{plan.generators}"
    return f"{plan.learners}L/{gen}G {zero} mb{plan.micro_batch} S{plan.max_staleness}"
