"""Per-token log-probabilities of completions under a causal LM (policy, reference, or SFT model), and the terms
every learner's loss starts from (`sequence_terms`): the policy and the frozen reference run on the same packed
rows, next to the generator's behaviour log-probs.

Rows are right-padded, so a row's tokens never attend to the padding after it: a forward over only the first w
columns gives the same log-probs for every row no longer than w. `sequence_terms` uses that to pad rows of similar
length together (`length_buckets`): a short completion next to a long one no longer costs the long one's width.
On the built-in task (prompts of 18-36 tokens, completions of 1-24) that removes about a third of the tokens the
policy and reference forward and backward run on (benchmarks/learner_step.py)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from async_rlhf.learner.peft_policy import adapters_off
from async_rlhf.types import Completion, ScoredGroup

# `Completion.token_values` key of the frozen reference's log-probs, when a scoring stage computed them before the
# step (`experimental/fused_reference.py`)
REFERENCE = "ref_logprobs"


def pack_sequences(prompts: list[list[int]], completions: list[list[int]], pad_id: int, max_length: int,
                   masks: list[list[int]] | None = None):
    """Right-padded prompt+completion sequences. Prompts are cut from the left when the pair exceeds max_length.
    `masks`: each completion's own token mask (multi-turn episodes: 0 on a tool's answer; empty: every token).

    Returns input_ids [B, L], attention_mask [B, L], completion_mask [B, L] (1 on completion tokens the policy
    sampled).
    """
    seqs, comp_masks = [], []
    for k, (p, c) in enumerate(zip(prompts, completions)):
        own = masks[k] if masks is not None and masks[k] else None
        c = c[:max_length - 1]
        p = p[max(0, len(p) + len(c) - max_length):]
        seqs.append(p + c)
        comp_masks.append([0] * len(p) + (own[:len(c)] if own else [1] * len(c)))
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
    """The generator's log-prob of each sampled token, placed where `mask` marks that row's completion tokens (a
    completion cut at `max_length` keeps its first tokens, `pack_sequences`: so do its log-probs)."""
    out = torch.zeros_like(mask)
    for row, c in enumerate(completions):
        pos = mask[row].nonzero().squeeze(-1)
        sampled = [lp for i, lp in enumerate(c.logprobs) if c.sampled(i)]  # a tool's answers are not in the mask
        n = min(len(pos), len(sampled))
        out[row, pos[:n]] = torch.tensor(sampled[:n], dtype=out.dtype, device=out.device)
    return out


def completion_batch(groups, pad_id: int, max_length: int, device, select=None):
    """Pack the completions of `groups` (all, or the (group, completion) pairs in `select`) with their prompts.

    Returns (input_ids, attention_mask, completion_mask, completions), tensors on `device`.
    """
    pairs = select if select is not None else [(g, i) for g, grp in enumerate(groups) for i in range(len(grp.completions))]
    completions = [groups[g].completions[i] for g, i in pairs]
    prompts = [c.prompt_token_ids or groups[g].prompt_token_ids for (g, _), c in zip(pairs, completions)]
    ids, attn, comp = pack_sequences(prompts, [c.token_ids for c in completions], pad_id, max_length,
                                     [c.mask for c in completions])
    return ids.to(device), attn.to(device), comp.to(device), completions


FORWARD_COST_TOKENS = 128  # padded tokens one more forward is worth (its fixed cost, measured on the built-in policy)


def length_buckets(lengths: list[int], max_buckets: int = 4,
                   forward_cost: int = FORWARD_COST_TOKENS) -> list[list[int]]:
    """Rows grouped by length so each group is padded only to its own longest row: the split of the rows sorted by
    length into at most `max_buckets` runs that minimises padded tokens + `forward_cost` per run (exact, by dynamic
    programming over the distinct lengths). Returns row indices per bucket, shortest bucket first; one bucket holding
    every row when splitting does not pay."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    if not order:
        return []
    sorted_lengths = [lengths[i] for i in order]
    # candidate bucket ends: the last position of each distinct length in sorted order
    ends = [j + 1 for j in range(len(order)) if j + 1 == len(order) or sorted_lengths[j + 1] != sorted_lengths[j]]
    inf = float("inf")
    # best[k][e]: cost of covering sorted rows [0, ends[e]) with k + 1 buckets; back[k][e]: where the last one starts
    best = [[inf] * len(ends) for _ in range(max_buckets)]
    back = [[-1] * len(ends) for _ in range(max_buckets)]
    for e, end in enumerate(ends):
        best[0][e] = end * sorted_lengths[end - 1] + forward_cost
    for k in range(1, max_buckets):
        for e, end in enumerate(ends):
            for s in range(e):
                start = ends[s]
                cost = best[k - 1][s] + (end - start) * sorted_lengths[end - 1] + forward_cost
                if cost < best[k][e]:
                    best[k][e], back[k][e] = cost, s
    k = min(range(max_buckets), key=lambda k: best[k][-1])
    cuts, e = [], len(ends) - 1
    while k > 0:
        s = back[k][e]
        cuts.append(ends[s])
        e, k = s, k - 1
    bounds = [0, *reversed(cuts), len(order)]
    return [order[a:b] for a, b in zip(bounds, bounds[1:])]


