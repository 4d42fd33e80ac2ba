"""Per-token log-probabilities of completions under a causal LM (policy, reference, or SFT model), and the terms
every learner's loss starts from (`sequence_terms`): one forward of the policy, one of the frozen reference, and
the generator's behaviour log-probs, on the same packed rows."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from async_rlhf.peft_policy import adapters_off
from async_rlhf.types import Completion, ScoredGroup


def pack_sequences(prompts: list[list[int]], completions: list[list[int]], pad_id: int, max_length: int):
    """Right-padded prompt+completion sequences. Prompts are cut from the left when the pair exceeds max_length.

    Returns input_ids [B, L], attention_mask [B, L], completion_mask [B, L] (1 on completion tokens).
    """
    seqs, comp_masks = [], []
    for p, c in zip(prompts, completions):
        c = c[:max_length - 1]
        p = p[max(0, len(p) + len(c) - max_length):]
        seqs.append(p + c)
        comp_masks.append([0] * len(p) + [1] * len(c))
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    comp = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, comp_masks)):
        input_ids[i, :len(s)] = torch.tensor(s)
        attention[i, :len(s)] = 1
        comp[i, :len(s)] = torch.tensor(m)
    return input_ids, attention, comp


def token_logps(model, input_ids, attention_mask, completion_mask, temperature: float = 1.0,
                drift_temperature: float | None = None):
    """Log-prob of each completion token given everything before it, from logits / `temperature`.

    Returns (logps [B, L-1], mask [B, L-1], drift_logps [B, L-1] or None). Position t scores token t+1; padding
    and prompt positions are 0. `drift_logps` (no gradient) uses logits / `drift_temperature`: the distribution a
    sampler at that temperature used, to compare with the generator's behaviour log-probs.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    scaled = logits / temperature if temperature not in (0.0, 1.0) else logits
    logps = torch.gather(scaled.log_softmax(-1), 2, targets).squeeze(-1)
    mask = completion_mask[:, 1:].to(logps.dtype)
    drift = None
    if drift_temperature is not None:
        if drift_temperature in (0.0, temperature) or (drift_temperature == 1.0 and temperature in (0.0, 1.0)):
            drift = logps.detach()
        else:
            with torch.no_grad():
                drift = torch.gather((logits.detach() / drift_temperature).log_softmax(-1), 2, targets).squeeze(-1)
        drift = drift * mask
    return logps * mask, mask, drift


def behaviour_logps(completions: list[Completion], mask: torch.Tensor) -> torch.Tensor:
    """The generator's log-prob of each sampled token, placed where `mask` marks that row's completion tokens."""
    out = torch.zeros_like(mask)
    for row, c in enumerate(completions):
        pos = mask[row].nonzero().squeeze(-1)
        n = min(len(pos), len(c.logprobs))
        out[row, pos[:n]] = torch.tensor(c.logprobs[len(c.logprobs) - n:], dtype=out.dtype, device=out.device)
    return out


def completion_batch(groups, pad_id: int, max_length: int, device, select=None):
    """Pack the completions of `groups` (all, or the (group, completion) pairs in `select`) with their prompts.

    Returns (input_ids, attention_mask, completion_mask, completions), tensors on `device`.
    """
    pairs = select if select is not None else [(g, i) for g, grp in enumerate(groups) for i in range(len(grp.completions))]
    prompts = [groups[g].prompt_token_ids for g, _ in pairs]
    completions = [groups[g].completions[i] for g, i in pairs]
    ids, attn, comp = pack_sequences(prompts, [c.token_ids for c in completions], pad_id, max_length)
    return ids.to(device), attn.to(device), comp.to(device), completions


@dataclass
class SequenceTerms:
    input_ids: torch.Tensor  # [B, L] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [B, L]
    completion_mask: torch.Tensor  # [B, L] 1 on completion tokens
    logps: torch.Tensor  # [B, L-1] policy log-probs at `temperature`, with gradient; 0 off the completion
    ref_logps: torch.Tensor  # [B, L-1] frozen reference at `temperature`, no gradient
    drift_logps: torch.Tensor  # [B, L-1] policy at the sampling temperature, no gradient (vs behaviour: drift)
    behaviour: torch.Tensor  # [B, L-1] the generator's log-probs (mu), placed on the completion tokens
    mask: torch.Tensor  # [B, L-1] 1 where position t scores a completion token
    completions: list[Completion]  # [B] the rows' completions, in row order


