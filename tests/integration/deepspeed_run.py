"""A tiny asynchronous run under DeepSpeed, then a direct check that a generator loads the learner's weights.

    accelerate launch --config_file launch/accelerate/cpu_deepspeed_zero3.yaml \
        tests/integration/deepspeed_run.py --algorithm online_dpo --output_dir /tmp/ds_run

Run by tests/integration/test_deepspeed_learners.py (not collected by pytest itself). On every rank: train a few
steps with the real vLLM generator; record how the policy, the reference model and the reward model are held (a
DeepSpeed engine? partitioned? the fraction of each parameter this rank stores); then the weight sync exactly as
the pipeline does it (`gather_full_state`, then `ShmWeightTransport.publish`), loaded into a fresh vLLM generator
in a subprocess with the generators' own backend (`VLLMBackend.load_weights`), whose parameters are compared with
DeepSpeed's own consolidation of the learner's weights (`accelerator.get_state_dict`, a different code path).
Everything lands in <output_dir>/deepspeed_facts.json for the test to assert on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# vLLM fuses these projections into one parameter: its name, and the learner's names concatenated along dim 0
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _local_fraction(model) -> float:
    """Elements this rank stores / elements of the model (1.0 when replicated, ~1/world under ZeRO-3)."""
    local = full = 0
    for p in model.parameters():
        if hasattr(p, "ds_id"):
            local += p.ds_tensor.numel()
            full += p.ds_numel
        else:
            local += p.numel()
            full += p.numel()
    return local / full


def _held(model) -> dict:
    inner = getattr(model, "module", model)
    return {"type": type(model).__name__, "partitioned": any(hasattr(p, "ds_id") for p in inner.parameters()),
            "local_fraction": _local_fraction(inner),
            "dtype": str(next(inner.parameters()).dtype)}


def train_and_check(args) -> None:
    import torch

    from async_rlhf import AsyncOnlineDPOConfig, AsyncOnlineDPOTrainer, AsyncRLOOConfig, AsyncRLOOTrainer
    from async_rlhf.data.tiny_model import save_tiny_model
    from async_rlhf.data.toy_task import lowercase_reward, toy_prompts
    from async_rlhf.weight_sync import ShmWeightTransport, gather_full_state
    from async_rlhf.weight_sync.partitions import PartitionStore

    trainer_cls, config_cls, extra = {
        "online_dpo": (AsyncOnlineDPOTrainer, AsyncOnlineDPOConfig, {"beta": 0.1}),
        "rloo": (AsyncRLOOTrainer, AsyncRLOOConfig, {"off_policy_correction": "tis", "per_device_train_batch_size": 4}),
    }[args.algorithm]
    config = config_cls(**{"output_dir": args.output_dir, "max_steps": args.steps, "per_device_train_batch_size": 2,
                           **extra},  # RLOO counts completions (TRL): 2 prompts x 2
                        num_generations=2, max_new_tokens=8, max_length=48, learning_rate=1e-2,
                        lr_scheduler_type="constant", temperature=1.0, max_staleness=1, disable_tqdm=True, seed=1,
                        generator_backend="vllm", rollout_timeout=300, report_to="none",
                        weight_transport=args.weight_transport)
    model_dir = os.path.join(args.output_dir, "init_model")
    with config.main_process_first(desc="tiny model"):
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            save_tiny_model(model_dir)
    reward = model_dir if args.reward_model else lowercase_reward  # a model path: an (untrained) reward model
    trainer = trainer_cls(model=model_dir, reward_funcs=reward, args=config, train_dataset=toy_prompts(64))
    acc = trainer.accelerator
    facts = {"world_size": acc.num_processes, "distributed_type": acc.distributed_type.value,
             "zero_stage": acc.state.deepspeed_plugin.zero_stage if acc.state.deepspeed_plugin else None,
             "ref_model": _held(trainer.ref_model)}
    if args.reward_model:
        facts["reward_model"] = _held(trainer.scorer.funcs[0])
    trainer.train()
    facts["policy"] = _held(trainer.model_wrapped)
    chain, opt = [], trainer.optimizer
    while opt is not None:  # accelerate's wrapper > DeepSpeed's ZeRO optimizer > the optimizer that steps
        chain.append(type(opt).__name__)
        opt = getattr(opt, "optimizer", None)
    facts["policy_optimizer"] = chain

    # the sync, as the pipeline does it, and DeepSpeed's own consolidation to compare with (both collectives)
    gathered = gather_full_state(trainer.model_wrapped, acc.is_main_process)
    reference = acc.get_state_dict(trainer.model_wrapped)
    partitioned = facts["zero_stage"] == 3 and acc.num_processes > 1
    if partitioned:  # the network path's way under ZeRO-3: partitions kept per rank, assembled on rank 0
        store = PartitionStore.open(trainer.model_wrapped, timeout=120.0, bucket_bytes=1 << 14)
        state = store.take(args.steps)
    if not acc.is_main_process:
        if partitioned:
            store.close(wait=300.0)  # serves rank 0's assembly until its "stop"
        return
    reference = {k: v.detach().cpu() for k, v in reference.items()}
    if partitioned:
        assembled = dict(state.items())
        store.close()
        facts["partitions_names_match"] = list(assembled) == list(reference)
        facts["partitions_max_abs_diff"] = max((assembled[k].float() - reference[k].float()).abs().max().item()
                                               for k in reference)
        facts["partitions_held_bytes_peak"] = store.held_bytes_peak
    facts["gathered_names_match"] = list(gathered) == list(reference)
    facts["gathered_max_abs_diff"] = max((gathered[k].float() - reference[k].float()).abs().max().item()
                                         for k in reference)
    transport = ShmWeightTransport(args.output_dir)
    update = transport.publish(gathered, version=args.steps)
    loaded_file = os.path.join(args.output_dir, "generator_weights.pt")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--load_into_vllm", update.path,
                    "--model_dir", model_dir, "--output_dir", loaded_file], check=True, timeout=600,
                   env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    loaded = torch.load(loaded_file)
    initial = _initial_weights(model_dir)
    diffs, changed = {}, []
    for name, tensor in loaded.items():
        expected = _learner_view(name, reference)
        if tensor.shape != expected.shape and tensor.shape[1:] == expected.shape[1:]:
            tensor = tensor[:expected.shape[0]]  # vLLM pads the vocabulary rows of embed_tokens / lm_head
        diffs[name] = (tensor.float() - expected.float()).abs().max().item()
        changed.append(not torch.equal(expected, _learner_view(name, initial)))
    facts["generator_params"] = len(loaded)
    facts["generator_max_abs_diff"] = max(diffs.values())
    facts["generator_worst_param"] = max(diffs, key=diffs.get)
    facts["params_changed_by_training"] = sum(changed)
    facts["sync_bytes"] = update.num_bytes
    transport.close()
    with open(os.path.join(args.output_dir, "deepspeed_facts.json"), "w") as f:
        json.dump(facts, f, indent=2)


def _initial_weights(model_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def _learner_view(vllm_name: str, state: dict):
    """The learner tensor that vLLM's parameter `vllm_name` must equal (concatenated where vLLM fuses)."""
    import torch

    for fused, parts in FUSED.items():
        if f".{fused}." in vllm_name:
            return torch.cat([state[vllm_name.replace(fused, p)] for p in parts], dim=0)
    return state[vllm_name]


