"""Gold metrics of the guessing task (`data/guess_task.py`): real multi-turn episodes with a policy on held-out rows.

Each episode is run token in, token out (`data/tool_episodes.py`: turn n+1's prompt ids are turn n's, the sampled
ids and the tool answer's ids rendered alone), sampled with transformers' `generate` in this process
(`TransformersSampler`), every episode still going sampled in one batch per round. Reported:
- `success_rate`: the share of episodes whose secret was found within `MAX_GUESSES` guesses (the task's reward),
  with `chance` (5/16, random guessing without repeats) beside it;
- `turns_mean` (assistant turns per episode), `guesses_mean`, `guesses_to_solve_mean` (over solved episodes);
- `tool_failure_rate` (calls answered with an error: malformed arguments, unknown tools) and how episodes ended.
On the control environment (`env='control'`, answers independent of the secret) no policy beats chance.

Run on the prepared SFT policy (`tasks/build_guess.py` builds it), or on any saved policy directory with
`--policy` (a tokenizer saved beside it, as the trainers save one; else the task's):

    python -m async_rlhf.tasks.guess_evaluation --episodes 64
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_rlhf.data import guess_task
from async_rlhf.data.tool_episodes import Episode, TurnTokens, run_episodes
from async_rlhf.generation.engine.hf_backend import TransformersSampler
from async_rlhf.tasks.cache import _paths, default_cache_dir
from async_rlhf.types import SamplingSettings

MAX_COMPLETION_LENGTH = 256  # ids after the first prompt: 5 calls and answers (about 29 ids each) and a closing turn
MAX_TOOL_CALLING_ITERATIONS = guess_task.MAX_GUESSES  # rounds of calls, TRL's `max_tool_calling_iterations`


def policy_sampler(model, tokenizer, temperature: float = 1.0, batch_size: int = 128):
    """`run_episodes`' `sample` with `model`: each episode's last prompt, sampled once, up to its budget."""
    sampler = TransformersSampler(model, tokenizer.pad_token_id, tokenizer.eos_token_id, batch_size=batch_size)

    def sample(episodes: list[Episode], budgets: list[int]) -> list[tuple[list[int], list[float]]]:
        settings = SamplingSettings(max_new_tokens=max(budgets), temperature=temperature, n=1, seed=None)
        groups = sampler.generate([e.turn_prompts[-1] for e in episodes], settings)
        return [(g[0].token_ids, g[0].logprobs) for g in groups]

    return sample


def summarize(episodes: list[Episode]) -> dict:
    n = max(1, len(episodes))
    solved = [e for e in episodes if e.env.solved]
    finishes = {}
    for e in episodes:
        finishes[e.finish] = finishes.get(e.finish, 0) + 1
    return {
        "episodes": len(episodes),
        "success_rate": len(solved) / n,
        "chance": guess_task.CHANCE,
        "turns_mean": sum(e.turns for e in episodes) / n,
        "guesses_mean": sum(len(e.env.guesses) for e in episodes) / n,
        "guesses_to_solve_mean": sum(len(e.env.guesses) for e in solved) / max(1, len(solved)),
        "tool_failure_rate": sum(e.tool_failures for e in episodes) / max(1, sum(e.tool_calls for e in episodes)),
        "completion_tokens_mean": sum(len(e.completion_ids) for e in episodes) / n,
        "finish": finishes,
    }


@torch.no_grad()
def evaluate_guess_policy(model, tokenizer, env: str = "guess", num_episodes: int = 256, seed: int = 0,
                          temperature: float = 1.0, max_completion_length: int | None = None) -> dict:
    """Run `num_episodes` held-out episodes (the balanced `test` split of `seed`: each secret equally often) of
    `env` ('guess' or 'control') with `model` sampling at `temperature` (0: greedy); return the metrics above.
    `max_completion_length`: the episode's budget of ids after the first prompt (default `MAX_COMPLETION_LENGTH`)."""
    rows = list(guess_task.make_split(num_episodes, seed, "test"))
    envs = [guess_task.ENVIRONMENTS[env]() for _ in rows]
    torch.manual_seed(seed)
    episodes = run_episodes(tokenizer, envs, rows, policy_sampler(model, tokenizer, temperature),
                            max_completion_length or MAX_COMPLETION_LENGTH, MAX_TOOL_CALLING_ITERATIONS,
                            TurnTokens(tokenizer),
                            max_model_len=model.config.max_position_embeddings)
    return {"env": env, "temperature": temperature, **summarize(episodes)}


def evaluate_directory(policy: str, tokenizer_path: str | None = None, envs: tuple[str, ...] = ("guess", "control"),
                       num_episodes: int = 256, seed: int = 0, temperature: float = 1.0) -> dict:
    """`evaluate_guess_policy` on a saved policy directory, on each of `envs`; {env: metrics}."""
    if tokenizer_path is None:
        saved = os.path.exists(os.path.join(policy, "tokenizer_config.json"))
        tokenizer_path = policy if saved else None
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path) if tokenizer_path else guess_task.build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    return {env: evaluate_guess_policy(model, tokenizer, env, num_episodes, seed, temperature) for env in envs}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Gold metrics of a guessing-task policy on held-out episodes.")
    parser.add_argument("--policy", default=None, help="a saved policy directory (default: the prepared SFT "
                                                       "policy of --seed, `tasks/build_guess.py`)")
    parser.add_argument("--env", choices=("guess", "control", "both"), default="both")
    parser.add_argument("--episodes", type=int, default=256, help="held-out episodes (a multiple of 16 is balanced)")
    parser.add_argument("--seed", type=int, default=0, help="the task seed (which held-out rows) and sampling seed")
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    args = parser.parse_args(argv)
    policy = args.policy or _paths(default_cache_dir(args.seed, guess_task))["sft_model"]
    if not os.path.exists(os.path.join(policy, "config.json")):
        raise SystemExit(f"no policy in {policy}: build the SFT policy first (python -m async_rlhf.tasks.build_guess "
                         f"--seed {args.seed}) or pass --policy")
    envs = ("guess", "control") if args.env == "both" else (args.env,)
    torch.set_num_threads(os.cpu_count() or 1)
    result = evaluate_directory(policy, envs=envs, num_episodes=args.episodes, seed=args.seed,
                                temperature=args.temperature)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
