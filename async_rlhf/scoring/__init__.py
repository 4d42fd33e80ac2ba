"""Where a rollout is scored: `rewards.py` (reward models and functions, `ScoredGroup`s), `stage.py` (scoring each
part on rank 0 as it arrives) and `reward_prefix.py` (a reward model's forward with each prompt run once)."""