def load_into_vllm(update_path: str, model_dir: str, out_file: str) -> None:
    """A fresh generator backend (what each generator process runs) loads the published file; dump its weights."""
    import torch
    from safetensors import safe_open

    from async_rlhf.generation.engine.vllm_backend import VLLMBackend
    from async_rlhf.types import WeightUpdate

    backend = VLLMBackend(model_dir, device="cpu", dtype="float32", max_model_len=64, seed=0)
    with safe_open(update_path, framework="pt") as f:
        names = list(f.keys())
    backend.load_weights(WeightUpdate(version=1, transport="shm", path=update_path, names=names, num_bytes=0))

    def weights(worker):
        """Every parameter as the engine computes with it. vLLM's CPU linear layers repack their weight for the
        matmul kernel and leave an empty `weight` behind, so those are read back through the layer's own kernel:
        x = I gives x @ W^T = W^T."""
        from vllm.model_executor.layers.linear import LinearBase

        model = worker.get_model()
        out = {}
        with torch.no_grad():
            for prefix, module in model.named_modules():
                if isinstance(module, LinearBase):
                    eye = torch.eye(module.input_size, dtype=torch.float32)
                    out[f"{prefix}.weight"] = module.quant_method.apply(module, eye, bias=None).t().contiguous()
            for name, param in model.named_parameters():
                if name not in out:
                    out[name] = param.detach().cpu().clone()
        return out

    torch.save(backend.llm.collective_rpc(weights)[0], out_file)
    backend.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--algorithm", default="online_dpo", choices=["online_dpo", "rloo"])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--reward_model", action="store_true", help="score with a (tiny) reward model")
    parser.add_argument("--weight_transport", default="auto", help="the run's weight_transport (network: under "
                        "ZeRO-3 the partitions path, weight_sync/partitions.py)")
    parser.add_argument("--load_into_vllm", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model_dir", default=None, help=argparse.SUPPRESS)
    cli = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    if cli.load_into_vllm:
        load_into_vllm(cli.load_into_vllm, cli.model_dir, cli.output_dir)
    else:
        train_and_check(cli)
