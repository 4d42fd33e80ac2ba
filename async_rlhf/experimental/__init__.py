"""Optional schedules, off by default, kept working and tested until a measurement promotes them into the core.

Each plugs into one seam of the core: how a step's batch is formed (`pipeline/batch_forming.py`:
`partial_rollouts.py`, `arrival_order.py` for `train_while_generating`), how generators are scheduled
(`generation/pool/scheduling.py`: `tail_migration/`, `elastic.py` with `autoscale_rule.py` for
`generator_autoscale`), and the learner's reference pass (`fused_reference.py`, `reference_while_generating`).
What each measured, and why it stays here, is in docs/performance.md."""
