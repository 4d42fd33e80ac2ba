"""TRL's multi-turn arguments checked before anything starts (`trainers/multi_turn.py`): a factory or tool that
cannot reach a generator process, a tool with no schema, an environment without `reset`, a row naming no
environment, and serving that cannot run episodes are refused with the name of what is wrong; an environment's
`get_reward` becomes a reward named after its class."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from async_rlhf.data import guess_task as g
from async_rlhf.errors import ConfigError, DatasetError
from async_rlhf.learner.logprobs import behaviour_logps, pack_sequences
from async_rlhf.scoring.rewards import EnvironmentReward, EnvironmentState
from async_rlhf.trainers.multi_turn import MultiTurn, start_multi_turn
from async_rlhf.trainers.policy_gradient import PolicyTerms, trl_metrics
from async_rlhf.types import Completion


def no_docstring(x: int) -> int:
    return x


class NoReset:
    def act(self, n: int) -> str:
        """Act.

        Args:
            n: how much
        """
        return "ok"


def test_refusals_name_what_is_wrong():
    with pytest.raises(ConfigError, match="environment_factory: cannot be pickled"):
        MultiTurn(environment_factory=lambda: g.GuessEnv())
    with pytest.raises(ConfigError, match="tools: 'inner': cannot be pickled"):
        def inner(n: int) -> int:
            """Inner.

            Args:
                n: a number
            """
            return n
        MultiTurn(tools=[inner])
    with pytest.raises(ConfigError, match="tool no_docstring: no schema"):
        MultiTurn(tools=[no_docstring])
    with pytest.raises(ConfigError, match="NoReset has no `reset` method"):
        MultiTurn(environment_factory=NoReset)
    assert start_multi_turn(None, None) is None


def test_rows_route_to_their_environment_and_rewards_are_named_after_classes():
    mt = MultiTurn(environment_factory={"guess": g.GuessEnv, "control": g.UninformativeGuessEnv})
    assert mt.reward_classes == ["GuessEnv", "UninformativeGuessEnv"]
    funcs = mt.reward_funcs(None)
    assert [f.__name__ for f in funcs] == ["GuessEnv", "UninformativeGuessEnv"]
    tok = mt.prepare_tokenizer(g.build_tokenizer())
    rows = Dataset.from_list([{**r, "environment": e} for r, e in zip(g.make_split(2, 0, "test"), ["guess", "dice"])])
    with pytest.raises(DatasetError, match="row 1, column 'environment': 'dice' is not among"):
        mt.prompt_ids(rows, tok, 4096, {})
    ids, kept, json_rows = mt.prompt_ids(rows.select([0]), tok, 4096, {})
    assert kept == [0] and json_rows[0]["environment"] == "guess" and "guess" in tok.decode(ids[0])
    states = [EnvironmentState({"env": "GuessEnv", "rewards": {"GuessEnv": 1.0}, "state": {"solved": True}}),
              EnvironmentState({"env": "UninformativeGuessEnv", "rewards": {"UninformativeGuessEnv": 0.0}})]
    assert states[0].solved is True and funcs[0](environments=states) == [1.0, None]
    assert EnvironmentReward("UninformativeGuessEnv")(environments=states) == [None, 0.0]


def test_serving_that_cannot_run_episodes_is_refused():
    from async_rlhf import AsyncGRPOConfig

    mt = MultiTurn(environment_factory=g.GuessEnv)
    args = AsyncGRPOConfig(output_dir="/tmp/unused", generator_backend="vllm", report_to="none")
    mt.check_args(args)  # 'auto' streams on vLLM; episodes take batch-level serving
    assert args.generation_mode == "batch" and not args.streaming
    args = AsyncGRPOConfig(output_dir="/tmp/unused", generator_backend="vllm", generation_mode="stream",
                           report_to="none")
    with pytest.raises(ConfigError, match="generation_mode='batch'"):
        mt.check_args(args)
    args = AsyncGRPOConfig(output_dir="/tmp/unused", generator_backend="transformers", tool_timeout=0,
                           report_to="none")
    with pytest.raises(ConfigError, match="tool_timeout: must be > 0"):
        mt.check_args(args)


def test_tool_answers_are_out_of_the_loss_and_log_probs_stay_with_their_tokens():
    c = Completion(token_ids=[5, 6, 7, 8, 9], logprobs=[-1.0, -2.0, 0.0, 0.0, -3.0], finish_reason="stop",
                   mask=[1, 1, 0, 0, 1])
    ids, attn, comp = pack_sequences([[1, 2]], [c.token_ids], pad_id=0, max_length=64, masks=[c.mask])
    assert ids[0].tolist() == [1, 2, 5, 6, 7, 8, 9] and comp[0].tolist() == [0, 0, 1, 1, 0, 0, 1]
    mask = comp[:, 1:].float()  # position t scores token t + 1, as `token_logps` lays it out
    assert behaviour_logps([c], mask)[0].tolist() == [0.0, -1.0, -2.0, 0.0, 0.0, -3.0]
    assert c.num_sampled == 3 and not c.sampled(2)


def test_num_tokens_counts_prompts_and_sampled_tokens_not_tool_answers():
    """TRL's `num_tokens` counts each prompt and the tokens the policy sampled (`tool_mask` 1), not tool answers."""
    c = Completion(token_ids=[5, 6, 7, 8, 9], logprobs=[-1.0, -2.0, 0.0, 0.0, -3.0], finish_reason="stop",
                   mask=[1, 1, 0, 0, 1])
    ids, attn, comp = pack_sequences([[1, 2]], [c.token_ids], pad_id=0, max_length=64, masks=[c.mask])
    seq = SimpleNamespace(mask=comp[:, 1:].float(), completions=[c], logps=torch.zeros(1, 6), attention_mask=attn)
    trainer = SimpleNamespace(state=SimpleNamespace(num_input_tokens_seen=0), _metrics={},
                              accelerator=SimpleNamespace(num_processes=1))
    trl_metrics(trainer, PolicyTerms(seq, seq.mask, torch.zeros(1), torch.tensor([True])))
    assert trainer.state.num_input_tokens_seen == 5 and trainer._metrics["num_tokens"] == [5.0]  # 2 + 3, not 7
