"""The generator backends against the transformers forward pass: same greedy tokens, behaviour log-probs equal
to log_softmax of the (tempered, top-k filtered) logits, weight swaps that take effect (through vLLM's native
weight-transfer calls with our "async_rlhf_shm" backend), carry our policy version as vLLM's weight version, and
are refused before anything loads when their names are wrong.

One vLLM engine serves the whole module: importing vLLM and starting it costs 20-50 s on a small CPU. It runs
inside the pytest process (VLLMBackend's default), where on CPU it turns `torch.set_num_threads` into a no-op.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from async_rlhf.generation.engine import load_backend
from async_rlhf.generation.engine.hf_backend import HFBackend
from async_rlhf.data.tiny_model import char_tokenizer, save_tiny_model, tiny_llama
from async_rlhf.types import Completion, SamplingSettings, WeightUpdate

EOS = char_tokenizer().eos_token_id
PROMPTS = [[2, 40, 41, 42], [2, 50], [2, 60, 61, 62, 63, 64, 65]]  # different lengths: HF left-pads
GREEDY = SamplingSettings(max_new_tokens=16, temperature=0.0, n=1)
ATOL = 1e-4  # float32 on both sides; measured differences are ~5e-7


@pytest.fixture(scope="module")
def vllm_backend(tiny_model_dir):
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    from async_rlhf.generation.engine.vllm_backend import VLLMBackend

    device = "cpu" if current_platform.is_cpu() else "cuda"
    backend = VLLMBackend(tiny_model_dir, device=device, dtype="float32", seed=0, kv_cache_memory_bytes=64 << 20)
    yield backend
    backend.close()
    backend.close()  # idempotent


@pytest.fixture(scope="module")
def hf_backend(tiny_model_dir) -> HFBackend:
    return HFBackend(tiny_model_dir, seed=0)


@pytest.fixture(params=["vllm", "transformers"])
def backend(request):
    return request.getfixturevalue("vllm_backend" if request.param == "vllm" else "hf_backend")


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def new_weights():
    """(path in /dev/shm, transformers model) for a re-initialised policy with the same architecture."""
    model = tiny_llama(char_tokenizer(), seed=1).eval()  # the architecture of `tiny_model_dir`
    path = f"/dev/shm/async_rlhf_test_weights_{os.getpid()}.safetensors"
    save_file(model.state_dict(), path)
    yield path, model
    os.unlink(path)


@torch.no_grad()
def reference_logprobs(model, prompt: list[int], completion: Completion, temperature=1.0, top_k=-1) -> torch.Tensor:
    """[T] log-prob of each completion token under log_softmax(top_k(logits / temperature)), teacher-forced."""
    ids = torch.tensor([prompt + completion.token_ids])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [T, V]: position t predicts token t
    if temperature > 0:
        logits = logits / temperature
    if top_k > 0:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]


@torch.no_grad()
def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        if ids[-1] == EOS:
            break
    return ids[len(prompt) :]


def tokens(result: list[list[Completion]]) -> list[list[list[int]]]:
    return [[c.token_ids for c in group] for group in result]


def test_greedy_matches_transformers(vllm_backend, hf_backend, reference):
    from_vllm = vllm_backend.generate(PROMPTS, GREEDY)
    from_hf = hf_backend.generate(PROMPTS, GREEDY)
    assert tokens(from_vllm) == tokens(from_hf)
    for prompt, (completion,) in zip(PROMPTS, from_vllm):
        assert completion.token_ids == reference_greedy(reference, prompt, GREEDY.max_new_tokens)
        # At temperature 0 both backends report the raw distribution's log-probs.
        expected = reference_logprobs(reference, prompt, completion)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.7, 5)])
def test_behaviour_logprobs_match_forward(backend, reference, temperature, top_k):
    settings = SamplingSettings(max_new_tokens=12, temperature=temperature, top_k=top_k, n=4, seed=7)
    prompts = PROMPTS[:2]
    result = backend.generate(prompts, settings)
    for prompt, group in zip(prompts, result, strict=True):
        for completion in group:
            expected = reference_logprobs(reference, prompt, completion, temperature, top_k)
            # Finite: every sampled token survived the top-k filter.
            assert torch.isfinite(expected).all()
            torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=ATOL, rtol=0)


@torch.no_grad()
def reference_greedy_penalized(model, prompt: list[int], max_new_tokens: int, penalty: float) -> list[int]:
    """Greedy decoding with the repetition penalty: each token already in the prompt or completion has its logit l
    replaced by l / penalty if l > 0, else l * penalty."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        seen = torch.tensor(sorted(set(ids)))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / penalty, logits[seen] * penalty)
        ids.append(int(logits.argmax()))
        if ids[-1] == EOS:
            break
    return ids[len(prompt) :]


