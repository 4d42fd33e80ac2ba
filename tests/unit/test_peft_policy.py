"""LoRA policies (learner/peft_policy.py, weight_sync/lora_merge.py) on the tiny Llama: what the generators receive is the
merged model under the base names, the reference is the base with adapters off, the policy is never altered by a
sync, and bad configurations fail before any model loads. The training runs are in
tests/integration/test_lora_learners.py."""

from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft")

from transformers import AutoModelForCausalLM  # noqa: E402

from async_rlhf.errors import ConfigError
from async_rlhf.learner.logprobs import sequence_terms  # noqa: E402
from async_rlhf.learner.peft_policy import (adapters_are_identity, adapters_off, base_state_dict,  # noqa: E402
                                    check_peft_config, get_peft_config)
from async_rlhf.types import Completion, ScoredGroup  # noqa: E402
from async_rlhf.weight_sync import ShmWeightTransport, gather_full_state  # noqa: E402

PROMPTS = torch.tensor([[5, 17, 30, 44, 9, 12, 70, 3], [8, 8, 21, 60, 33, 2, 14, 40]])  # fixed token ids


def _lora_policy(model_dir, seed=0, **lora):
    """The tiny Llama with LoRA adapters whose B matrices are random (freshly made adapters are zero: their merge
    would equal the base and hide a wrong merge)."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules="all-linear", **lora)
    model = peft.get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _logits(model, ids=PROMPTS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_merged_weights_have_the_base_names_and_give_the_lora_policys_logits(tiny_model_dir, tmp_path):
    policy = _lora_policy(tiny_model_dir)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    state = gather_full_state(policy, is_main=True)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert list(state) == list(plain.state_dict())  # the names (and order) a generator's model has
    # the sync leaves the policy exactly as it was: base weights restored bit for bit, adapters unmerged
    after = policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(m.merged for m in policy.modules() if hasattr(m, "merged_adapters"))
    # peft's own merge of a copy agrees to the bit
    reference = copy.deepcopy(policy).merge_and_unload().state_dict()
    assert all(torch.equal(state[k], reference[k]) for k in reference)
    # through the real weight path: published as a shm file and loaded by the transformers generator backend
    from async_rlhf.generation.engine.hf_backend import HFBackend

    transport = ShmWeightTransport(str(tmp_path))
    backend = HFBackend(tiny_model_dir)
    try:
        backend.load_weights(transport.publish(state, version=1))  # strict: every name must match
        generator_logits, learner_logits = _logits(backend.model), _logits(policy)
    finally:
        backend.close()
        transport.close()
    assert torch.allclose(generator_logits, learner_logits, atol=1e-5), \
        (generator_logits - learner_logits).abs().max()
    assert not torch.allclose(learner_logits, _logits(plain), atol=1e-3)  # the adapters do change the model


def test_dora_layers_merge_like_peft_and_are_restored(tiny_model_dir):
    policy = _lora_policy(tiny_model_dir, use_dora=True)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    state = base_state_dict(policy)
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())
    reference = copy.deepcopy(policy).merge_and_unload().state_dict()
    assert list(state) == list(reference)
    assert all(torch.allclose(state[k], reference[k], atol=1e-6) for k in reference)


def test_modules_to_save_are_sent_under_the_wrapped_modules_name(tiny_model_dir):
    policy = _lora_policy(tiny_model_dir, modules_to_save=["lm_head"])
    with torch.no_grad():
        policy.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.1)
    state = base_state_dict(policy)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert list(state) == list(plain.state_dict())
    assert torch.equal(state["lm_head.weight"], plain.state_dict()["lm_head.weight"] + 0.1)
    plain.load_state_dict(state)
    assert torch.allclose(_logits(plain), _logits(policy), atol=1e-5)


def test_generators_start_from_the_base_directory_only_while_adapters_are_zero(tiny_model_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    fresh = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", r=4, target_modules="all-linear"))
    assert adapters_are_identity(fresh)
    assert not adapters_are_identity(_lora_policy(tiny_model_dir))  # trained (non-zero) B
    assert not adapters_are_identity(_lora_policy(tiny_model_dir, use_dora=True))  # DoRA rescales even at B = 0
    assert not adapters_are_identity(_lora_policy(tiny_model_dir, modules_to_save=["lm_head"]))


def test_reference_is_the_base_with_adapters_off(tiny_model_dir):
    policy = _lora_policy(tiny_model_dir).train()
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with adapters_off(policy) as reference:
        assert not reference.training
        assert torch.equal(_logits(reference), _logits(plain))
    assert policy.training  # mode and adapters back as they were
    assert not torch.allclose(_logits(policy), _logits(plain), atol=1e-3)
    with pytest.raises(ValueError, match="ref_model: None is only allowed for a LoRA policy"):
        with adapters_off(plain):
            pass


def test_sequence_terms_without_ref_model_use_the_adapter_free_base(tiny_model_dir):
    policy = _lora_policy(tiny_model_dir)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    groups = [ScoredGroup(prompt_id=0, prompt_token_ids=[5, 17, 30, 44],
                          completions=[Completion([9, 12, 70], [-1.0, -2.0, -3.0], "length"),
                                       Completion([3, 8], [-1.0, -1.5], "length")],
                          rewards=[1.0, 0.0], policy_version=0)]
    kwargs = dict(pad_id=0, max_length=32, device="cpu", temperature=1.0, sampling_temperature=1.0)
    for shared in (False, True):
        lora = sequence_terms(policy, None, groups, shared_prefix=shared, **kwargs)
        explicit = sequence_terms(policy, plain, groups, shared_prefix=shared, **kwargs)
        assert torch.allclose(lora.ref_logps, explicit.ref_logps, atol=1e-6)
        assert torch.equal(lora.logps, explicit.logps) and lora.logps.requires_grad
        assert not torch.allclose(lora.logps, lora.ref_logps, atol=1e-3)


def test_critic_of_a_lora_policy_starts_from_its_merged_backbone(tiny_model_dir):
    from async_rlhf.trainers.ppo import build_critic

    policy = _lora_policy(tiny_model_dir)
    critic = build_critic(policy)
    merged = base_state_dict(policy)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(critic.state_dict()[name], merged[name])


def test_bad_peft_configs_fail_before_any_model_loads(tiny_model_dir):
    with pytest.raises(TypeError, match="peft_config: must be a peft.PeftConfig"):
        check_peft_config({"r": 8}, tiny_model_dir)
    with pytest.raises(ValueError, match="PeftModel together with a peft_config"):
        check_peft_config(peft.LoraConfig(r=4), _lora_policy(tiny_model_dir))
    with pytest.raises(ConfigError, match="only LoRA .* got PromptTuningConfig"):
        check_peft_config(peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4), tiny_model_dir)
    with pytest.raises(ConfigError, match="task_type: .* got 'SEQ_CLS'"):
        check_peft_config(peft.LoraConfig(r=4, task_type="SEQ_CLS"), tiny_model_dir)


def test_recipe_flags_make_trls_lora_config():
    from async_rlhf.config.algorithms import AsyncOnlineDPOConfig
    from async_rlhf.config.cli import parse_args
    from async_rlhf.tasks.setup import ScriptArguments

    def parse(*flags):
        script, _ = parse_args((ScriptArguments, AsyncOnlineDPOConfig), ["--output_dir", "/tmp/x", *flags])
        return get_peft_config(script)

    assert parse() is None
    config = parse("--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.1",
                   "--lora_target_modules", "q_proj", "v_proj")
    assert isinstance(config, peft.LoraConfig)
    assert (config.r, config.lora_alpha, config.lora_dropout) == (8, 16, 0.1)
    assert set(config.target_modules) == {"q_proj", "v_proj"}
    assert parse("--use_peft", "--lora_target_modules", "all-linear").target_modules == "all-linear"
    with pytest.raises(ConfigError, match="lora_r: must be >= 1, got 0"):
        parse("--use_peft", "--lora_r", "0")
