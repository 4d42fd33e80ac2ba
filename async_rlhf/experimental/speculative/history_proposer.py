"""`speculative="history"`: drafts copied from earlier sequences of this engine (SPEC-RL, RhymeRL), as a vLLM proposer.

In RL every prompt is sampled `num_generations` times per step and again in later epochs, so a running sample often
continues the way an earlier completion of the same prompt did. This proposer keeps the token sequences (prompt and
completion) the engine has worked on, indexed by their n-grams, and drafts, for each running sequence, the tokens
that followed the most recent earlier occurrence of its last n-gram (longest n first), in any kept sequence,
itself included (so it also does what vLLM's `ngram` prompt lookup does).

Interface: vLLM 0.32's documented extension point for proposers, `speculative_config={"method": "custom_class",
"model": "async_rlhf.experimental.speculative.history_proposer.HistoryProposer"}`
(`vllm/v1/spec_decode/custom_class_proposer.py`):
built with the `VllmConfig`, called once per engine step with each running request's newly sampled tokens and its
whole token row. That interface passes no request ids, so a row is recognised as the sequence seen there at the
previous step by its tokens (same row, not shorter, same last tokens); anything else starts a new kept sequence.
A wrong guess can only cost acceptance: drafts never change what is sampled (vLLM's rejection sampler accepts a
draft token with the target probability and resamples from the rest otherwise).

Memory is bounded: at most `MAX_TOKENS` tokens are kept; the oldest sequences are forgotten first, and the n-gram
index is rebuilt from what is kept whenever it holds too many stale entries.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_TOKENS = 200_000  # tokens of history kept per engine
NGRAMS = (4, 3, 2)  # n-gram lengths tried, longest first
CHECK = 4  # a row continues the sequence seen there if these many tokens before its old end are unchanged


class HistoryProposer:
    """Built by vLLM's model runner (`create_custom_proposer`); one per engine, used from the engine's thread only."""

    def __init__(self, vllm_config, max_tokens: int = MAX_TOKENS) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.max_tokens = max_tokens
        self._seqs: OrderedDict[int, list[int]] = OrderedDict()  # sequence id -> its tokens, oldest first
        self._kept = 0  # tokens in `_seqs`
        self._index: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (sequence, position after it)
        self._rows: dict[int, int] = {}  # row of the last step -> sequence id
        self._next_id = 0

    def load_model(self, *args, **kwargs) -> None:  # called by vLLM's runners on every proposer: nothing to load
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        drafts: list[list[int]] = []
        rows: dict[int, int] = {}
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:  # a partial prefill: nothing sampled yet
                drafts.append([])
                continue
            n = int(num_tokens_no_spec[i])
            row = token_ids_cpu[i, :n].tolist()
            sid = self._follow(i, row)
            rows[i] = sid
            budget = min(self.k, self.max_model_len - n - 1)
            drafts.append(self._draft(row, budget) if budget > 0 else [])
        self._rows = rows
        return drafts

    # ---- bookkeeping -------------------------------------------------------------------------------------------
    def _follow(self, i: int, row: list[int]) -> int:
        """Id of the kept sequence that row `i` continues (a new one if none), with the row's new tokens added."""
        sid = self._rows.get(i)
        seq = self._seqs.get(sid) if sid is not None else None
        if seq is not None and len(row) >= len(seq) and row[max(0, len(seq) - CHECK):len(seq)] == seq[-CHECK:]:
            self._seqs.move_to_end(sid)
            self._extend(sid, seq, row[len(seq):])
            return sid
        sid, self._next_id = self._next_id, self._next_id + 1
        seq = self._seqs[sid] = []
        self._extend(sid, seq, row)
        return sid

    def _extend(self, sid: int, seq: list[int], new: list[int]) -> None:
        start = len(seq)
        seq.extend(new)
        self._kept += len(new)
        # index every n-gram that now has a token after it: those ending before the new last token
        for end in range(max(start, 1), len(seq)):
            for m in NGRAMS:
                if end >= m:
                    self._index[tuple(seq[end - m:end])] = (sid, end)
        self._forget()

    def _forget(self) -> None:
        while self._kept > self.max_tokens and len(self._seqs) > 1:
            _, seq = self._seqs.popitem(last=False)
            self._kept -= len(seq)
        if len(self._index) > 2 * len(NGRAMS) * max(self._kept, 1):  # mostly stale: rebuild from what is kept
            self._index = {}
            for sid, seq in self._seqs.items():
                for end in range(1, len(seq)):
                    for m in NGRAMS:
                        if end >= m:
                            self._index[tuple(seq[end - m:end])] = (sid, end)

    # ---- drafting ----------------------------------------------------------------------------------------------
    def _draft(self, row: list[int], budget: int) -> list[int]:
        for m in NGRAMS:
            if len(row) < m:
                continue
            hit = self._index.get(tuple(row[-m:]))
            if hit is None:
                continue
            seq = self._seqs.get(hit[0])
            if seq is None:  # forgotten since it was indexed
                continue
            return seq[hit[1]:hit[1] + budget]
        return []
