"""A reward model's scores with the tokens a prompt's completions share run once (RLHFless's shared prefix, for the
reward model; `reward_shared_prefix`).

The reward model sees text: prompt + completion, tokenized whole (`scoring.RewardScorer`), so the n rows of a prompt
need not share exactly the prompt's tokens (a merge across the boundary can differ). What they share is the longest
common prefix of their token ids: that runs once per prompt as a left-padded batch with `use_cache`, its key/value
cache is expanded to the rows that continue it, and each row's remaining tokens run on top. The score is the head
(`model.score`, a linear layer as in transformers' `...ForSequenceClassification`) on the hidden state of the token
transformers would pool: the row's last token that is not the pad token. The shared prefix stops before that token,
so it always lies in the part run per row.

Exact in the sense that each row is the same token ids at positions 0..len-1; the unshared forward pads the batch
(on the left with a left-padding tokenizer, such as the built-in task's) without position ids, so it shifts a row's
positions by its padding. With rotary position embeddings (Llama, Qwen, Mistral, ...) attention depends only on
position differences and both agree within float tolerance (tests/unit/test_reward_prefix.py); a model with absolute
position embeddings would give different scores either way, so leave the option off for it.
"""

from __future__ import annotations

import os

import torch
from transformers import PreTrainedModel


def supports_shared_prefix(model) -> bool:
    """A causal decoder under a linear score head, whose backbone takes a key/value cache."""
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), None)
    return (isinstance(model, PreTrainedModel) and isinstance(getattr(model, "score", None), torch.nn.Linear)
            and backbone is not None and not model.config.is_encoder_decoder
            and model.config.get_text_config().pad_token_id is not None)


def _common_prefix(rows: list[list[int]]) -> int:
    return len(os.path.commonprefix(rows)) if len(rows) > 1 else len(rows[0])


@torch.no_grad()
def shared_prefix_scores(model, rows: list[list[int]], prompts: list[str], device) -> list[float] | None:
    """Logit 0 of `model` on each row of token ids (unpadded: the tokenizer's output for prompt + completion), rows
    of the same prompt text sharing one forward of their common prefix. None when a row is all padding or a prompt's
    rows share no token before the pooled one (the caller then runs the padded forward)."""
    pad = model.config.get_text_config().pad_token_id
    pooled = []  # per row: the index transformers pools, its last token that is not the pad token
    for ids in rows:
        real = [i for i, t in enumerate(ids) if t != pad]
        if not real:
            return None
        pooled.append(real[-1])
    members: dict[str, list[int]] = {}
    for r, text in enumerate(prompts):
        members.setdefault(text, []).append(r)
    slots = list(members.values())  # groups of rows that share one prefix forward
    group_of = {r: g for g, rs in enumerate(slots) for r in rs}
    shared = [min(_common_prefix([rows[r] for r in rs]), *(pooled[r] for r in rs)) for rs in slots]
    if min(shared) < 1:
        return None
    backbone = getattr(model, model.base_model_prefix)
    width = max(shared)
    ids = torch.zeros((len(slots), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for g, (rs, n) in enumerate(zip(slots, shared)):  # left padding: every prefix ends at column `width`
        ids[g, width - n:] = torch.tensor(rows[rs[0]][:n])
        attn[g, width - n:] = 1
    ids, attn = ids.to(device), attn.to(device)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = backbone(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True).past_key_values
    index = torch.tensor([group_of[r] for r in range(len(rows))], device=device)
    cache.batch_select_indices(index)  # [G, ...] -> [B, ...]: row r continues prefix group_of[r]
    starts = [shared[group_of[r]] for r in range(len(rows))]
    span = max(len(ids_r) - s for ids_r, s in zip(rows, starts))
    rest = torch.zeros((len(rows), span), dtype=torch.long)
    rest_attn = torch.zeros_like(rest)
    for r, (ids_r, s) in enumerate(zip(rows, starts)):  # right padding after a row's end: causal, nothing sees it
        rest[r, :len(ids_r) - s] = torch.tensor(ids_r[s:])
        rest_attn[r, :len(ids_r) - s] = 1
    rest, rest_attn = rest.to(device), rest_attn.to(device)
    first = torch.tensor(starts, device=device)
    hidden = backbone(input_ids=rest, attention_mask=torch.cat([attn[index], rest_attn], dim=1),
                      position_ids=first[:, None] + torch.arange(span, device=device)[None],
                      past_key_values=cache).last_hidden_state  # [B, span, H]
    at = torch.tensor([p - s for p, s in zip(pooled, starts)], device=device)
    return model.score(hidden[torch.arange(len(rows), device=device), at])[:, 0].float().tolist()
