"""Where a rollout is born and waits, on learner rank 0: `prompt_stream.py` (which prompts a step trains on),
`assignment.py` (which generator samples which group), `generator_pool.py` (the interface every generator pool
offers the pipeline), `staleness_queue.py` (where finished batches wait under the staleness bound),
`rollout_pipeline.py` (the step protocol that ties them together), `rank_share.py` (a step's batch on every learner
rank) and `records.py` (counters, checkpoints and metrics)."""
