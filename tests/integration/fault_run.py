"""A small online DPO run on the toy task with one fault injected, for the failure tests (run as a subprocess,
alone or under `accelerate launch`).

    python tests/integration/fault_run.py OUT --max_steps 40 --save_steps 3 [--fault hang_in_save --at 6]

Faults (each at optimizer step `--at`, on learner rank 0):
  none              no fault
  hang_in_save      the checkpoint of that step stops for good just before its completion marker is written
                    (everything else is on disk), after writing OUT/hanging_in_save; the test kills the run there
  hang_mid_save     the same, after the model weights but before the optimizer state
  break_generator   delete the generator's weights, then kill generator 0: every restart fails to load
The generators start from OUT/model (a copy of the tiny model), so breaking it touches nothing shared.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--max_steps", type=int, default=40)
    p.add_argument("--save_steps", type=int, default=3)
    p.add_argument("--fault", default="none",
                   choices=["none", "hang_in_save", "hang_mid_save", "break_generator"])
    p.add_argument("--at", type=int, default=6)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--max_restarts", type=int, default=1)
    p.add_argument("--shm_dir", default="/dev/shm")
    a = p.parse_args()

    from transformers import Trainer, TrainerCallback

    from async_rlhf import AsyncOnlineDPOConfig, AsyncOnlineDPOTrainer
    from async_rlhf.learner import checkpointing
    from async_rlhf.data.tiny_model import save_tiny_model
    from async_rlhf.data.toy_task import lowercase_reward, toy_prompts

    config = AsyncOnlineDPOConfig(
        output_dir=a.out, max_steps=a.max_steps, per_device_train_batch_size=2, num_generations=2, max_new_tokens=6,
        max_length=48, learning_rate=5e-3, lr_scheduler_type="constant", max_staleness=1,
        generator_backend="transformers", generator_max_restarts=a.max_restarts, save_strategy="steps",
        save_steps=a.save_steps, disable_tqdm=True, seed=5, rollout_timeout=120, generator_start_timeout=120,
        shm_dir=a.shm_dir,
    )
    model_dir = os.path.join(a.out, "model")
    with config.main_process_first(desc="tiny model"):
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            save_tiny_model(model_dir)
    trainer = AsyncOnlineDPOTrainer(model_dir, reward_funcs=lowercase_reward, args=config,
                                    train_dataset=toy_prompts(64, seed=5))

    def at_fault_step() -> bool:
        return trainer.accelerator.is_main_process and trainer.state.global_step == a.at

    def hang(flag: str) -> None:
        open(os.path.join(a.out, flag), "w").close()
        while True:
            time.sleep(1)

    if a.fault == "hang_in_save":
        mark_complete = checkpointing.mark_complete

        def marker_never_written(directory, version):
            if at_fault_step():
                hang("hanging_in_save")
            mark_complete(directory, version)

        checkpointing.mark_complete = marker_never_written
    elif a.fault == "hang_mid_save":
        save_optimizer = Trainer._save_optimizer_and_scheduler

        def optimizer_never_written(self, output_dir):
            if at_fault_step():
                hang("hanging_in_save")
            save_optimizer(self, output_dir)

        Trainer._save_optimizer_and_scheduler = optimizer_never_written
    elif a.fault == "break_generator":
        class BreakGenerator(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if at_fault_step():
                    os.unlink(os.path.join(model_dir, "model.safetensors"))
                    os.kill(trainer.pipeline.pool.processes[0].pid, signal.SIGKILL)

        trainer.add_callback(BreakGenerator())
    trainer.train(resume_from_checkpoint=True if a.resume else None)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