def bucketed_token_logps(model, input_ids, attention_mask, completion_mask, buckets: list[list[int]],
                         temperature: float = 1.0, drift_temperature: float | None = None):
    """`token_logps` of right-padded rows, run bucket by bucket on each bucket's own width (`length_buckets`), and
    laid out as `token_logps` on the whole batch would lay them out: [B, L-1], 0 past a row's end."""
    if len(buckets) <= 1:
        return token_logps(model, input_ids, attention_mask, completion_mask, temperature, drift_temperature)
    width = input_ids.shape[1] - 1
    device = input_ids.device
    lengths = attention_mask.sum(-1)
    parts: list[list[torch.Tensor]] = [[], [], []]
    for rows in buckets:
        index = torch.tensor(rows, device=device)
        w = max(int(lengths[index].max()), 2)
        out = token_logps(model, input_ids[index, :w], attention_mask[index, :w], completion_mask[index, :w],
                          temperature, drift_temperature)
        for part, t in zip(parts, out):
            if t is not None:
                part.append(F.pad(t, (0, width - t.shape[1])))
    inverse = torch.empty(len(lengths), dtype=torch.long, device=device)
    inverse[torch.tensor([r for rows in buckets for r in rows], device=device)] = torch.arange(len(lengths),
                                                                                                device=device)
    logps, mask, drift = (torch.cat(part)[inverse] if part else None for part in parts)
    return logps, mask, drift


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
                   temperature: float, sampling_temperature: float, select=None, shared_prefix: bool = False,
                   policy_shared_prefix: bool = False, split_forwards: bool = True,
                   fused_temperature: float | None = None) -> SequenceTerms:
    """The rows `select` ((group, completion) pairs; default every completion of every group) packed once and run
    through the policy (with gradient) and the reference (without; `ref_model` None: the LoRA policy with its
    adapters switched off), both at `temperature`: 1 for DPO-style losses on sequence log-probs, the sampling
    temperature for policy-gradient ratios against the behaviour log-probs.

    `split_forwards` (False under DeepSpeed, whose engines expect one forward per backward): each model runs once
    per length bucket (`length_buckets`) instead of once on rows all padded to the longest, and the two options
    below apply. `shared_prefix`: the reference runs each group's prompt once (`shared_prefix_logps`).
    `policy_shared_prefix`: so does the policy, with gradient (worth it when groups give several rows, as online
    DPO's chosen and rejected rows do). Either falls back to the padded forward when a row is cut to `max_length`.
    Every way gives the same log-probs within float tolerance (tests/unit/learner/test_shared_prefix.py).

    `fused_temperature`: the temperature at which learner rank 0's scoring thread computed the reference log-probs
    that the completions carry (`Completion.token_values[REFERENCE]`, `experimental/fused_reference.py`); when it is `temperature` and every
    row carries them, the reference does not run here. None: never use carried values."""
    ids, attn, comp, completions = completion_batch(groups, pad_id, max_length, device, select)
    buckets = length_buckets(attn.sum(-1).tolist()) if split_forwards else [list(range(len(ids)))]
    mask = comp[:, 1:].to(torch.float32)  # as `token_logps` lays out its result
    out = None
    if policy_shared_prefix and split_forwards:
        out = shared_prefix_token_logps(model, groups, select, mask, max_length, temperature, sampling_temperature)
    if out is None:
        logps, mask, drift = bucketed_token_logps(model, ids, attn, comp, buckets, temperature=temperature,
                                                  drift_temperature=sampling_temperature)
    else:
        logps, drift = out
    ref = carried_ref_logps(completions, mask) if fused_temperature == temperature else None
    if ref is None:
        ref = reference_token_logps(ref_model, groups, select, ids, attn, comp, mask, buckets, max_length=max_length,
                                    temperature=temperature, shared_prefix=shared_prefix and split_forwards,
                                    policy=model)
    return SequenceTerms(ids, attn, comp, logps, ref, drift, behaviour_logps(completions, mask), mask, completions)


