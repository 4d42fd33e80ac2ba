"""Generation, split at the process boundary: `engine/` runs inside a generator process (or a vLLM server's
workers), `pool/` runs on learner rank 0 and starts, feeds, watches and restarts the generators. `serve.py` is the
entry point of a generator server on any host (`python -m async_rlhf.generation.serve`)."""
