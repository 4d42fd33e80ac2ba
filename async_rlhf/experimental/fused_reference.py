"""Reference log-probs as each part arrives (RLHFuse's inter-stage fusion, the reference half): learner rank 0's
scoring thread (`scoring/stage.py`) runs the frozen reference model over every completion of the parts that have
arrived, while the generators produce the rest of the batch, and each completion carries its values
(`Completion.token_values`, under `learner/logprobs.REFERENCE`) into the staleness queue, checkpoints and the other learner ranks (as JSON, like the
rewards). The learner's step then skips its reference forward (`logprobs.sequence_terms`, `fused_temperature`).

Equal to the step's own: the same function computes both (`logprobs.reference_token_logps`, with the same
packing, `max_length`, temperature and shared prefix); a row's log-probs do not depend on which other rows share its
forward (right padding, causal attention), so only float rounding differs (tests/unit/experimental/test_fused_reference.py).
Every completion of a part is run, since the scoring thread cannot know which rows a loss will select (online DPO's
chosen and rejected ones): with n = 2 that is the same rows as the step ran.

When the learner computes the reference itself instead (the trainer decides, `trainers/base.py`): under DeepSpeed
(no scoring thread), with a LoRA policy (its reference is the policy with its adapters switched off: toggling them on
this thread while the step trains the same modules on the main thread is unsafe, and a second copy of the base is
what LoRA avoids), with `reference_while_generating=False` (the default), and for any row whose values are missing
(a non-finite value here is left out, so the step's own forward produces it).

Experimental because it has not paid where measured: paired 50 steps on 2 CPU cores, loop 1.02x, within the
load's spread; no GPU measurement (docs/performance.md, Verdicts).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from async_rlhf.learner.logprobs import REFERENCE, completion_batch, length_buckets, reference_token_logps
from async_rlhf.types import RolloutBatch, ScoredGroup


def reference_parts(parts: list[RolloutBatch], ref_model, *, pad_id: int, max_length: int, device,
                    temperature: float, shared_prefix: bool) -> list[RolloutBatch]:
    """`parts` with every completion's reference log-probs filled (`token_values[REFERENCE]`): one packing of all their completions, run as the
    learner's step would run it (length buckets; each prompt once with `shared_prefix`)."""
    groups = [ScoredGroup(pid, prompt, group, [0.0] * len(group), part.policy_version)
              for part in parts for pid, prompt, group in zip(part.prompt_ids, part.prompt_token_ids,
                                                              part.completions)]
    if not any(g.completions for g in groups):
        return parts
    ids, attn, comp, _ = completion_batch(groups, pad_id, max_length, device)
    mask = comp[:, 1:].to(torch.float32)
    buckets = length_buckets(attn.sum(-1).tolist())
    ref = reference_token_logps(ref_model, groups, None, ids, attn, comp, mask, buckets, max_length=max_length,
                                temperature=temperature, shared_prefix=shared_prefix)
    rows = iter(zip(ref.cpu(), mask.bool().cpu()))
    out = []
    for part in parts:
        completions = []
        for group in part.completions:
            filled = []
            for c in group:
                values, marks = next(rows)
                row = values[marks].tolist()
                ok = all(map(math.isfinite, row))
                filled.append(dataclasses.replace(c, token_values={**c.token_values, REFERENCE: row} if ok
                                                  else c.token_values))
            completions.append(filled)
        out.append(dataclasses.replace(part, completions=completions))
    return out
