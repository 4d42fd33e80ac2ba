"""A TRL 1.16 online-DPO script, switched to the asynchronous trainer by one import.

    python examples/trl_online_dpo.py --output_dir outputs/trl_drop_in
    python examples/trl_online_dpo.py --trainer trl --output_dir outputs/trl_control

Everything below `main`'s import switch is written against TRL's API (`OnlineDPOConfig`, `OnlineDPOTrainer`, its
constructor arguments); only the import line differs. It trains the built-in task's SFT policy against its proxy
reward model (both prepared into ~/.cache/async_rlhf on first use, 2 to 4 minutes; nothing is downloaded) and prints
the final log line. `--trainer trl` runs TRL's own class on the same script, for comparison.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", choices=["async_rlhf", "trl"], default="async_rlhf")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=10)
    cli = parser.parse_args(argv)

    if cli.trainer == "trl":
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
    else:  # the one line a TRL user changes
        from async_rlhf import AsyncOnlineDPOConfig as OnlineDPOConfig, AsyncOnlineDPOTrainer as OnlineDPOTrainer

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from async_rlhf.data.builtin_task import make_splits
    from async_rlhf.tasks.build_builtin import prepare_builtin

    paths = prepare_builtin()
    tokenizer = AutoTokenizer.from_pretrained(paths["tokenizer"])
    model = AutoModelForCausalLM.from_pretrained(paths["sft_model"])
    reward_model = AutoModelForSequenceClassification.from_pretrained(paths["reward_model"], num_labels=1)
    reward_tokenizer = AutoTokenizer.from_pretrained(paths["tokenizer"])

    args = OnlineDPOConfig(
        output_dir=cli.output_dir, max_steps=cli.max_steps, per_device_train_batch_size=8, learning_rate=3e-5,
        max_new_tokens=24, max_length=128, temperature=1.0, logging_steps=5, report_to="none",
        bf16=False,  # TRL's default bf16=True needs use_cpu=True on a CPU-only machine
    )
    trainer = OnlineDPOTrainer(model=model, reward_funcs=reward_model, args=args, train_dataset=make_splits()["train"],
                               processing_class=tokenizer, reward_processing_classes=reward_tokenizer)
    trainer.train()
    print(trainer.state.log_history[-1])


if __name__ == "__main__":
    main()
