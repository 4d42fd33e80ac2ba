"""Which generator samples which prompt group: by expected token load (RLHFless's length-aware assignment).

A streamed batch is one request per prompt group, so groups can go to any generator. `LengthEstimator` predicts a
group's decode work from what the run has seen: the mean completion length of this prompt's earlier samples (a
prompt comes back every epoch), else its token budget (its own, when the dataset gives one, else `max_new_tokens`)
times the share of their budgets that completions have used so far, else the budget (the first batch). `assign` is the longest-processing-time rule: the costliest group first, each to the
generator with the least expected work, counting what every generator still has in flight from earlier batches (so
a generator busy with a long tail gets less of the next batch).

`imbalance` is the report: the most tokens any generator got, over the mean, for a batch as it was assigned, and
for the same batch split into equal-count contiguous chunks (what batch-level generation does), from the tokens
actually sampled.
"""

from __future__ import annotations


class LengthEstimator:
    def __init__(self, max_new_tokens: int, budgets: list[int] | None = None):
        self.max_new_tokens = max_new_tokens
        self.budgets = budgets  # prompt id -> its own max_new_tokens, or None
        self._per_prompt: dict[int, float] = {}  # prompt id -> mean completion tokens, last time it was sampled
        self._tokens = 0  # over every completion seen: tokens sampled ...
        self._allowed = 0  # ... and tokens its budget allowed

    def _budget(self, prompt_id: int) -> int:
        return self.budgets[prompt_id] if self.budgets else self.max_new_tokens

    def observe(self, prompt_id: int, lengths: list[int]) -> None:
        if lengths:
            self._per_prompt[prompt_id] = sum(lengths) / len(lengths)
            self._tokens += sum(lengths)
            self._allowed += self._budget(prompt_id) * len(lengths)

    def expected_length(self, prompt_id: int) -> float:
        """This prompt's last mean length; else its budget times the share of their budgets completions have used
        so far (the run's mean length when there are no budgets); else its budget."""
        budget = self._budget(prompt_id)
        if prompt_id in self._per_prompt:
            return min(budget, self._per_prompt[prompt_id])
        if self._allowed:
            return budget * self._tokens / self._allowed
        return float(budget)


def assign(costs: list[float], in_flight: list[float]) -> list[int]:
    """Generator index for each cost: largest first, each to the generator with the least work (`in_flight` plus
    what this call gave it). Ties go to the lowest index, so the result is deterministic."""
    load = list(in_flight)
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        g = min(range(len(load)), key=lambda g: load[g])
        owner[i] = g
        load[g] += costs[i]
    return owner


def imbalance(tokens: list[int], owner: list[int], num_generators: int) -> tuple[float, float]:
    """(as assigned, as equal-count chunks): max over mean of the tokens per generator, for one batch's groups in
    batch order (`tokens[i]` sampled for group i, which went to generator `owner[i]`)."""
    def ratio(per: list[int]) -> float:
        mean = sum(per) / len(per)
        return max(per) / mean if mean else 1.0

    assigned = [0] * num_generators
    for t, g in zip(tokens, owner):
        assigned[g] += t
    chunks = min(num_generators, len(tokens))
    bounds = [round(c * len(tokens) / chunks) for c in range(chunks + 1)]
    counted = [sum(tokens[bounds[c]:bounds[c + 1]]) for c in range(chunks)] + [0] * (num_generators - chunks)
    return ratio(assigned), ratio(counted)


class ImbalanceTally:
    """The run's `generator/imbalance` metrics: the mean, over batches split across generators, of max/mean tokens
    per generator (1.0: perfectly even), as assigned and as equal-count chunks would have been (`imbalance`)."""

    def __init__(self):
        self.assigned = self.counted = 0.0
        self.batches = 0

    def add(self, parts: list, pool_size: int) -> None:
        """One reassembled batch: its `RolloutBatch` parts in chunk order."""
        tokens = [sum(len(c.token_ids) for c in group) for p in parts for group in p.completions]
        ids = {g: j for j, g in enumerate(sorted({p.generator_id for p in parts}))}  # elastic: ids change
        owners = [ids[p.generator_id] for p in parts for _ in p.prompt_ids]
        assigned, counted = imbalance(tokens, owners, max(pool_size, len(ids)))
        self.assigned += assigned
        self.counted += counted
        self.batches += 1

    def stats(self) -> dict[str, float]:
        if not self.batches:
            return {}
        return {"generator/imbalance": self.assigned / self.batches,
                "generator/imbalance_count_split": self.counted / self.batches}

