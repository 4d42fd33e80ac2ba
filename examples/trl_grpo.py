"""A TRL 1.16 GRPO script, switched to the asynchronous trainer by one import.

    python examples/trl_grpo.py --output_dir outputs/trl_grpo_drop_in
    python examples/trl_grpo.py --trainer trl --output_dir outputs/trl_grpo_control

Everything below `main`'s import switch is written against TRL's API (`GRPOConfig`, `GRPOTrainer`, its constructor
arguments, a reward function with TRL's signature); only the import line differs. It trains the built-in task's SFT
policy against its proxy reward model plus a brevity term (both prepared into ~/.cache/async_rlhf on first use, 2 to
5 minutes; nothing is downloaded), 16 completions a step (4 prompts x 4), and prints the final log line.
`--trainer trl` runs TRL's own class on the same script, for comparison.
"""

from __future__ import annotations

import argparse


def brevity(completions, trainer_state=None, **kwargs) -> list[float]:
    """TRL's reward-function signature: text completions (message lists for conversational data), every other
    dataset column and `trainer_state` as keyword arguments."""
    return [-0.01 * len(c) for c in completions]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", choices=["async_rlhf", "trl"], default="async_rlhf")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=10)
    cli = parser.parse_args(argv)

    if cli.trainer == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:  # the one line a TRL user changes
        from async_rlhf import AsyncGRPOConfig as GRPOConfig, AsyncGRPOTrainer as GRPOTrainer

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from async_rlhf.data.builtin_task import make_splits
    from async_rlhf.tasks.build_builtin import prepare_builtin

    paths = prepare_builtin()
    tokenizer = AutoTokenizer.from_pretrained(paths["tokenizer"])
    model = AutoModelForCausalLM.from_pretrained(paths["sft_model"])
    reward_model = AutoModelForSequenceClassification.from_pretrained(paths["reward_model"], num_labels=1)
    reward_tokenizer = AutoTokenizer.from_pretrained(paths["tokenizer"])

    args = GRPOConfig(
        output_dir=cli.output_dir, max_steps=cli.max_steps, per_device_train_batch_size=16, num_generations=4,
        max_completion_length=24, learning_rate=3e-5, beta=0.04, logging_steps=5, report_to="none",
        bf16=False,  # TRL's default bf16=True needs use_cpu=True on a CPU-only machine
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_model, brevity], args=args,
                          train_dataset=make_splits()["train"], processing_class=tokenizer,
                          reward_processing_classes=[reward_tokenizer, None])
    trainer.train()
    print(trainer.state.log_history[-1])


if __name__ == "__main__":
    main()