def test_repetition_penalty_is_applied(backend, reference):  # before any test loads other weights
    settings = SamplingSettings(max_new_tokens=16, temperature=0.0, n=1, repetition_penalty=3.0)
    result = backend.generate(PROMPTS, settings)
    for prompt, (completion,) in zip(PROMPTS, result, strict=True):
        assert completion.token_ids == reference_greedy_penalized(reference, prompt, 16, 3.0)
    assert tokens(result) != tokens(backend.generate(PROMPTS, GREEDY))  # the penalty changed the greedy tokens


def test_min_p_keeps_only_tokens_near_the_most_likely(backend, reference):
    """Every token sampled with min_p has probability >= min_p x the most likely token's; without min_p some does
    not (so the check can fail)."""
    import math

    def below_min_p(result, min_p):
        worst = []
        for prompt, group in zip(PROMPTS, result, strict=True):
            for completion in group:
                ids = torch.tensor([prompt + completion.token_ids])
                logps = reference(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)  # [T, V]
                chosen = logps.gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
                worst.append(float((chosen - logps.max(-1).values).min()))
        return min(worst) < math.log(min_p) - 1e-4

    with torch.no_grad():
        filtered = backend.generate(PROMPTS, SamplingSettings(max_new_tokens=12, temperature=1.0, n=4, seed=7,
                                                              min_p=0.5))
        plain = backend.generate(PROMPTS, SamplingSettings(max_new_tokens=12, temperature=1.0, n=4, seed=7))
        assert not below_min_p(filtered, 0.5)
        assert below_min_p(plain, 0.5)


def test_n_completions_and_finish_reasons(backend):
    # The random tiny model gives EOS ~1/104 per token: over 48 x 24 tokens both finish reasons occur.
    settings = SamplingSettings(max_new_tokens=24, temperature=1.0, n=16, seed=1)
    result = backend.generate(PROMPTS, settings)
    assert [len(group) for group in result] == [16, 16, 16]
    reasons = set()
    for group in result:
        assert len({tuple(c.token_ids) for c in group}) > 1, "n samples of one prompt are all identical"
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) > 0
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
                assert len(c.token_ids) <= settings.max_new_tokens
            else:
                assert c.finish_reason == "length"
                assert len(c.token_ids) == settings.max_new_tokens and EOS not in c.token_ids
            reasons.add(c.finish_reason)
    assert reasons == {"stop", "length"}


def test_vllm_seed_reproduces_samples(vllm_backend):
    settings = SamplingSettings(max_new_tokens=8, temperature=1.0, n=3, seed=3)
    first = tokens(vllm_backend.generate(PROMPTS, settings))
    assert tokens(vllm_backend.generate(PROMPTS, settings)) == first
    other = SamplingSettings(max_new_tokens=8, temperature=1.0, n=3, seed=4)
    assert tokens(vllm_backend.generate(PROMPTS, other)) != first


def test_load_weights_switches_policy(vllm_backend, hf_backend, tiny_model_dir, new_weights):
    path, new_model = new_weights
    # The long prompt fills whole KV blocks, which vLLM's prefix cache keeps: stale after a weight swap.
    prompts = PROMPTS + [[2] + [10 + i % 90 for i in range(199)]]
    before = tokens(vllm_backend.generate(prompts, GREEDY))
    update = WeightUpdate(version=1, transport="shm", path=path)
    try:
        vllm_backend.load_weights(update)
        hf_backend.load_weights(update)
        assert vllm_backend.weight_version == "1"  # vLLM's own record is our policy version
        after = tokens(vllm_backend.generate(prompts, GREEDY))
        assert after != before
        assert after == tokens(hf_backend.generate(prompts, GREEDY))
        assert after == [[reference_greedy(new_model, p, GREEDY.max_new_tokens)] for p in prompts]
    finally:  # the module's backends are shared: put the original policy back
        original = WeightUpdate(version=2, transport="shm", path=os.path.join(tiny_model_dir, "model.safetensors"))
        vllm_backend.load_weights(original)
        hf_backend.load_weights(original)
    assert tokens(vllm_backend.generate(prompts, GREEDY)) == before
    assert tokens(hf_backend.generate(prompts, GREEDY)) == before
    assert vllm_backend.weight_version == "2"


def test_vllm_weight_version_follows_every_update(vllm_backend, tiny_model_dir, new_weights):
    """Through the native path (`LLM.start/update/finish_weight_update` with our backend) on every load."""
    original = os.path.join(tiny_model_dir, "model.safetensors")
    for version, path in [(11, new_weights[0]), (12, original), (13, original)]:
        vllm_backend.load_weights(WeightUpdate(version=version, transport="shm", path=path))
        assert vllm_backend.llm.get_weight_version() == str(version)


