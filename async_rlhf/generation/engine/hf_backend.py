"""The transformers samplers: `HFBackend`, the generator backend for machines without vLLM (and the reference in
tests), and `TransformersSampler`, which samples an in-memory model (evaluation and data preparation).

Both return behaviour log-probs of the distribution each token was drawn from (see below), cut each completion
after its first EOS the same way (`_cut_at_eos`), and differ only in how they batch: `HFBackend` repeats each
prompt `n` times in one batch with its own GenerationConfig (only `SamplingSettings` apply), `TransformersSampler`
uses `num_return_sequences` over batches of `batch_size` prompts with the model's own generation config. For
`n > 1` the two therefore draw different (equally valid) samples from the same seed: the built-in task's prepared
preference pairs come from `TransformersSampler` and are reproducible only with it.

Behaviour log-probs come from `output_scores`, which transformers records *after* its logits processors: with
sampling that is temperature, then top-k, then top-p (filtered tokens at -inf), the same order as vLLM, so
`log_softmax(scores)` is the distribution each token was drawn from. With temperature 0 the search is greedy, no
warper runs, and the scores are the raw logits (vLLM returns the same in that case).

`HFBackend`: prompts are left-padded into one batch and each is repeated `n` times (rather than `num_return_sequences`, which
greedy search refuses for n > 1). transformers keeps generating padding after a sequence's EOS until the whole
batch is done; each completion is cut after its first EOS. `output_scores` keeps a [P*n, vocab] tensor per step in
memory: fine for the small models this fallback is for, heavy for a 150k vocabulary at large batch.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from async_rlhf.types import Completion, SamplingSettings, WeightUpdate


class HFBackend:
    """Samples with a transformers causal LM held by this object. Uses (and seeds) torch's global RNG."""

    name = "transformers"

    def __init__(self, model_path: str, device: str = "cpu", seed: int = 0, dtype: str = "float32") -> None:
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.to(self.device).eval()
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.model.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.pad_id = gen.pad_token_id if gen.pad_token_id is not None else min(self.eos_ids)
        # SamplingSettings is the only source of sampling parameters. transformers would merge the checkpoint's
        # own defaults (temperature, top_k, repetition_penalty, ...) into every call; vLLM would not.
        self.model.generation_config = GenerationConfig(
            bos_token_id=gen.bos_token_id, eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id
        )
        torch.manual_seed(seed)

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], settings: SamplingSettings,
                 max_new_tokens: list[int] | None = None) -> list[list[Completion]]:
        """`max_new_tokens`: each prompt's budget (the batch decodes up to the largest; longer samples are cut)."""
        n = settings.n
        width = max(len(p) for p in prompt_token_ids)
        input_ids = torch.full((len(prompt_token_ids), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, ids in enumerate(prompt_token_ids):  # left padding: every prompt ends at column `width`
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            attention_mask[i, width - len(ids) :] = 1
        warpers = {}  # greedy: none (transformers warns about sampling flags without do_sample)
        if settings.temperature > 0:
            # top_k 0 means no top-k warper; left unset, transformers' legacy default of 50 could apply.
            warpers = dict(temperature=settings.temperature, top_k=max(settings.top_k, 0), top_p=settings.top_p)
            if settings.min_p > 0:
                warpers["min_p"] = settings.min_p
        if settings.repetition_penalty != 1.0:  # applies to greedy decoding too; `out.scores` include it
            warpers["repetition_penalty"] = settings.repetition_penalty
        config = GenerationConfig(
            max_new_tokens=max(max_new_tokens) if max_new_tokens else settings.max_new_tokens,
            do_sample=settings.temperature > 0,
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids),
            output_scores=True,
            return_dict_in_generate=True,
            **warpers,
        )
        if settings.seed is not None:
            torch.manual_seed(settings.seed)
        out = self.model.generate(
            input_ids=input_ids.repeat_interleave(n, dim=0).to(self.device),
            attention_mask=attention_mask.repeat_interleave(n, dim=0).to(self.device),
            generation_config=config,
        )
        new_tokens = out.sequences[:, width:]  # [P*n, T]
        logprobs = torch.stack(  # [P*n, T]; out.scores: T processed-logit tensors of [P*n, V]
            [s.float().log_softmax(-1).gather(-1, new_tokens[:, t, None])[:, 0] for t, s in enumerate(out.scores)], 1
        )
        new_tokens, logprobs = new_tokens.cpu(), logprobs.cpu()
        flat = [_cut_at_eos(t.tolist(), lp.tolist(), self.eos_ids) for t, lp in zip(new_tokens, logprobs)]
        if max_new_tokens:
            flat = [_within_budget(c, max_new_tokens[i // n]) for i, c in enumerate(flat)]
        return [flat[p * n : (p + 1) * n] for p in range(len(prompt_token_ids))]

    def load_weights(self, update: WeightUpdate) -> None:
        """Copy every tensor of the learner's state dict into the model; names must match exactly."""
        if update.transport == "shm":
            from async_rlhf.weight_sync.safetensors_io import iter_safetensors

            # not safetensors' load_file: it leaves objects behind on every read (see iter_safetensors)
            self.model.load_state_dict(dict(iter_safetensors(update.path)), strict=True)
        elif update.transport == "broadcast":
            from async_rlhf.weight_sync.broadcast import receive_weights

            if self._group is None:
                raise RuntimeError("a 'broadcast' weight update before join_weight_group")
            self.model.load_state_dict(dict(receive_weights(self._group, update)), strict=True)
        elif update.transport == "ipc":  # learner rank 0's device memory on this GPU (colocated mode)
            from async_rlhf.weight_sync.ipc import rebuild

            index = torch.device(self.device).index or 0
            shared = {n: rebuild(h, index) for n, h in zip(update.names, update.ipc_handles, strict=True)}
            self.model.load_state_dict(shared, strict=True)  # copies: the learner may free the version after the ack
            torch.cuda.synchronize(index)
        else:
            raise NotImplementedError(f"HFBackend loads weights over 'shm', 'broadcast' or 'ipc', "
                                      f"got {update.transport!r}")

    num_workers = 1  # members this backend adds to a weight broadcast group
    _group = None

    def join_weight_group(self, info) -> None:
        """Join learner rank 0's broadcast group as rank `info.rank` (`weight_sync.broadcast.GroupInfo`)."""
        from async_rlhf.weight_sync.broadcast import WeightGroup

        self.leave_weight_group()
        self._group = WeightGroup(info, rank=info.rank)

    def leave_weight_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def close(self) -> None:
        self.leave_weight_group()
        self.model = None


class TransformersSampler:
    """`GeneratorBackend` over a transformers causal LM in this process (evaluation and data preparation only;
    it never loads weights from a `WeightUpdate`: pass it the model you want sampled). Prompts are left-padded in
    batches of `batch_size`."""

    name = "transformers"

    def __init__(self, model: PreTrainedModel, pad_token_id: int, eos_token_id: int, batch_size: int = 128,
                 on_batch=None):
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.batch_size = batch_size
        self.on_batch = on_batch  # called with the number of prompts after each batch (progress bars)

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], settings: SamplingSettings) -> list[list[Completion]]:
        if settings.seed is not None:
            torch.manual_seed(settings.seed)
        was_training = self.model.training
        self.model.eval()
        device = next(self.model.parameters()).device
        out: list[list[Completion]] = []
        for start in range(0, len(prompt_token_ids), self.batch_size):
            batch = prompt_token_ids[start:start + self.batch_size]
            width = max(len(p) for p in batch)
            input_ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + p for p in batch], device=device)
            attention_mask = (torch.arange(width, device=device)[None] >= torch.tensor(
                [width - len(p) for p in batch], device=device)[:, None]).long()
            greedy = settings.temperature == 0.0
            gen = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=settings.max_new_tokens,
                do_sample=not greedy,
                temperature=None if greedy else settings.temperature,
                top_p=None if greedy else settings.top_p,
                top_k=None if greedy or settings.top_k < 0 else settings.top_k,
                num_return_sequences=settings.n,
                pad_token_id=self.pad_token_id,
                eos_token_id=self.eos_token_id,
                output_scores=True,
                return_dict_in_generate=True,
            )
            new_tokens = gen.sequences[:, width:]  # [B * n, T]
            logps = torch.stack(gen.scores, dim=1).float().log_softmax(-1)  # [B * n, T, V], after the warpers
            logps = logps.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)  # [B * n, T]
            flat = [_cut_at_eos(t, lp, {self.eos_token_id})
                    for t, lp in zip(new_tokens.tolist(), logps.tolist())]
            out.extend(flat[i * settings.n:(i + 1) * settings.n] for i in range(len(batch)))
            if self.on_batch is not None:
                self.on_batch(len(batch))
        self.model.train(was_training)
        return out

    def load_weights(self, update: WeightUpdate) -> None:
        raise NotImplementedError("TransformersSampler samples the model it was given; it does not load updates")

    def close(self) -> None:
        pass


def _cut_at_eos(tokens: list[int], logprobs: list[float], eos_ids) -> Completion:
    """transformers keeps generating padding after a sequence's EOS until the whole batch is done: cut there. No
    EOS: the completion hit `max_new_tokens` (or stopped on an EOS id the sampler was not told of)."""
    for i, tok in enumerate(tokens):
        if tok in eos_ids:
            return Completion(tokens[: i + 1], logprobs[: i + 1], "stop")
    return Completion(tokens, logprobs, "length")


def _within_budget(c: Completion, budget: int) -> Completion:
    """`c` cut to its prompt's token budget (a sample of the batch that ran past it, as vLLM would have stopped it)."""
    if len(c.token_ids) <= budget:
        return c
    return Completion(token_ids=c.token_ids[:budget], logprobs=c.logprobs[:budget], finish_reason="length")
