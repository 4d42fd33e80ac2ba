"""Per-token log-probabilities of completions under a causal LM (policy, reference, or SFT model)."""

from __future__ import annotations

import torch


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


def token_logps(model, input_ids, attention_mask, completion_mask, temperature: float = 1.0):
    """Log-prob of each completion token given everything before it.

    Returns (logps [B, L-1], mask [B, L-1], logps_at_temperature [B, L-1] or None). Position t scores token t+1.
    The temperature variant (logits / T) is what a sampler at temperature T used: comparing it with the
    generator's behaviour log-probs measures off-policy drift.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    logps = torch.gather(logits.log_softmax(-1), 2, targets).squeeze(-1)
    tempered = None
    if temperature not in (0.0, 1.0):
        with torch.no_grad():
            tempered = torch.gather((logits.detach() / temperature).log_softmax(-1), 2, targets).squeeze(-1)
    mask = completion_mask[:, 1:].to(logps.dtype)
    return logps * mask, mask, (tempered * mask if tempered is not None else None)