def sequence_terms(model, ref_model, groups: list[ScoredGroup], *, pad_id: int, max_length: int, device,
                   temperature: float, sampling_temperature: float, select=None,
                   shared_prefix: bool = False) -> SequenceTerms:
    """The rows `select` ((group, completion) pairs; default every completion of every group) packed once and run
    through the policy (with gradient) and the reference (without; `ref_model` None: the LoRA policy with its
    adapters switched off), both at `temperature`: 1 for DPO-style losses on sequence log-probs, the sampling
    temperature for policy-gradient ratios against the behaviour log-probs.
    `shared_prefix`: the reference runs each group's prompt once (`shared_prefix_logps`)."""
    ids, attn, comp, completions = completion_batch(groups, pad_id, max_length, device, select)
    logps, mask, drift = token_logps(model, ids, attn, comp, temperature=temperature,
                                     drift_temperature=sampling_temperature)
    with contextlib.ExitStack() as stack:
        if ref_model is None:  # a LoRA policy's reference: the policy itself with its adapters off (peft_policy.py)
            ref_model = stack.enter_context(adapters_off(model))
        ref = None
        if shared_prefix:
            ref = shared_prefix_logps(ref_model, groups, select, mask, max_length, temperature=temperature)
        if ref is None:
            with torch.no_grad():
                ref, _, _ = token_logps(ref_model, ids, attn, comp, temperature=temperature)
    return SequenceTerms(ids, attn, comp, logps, ref, drift, behaviour_logps(completions, mask), mask, completions)


@torch.no_grad()
def shared_prefix_logps(model, groups: list[ScoredGroup], select, mask: torch.Tensor, max_length: int,
                        temperature: float = 1.0) -> torch.Tensor | None:
    """Frozen-model log-probs of the rows `select` with each group's prompt run once (RLHFless's shared prefix):
    the prompts go through `model` as one left-padded batch, their key/value cache is expanded to the rows that
    continue them, and the completions run on top of it. Equal to `token_logps` on the packed rows within float
    tolerance (tests/unit/test_shared_prefix.py); the prompt's forward is paid once per group, not once per sample.

    `mask` is the packed rows' completion mask ([B, L-1], from `token_logps`): the result is laid out like it.
    Returns None (the caller then runs the unshared forward) when a row is cut to `max_length`, since its prompt
    is then truncated differently from its siblings'."""
    pairs = select if select is not None else [(g, i) for g, grp in enumerate(groups) for i in range(len(grp.completions))]
    completions = [groups[g].completions[i].token_ids for g, i in pairs]
    if any(len(groups[g].prompt_token_ids) + len(c) > max_length or not c for (g, _), c in zip(pairs, completions)):
        return None
    device = mask.device
    order = list(dict.fromkeys(g for g, _ in pairs))  # the groups these rows continue, each once
    slot = {g: k for k, g in enumerate(order)}
    prompts = [groups[g].prompt_token_ids for g in order]
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for k, p in enumerate(prompts):  # left padding: every prompt ends at column `width`
        ids[k, width - len(p):] = torch.tensor(p)
        attn[k, width - len(p):] = 1
    ids, attn = ids.to(device), attn.to(device)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True)
    last = out.logits[:, -1].float()  # [G, V]: the distribution of each group's first completion token
    rows = torch.tensor([slot[g] for g, _ in pairs], device=device)
    cache = out.past_key_values
    cache.batch_select_indices(rows)  # [G, ...] -> [B, ...]: row r continues prompt rows[r]
    span = max(len(c) for c in completions)
    comp = torch.zeros((len(pairs), span), dtype=torch.long)
    comp_attn = torch.zeros_like(comp)
    for r, c in enumerate(completions):  # right padding after the completion: causal, so nothing earlier sees it
        comp[r, :len(c)] = torch.tensor(c)
        comp_attn[r, :len(c)] = 1
    comp, comp_attn = comp.to(device), comp_attn.to(device)
    lengths = attn.sum(-1)[rows]
    logits = model(input_ids=comp, attention_mask=torch.cat([attn[rows], comp_attn], dim=1),
                   position_ids=lengths[:, None] + torch.arange(span, device=device)[None],
                   past_key_values=cache).logits.float()  # [B, C, V]: position t predicts token t + 1
    logits = torch.cat([last[rows][:, None], logits[:, :-1]], dim=1)  # [B, C]: the logits each token was drawn from
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    logps = logits.log_softmax(-1).gather(-1, comp[..., None]).squeeze(-1)  # [B, C]
    result = torch.zeros_like(mask)
    for r, c in enumerate(completions):
        result[r, mask[r].nonzero().squeeze(-1)] = logps[r, :len(c)].to(result.dtype)
    return result
