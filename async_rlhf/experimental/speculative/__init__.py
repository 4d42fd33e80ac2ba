"""Speculative rollouts (`speculative`): drafts proposed cheaply and verified by the policy with vLLM's rejection
sampling, so samples and behaviour log-probs stay exactly the policy's. Measured 0.53-0.87x the samples/s of no
speculation on every workload of the 2-core CPU (docs/performance.md, speculative rollouts), so off by default.

What the core keeps is a pass-through of vLLM's own `speculative_config` (`generation/engine/vllm_backend.py`) and the
fix that makes vLLM's CPU build exact under it (`generation/engine/spec_decode_cpu.py`); the option's names and
checks, and the translation into vLLM's config, are config-time (`config/speculative.py`). Here:
- `history_proposer.py`: `speculative="history"`, drafts copied from earlier sequences of the same engine, behind
  vLLM's `custom_class` proposer interface;
- `choice.py`: `speculative="auto"`, measured on the policy before the generators start (called through
  `experimental/schedules.py`).
"""
