"""Optional schedules, off by default, kept working and tested until a measurement promotes them into the core.

Each is whole here (its policy, its messages, its engine and pool hooks, its config fields in
`config/experimental.py`) and reaches the core only through a seam the core declares, with the core's behaviour as
the default: how a step's batch is formed (`pipeline/batch_forming.py`: `partial_rollouts.py`, `arrival_order.py`
for `train_while_generating`), how generators are scheduled (`generation/pool/scheduling.py` and the local pool's
membership hooks: `tail_migration/`, `elastic.py` and `elastic_pool.py` with `autoscale_rule.py` for
`generator_autoscale`), the streaming engine's extension points (`generation/engine/stream_engine.py`:
`tail_migration/engine.py`, and `continuous_batching/`, whose engine also builds its own backend), stages of rank 0's
scoring thread (`fused_reference.py`, `reference_while_generating`) and what is decided before the generators start
(`speculative/`, `speculative="auto"`). Which a run gets: `schedules.py`. What each measured, and why it stays here,
is in docs/performance.md."""