@torch.no_grad()
def reference_token_logps(ref_model, groups: list[ScoredGroup], select, ids, attn, comp, mask, buckets, *,
                          max_length: int, temperature: float, shared_prefix: bool, policy=None) -> torch.Tensor:
    """The frozen reference's log-probs of the packed rows (`completion_batch`), laid out like `mask`: each
    group's prompt once (`shared_prefix`, when no row is cut), else bucket by bucket. `ref_model` None: `policy` (a
    LoRA policy) with its adapters off. What the learner's step runs, and what the scoring thread runs for it."""
    with contextlib.ExitStack() as stack:
        if ref_model is None:  # a LoRA policy's reference: the policy itself with its adapters off (learner/peft_policy.py)
            ref_model = stack.enter_context(adapters_off(policy))
        ref = shared_prefix_logps(ref_model, groups, select, mask, max_length, temperature) if shared_prefix else None
        if ref is None:
            ref, _, _ = bucketed_token_logps(ref_model, ids, attn, comp, buckets, temperature=temperature)
    return ref


def carried_ref_logps(completions: list[Completion], mask: torch.Tensor) -> torch.Tensor | None:
    """The reference log-probs the rows' completions carry, laid out like `mask` ([B, L-1]); None unless every row
    carries one value per position its mask marks."""
    counts = mask.sum(-1).tolist()
    if any(len(c.token_values.get(REFERENCE, ())) != n for c, n in zip(completions, counts)):
        return None
    values = torch.tensor([v for c in completions for v in c.token_values[REFERENCE]], dtype=mask.dtype, device=mask.device)
    return torch.zeros_like(mask).masked_scatter(mask.bool(), values)  # row-major: each row's tokens in order


@torch.no_grad()
def shared_prefix_logps(model, groups: list[ScoredGroup], select, mask: torch.Tensor, max_length: int,
                        temperature: float = 1.0) -> torch.Tensor | None:
    """Frozen-model log-probs of the rows `select` with each group's prompt run once (RLHFless's shared prefix), laid
    out like `mask`; None when a row is cut to `max_length`. See `shared_prefix_token_logps`."""
    out = shared_prefix_token_logps(model, groups, select, mask, max_length, temperature)
    return None if out is None else out[0]


def shared_prefix_token_logps(model, groups: list[ScoredGroup], select, mask: torch.Tensor, max_length: int,
                              temperature: float = 1.0, drift_temperature: float | None = None):
    """Log-probs of the rows `select` with each group's prompt run once: the prompts go through `model` as one
    left-padded batch, their key/value cache is expanded to the rows that continue them, and the completions run on
    top of it. Equal to `token_logps` on the packed rows within float tolerance (tests/unit/learner/test_shared_prefix.py);
    the prompt's forward is paid once per group, not once per sample. Gradients flow when enabled (through the
    expanded cache, into the prompt's forward once per group).

    `mask` is the packed rows' completion mask ([B, L-1], as `token_logps` returns it): the results are laid out
    like it. Returns (logps, drift_logps or None; see `token_logps`), or None (the caller then runs the unshared
    forward) when a row is cut to `max_length`, since its prompt is then truncated differently from its siblings'."""
    pairs = select if select is not None else [(g, i) for g, grp in enumerate(groups) for i in range(len(grp.completions))]
    if any(groups[g].completions[i].mask or groups[g].completions[i].prompt_token_ids for g, i in pairs):
        return None  # multi-turn episodes: masked answers, or a sample's own prompt
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
    targets = comp[..., None]
    scaled = logits / temperature if temperature not in (0.0, 1.0) else logits
    logps = scaled.log_softmax(-1).gather(-1, targets).squeeze(-1)  # [B, C]
    real = comp_attn.bool()
    place = mask.bool()  # row-major, both hold each row's completion tokens in order: one scatter places them all
    result = torch.zeros_like(mask).masked_scatter(place, logps[real].to(mask.dtype))
    drift = None
    if drift_temperature is not None:
        if drift_temperature in (0.0, temperature) or (drift_temperature == 1.0 and temperature in (0.0, 1.0)):
            drift = result.detach()
        else:
            with torch.no_grad():
                hot = (logits.detach() / drift_temperature).log_softmax(-1).gather(-1, targets).squeeze(-1)
            drift = torch.zeros_like(mask).masked_scatter(place, hot[real].to(mask.dtype))
    return result, drift