def test_vllm_refuses_wrong_names_before_loading(vllm_backend, tiny_model_dir, new_weights, tmp_path):
    """A file with a misnamed tensor is refused by the generator before vLLM's reload starts; and one that gets
    past it (sent straight to the engine) is refused by the worker, which puts the old weights back."""
    original = os.path.join(tiny_model_dir, "model.safetensors")
    vllm_backend.load_weights(WeightUpdate(version=20, transport="shm", path=original))
    before = tokens(vllm_backend.generate(PROMPTS, GREEDY))
    state = new_weights[1].state_dict()
    state["model.layers.0.mlp.up_proj.wrong"] = state.pop("model.layers.0.mlp.up_proj.weight")
    wrong = str(tmp_path / "wrong.safetensors")
    save_file(state, wrong)
    with pytest.raises(ValueError, match="missing .'model.layers.0.mlp.up_proj.weight'., unexpected "
                                         ".'model.layers.0.mlp.up_proj.wrong'."):
        vllm_backend.load_weights(WeightUpdate(version=21, transport="shm", path=wrong))
    assert vllm_backend.weight_version == "20"
    assert tokens(vllm_backend.generate(PROMPTS, GREEDY)) == before

    # The worker's own check, after start_weight_update has moved every layer to the meta device.
    llm, state_names = vllm_backend.llm, new_weights[1].state_dict().keys()
    llm.start_weight_update()
    with pytest.raises(Exception, match="differs from its update"):
        llm.update_weights({"update_info": {"path": wrong, "version": 22, "names": sorted(state_names)}})
    assert tokens(vllm_backend.generate(PROMPTS, GREEDY)) == before  # nothing was loaded
    vllm_backend.load_weights(WeightUpdate(version=23, transport="shm", path=new_weights[0]))  # and it still loads
    assert vllm_backend.weight_version == "23"
    assert tokens(vllm_backend.generate(PROMPTS, GREEDY)) != before
    vllm_backend.load_weights(WeightUpdate(version=24, transport="shm", path=original))
    assert tokens(vllm_backend.generate(PROMPTS, GREEDY)) == before


def test_load_weights_rejects_bad_updates(vllm_backend, hf_backend, new_weights, tmp_path):
    partial = {k: v for k, v in new_weights[1].state_dict().items() if k != "model.layers.0.mlp.up_proj.weight"}
    save_file(partial, str(tmp_path / "partial.safetensors"))
    update = WeightUpdate(version=1, transport="shm", path=str(tmp_path / "partial.safetensors"))
    with pytest.raises(ValueError, match="missing .'model.layers.0.mlp.up_proj.weight'."):
        vllm_backend.load_weights(update)
    with pytest.raises(RuntimeError, match="Missing key"):
        hf_backend.load_weights(update)
    with pytest.raises(ValueError, match="unknown weight transport"):
        vllm_backend.load_weights(WeightUpdate(version=1, transport="carrier-pigeon"))
    with pytest.raises(NotImplementedError):
        hf_backend.load_weights(WeightUpdate(version=1, transport="carrier-pigeon"))
    # "broadcast" needs the group first (weight_sync/broadcast.py; exercised in test_weight_broadcast.py)
    with pytest.raises(RuntimeError, match="join_weight_group"):
        hf_backend.load_weights(WeightUpdate(version=1, transport="broadcast"))
    full = new_weights[1].state_dict()
    update = WeightUpdate(version=1, transport="broadcast", names=list(full), dtypes=["float32"] * len(full),
                          shapes=[list(t.shape) for t in full.values()])
    with pytest.raises(Exception, match="join_weight_group"):
        vllm_backend.load_weights(update)
    with pytest.raises(ValueError, match="shapes differ"):
        vllm_backend.load_weights(WeightUpdate(**{**update.__dict__, "shapes": [[1]] * len(full)}))


def test_vllm_rejects_unsupported_cpu_head_size(tmp_path):
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    from async_rlhf.generation.engine.vllm_backend import VLLMBackend

    if not current_platform.is_cpu():
        pytest.skip("CPU attention limit")
    path = save_tiny_model(str(tmp_path), num_heads=4)  # 64 / 4: head size 16, which CPU attention lacks
    with pytest.raises(ValueError, match="head_dim=16"):
        VLLMBackend(path)  # checked before the engine starts, so no second engine in this process


def test_load_backend(tiny_model_dir, monkeypatch):
    backend = load_backend("transformers", tiny_model_dir, seed=0, dtype="float32")
    assert isinstance(backend, HFBackend) and backend.name == "transformers"
    with pytest.raises(ValueError, match="vllm, transformers"):
        load_backend("sglang", tiny_model_dir)
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail, as on a machine without it
    with pytest.raises(ImportError, match='generator_backend="transformers"'):
        load_backend("vllm", tiny_model_dir)


def test_each_prompt_stops_at_its_own_budget(backend):
    budgets = [3, 9, 1]
    settings = SamplingSettings(max_new_tokens=12, temperature=1.0, n=2, seed=4)
    out = backend.generate(PROMPTS, settings, budgets)
    for group, budget in zip(out, budgets):
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) <= budget
            assert c.finish_reason == ("length" if c.token_ids[-1:] != [EOS] else "stop")
    assert any(len(c.token_ids) == 9 for c in out[1])  # the random policy rarely ends early

